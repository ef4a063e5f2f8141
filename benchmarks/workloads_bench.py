"""Whole-process `btb-lab run` on workloads shaped like the research (a benchmark, not a
test): long shared prefixes, agentic sessions, a real trace, and the short-prompt case.

Each case is a trace file (written once, deterministically, by this checkout) and a
two-variant hypothesis (cache_aware and btb on 4 × (4×H100) llama-3.3-70b, one repeat).
Every run is a fresh process; the figures per run:

- whole: spawn to exit, as a user waits for `btb-lab run`;
- peak RSS: the process's high-water mark (VmHWM); and the peak PSS of the process with
  its children (the plot child a run forks, `report.forked`), sampled every 50 ms: the
  memory the run takes from the machine, pages shared copy-on-write counted once;
- stages: import (the CLI's modules), load (trace → requests), simulate (every variant,
  records stored), finish (the records' parquet conversion and the last manifest, where
  the checkout has `runner._finish`), analyse (`analyze_run`, or its two halves
  `read_stored_run` and `analyze_stored` where the plots are drawn meanwhile: reading the
  run back, metrics, bootstrap, verdict), report (plots and report.md: the drawing the
  analysis did not hide), other (the rest of the command: planning,
  printing), start+exit (the interpreter's start, and its teardown where the checkout's
  console script has one);
- in-loop: simulated requests per second inside the engine's event loop (the record
  sink's time taken out): per second of the time any loop was running, where the
  variants' loops run side by side in worker processes (`btb-lab run --jobs`, one per
  core by default); and per core, per second of each loop's own time (the same figure
  when the loops run one after another); then the loops' minor page faults and kernel
  time, which in a worker are mostly copy-on-write copies of the parent's requests.

Several checkouts (`--code DIR`, e.g. a pre-change checkout) run side by side, their
runs interleaved, each process with that checkout first on `PYTHONPATH` and a shared
bytecode cache, after one warm-up run each. Medians of `--runs` runs and the ratios to
the first checkout are printed. On a shared machine run it under the heavy-work lock.

Then whole `btb-lab sweep` processes (`--sweeps`): the BTB write-up's six-setup table and
four points over a trace, their points in `--sweep-jobs` processes; per sweep the whole
time and the user and system time of it and its point processes.

Run: .venv/bin/python benchmarks/workloads_bench.py [--code DIR ...] [--runs 3]
     [--cases seed_bursty,agentic,...] [--sweeps seed_table,...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRACES = next(
    (p / "shared" / "traces" for p in ROOT.parents if (p / "shared" / "traces").is_dir()),
    ROOT.parent / "shared" / "traces",
)
STAGES = ("import", "load", "simulate", "finish", "analyse", "report", "other", "start+exit")


@dataclass
class Case:
    name: str
    what: str
    trace: str  # file name in the work folder
    fmt: str
    block_tokens: int
    prefix_tokens: int  # BTB's Y
    windows: int = 2  # seed_bursty windows, for the seed_bursty cases
    rows: int = 0


CASES = {
    "seed_bursty": Case(
        "seed_bursty", "seed-shaped bursty windows: 2 × (8 bursts of 500 + 120 decoys), "
        "65,536-token prefixes, 256-token blocks", "seed_bursty.jsonl", "bursted-art", 256, 65536,
    ),
    "bursted_mixed": Case(
        "bursted_mixed", "8 synthetic windows (one 500-request burst, 65,536-token prefix) + "
        "8 Mooncake conversation windows", "bursted_mixed.jsonl", "bursted-art", 512, 65536,
    ),
    "agentic": Case(
        "agentic", "long agentic sessions: 1,000 sessions, ~6 turns, 32k-token first turns, "
        "contexts up to 128k", "agentic.jsonl", "bursted-art", 512, 16384,
    ),
    "mooncake": Case(
        "mooncake", "the shipped Mooncake conversation trace (12,031 rows, real timestamps)",
        "mooncake_conversation.jsonl", "mooncake", 512, 16384,
    ),
    "short": Case(
        "short", "short prompts: the sim bench workload (Poisson 24/s, 1–8 shared blocks + 1)",
        "short.jsonl", "mooncake", 512, 4096,
    ),
    # Research scale: the size of the published Bursted-ART test split (76,800 rows), where
    # the fixed costs (imports, plots) no longer dominate and the engine and loader do.
    "seed_bursty_19w": Case(
        "seed_bursty_19w", "seed_bursty at research scale: 19 windows, about the size of the "
        "published Bursted-ART test split", "bursted_art_19w.jsonl", "bursted-art", 256, 65536,
        windows=19,
    ),
    # The same requests from `btb-lab trace convert`'s parquet: integer ids, no JSON parse
    # and no string hash per block; the load stage against seed_bursty_19w's is the gain.
    "seed_bursty_19w_parquet": Case(
        "seed_bursty_19w_parquet", "seed_bursty_19w's trace converted to parquet "
        "(`btb-lab trace convert`)", "bursted_art_19w.parquet", "bursted-art", 256, 65536,
        windows=19,
    ),
    # The same windows in the Mooncake format, one after another, their ids counting up
    # in order of first appearance as Mooncake's own traces number blocks: integer ids
    # that Python hashes to themselves, the compiled cache's worst case before its
    # tables spread consecutive hashes (2026-12-06).
    "mooncake_19w": Case(
        "mooncake_19w", "seed_bursty_19w's windows as a Mooncake trace (ids counting up, "
        "windows 60 s apart)", "mooncake_19w.jsonl", "mooncake", 256, 65536, windows=19,
    ),
    # A diagnostic, not a workload: seed_bursty's requests in 32,768-token blocks (3 a
    # request instead of 257); its in-loop rate against seed_bursty's is how much of the
    # engine's time goes to per-block work, the ceiling of a cache that works per run.
    "seed_bursty_coarse": Case(
        "seed_bursty_coarse", "seed_bursty in 32,768-token blocks (3 a request): the engine "
        "without its per-block work", "seed_bursty_coarse.jsonl", "bursted-art", 32768, 65536,
    ),
}  # fmt: skip

HYPOTHESIS = """\
id: BENCH_{upper}
title: workloads bench, {name}
claim: benchmark only
backend: sim
model: llama-3.3-70b
cluster:
  instances:
    - {{role: C, count: 4, gpu: H100, gpus: 4}}
  kv_connector: {{type: mooncake, role: kv_both, protocol: rdma}}
workload:
  trace: {{path: {trace}, format: {fmt}}}
  block_tokens: {block_tokens}
variants:
  cache_aware:
    description: cache-aware routing
    router: {{policy: cache_aware}}
  btb:
    description: burst detection and warming
    router:
      policy: btb
      params: {{burst_count: 2, burst_window_s: 1.0, prefix_tokens: {prefix_tokens}, replicas: 4}}
baseline: cache_aware
repeats: 1
seed: 7
verdict:
  metric: ttft_p90
  direction: decrease
  min_effect: 0.05
"""


def _btb(*args: str) -> None:
    btb = Path(sys.executable).with_name("btb-lab")
    subprocess.run([str(btb), *args], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def prepare(case: Case, work: Path, traces: Path) -> Path:
    """Write the case's trace file (unless present) and hypothesis; returns the hypothesis."""
    trace = work / case.trace
    if not trace.is_file():
        if trace.suffix == ".parquet":
            source = work / CASES[case.name.removesuffix("_parquet")].trace
            if not source.is_file():
                prepare(CASES[case.name.removesuffix("_parquet")], work, traces)
            _btb("trace", "convert", str(source), "-o", str(trace))
        elif case.name.startswith("seed_bursty"):
            _btb("trace", "generate", "seed_bursty", "--block-tokens", str(case.block_tokens),
                 "-p", f"windows={case.windows}", "-o", str(trace))  # fmt: skip
            _drop_turns(trace)
        elif case.name == "bursted_mixed":
            _btb("trace", "generate", "bursted", "--seed", "0", "-p", "windows=8",
                 "-p", "burst_size=500", "-p", "prefix_tokens=65536", "-p", "burst_spread_s=10",
                 "-p", "real_windows=8",
                 "-p", f"real_trace={traces / 'mooncake_conversation.jsonl'}",
                 "-o", str(trace))  # fmt: skip
        elif case.name == "agentic":
            _btb("trace", "generate", "agentic", "--seed", "0", "-p", "sessions=1000",
                 "-p", "session_rate_per_s=0.5", "-p", "turns_mean=6", "-p", "max_turns=20",
                 "-p", "think_time_s_mean=20", "-p", "first_turn_tokens_median=32000",
                 "-p", "growth_tokens_median=2000", "-o", str(trace))  # fmt: skip
        elif case.name == "mooncake_19w":
            source = work / CASES["seed_bursty_19w"].trace
            if not source.is_file():
                prepare(CASES["seed_bursty_19w"], work, traces)
            _write_counting_mooncake(source, trace)
        elif case.name == "mooncake":
            trace.write_bytes((traces / "mooncake_conversation.jsonl").read_bytes())
        else:
            _write_short(trace)
    if trace.suffix == ".parquet":
        import pyarrow.parquet as pq

        case.rows = pq.ParquetFile(trace).metadata.num_rows
    else:
        case.rows = sum(1 for _ in trace.open("rb"))
    hypothesis = work / f"{case.name}.yaml"
    hypothesis.write_text(
        HYPOTHESIS.format(upper=case.name.upper(), name=case.name, trace=trace, fmt=case.fmt,
                          block_tokens=case.block_tokens, prefix_tokens=case.prefix_tokens),
        encoding="utf-8",
    )  # fmt: skip
    return hypothesis


def _drop_turns(path: Path) -> None:
    """seed_bursty rows name their burst job as the session and every request turn 1; a
    loader from before one turn could hold several requests rejects that, so the bench
    file leaves `turn` out (turn 1 is the default): every checkout reads the same rows."""
    tmp = path.with_suffix(".tmp")
    with path.open(encoding="utf-8") as rows, tmp.open("w", encoding="utf-8") as handle:
        for line in rows:
            row = json.loads(line)
            row["metadata"].pop("turn", None)
            handle.write(json.dumps(row, separators=(",", ":")) + "\n")
    tmp.replace(path)


def _write_counting_mooncake(source: Path, path: Path, gap_s: float = 60.0) -> None:
    """`source`'s rows as Mooncake rows: each window (trace_id) `gap_s` after the last
    arrival before it, each distinct id numbered in order of first appearance."""
    ids: dict[str, int] = {}
    window, offset_s, base_s, last_s = None, 0.0, 0.0, 0.0
    with source.open(encoding="utf-8") as rows, path.open("w", encoding="utf-8") as handle:
        for line in rows:
            row = json.loads(line)
            if row["trace_id"] != window:
                window, offset_s, base_s = row["trace_id"], last_s + gap_s, row["arrival_s"]
            t_s = offset_s + row["arrival_s"] - base_s
            last_s = max(last_s, t_s)
            out = {"timestamp": round(t_s * 1000.0, 3), "input_length": row["input_length"],
                   "output_length": row["output_length"],
                   "hash_ids": [ids.setdefault(h, len(ids)) for h in row["hash_ids"]]}  # fmt: skip
            handle.write(json.dumps(out) + "\n")


def _write_short(path: Path, n: int = 20_000) -> None:
    sys.path.insert(0, str(ROOT))
    from btb_lab.sim.bench import bench_workload

    with path.open("w", encoding="utf-8") as handle:
        for r in bench_workload(n):
            row = {"timestamp": r.arrival_s * 1000.0, "input_length": r.input_tokens,
                   "output_length": r.output_tokens, "hash_ids": list(r.block_hashes)}  # fmt: skip
            handle.write(json.dumps(row) + "\n")


# ---------------------------------------------------------------- the child process

DRIVER = r"""
import sys, time
T0 = time.perf_counter()
import importlib.abc, importlib.util, json, os, resource
stages = {"load": 0.0, "simulate": 0.0, "finish": 0.0, "analyse": 0.0, "report": 0.0}
calls = []  # (start, end, sink seconds, requests, minor faults, system s) of each engine loop
out_file, argv = sys.argv[1], sys.argv[2:]
MAIN_PID = os.getpid()

def timed(stage, fn, minus=None):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            stages[stage] += time.perf_counter() - start
            if minus:
                stages[minus] -= time.perf_counter() - start
    return wrapper

def engine_loop(fn):
    def wrapper(costs, settings, policy, requests, emit, *args, **kwargs):
        sink = [0.0]
        def timed_emit(record):
            start = time.perf_counter()
            emit(record)
            sink[0] += time.perf_counter() - start
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        result = fn(costs, settings, policy, requests, timed_emit, *args, **kwargs)
        end = time.perf_counter()
        after = resource.getrusage(resource.RUSAGE_SELF)
        # page faults and kernel time of the loop: in a worker, its copy-on-write faults
        call = (start, end, sink[0], len(requests), after.ru_minflt - before.ru_minflt,
                after.ru_stime - before.ru_stime)
        if os.getpid() == MAIN_PID:
            calls.append(call)
        else:  # a variant's worker process (`run --jobs`): its loop through a file (the
            # monotonic clock is the system's, so its times line up with this process's)
            with open(out_file + ".loop", "a") as handle:
                handle.write(" ".join(map(str, call)) + "\n")
        return result
    return wrapper

def peak_rss_kib():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

PATCHES = {
    # simulate: a repeat's variants (`_run_repeat`, which may run them in workers), or in
    # checkouts without it each variant's run
    "btb_lab.runner": [("_load_requests", lambda f: timed("load", f)),
                       ("_run_repeat", lambda f: timed("simulate", f)),
                       ("_run_one", lambda f: timed("simulate", f)),
                       ("_finish", lambda f: timed("finish", f))],
    "btb_lab.sim.backend": [("run_engine", engine_loop)],
    "btb_lab.report.render": [("build_report", lambda f: timed("report", f)),
                              ("analyze_run", lambda f: timed("analyse", f, minus="report")),
                              ("read_stored_run", lambda f: timed("analyse", f, minus="report")),
                              ("analyze_stored", lambda f: timed("analyse", f, minus="report"))],
}

class Patcher(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            patched = set()
            for attr, wrap in PATCHES[name]:
                stage = "simulate" if attr in ("_run_repeat", "_run_one") else attr
                if hasattr(module, attr) and stage not in patched:
                    setattr(module, attr, wrap(getattr(module, attr)))
                    patched.add(stage)
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, Patcher())
import atexit
from btb_lab import cli
T1 = time.perf_counter()
sys.argv = ["btb-lab", *argv]
ended = {"code": 0, "at": None}
run_main = cli.main

def timed_main():
    try:
        run_main()
    except SystemExit as exc:
        ended["code"] = exc.code or 0
        raise
    finally:
        ended["at"] = time.perf_counter()

def write_out():  # an exit handler: the console script's entry ends the process itself
    if os.getpid() != MAIN_PID:
        return
    stages["import"] = T1 - T0
    if os.path.exists(out_file + ".loop"):
        with open(out_file + ".loop") as handle:
            for line in handle:
                start, end, sink, requests, faults, sys_s = line.split()
                calls.append((float(start), float(end), float(sink), int(requests),
                              int(faults), float(sys_s)))
    # per core: each loop's own seconds, the record sink's taken out; wall: the time any
    # loop was running (loops side by side in workers count once), less the same share
    busy = sum(c[1] - c[0] - c[2] for c in calls)
    spans = sum(c[1] - c[0] for c in calls)
    union, reach = 0.0, float("-inf")
    for start, end, *_ in sorted(calls):
        union += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    loop = {"s": union * busy / spans if spans > 0 else 0.0, "cpu_s": busy,
            "requests": sum(c[3] for c in calls), "faults": sum(c[4] for c in calls),
            "sys_s": sum(c[5] for c in calls)}
    with open(out_file, "w") as handle:
        json.dump({"stages": stages, "loop": loop, "inside_s": ended["at"] - T0,
                   "code": ended["code"], "peak_rss_kib": peak_rss_kib()}, handle)

atexit.register(write_out)
cli.main = timed_main
# what the `btb-lab` script runs: `entry` where the checkout has it (older ones: `main`)
getattr(cli, "entry", cli.main)()
"""


@dataclass
class Run:
    whole_s: float
    rss_mib: float
    tree_pss_mib: float  # the process and its children, sampled (`_PssSampler`)
    stages: dict[str, float | None]
    loop_rps: float | None  # simulated requests per second of the loops' wall time
    loop_core_rps: float | None  # per second of each loop's own time (one core's rate)
    requests: int
    loop_faults_k: float | None = None  # the loops' minor page faults, thousands
    loop_sys_s: float | None = None  # the loops' kernel time (the faults' cost, mostly)


@dataclass
class Series:
    runs: list[Run] = field(default_factory=list)

    def median(self, key: str) -> float | None:
        values = [_value(r, key) for r in self.runs]
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None


_RUN_KEYS = ("whole_s", "rss_mib", "tree_pss_mib", "loop_rps", "loop_core_rps", "loop_faults_k",
             "loop_sys_s")  # fmt: skip


def _value(run: Run, key: str) -> float | None:
    if key in _RUN_KEYS:
        value: float | None = getattr(run, key)
        return value
    return run.stages.get(key)


class _PssSampler:
    """The peak, over samples every `interval_s`, of the summed PSS of a process and its
    descendants: what a run and the plot child it forks take together, each shared page
    split between its sharers (their RSS figures would each count it whole)."""

    def __init__(self, pid: int, interval_s: float = 0.05) -> None:
        self.peak_kib = 0
        self._pid = pid
        self._interval_s = interval_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._done.is_set():
            self.peak_kib = max(self.peak_kib, sum(map(_pss_kib, _tree(self._pid))))
            self._done.wait(self._interval_s)


def _tree(pid: int) -> list[int]:
    pids, i = [pid], 0
    while i < len(pids):
        try:
            for task in os.listdir(f"/proc/{pids[i]}/task"):
                with open(f"/proc/{pids[i]}/task/{task}/children") as handle:
                    pids += [int(c) for c in handle.read().split()]
        except OSError:  # gone meanwhile
            pass
        i += 1
    return pids


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            return next((int(line.split()[1]) for line in handle if line.startswith("Pss:")), 0)
    except (OSError, ValueError):  # gone meanwhile, or a zombie
        return 0


def _child(code: Path, script: str, args: list[str], work: Path) -> tuple[float, float, Any]:
    """Run `script` with `code` first on the path: (wall seconds, peak RSS MiB, its JSON)."""
    out = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    result = out / "bench.json"
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPATH"] = str(code)
    env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    argv = [
        sys.executable,
        "-c",
        script,
        str(result),
        *[a.replace("{out}", str(out)) for a in args],
    ]
    errors = out / "stderr.txt"
    with errors.open("wb") as stderr:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=stderr)
        sampler = _PssSampler(proc.pid)
        _, status, usage = os.wait4(proc.pid, 0)
        whole = time.perf_counter() - start
        sampler.stop()
    if os.waitstatus_to_exitcode(status) != 0 or not result.is_file():
        text = errors.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{code}: {' '.join(args)} failed:\n{text}")
    data = json.loads(result.read_text())
    data["tree_pss_kib"] = sampler.peak_kib
    shutil.rmtree(out)
    # the child's own high-water mark: wait4's can carry the parent's from before exec
    return whole, data.get("peak_rss_kib", usage.ru_maxrss) / 1024, data


def one_run(code: Path, hypothesis: Path, work: Path) -> Run:
    args = ["run", str(hypothesis), "--out", "{out}/run", "--no-progress"]
    whole, rss, data = _child(code, DRIVER, args, work)
    stages: dict[str, float | None] = dict(data["stages"])
    stages["other"] = data["inside_s"] - sum(v for v in stages.values() if v is not None)
    stages["start+exit"] = whole - data["inside_s"]
    if not stages["finish"]:  # a checkout without `runner._finish`: inside "other"
        stages["finish"] = None
    loop = data["loop"]
    return Run(
        whole_s=whole,
        rss_mib=rss,
        tree_pss_mib=data["tree_pss_kib"] / 1024,
        stages=stages,
        loop_rps=loop["requests"] / loop["s"] if loop["s"] > 0 else None,
        loop_core_rps=loop["requests"] / loop["cpu_s"] if loop["cpu_s"] > 0 else None,
        requests=loop["requests"],
        loop_faults_k=loop["faults"] / 1000 if "faults" in loop else None,
        loop_sys_s=loop.get("sys_s"),
    )


LOAD_DRIVER = r"""
import hashlib, json, sys, time
from pathlib import Path
start = time.perf_counter()
from btb_lab.workload.formats import load_trace
imported = time.perf_counter()
requests = load_trace(Path(sys.argv[2]), "bursted-art", block_tokens=256).requests
done = time.perf_counter()
digest = hashlib.sha256()
for r in requests:
    digest.update(repr(r.block_hashes).encode())
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
json.dump({"import_s": imported - start, "load_s": done - imported, "rows": len(requests),
           "peak_rss_kib": hwm,
           "blocks": sum(len(r.block_hashes) for r in requests),
           "distinct": len({h for r in requests for h in r.block_hashes}),
           "ids_sha256": digest.hexdigest()}, open(sys.argv[1], "w"))
"""


VALIDATE_DRIVER = r"""
import json, sys, time
start = time.perf_counter()
out = sys.argv[1]
from btb_lab.cli import main
sys.argv = ["btb-lab", "validate", sys.argv[2]]
try:
    main()
except SystemExit:
    pass
heavy = sorted(m for m in ("numpy", "pandas", "pyarrow", "matplotlib") if m in sys.modules)
json.dump({"inside_s": time.perf_counter() - start, "heavy": heavy}, open(out, "w"))
"""


def validate_bench(codes: list[Path], runs: int, work: Path) -> None:
    """`btb-lab validate hypotheses/h1.yaml` as a whole process (the checkout's own file)."""
    print("\nvalidate hypotheses/h1.yaml (whole process, median of", runs * 3, "runs):")
    for code in codes:
        hypothesis = code / "hypotheses" / "h1.yaml"
        if not hypothesis.is_file():
            hypothesis = ROOT / "hypotheses" / "h1.yaml"
        results = [_child(code, VALIDATE_DRIVER, [str(hypothesis)], work) for _ in range(runs * 3)]
        whole = statistics.median(r[0] for r in results)
        heavy = ", ".join(results[0][2]["heavy"]) or "none"
        print(f"  {_label(code):<14} {whole:5.2f} s  (heavy libraries loaded: {heavy})")


def load_bench(codes: list[Path], windows: int, runs: int, work: Path) -> None:
    """Loading a Bursted-ART-shaped file (seed_bursty windows, 257 blocks of 256 tokens a
    row): rows per minute, peak RSS, and whether every checkout gives the same ids."""
    path = work / f"bursted_art_{windows}w.jsonl"
    if not path.is_file():
        _btb("trace", "generate", "seed_bursty", "--block-tokens", "256",
             "-p", f"windows={windows}", "-o", str(path))  # fmt: skip
        _drop_turns(path)
    runs_by: dict[str, list[tuple[float, float, Any]]] = {_label(c): [] for c in codes}
    for _ in range(runs):
        for code in codes:
            runs_by[_label(code)].append(_child(code, LOAD_DRIVER, [str(path)], work))
    first = runs_by[_label(codes[0])][0][2]
    print(f"\nload: {path.name}, {first['rows']:,} rows, {first['blocks']:,} block ids "
          f"({first['distinct']:,} distinct), bursted-art, 256-token blocks")  # fmt: skip
    base = None
    for label, results in runs_by.items():
        load_s = statistics.median(r[2]["load_s"] for r in results)
        rss = statistics.median(r[1] for r in results)
        same = all(r[2]["ids_sha256"] == first["ids_sha256"] for r in results)
        rate = first["rows"] / load_s * 60
        base = base or load_s
        each = ", ".join(f"{r[2]['load_s']:.2f}" for r in results)
        print(f"  {label:<14} load {load_s:7.2f} s  {rate:>12,.0f} rows/min  peak RSS "
              f"{rss:7,.0f} MiB  {base / load_s:5.2f}×  ids {'same' if same else 'DIFFER'}  "
              f"(runs {each})")  # fmt: skip


SWEEPS = {
    # name: (what, sweep file: "experiments/..." from the checkout, or a case to sweep)
    "seed_table": (
        "the BTB write-up's six-setup table, 6 points × 2 variants × 61,800 generated requests",
        "experiments/btb_seed_table.yaml",
    ),
    "seed_bursty_4": ("4 points over the seed_bursty trace (BTB's replicas 1-4)", "seed_bursty"),
    "seed_bursty_19w_4": ("4 points over the 19-window trace (BTB's replicas 1-4)",
                          "seed_bursty_19w"),
}  # fmt: skip

SWEEP_FILE = """\
name: bench_{case}
base: {case}.yaml
axes:
  replicas:
{points}
table:
  metrics: [ttft_p90]
  variants: [cache_aware, btb]
  baseline: cache_aware
"""

# what the `btb-lab` script runs (run from the work folder, so that the `PYTHONPATH`
# checkout is the one imported)
ENTRY = "import sys\nfrom btb_lab.cli import entry\nsys.argv[0] = 'btb-lab'\nsys.exit(entry())"


def _sweep_file(name: str, code: Path, work: Path, traces: Path) -> Path:
    source = SWEEPS[name][1]
    if source.startswith("experiments/"):
        own = code / source
        return own if own.is_file() else ROOT / source
    prepare(CASES[source], work, traces)
    path = work / f"sweep_{name}.yaml"
    points = "\n".join(
        f"    m{m}: {{variants.btb.router.params.replicas: {m}}}" for m in (1, 2, 3, 4)
    )
    path.write_text(SWEEP_FILE.format(case=source, points=points), encoding="utf-8")
    return path


def _sweep_run(code: Path, sweep: Path, jobs: int, work: Path) -> dict[str, float]:
    """One whole `btb-lab sweep` process: wall, and the user and system time of it and
    the point processes it waited for, and the largest peak RSS among them."""
    out = Path(tempfile.mkdtemp(prefix="sweep-", dir=work))
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPATH"] = str(code)
    env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    argv = [sys.executable, "-c", ENTRY, "sweep", str(sweep), "--jobs", str(jobs),
            "--out", str(out / "sweep")]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, cwd=work, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)  # fmt: skip
    assert proc.stderr is not None
    errors = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    whole = time.perf_counter() - start
    failed = list((out / "sweep" / "points").glob("*/error.txt"))
    shutil.rmtree(out)
    if os.waitstatus_to_exitcode(status) != 0 or failed:
        raise SystemExit(
            f"{code}: sweep {sweep} failed:\n{errors.decode(errors='replace')[-3000:]}"
        )
    return {"whole_s": whole, "user_s": usage.ru_utime, "sys_s": usage.ru_stime,
            "rss_mib": usage.ru_maxrss / 1024}  # fmt: skip


def sweep_bench(
    names: list[str], codes: list[Path], runs: int, jobs: int, work: Path, traces: Path
) -> None:
    """Whole `btb-lab sweep` processes (a sweep's points in `jobs` processes), runs
    interleaved across checkouts: what a table of points costs, not one run."""
    for name in names:
        what = SWEEPS[name][0]
        files = {_label(c): _sweep_file(name, c, work, traces) for c in codes}
        by: dict[str, list[dict[str, float]]] = {_label(c): [] for c in codes}
        for _ in range(runs):
            for code in codes:
                by[_label(code)].append(_sweep_run(code, files[_label(code)], jobs, work))
        labels = list(by)
        print(f"\nsweep {name}: {what}; --jobs {jobs}")
        header = f"  {'':<16}" + "".join(f"{label:>14}" for label in labels)
        print(header + "".join(f"{'×' + label:>12}" for label in labels[1:]))
        for title, key in (("whole (s)", "whole_s"), ("user (s)", "user_s"),
                           ("system (s)", "sys_s"), ("peak RSS (MiB)", "rss_mib")):  # fmt: skip
            medians = [statistics.median(r[key] for r in by[label]) for label in labels]
            line = f"  {title:<16}" + "".join(f"{_fmt(m, 0 if 'RSS' in title else 2):>14}"
                                              for m in medians)  # fmt: skip
            line += "".join(f"{medians[0] / m:>11.2f}×" if m else f"{'—':>12}" for m in medians[1:])
            print(line)
        each = ", ".join(
            f"{label} " + "/".join(f"{r['whole_s']:.2f}" for r in by[label]) for label in labels
        )
        print(f"  runs (whole s): {each}")


def _fmt(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def report(cases: list[Case], codes: list[Path], results: dict[str, dict[str, Series]]) -> None:
    labels = [_label(c) for c in codes]
    for case in cases:
        print(f"\n{case.name}: {case.what}; {case.rows:,} rows × 2 variants")
        header = f"  {'':<16}" + "".join(f"{label:>14}" for label in labels)
        if len(codes) > 1:
            header += "".join(f"{'×' + label:>12}" for label in labels[1:])
        print(header)
        rows = [("whole (s)", "whole_s", 2), ("in-loop req/s", "loop_rps", 0),
                ("  per core", "loop_core_rps", 0), ("  page faults (k)", "loop_faults_k", 0),
                ("  system (s)", "loop_sys_s", 2), ("peak RSS (MiB)", "rss_mib", 0),
                ("tree PSS (MiB)", "tree_pss_mib", 0)]  # fmt: skip
        rows += [(f"  {stage} (s)", stage, 2) for stage in STAGES]
        for title, key, digits in rows:
            medians = [results[case.name][label].median(key) for label in labels]
            line = f"  {title:<16}" + "".join(f"{_fmt(m, digits):>14}" for m in medians)
            for m in medians[1:]:
                base = medians[0]
                if m is None or base is None or m == 0 or base == 0:
                    line += f"{'—':>12}"
                elif key in ("loop_rps", "loop_core_rps"):
                    line += f"{m / base:>11.2f}×"
                else:
                    line += f"{base / m:>11.2f}×"  # how many times faster (or smaller)
            print(line)
        whole = ", ".join(
            f"{label} " + "/".join(f"{r.whole_s:.2f}" for r in results[case.name][label].runs)
            for label in labels
        )
        print(f"  runs (whole s): {whole}")


def _label(code: Path) -> str:
    return code.name or str(code)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", type=Path, action="append", default=[],
                        help="A checkout to run (repeatable); default: this one.")  # fmt: skip
    parser.add_argument("--runs", type=int, default=3, help="Timed runs per case and checkout.")
    parser.add_argument("--cases", default=",".join(CASES), help="Comma-separated case names.")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "btb-bench")
    parser.add_argument("--json", type=Path, default=None, help="Also write every run here.")
    parser.add_argument("--traces", type=Path, default=TRACES,
                        help="Folder of the shipped Mooncake traces.")  # fmt: skip
    parser.add_argument("--load-windows", type=int, default=19,
                        help="seed_bursty windows to load (19: 78,280 rows); 0: none.")  # fmt: skip
    choices = ", ".join(SWEEPS)
    parser.add_argument("--sweeps", default="seed_table,seed_bursty_4",
                        help=f"Sweeps, comma-separated ({choices}); '': none.")  # fmt: skip
    parser.add_argument("--sweep-jobs", type=int, default=2, help="A sweep's --jobs.")
    args = parser.parse_args()
    codes = [c.resolve() for c in args.code] or [ROOT]
    if len({_label(c) for c in codes}) != len(codes):
        raise SystemExit("--code folders need distinct names")
    args.work.mkdir(parents=True, exist_ok=True)
    cases = [CASES[name] for name in args.cases.split(",") if name]
    if not (args.traces / "mooncake_conversation.jsonl").is_file():
        skipped = [c.name for c in cases if c.name in ("mooncake", "bursted_mixed")]
        print(f"no {args.traces}: skipping {', '.join(skipped)}")
        cases = [c for c in cases if c.name not in skipped]
    hypotheses = {case.name: prepare(case, args.work, args.traces) for case in cases}
    load = os.getloadavg()
    print(
        f"workloads bench: {len(cases)} cases × {len(codes)} checkouts × {args.runs} runs; load "
        f"average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} CPUs"
    )
    for code in codes if cases else ():  # warm-up: bytecode cache, page cache
        one_run(code, hypotheses[cases[-1].name], args.work)
    results: dict[str, dict[str, Series]] = {
        case.name: {_label(c): Series() for c in codes} for case in cases
    }
    for case in cases:
        for _ in range(args.runs):
            for code in codes:
                results[case.name][_label(code)].runs.append(
                    one_run(code, hypotheses[case.name], args.work)
                )
    report(cases, codes, results)
    sweeps = [name for name in args.sweeps.split(",") if name]
    if unknown := [name for name in sweeps if name not in SWEEPS]:
        raise SystemExit(f"unknown sweep {unknown[0]!r}; choose from {', '.join(SWEEPS)}")
    sweep_bench(sweeps, codes, args.runs, args.sweep_jobs, args.work, args.traces)
    validate_bench(codes, args.runs, args.work)
    if args.load_windows:
        load_bench(codes, args.load_windows, args.runs, args.work)
    load = os.getloadavg()
    print(f"\nload average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.json:
        args.json.write_text(json.dumps({
            case: {label: [r.__dict__ for r in series.runs] for label, series in per.items()}
            for case, per in results.items()
        }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
