"""The hypothesis in words, as the report states what produced its verdict: model,
topology, workload, variants and the decision rule with every scope it has; and what the
runs' engines and router said beside the records (cache hits, KV moves not made)."""

from __future__ import annotations

from btb_lab.config.hypothesis import Guard, Hypothesis
from btb_lab.config.metrics import METRICS
from btb_lab.config.workload import SESSION_REPLAY_TEXT
from btb_lab.results import RunEntry

__all__ = [
    "connector_lines",
    "engine_lines",
    "model",
    "rule",
    "topology",
    "variant_text",
    "workload",
]


def topology(hyp: Hypothesis, backend: str = "sim") -> str:
    """The declared instances and connector; on a cluster run against attached endpoints,
    said to be declared only (someone else started those servers)."""
    groups = [f"{g.count}×{g.role} ({g.gpus}×{g.gpu})" for g in hyp.cluster.instances]
    conn = hyp.cluster.kv_connector
    text = " + ".join(groups)
    if conn.type != "none":
        roles = "".join(f", {r}: {k}" for r, k in sorted(conn.roles.items()))
        text += f", KV connector {conn.type} ({conn.role}{roles})"
    if backend == "cluster" and hyp.cluster.launch.endpoints:
        text += (f"; attached to {len(hyp.cluster.launch.endpoints)} endpoints: roles as "
                 "declared, devices and connector not checked")  # fmt: skip
    return text


def model(hyp: Hypothesis) -> str:
    if isinstance(hyp.model, str):
        return hyp.model
    return f"{hyp.model.name} ({hyp.model.params:g} params, {hyp.model.layers} layers)"


def workload(hyp: Hypothesis) -> str:
    w = hyp.workload
    if w.trace is not None:
        source = f"trace `{w.trace.path}` ({w.trace.format})"
    else:
        assert w.generator is not None
        params = ", ".join(f"{k}={v}" for k, v in sorted(w.generator.params.items()))
        source = f"generator `{w.generator.kind}`" + (f" ({params})" if params else "")
    shaped = []  # every other setting that changes what is replayed, where it is set
    if w.offset:
        shaped.append(f"from request {w.offset:,} on (offset)")
    if w.window_gap_s:
        shaped.append(f"windows {w.window_gap_s:g} s apart")
    if w.variation is not None and w.variation.arrival_jitter_s:
        shaped.append(f"arrivals jittered ±{w.variation.arrival_jitter_s:g} s per repeat")
    if w.variation is not None and w.variation.resample_windows:
        shaped.append("windows resampled with replacement per repeat")
    return "".join([source, *(f", {text}" for text in shaped)]) + SESSION_REPLAY_TEXT.get(
        w.session_replay, ""
    )


def variant_text(hyp: Hypothesis, name: str) -> str:
    v = hyp.variants[name]
    params = ", ".join(f"{k}={val}" for k, val in sorted(v.router.params.items()))
    text = f"`{name}`{' (baseline)' if name == hyp.baseline else ''}: {v.router.policy}"
    if params:
        text += f" ({params})"
    overrides = {**{f"sim.{k}": val for k, val in v.sim.items()},
                 **{f"costs.{k}": val for k, val in v.costs.items()},
                 **{f"cluster.{k}": val for k, val in v.cluster.items()}}  # fmt: skip
    if overrides:
        text += "; overrides " + ", ".join(f"{k}={val}" for k, val in sorted(overrides.items()))
    if v.description:
        text += f" — {v.description}"
    return text


def scoped(metric: str, klass: str | None, pool: str | None) -> str:
    """`ttft_p90 (WARM) in pool `art``: a metric with the requests it is restricted to."""
    text = metric + (f" ({klass})" if klass else "")
    return text + (f" in pool `{pool}`" if pool else "")


def guard_rule(guard: Guard) -> str:
    """`ok_rate ≤ 1 pt worse`, `e2e_p90 in pool `art` ≤ 5% worse`: ok_rate's limit is
    absolute (points), every other one relative, as the verdict applies them."""
    limit = f"{guard.max_worse * 100:g}"
    unit = " pt" if METRICS[guard.metric].kind == "ok_rate" else "%"
    return f"{scoped(guard.metric, guard.klass, guard.pool)} ≤ {limit}{unit} worse"


def rule(hyp: Hypothesis) -> str:
    """The decision rule: the claim's metric, direction and effect, then its guards."""
    r = hyp.verdict
    text = (
        f"{scoped(r.metric, r.klass, r.pool)} {r.direction}s by at least "
        f"{r.min_effect * 100:g}% vs `{hyp.baseline}`"
    )
    text += "; guards: " + ", ".join(map(guard_rule, r.guards)) if r.guards else ""
    classes = [c for c in (r.klass, *(g.klass for g in r.guards)) if c]
    if classes:  # routing moves requests between classes: the pairs are the baseline's
        text += (f"; a class ({', '.join(dict.fromkeys(classes))}) is the requests the "
                 "baseline labels so, both variants judged on them (the Result's class rows "
                 "label each variant's own)")  # fmt: skip
    return text


def engine_lines(runs: list[RunEntry]) -> list[str]:
    """Per run, what the engines themselves reported (real clusters only): each instance's
    prefix-cache hit rate over the run from vLLM's /metrics, and the load driver's lag."""
    lines: list[str] = []
    for entry in runs:
        extra = entry.extra
        metrics = extra.get("metrics") or {}
        rates = metrics.get("cache_hit_rate") or {}
        # an instance whose /metrics failed has no rate: say so rather than leave it out
        failed = {
            name: f"{scrape['error']} at the {when}"
            for when, key in (("start", "before"), ("end", "after"))
            for name, scrape in sorted((metrics.get(key) or {}).items())
            if isinstance(scrape, dict) and "error" in scrape
        }
        if not rates and not failed:
            continue
        shown = ", ".join(
            [f"{name} {'n/a' if rate is None else f'{rate * 100:.1f}%'}"
             for name, rate in sorted(rates.items()) if name not in failed]
            + [f"{name} n/a (/metrics failed: {why})" for name, why in sorted(failed.items())]
        )  # fmt: skip
        line = f"{entry.variant} r{entry.repeat + 1}: prefix-cache hit {shown}"
        driver = extra.get("driver") or {}
        if driver.get("lag_p99_ms") is not None:
            line += f"; driver send lag p99 {float(driver['lag_p99_ms']):.2f} ms"
        lines.append(line)
    return lines


def connector_lines(runs: list[RunEntry]) -> list[str]:
    """Per run, the KV moves a policy decided that ran without a connector (`cluster.
    kv_connector.type: none`), as both worlds run them: an offload on its decode instance,
    a warm copy as a speculative prefill on its target."""
    lines: list[str] = []
    for entry in runs:
        stats = {**(entry.extra.get("router") or {}), **(entry.extra.get("sim_stats") or {})}
        said = [
            f"{int(n):,} {what}"
            for key, what in (
                ("offloads_without_connector", "prefill offloads ran on their decode instance"),
                ("warm_copies_as_prefills", "warm copies ran as speculative prefills"),
            )
            if (n := stats.get(key))
        ]
        if said:
            lines.append(f"{entry.variant} r{entry.repeat + 1}: {', '.join(said)}")
    return lines
