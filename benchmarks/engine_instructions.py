"""The simulator's engine alone, for counting its instructions (a benchmark, not a test).

Wall-clock rates on a shared machine move by a third between hours; instruction counts do
not. Load a hypothesis's first workload, then replay it through the engine for every
variant (with the event log the runner uses, records kept in memory, no sink). Run it
twice under cachegrind, with and without `--load-only`; the difference of the two totals
is the engine's:

    valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file=/tmp/cg.load \\
        .venv/bin/python benchmarks/engine_instructions.py HYP.yaml --load-only
    valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file=/tmp/cg.all \\
        .venv/bin/python benchmarks/engine_instructions.py HYP.yaml
    cg_diff /tmp/cg.load /tmp/cg.all > /tmp/cg.engine && cg_annotate /tmp/cg.engine

Without valgrind it prints the replay's wall time too.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from btb_lab.events import EventLog
from btb_lab.policies import build_policy
from btb_lab.runner import RunOptions, _load_requests, _variant_world, derive_seed, plan_run
from btb_lab.sim.backend import run_replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("hypothesis", type=Path)
    parser.add_argument("--load-only", action="store_true", help="Stop after loading.")
    args = parser.parse_args()
    plan = plan_run(args.hypothesis, RunOptions())
    hyp, loaded = plan.hypothesis, plan.loaded
    requests = _load_requests(loaded, derive_seed(plan.seed, "workload", 0))
    worlds = {name: _variant_world(hyp, name, loaded.base_dir) for name in plan.variants}
    if args.load_only:
        return
    start = time.perf_counter()
    for name in plan.variants:
        resolved, costs = worlds[name]
        router = hyp.variants[name].router
        records: list[object] = []
        run_replay(
            costs, resolved.sim,
            lambda router=router: build_policy(router.policy, router.params, seed=hyp.seed),
            requests, records.append, variant=name, events=EventLog("engine"),
        )  # fmt: skip
    elapsed_s = time.perf_counter() - start
    total = len(requests) * len(plan.variants)
    print(f"{total:,} simulated requests in {elapsed_s:.3f} s ({total / elapsed_s:,.0f}/s)")


if __name__ == "__main__":
    main()
