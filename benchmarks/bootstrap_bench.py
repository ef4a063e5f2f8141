"""Verdict statistics and reports at a million requests (a benchmark, not a test).

Part 1: the paired bootstrap of one comparison over 1,000,000 requests × 1,000 resamples
(TTFT p90 and p50 through the quantile window, OK rate through outcome cells, TTFT mean
through the labelled normal approximation), one repeat and four repeats of 250,000.
Part 2: `btb-lab report` of a synthetic stored run of the demo hypothesis with 1,000,000
requests per variant (two variants, lognormal latencies, four instances): analysis,
verdict, plots and report from the stored parquet files.

Run: .venv/bin/python benchmarks/bootstrap_bench.py [--requests N] [--skip-report]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from btb_lab.analysis.bootstrap import paired_draws

ROOT = Path(__file__).resolve().parents[1]


def _timed(label: str, fn) -> None:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    draws = fn()
    wall = time.perf_counter() - start
    low, high = np.percentile(draws.values, [2.5, 97.5])
    interval = f"[{low * 100:+.2f}%, {high * 100:+.2f}%]"
    print(f"  {label:<34} {wall:6.2f} s   {interval}  ({draws.method})")


def bootstrap(n: int, samples: int) -> None:
    rng = np.random.default_rng(1)
    base = rng.lognormal(-1.0, 1.0, n)
    var = base * rng.lognormal(-0.05, 0.3, n)
    var[rng.random(n) < 0.01] = np.nan  # 1% failed in the variant
    ok_b = np.ones(n)
    ok_v = np.where(np.isnan(var), 0.0, 1.0)
    print(f"paired bootstrap, {n:,} requests × {samples:,} resamples")
    for repeats in (1, 4):

        def split(x: np.ndarray, r: int = repeats) -> list[np.ndarray]:
            return np.array_split(x[:, None], r)

        tag = f"{repeats} repeat{'s' if repeats > 1 else ''}"
        for q in (90.0, 50.0):
            _timed(
                f"TTFT p{q:g}, {tag}",
                lambda q=q, s=split: paired_draws(
                    s(base), s(var), "latency", q, samples=samples, rng=np.random.default_rng(3)
                ),
            )
        _timed(
            f"OK rate, {tag}",
            lambda s=split: paired_draws(
                s(ok_b), s(ok_v), "ok_rate", None, samples=samples, rng=np.random.default_rng(3)
            ),
        )
        _timed(
            f"TTFT mean, {tag}",
            lambda s=split: paired_draws(
                s(base), s(var), "latency", None, samples=samples, rng=np.random.default_rng(3)
            ),
        )


def report(n: int) -> None:
    from btb_lab.hypothesis.loader import load_hypothesis
    from btb_lab.records import STORED_COLUMNS
    from btb_lab.report.render import build_report
    from btb_lab.results import Manifest, RunEntry

    hyp = load_hypothesis(ROOT / "hypotheses" / "btb.yaml", {"repeats": 1}).hypothesis
    rng = np.random.default_rng(2)
    arrival = np.sort(rng.uniform(0, n / 300.0, n))  # 300 requests/s
    frames = []
    for variant, factor in (("cache_aware", 1.0), ("btb", 0.8)):
        ttft = rng.lognormal(-1.5, 1.0, n) * factor
        decode = rng.lognormal(1.0, 0.5, n)
        frame = pd.DataFrame({
            "variant": variant, "repeat": 0, "request_id": [f"r{i}" for i in range(n)],
            "trace_id": "w0", "source": "synthetic", "session_id": None, "class": None,
            "instance": [f"C{i % 4}" for i in range(n)], "route": "CACHE_HIT",
            "arrival_s": arrival, "sent_s": arrival, "first_token_s": arrival + ttft,
            "finish_s": arrival + ttft + decode, "input_tokens": 4096, "output_tokens": 128,
            "cached_tokens": 2048, "ok": True, "error": None, "turn": 1, "group_id": None,
            "prefill_instance": None, "cache_tier": "hbm", "queue_s": 0.1 * ttft,
            "kv_load_s": 0.0, "kv_transfer_s": 0.0, "prefill_s": 0.9 * ttft,
            "decode_s": decode, "extra": None,
        })  # fmt: skip
        frames.append(frame)
    records = pd.concat(frames, ignore_index=True)
    records["ttft_s"] = records["first_token_s"] - records["sent_s"]
    records["e2e_s"] = records["finish_s"] - records["sent_s"]
    records["tpot_s"] = (records["e2e_s"] - records["ttft_s"]) / 127
    run_dir = Path(tempfile.mkdtemp(prefix="btb-bench-report-"))
    try:
        records[[*STORED_COLUMNS, "extra"]].to_parquet(run_dir / "requests.parquet", index=False)
        util_columns = ["variant", "repeat", "time_s", "instance", "device", "utilization",
                        "memory_bytes", "source"]  # fmt: skip
        pd.DataFrame(columns=util_columns).to_parquet(run_dir / "utilization.parquet")
        Manifest(
            run_id="bench", run_dir=str(run_dir), hypothesis_id=hyp.id, hypothesis_file="btb.yaml",
            hypothesis=hyp.model_dump(mode="json", by_alias=True), cli={}, backend="sim",
            variants=["cache_aware", "btb"], repeats=1, master_seed=hyp.seed, runs_planned=2,
            started="now", complete=True,
            runs=[RunEntry(variant=v, repeat=0, seed=0, workload_seed=0, requests=n,
                           status="ok", started="now") for v in ("cache_aware", "btb")],
        ).save(run_dir)  # fmt: skip
        start = time.perf_counter()
        build_report(run_dir)
        wall = time.perf_counter() - start
        print(
            f"btb-lab report of {n:,} requests × 2 variants: {wall:.1f} s "
            f"(plots: {', '.join(sorted(p.name for p in (run_dir / 'plots').iterdir()))})"
        )
    finally:
        shutil.rmtree(run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--skip-report", action="store_true")
    args = parser.parse_args()
    bootstrap(args.requests, args.samples)
    if not args.skip_report:
        report(args.requests)


if __name__ == "__main__":
    main()
