"""Run a hypothesis: plan variants × repeats, replay the workload through a backend,
store records as they finish, then analyze, judge and render the report.

Seeds: repeat r's workload seed derives from (master seed, r); each variant × repeat's
backend seed also mixes in a blake2b digest of the variant name. All variants of one
repeat replay the same requests, and the same file + seed + backend give the same
numbers.

This module is long because the run's whole life is one story read top to bottom:
planning, the repeat loop with its interrupt and failure handling, and the finalisation
that must happen in one order; splitting it would scatter that order across files.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import importlib.metadata
import math
import platform
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from btb_lab import __version__, collector, workers
from btb_lab.analysis.classes import assign_classes
from btb_lab.backends import Backend, RunContext
from btb_lab.config.hypothesis import Hypothesis
from btb_lab.config.limits import MAX_UTIL_SAMPLES
from btb_lab.config.variants import resolve_variant
from btb_lab.errors import STORAGE_ERRNOS, OutputError, UserError, describe_os_error
from btb_lab.forks import fork_safe
from btb_lab.hypothesis.loader import LoadedHypothesis, load_hypothesis
from btb_lab.interrupts import terminate_interrupts
from btb_lab.model.costmodel import RooflineCostModel, build_cost_model
from btb_lab.records import Request
from btb_lab.redact import redact_argv, redact_options, redact_value
from btb_lab.registry import Registry
from btb_lab.workload.loader import WorkloadCache, load_requests

if TYPE_CHECKING:
    from btb_lab.analysis.models import Summary, Verdict
    from btb_lab.report import forked
from btb_lab.results import (
    MANIFEST,
    RECORD_SINKS,
    ArrowRecordSink,
    JsonlRecordSink,
    Manifest,
    RunEntry,
    StoredFrames,
    check_out,
    finalize_parquet,
    new_run_dir,
    new_run_id,
    write_events_part,
    write_utilization_part,
)

__all__ = [
    "BACKENDS",
    "RunInterrupted",
    "RunOptions",
    "RunOutcome",
    "RunPlan",
    "derive_seed",
    "get_backend",
    "plan_run",
    "run_hypothesis",
]


def _sim() -> Backend:
    from btb_lab.sim.backend import SimBackend

    return SimBackend()


def _cluster() -> Backend:
    from btb_lab.cluster.backend import ClusterBackend

    return ClusterBackend()


# Backends by name. Each factory imports its backend on first use (the cluster backend
# pulls in httpx and the launcher), and every import stays visible to mypy.
BACKENDS: Registry[Callable[[], Backend]] = Registry("backend")
BACKENDS.add("sim", _sim)
BACKENDS.add("cluster", _cluster)


def get_backend(name: str) -> Backend:
    """A new backend by name (an unknown name is a UserError listing the known ones)."""
    return BACKENDS.get(name)()


_KEY_PACKAGES = ("numpy", "pandas", "pyarrow", "pydantic", "matplotlib", "vllm", "mooncake")


@dataclass
class RunOptions:
    """Command-line choices that override the hypothesis file for one run."""

    backend: str | None = None
    out: Path | None = None
    repeats: int | None = None
    requests: int | None = None
    time_scale: float | None = None
    variants: list[str] | None = None
    seed: int | None = None
    dry_run: bool = False
    progress: bool = True
    overrides: dict[str, Any] = field(default_factory=dict)
    results_root: Path = Path("results")
    # where each override came from, for error messages (`--set repeats`, a sweep line)
    origins: dict[str, str] = field(default_factory=dict)
    # a repeat's variants at once, each in a worker process, on a backend whose runs share
    # nothing (the simulator): at most this many; 0 = one per core; 1 = one after another
    jobs: int = 1
    # the last workload parsed or generated, kept across runs (a sweep's points replay the
    # same one); None: the run keeps its own while several repeats may read its trace file
    workloads: WorkloadCache | None = None
    # the sweep point this run is (its id): never a hypothesis's newest full run
    sweep_point: str | None = None


@dataclass
class RunOutcome:
    run_dir: Path
    verdict: Verdict | None  # None for a dry run
    summary: Summary | None  # None for a dry run
    plan: RunPlan | None = None


@dataclass
class RunPlan:
    """What a run will do (printed by --dry-run)."""

    hypothesis: Hypothesis
    loaded: LoadedHypothesis
    backend: str
    variants: list[str]
    repeats: int
    seed: int
    requests_per_run: int | None
    instances: list[str]
    notes: list[str] = field(default_factory=list)  # `workload_notes` of the first repeat

    def describe(self) -> list[str]:
        h = self.hypothesis
        lines = [
            f"hypothesis {h.id}: {h.title}",
            f"backend: {self.backend}",
            f"instances: {', '.join(self.instances)}",
            (
                f"workload: {self.requests_per_run if self.requests_per_run is not None else '?'} "
                f"requests per run, time_scale {h.workload.time_scale:g}"
            ),
            *(f"note: {note}" for note in self.notes),
            f"repeats: {self.repeats_text()}, master seed {self.seed}",
            f"variants ({len(self.variants)}; baseline {h.baseline}):",
        ]
        for name in self.variants:
            v = h.variants[name]
            lines.append(f"  {name}: {v.router.policy} {v.router.params or ''}".rstrip())
        auto = self.hypothesis.auto_repeats
        runs = len(self.variants) * self.repeats
        if auto is not None:
            lines.append(f"runs: {runs} to {len(self.variants) * auto.max} (variants × repeats)")
        else:
            lines.append(f"runs: {runs} (variants × repeats)")
        return lines

    def repeats_text(self) -> str:
        auto = self.hypothesis.auto_repeats
        if auto is None:
            return str(self.repeats)
        target = (
            auto.half_width if auto.half_width is not None else self.hypothesis.verdict.min_effect
        )
        return (
            f"auto ({auto.min} to {auto.max}, until every primary interval's half-width is "
            f"at most {target * 100:g} points)"
        )


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) during a run: finished records are stored and the report
    rendered, unless the stop came while it was written (`reported` False: every record
    is stored, and `btb-lab report DIR` writes it). `signum` is the signal that stopped it."""

    def __init__(self, run_dir: Path, signum: int = 2, *, reported: bool = True) -> None:
        super().__init__(str(run_dir))
        self.run_dir = run_dir
        self.signum = signum
        self.reported = reported


def derive_seed(master: int, *parts: object) -> int:
    """A 63-bit seed from the master seed and labels (blake2b; stable across processes)."""
    text = "\x1f".join(str(p) for p in (master, *parts))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


_FLAGS = (
    ("repeats", "repeats", "--repeats"),
    ("requests", "workload.requests", "--requests"),
    ("time_scale", "workload.time_scale", "--time-scale"),
    ("seed", "seed", "--seed"),
)


def _overrides(options: RunOptions) -> tuple[dict[str, Any], dict[str, str]]:
    """The overrides the options make, and where each came from (for error messages)."""
    merged = dict(options.overrides)
    origins = {key: options.origins.get(key, f"--set {key}") for key in merged}
    for attr, key, flag in _FLAGS:
        value = getattr(options, attr)
        if value is not None:
            merged[key] = value
            origins[key] = f"{flag} {value}"
    if options.repeats is not None:
        merged["auto_repeats"] = None  # an explicit count replaces `repeats: auto`
        origins["auto_repeats"] = f"--repeats {options.repeats}"
    return merged, origins


def plan_run(path: Path, options: RunOptions) -> RunPlan:
    """Load the hypothesis with the options applied and decide what will run."""
    for flag, value in (("--repeats", options.repeats), ("--requests", options.requests)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be at least 1 (got {value})")
    if options.time_scale is not None and options.time_scale <= 0:
        raise UserError(f"--time-scale must be positive (got {options.time_scale})")
    if options.backend is not None and options.backend not in BACKENDS:
        raise UserError(f"--backend {options.backend}: choose from {', '.join(BACKENDS)}")
    if options.variants is not None and not options.variants:
        raise UserError("--variants: name at least one variant")
    overrides, origins = _overrides(options)
    loaded = load_hypothesis(path, overrides, origins)
    hyp = loaded.hypothesis
    variants = list(hyp.variants)
    if options.variants:
        unknown = [v for v in options.variants if v not in hyp.variants]
        if unknown:
            raise UserError(f"--variants: unknown {', '.join(unknown)}; choose from: "
                            + ", ".join(hyp.variants))  # fmt: skip
        chosen = set(options.variants) | {hyp.baseline}
        variants = [v for v in hyp.variants if v in chosen]
    instances = [f"{g.count}×{g.role} ({g.gpus}×{g.gpu})" for g in hyp.cluster.instances]
    return RunPlan(
        hypothesis=hyp, loaded=loaded, backend=options.backend or hyp.backend, variants=variants,
        repeats=hyp.repeats, seed=hyp.seed, requests_per_run=hyp.workload.requests,
        instances=instances,
    )  # fmt: skip


def _load_requests(
    loaded: LoadedHypothesis, seed: int, workloads: WorkloadCache | None = None
) -> list[Request]:
    """A repeat's requests; inside a run (`collector.frozen`) they, and what else lives
    now, are left out of the cyclic collector's scans for the rest of the run (frozen
    before the collector is back on, which would otherwise scan them once first)."""
    with collector.paused(then_freeze=True):
        return load_requests(
            loaded.hypothesis.workload, base_dir=loaded.base_dir, seed=seed, cache=workloads
        )


def workload_notes(hyp: Hypothesis, requests: list[Request]) -> list[str]:
    """What the first repeat's workload left out of its input or may have misread, said
    once on the terminal and in the manifest and report: malformed rows skipped, fewer
    requests than asked, timestamps that look like seconds where milliseconds belong."""
    notes = []
    skipped = getattr(requests, "skipped", [])
    if skipped and hyp.workload.trace is not None:
        more = f" (and {len(skipped) - 1:,} more)" if len(skipped) > 1 else ""
        notes.append(
            f"{hyp.workload.trace.path}: {len(skipped):,} malformed rows skipped "
            f"(skip_bad_rows), first: {skipped[0]}{more}"
        )
    trace = hyp.workload.trace
    windows = len({r.trace_id for r in requests})
    if trace is not None and requests:
        from btb_lab.workload.trace_checks import block_size_hint, milliseconds_hint

        times = [r.arrival_s for r in requests]
        span_s = max(times) - min(times) - hyp.workload.window_gap_s * (windows - 1)
        hint = milliseconds_hint(trace.format, len(requests), span_s, hyp.workload.time_scale)
        if hint is not None:
            notes.append(f"{trace.path}: {hint}")
        sizes = ((r.input_tokens, len(r.block_hashes)) for r in requests)
        hint = block_size_hint(sizes, hyp.workload.block_tokens)
        if hint is not None:
            notes.append(f"{trace.path}: {hint}")
    variation = hyp.workload.variation
    # one window drawn with replacement is only itself
    if variation is not None and variation.resample_windows and windows == 1:
        notes.append(
            "workload.variation.resample_windows: the workload has one window (trace_id), "
            "so every repeat replays it whole"
            + ("" if variation.arrival_jitter_s else "; arrival_jitter_s would vary it")
        )
    asked = hyp.workload.requests
    if asked is not None and len(requests) < asked:
        offset = hyp.workload.offset
        after = f" after workload.offset {offset:,}" if offset else ""
        notes.append(
            f"workload.requests is {asked:,} but the workload has {len(requests):,}{after}: "
            f"all {len(requests):,} replayed"
        )
    return notes


def _versions() -> dict[str, str]:
    out = {"btb-lab": __version__, "python": platform.python_version()}
    for pkg in _KEY_PACKAGES:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def _sim_cache() -> str:
    """Which prefix cache the simulator runs on (compiled or python: the same records)."""
    from btb_lab.sim.cache import implementation

    try:
        return implementation()[0]
    except ValueError as exc:
        raise UserError(str(exc)) from None


def _git_commit(folder: Path) -> dict[str, Any] | None:
    """Commit (and dirtiness) of the repository holding the hypothesis file, if any."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "HEAD"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(folder), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(dirty)}


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class _Progress:
    """Rich progress (variant, repeat, requests done, ETA), or nothing."""

    def __init__(self, enabled: bool, *, threaded: bool = True) -> None:
        self.enabled = enabled
        # unthreaded: redrawn on each update instead of by a refresh thread, so that the
        # process can fork workers (a fork copies no thread, and no lock one held)
        self.threaded = threaded
        self._progress: Any = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("requests"), TimeElapsedColumn(), TextColumn("ETA"),
                TimeRemainingColumn(), transient=False, auto_refresh=self.threaded,
            )  # fmt: skip
            self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(None, None, None)

    def task(self, label: str, total: int) -> Callable[[int, int], None]:
        if self._progress is None:
            return lambda done, total: None
        progress = self._progress
        task_id = progress.add_task(label, total=total)
        last = [0.0]

        def update(done: int, total_now: int) -> None:
            now = time.monotonic()
            if done < total_now and now - last[0] < 0.1:
                return
            last[0] = now
            progress.update(task_id, completed=done, total=total_now, refresh=not self.threaded)

        return update


def run_hypothesis(path: Path, options: RunOptions) -> RunOutcome:
    """Plan, run every variant × repeat, store, analyze, judge and render.

    Bad input fails before the run directory exists: the hypothesis, the flags and the
    first repeat's workload are all checked first. After that, whatever stops the run — a
    later repeat's workload, a full disk, Ctrl-C or SIGTERM — leaves a directory whose
    manifest says what happened (`error`, `interrupted`, `complete`) and which `btb-lab
    report DIR` explains.
    """
    plan = plan_run(path, options)
    first_seed = derive_seed(plan.seed, "workload", 0)
    if options.dry_run:
        requests = _load_requests(plan.loaded, first_seed)
        plan.requests_per_run = len(requests)
        plan.notes = workload_notes(plan.hypothesis, requests)
        return RunOutcome(run_dir=Path(), verdict=None, summary=None, plan=plan)
    # a child imports matplotlib on the second core while this process loads and
    # simulates, and draws the report's plots (`report.forked`)
    from btb_lab.report import forked, png

    with forked.prewarmed(png.pyplot), collector.frozen():
        return _run_planned(plan, options, first_seed)


def _run_planned(plan: RunPlan, options: RunOptions, first_seed: int) -> RunOutcome:
    hyp, loaded = plan.hypothesis, plan.loaded
    if options.out is not None:
        check_out(options.out)
    # Every variant's resolved blocks and cost model, built once before anything runs (a
    # topology that does not fit fails here, not after the first variant ran).
    worlds = {name: _variant_world(hyp, name, loaded.base_dir) for name in plan.variants}
    backend = get_backend(plan.backend)
    jobs = _jobs(options.jobs, backend, len(plan.variants))
    # a trace replayed by several repeats is parsed once (each repeat gets fresh requests;
    # a generator makes each repeat's own workload from its seed), and a sweep's points
    # share what their process parsed or generated last
    workloads = options.workloads
    several = plan.repeats > 1 or hyp.auto_repeats
    if workloads is None and several and hyp.workload.trace is not None:
        workloads = WorkloadCache()
    stamp = _stamp_ahead(plan)  # the trace's CRC is read while the trace loads
    first_requests = _load_requests(loaded, first_seed, workloads)
    plan.notes = workload_notes(hyp, first_requests)
    versions = _versions()
    if plan.backend == "sim":
        _check_sim_sampling(loaded, worlds, first_requests)
        versions["btb_lab.sim.cache"] = _sim_cache()
    run_dir = new_run_dir(options.results_root, hyp.id, out=options.out, run_id=new_run_id())
    interrupted: KeyboardInterrupt | None = None
    failure: Exception | None = None
    frames: StoredFrames | None = None
    drawing: forked.Warm | None = None
    ran_all = False  # every planned run ended: a stop after this loses no record
    # One `try` from the first manifest on: a stop that lands while the directory is set
    # up (a sweep worker meets SIGTERM as its point starts) still marks it interrupted.
    try:
        with terminate_interrupts():
            manifest = _new_manifest(run_dir, options, plan, len(first_requests), versions,
                                     stamp())  # fmt: skip
            _open_run_dir(run_dir, manifest)
            with _Progress(options.progress, threaded=jobs == 1) as progress:
                repeat = 0
                planned = plan.repeats
                while True:
                    workload_seed = derive_seed(plan.seed, "workload", repeat)
                    if repeat == 0:
                        requests = first_requests
                    else:
                        requests = _load_requests(loaded, workload_seed, workloads)
                    manifest.requests_per_run = len(requests)
                    _run_repeat(backend, hyp, worlds, plan.variants, repeat, requests, run_dir,
                                manifest, progress, workload_seed, jobs)  # fmt: skip
                    repeat += 1
                    if repeat >= planned:
                        planned = _repeats_needed(hyp, plan.variants, run_dir, manifest, repeat)
                        if repeat >= planned:
                            break
                        manifest.repeats = planned  # `repeats: auto` goes past its minimum
                        manifest.runs_planned = len(plan.variants) * planned
                        manifest.save(run_dir)
            ran_all = True
            # every record is in the parts: the drawing child plots from them while this
            # process converts them to parquet and analyses them
            from btb_lab.report.render import draw_from_parts

            drawing = draw_from_parts(run_dir, plan.variants)
    except KeyboardInterrupt as exc:
        interrupted = exc
    except Exception as exc:  # a later repeat's workload, a full disk, a bug: recorded
        failure = exc
    finally:
        # Backends that hold resources across variants (launched servers) release them here.
        close = getattr(backend, "close", None)
        if callable(close):
            close()
        opened = (run_dir / MANIFEST).exists()
        if opened:
            failure, interrupted, frames = _finish(
                run_dir, manifest, plan, interrupted, failure, ran_all
            )
        else:  # stopped, or refused by the disk, before the first manifest: nothing to keep
            (run_dir / SPACE_RESERVE).unlink(missing_ok=True)
            _remove_if_empty(run_dir)
        if drawing is not None and (failure is not None or interrupted is not None):
            from btb_lab.report.png import stop_drawing

            stop_drawing(drawing, run_dir / "plots")  # the report of a failed or stopped run
            drawing = None  # draws what is there, in this process
    if not opened and failure is not None:
        raise failure
    if not opened and interrupted is not None:
        raise interrupted

    # The workload is stored; the report reads it back from disk. Let it go first, so the
    # report's peak memory does not stack on the simulation's.
    first_requests = requests = []
    workloads = None
    from btb_lab.report.render import build_report

    if failure is not None:
        if isinstance(failure, OSError) and failure.errno in STORAGE_ERRNOS:
            raise OutputError(describe_os_error(failure, run_dir)) from None
        # the report says RUN FAILED and why; the error itself is what the user sees
        with contextlib.suppress(Exception):
            build_report(run_dir)
        if isinstance(failure, UserError):
            raise UserError(f"{failure}\n{run_dir}: the run is recorded as failed") from None
        raise failure
    try:
        run = build_report(run_dir, frames, drawing)
    except OSError as exc:
        raise OutputError(describe_os_error(exc, run_dir)) from None
    except KeyboardInterrupt as exc:  # the records are all stored: only the report is missing
        signum = getattr(exc, "signum", signal.SIGINT)
        raise RunInterrupted(run_dir, signum, reported=False) from None
    if interrupted is not None:
        raise RunInterrupted(run_dir, getattr(interrupted, "signum", signal.SIGINT))
    return RunOutcome(run_dir=run_dir, verdict=run.verdict, summary=run.summary, plan=plan)


def _new_manifest(
    run_dir: Path, options: RunOptions, plan: RunPlan, requests_per_run: int,
    versions: dict[str, str], trace: dict[str, Any] | None,
) -> Manifest:  # fmt: skip
    hyp, loaded = plan.hypothesis, plan.loaded
    return Manifest(
        run_id=run_dir.name if options.out is None else new_run_id(),
        run_dir=str(run_dir),
        hypothesis_id=hyp.id,
        hypothesis_file=str(loaded.path),
        hypothesis=redact_value(hyp.model_dump(mode="json", by_alias=True)),
        aliases=hyp.aliases,
        cli={"argv": redact_argv(list(sys.argv)), "options": _options_json(options)},
        backend=plan.backend,
        variants=plan.variants,
        repeats=plan.repeats,
        master_seed=plan.seed,
        requests_per_run=requests_per_run,
        notes=plan.notes,
        runs_planned=len(plan.variants) * plan.repeats,
        trace=trace,
        versions=versions,
        git=_git_commit(loaded.base_dir),
        host={"hostname": socket.gethostname(), "platform": platform.platform()},
        started=_now(),
    )


def _stamp_ahead(plan: RunPlan) -> Callable[[], dict[str, Any] | None]:
    """`_trace_stamp` started on a thread (its CRC reads the whole file outside the
    interpreter lock, beside the load); call the result to take the stamp (or its error)
    with the thread joined: before the manifest, so before any worker forks."""
    if plan.hypothesis.workload.trace is None:
        return lambda: None
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1, thread_name_prefix="btb-lab-stamp")
    future = pool.submit(_trace_stamp, plan)

    def result() -> dict[str, Any] | None:
        try:
            return future.result()
        finally:
            pool.shutdown()

    return result


def _trace_stamp(plan: RunPlan) -> dict[str, Any] | None:
    workload = plan.hypothesis.workload
    if workload.trace is None:
        return None
    from btb_lab.workload.loader import trace_path
    from btb_lab.workload.trace_checks import trace_stamp

    return trace_stamp(trace_path(workload, plan.loaded.base_dir))


def _open_run_dir(run_dir: Path, manifest: Manifest) -> None:
    """The first manifest, then the disk-space reserve; a disk that refuses either is an
    `OutputError` and leaves no manifest behind."""
    try:
        manifest.save(run_dir)
        # Room for the last words: freed when the run ends, so that on a full disk the
        # manifest can still record the error and the records their parquet files.
        (run_dir / SPACE_RESERVE).write_bytes(bytes(SPACE_RESERVE_BYTES))
    except OSError as exc:
        (run_dir / SPACE_RESERVE).unlink(missing_ok=True)
        (run_dir / MANIFEST).unlink(missing_ok=True)
        raise OutputError(describe_os_error(exc, run_dir)) from None


def _finish(
    run_dir: Path,
    manifest: Manifest,
    plan: RunPlan,
    interrupted: KeyboardInterrupt | None,
    failure: Exception | None,
    ran_all: bool = False,
) -> tuple[Exception | None, KeyboardInterrupt | None, StoredFrames | None]:
    """Records first, then the manifest that says whether they are complete. Returns the
    failure to report (the run's own, or the first write that failed here), the
    interrupt (the run's own, or one that arrived while converting the records) and the
    frames written (for the report, which need not read them back).

    A stop that arrives once every planned run has ended (`ran_all`: while the records
    are converted or the plots drawn) is recorded, but the records are complete: so is
    the run, and its verdict stands."""
    (run_dir / SPACE_RESERVE).unlink(missing_ok=True)
    if failure is not None:
        _record_failure(run_dir, manifest, failure)
    for entry in manifest.runs:
        if entry.status == "running":  # stopped between its last record and its status
            entry.status = "interrupted" if interrupted is not None else "failed"
            if entry.status == "failed" and entry.error is None:
                entry.error = "the run stopped before this variant's run ended"
            entry.finished = entry.finished or _now()
    frames = None
    try:
        rules = plan.hypothesis.classes
        frames = finalize_parquet(run_dir, plan.variants, lambda f: assign_classes(f, rules))
    except KeyboardInterrupt as exc:  # the parts hold every record; readers use them
        interrupted = interrupted or exc
    except OSError as exc:  # readers fall back to the parts
        if failure is None:
            failure = exc
            _record_failure(run_dir, manifest, exc)
    manifest.finished = _now()
    manifest.interrupted = interrupted is not None
    manifest.complete = (
        failure is None
        and (interrupted is None or ran_all)
        and len(manifest.runs) == manifest.runs_planned
        and all(r.status != "interrupted" for r in manifest.runs)
    )
    try:
        manifest.save(run_dir)
    except KeyboardInterrupt as exc:  # the stop landed on this save: once more, saying so
        interrupted = interrupted or exc
        manifest.interrupted = True
        try:
            manifest.save(run_dir)
        except OSError as err:
            failure = failure or err
    except OSError as exc:  # the last saved manifest stays (it says "running")
        failure = failure or exc
    return failure, interrupted, frames


ERROR_FILE = "error-{variant}-r{repeat}.txt"
RUN_ERROR_FILE = "error.txt"
# A file of zeros each run directory holds while its run is going (see run_hypothesis):
# when it is freed, a full disk still has room for the manifest, the parquet files and a
# report (a small run's plots — timelines, CDFs, utilization — are about 0.3 MB, and each
# is written to a temporary file first).
SPACE_RESERVE = ".space-reserve"
SPACE_RESERVE_BYTES = 1024 * 1024


def _record_failure(run_dir: Path, manifest: Manifest, exc: BaseException) -> None:
    """The run-level error in the manifest; a traceback file for anything but a user
    mistake or a full disk (which the one-line error explains)."""
    if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
        manifest.error = describe_os_error(exc, run_dir)
        return
    if isinstance(exc, UserError):
        manifest.error = str(exc)
        return
    manifest.error = f"{type(exc).__name__}: {exc}"
    try:
        (run_dir / RUN_ERROR_FILE).write_text(
            "".join(traceback.format_exception(exc)), encoding="utf-8"
        )
        manifest.error_file = RUN_ERROR_FILE
    except OSError:  # a full disk: the one-line error above still says what happened
        pass


def _remove_if_empty(run_dir: Path) -> None:
    for leftover in run_dir.glob("*.tmp"):
        leftover.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        run_dir.rmdir()


def _check_sim_sampling(
    loaded: LoadedHypothesis,
    worlds: dict[str, tuple[Hypothesis, RooflineCostModel]],
    requests: list[Request],
) -> None:
    """The simulator keeps one utilization sample per instance per sampling period of the
    simulated span, so a workload stretched over years (a huge time_scale or window gap)
    or a tiny sim.sample_interval_s would exhaust memory: refuse it before the run."""
    span_s = max((r.arrival_s for r in requests), default=0.0)
    for name, (resolved, _) in worlds.items():
        interval_s = resolved.sim.sample_interval_s
        instances = sum(g.count for g in resolved.cluster.instances)
        samples = instances * (span_s / interval_s + 1)
        if samples > MAX_UTIL_SAMPLES:
            raise UserError(
                f"{loaded.path}: sim.sample_interval_s: the workload spans {_count(span_s)} s "
                f"of simulated time; sampling {instances} instances every {interval_s:g} s "
                f"(variant {name}) keeps {_count(samples)} utilization samples, more than the "
                f"limit of {MAX_UTIL_SAMPLES:,}: raise sim.sample_interval_s or shorten the "
                "workload (time_scale, window_gap_s)"
            )


def _count(value: float) -> str:
    """`1,234,567`, or `1.2e+300` where the digits would run on."""
    return f"{value:,.0f}" if value < 1e15 else f"{value:.3g}"


def _repeats_needed(
    hyp: Hypothesis, variants: list[str], run_dir: Path, manifest: Manifest, done: int
) -> int:
    """How many repeats the run needs, judged after `done` of them: `repeats`, or with
    `repeats: auto` as many as make every primary interval's half-width at most the
    target — `done` when they already do, else the widest interval's projection (half-
    widths shrink as 1/√repeats), at least one more and at most the cap. Stopping on the
    interval's width, not on where it lies, keeps the rule from steering the verdict; a
    failed run stops at once, and so does one whose repeats copy each other (a plain trace
    on the simulator)."""
    auto = hyp.auto_repeats
    if auto is None:
        return hyp.repeats
    if done < auto.min:
        return auto.min
    if done >= auto.max or manifest.failed_variants:
        return done
    from btb_lab.analysis.repeats import distinct_repeats
    from btb_lab.analysis.summary import measured_frames
    from btb_lab.analysis.verdict import evaluate_verdict
    from btb_lab.results import read_records, read_utilization

    records, util, _ = measured_frames(
        hyp, read_records(run_dir, variants), read_utilization(run_dir, variants)
    )
    if distinct_repeats(records, util)[2]:
        return done  # a repeat copied an earlier one: more of them would add nothing
    verdict = evaluate_verdict(records, util, hyp.verdict, baseline=hyp.baseline,
                               variants=variants, seed=hyp.seed)  # fmt: skip
    target = auto.half_width if auto.half_width is not None else hyp.verdict.min_effect
    widths = [vv.primary.half_width for vv in verdict.variants.values() if vv.primary is not None]
    if all(w is not None and w <= target + 1e-12 for w in widths):
        return done
    known = [w for w in widths if w is not None]
    if len(known) < len(widths) or not known:
        return done + 1
    return min(auto.max, max(done + 1, math.ceil(done * (max(known) / target) ** 2)))


def _options_json(options: RunOptions) -> dict[str, Any]:
    data = asdict(replace(options, workloads=None))  # loaded workloads: not a setting
    del data["workloads"]
    for key in ("out", "results_root"):
        data[key] = None if data[key] is None else str(data[key])
    redacted: dict[str, Any] = redact_options(data)
    return redacted


def _variant_world(
    hyp: Hypothesis, name: str, base_dir: Path
) -> tuple[Hypothesis, RooflineCostModel]:
    """The hypothesis as variant `name` sees it, and its cost model."""
    resolved = resolve_variant(hyp, name)
    return resolved, build_cost_model(resolved, base_dir)


def _jobs(jobs: int, backend: Backend, variants: int) -> int:
    """How many of a repeat's variants run at once: 1 unless the backend's runs share
    nothing (`parallel_variants`) and this process can fork; 0 means one per core."""
    if not getattr(backend, "parallel_variants", False) or not fork_safe():
        return 1
    return max(1, min(jobs or workers.cores(), variants))


def _run_repeat(
    backend: Backend,
    hyp: Hypothesis,
    worlds: dict[str, tuple[Hypothesis, RooflineCostModel]],
    names: list[str],
    repeat: int,
    requests: list[Request],
    run_dir: Path,
    manifest: Manifest,
    progress: _Progress,
    workload_seed: int,
    jobs: int,
) -> None:
    """Every variant of one repeat: one after another, or (`jobs` > 1) each in a worker
    process, at most `jobs` at a time (`workers`): the same records and manifest."""
    if jobs <= 1:
        for name in names:
            _run_one(backend, hyp, worlds[name], name, repeat, requests, run_dir, manifest,
                     progress, workload_seed)  # fmt: skip
        return

    def task(name: str) -> workers.Task:
        entry = _new_entry(hyp, name, repeat, requests, workload_seed)

        def start() -> Callable[[int, int], None]:
            manifest.runs.append(entry)
            manifest.save(run_dir)
            return progress.task(_progress_label(hyp, name, repeat), len(requests))

        def work(sent: workers.WorkerProgress) -> dict[str, Any]:
            # this process's copy of the manifest: the parent saves the one on disk
            def answer() -> dict[str, Any]:
                return {"entry": entry.model_dump(mode="json"),
                        "fidelity": manifest.fidelity.get(name),
                        "telemetry_source": manifest.telemetry_source}  # fmt: skip

            try:
                _own_pages(requests)
                _run_one(backend, hyp, worlds[name], name, repeat, requests, run_dir, manifest,
                         sent, workload_seed, entry=entry, save=lambda: None)  # fmt: skip
            except BaseException as exc:
                exc.answer = answer()  # type: ignore[attr-defined]
                raise
            return answer()

        def done(answer: dict[str, Any] | None, died: str) -> None:
            if answer is None:  # died (`died` says how), or stopped before its run began
                entry.status = "failed" if died else "interrupted"
                entry.error = died or None
                entry.finished = _now()
            else:
                at = next(i for i, e in enumerate(manifest.runs) if e is entry)
                manifest.runs[at] = RunEntry.model_validate(answer["entry"])
                if answer["fidelity"] is not None:
                    manifest.fidelity[name] = answer["fidelity"]
                if answer["entry"]["status"] == "ok":
                    manifest.telemetry_source = answer["telemetry_source"]
            manifest.save(run_dir)

        return workers.Task(start=start, work=work, done=done)

    workers.run_tasks([task(name) for name in names], jobs)


def _own_pages(requests: list[Request]) -> None:
    """Take, in a forked worker, its own copy of the pages its run writes reference counts
    on: each request, its block-id tuple (about a page each on long prompts) and its id
    strings. The copy-on-write faults are as many either way, but taken here in one tight
    loop they cost a fraction of what they cost scattered through the event loop
    (seed_bursty_19w, 78,280 requests: 43k faults in 0.13 s here, and the run after it
    0.4 s shorter; benchmarks/README.md)."""
    for request in requests:
        _ = request.block_hashes, request.request_id, request.session_id, request.trace_id


def _new_entry(
    hyp: Hypothesis, name: str, repeat: int, requests: list[Request], workload_seed: int
) -> RunEntry:
    return RunEntry(
        variant=name, repeat=repeat, seed=derive_seed(hyp.seed, "variant", repeat, name),
        workload_seed=workload_seed, requests=len(requests), status="running", started=_now(),
    )  # fmt: skip


def _progress_label(hyp: Hypothesis, name: str, repeat: int) -> str:
    return f"{name} r{repeat + 1}/" + (
        f"≤{hyp.auto_repeats.max}" if hyp.auto_repeats else str(hyp.repeats)
    )


def _run_one(
    backend: Backend,
    hyp: Hypothesis,
    world: tuple[Hypothesis, RooflineCostModel],
    name: str,
    repeat: int,
    requests: list[Request],
    run_dir: Path,
    manifest: Manifest,
    progress: _Progress | workers.WorkerProgress,
    workload_seed: int,
    *,
    entry: RunEntry | None = None,
    save: Callable[[], None] | None = None,
) -> None:
    """One variant × repeat; its entry is added to the manifest, which `save` writes
    (a worker passes its entry, already in the parent's manifest, and saves nothing)."""
    save = save or (lambda: manifest.save(run_dir))
    if entry is None:
        entry = _new_entry(hyp, name, repeat, requests, workload_seed)
        manifest.runs.append(entry)
        save()
    seed = entry.seed
    record_format = getattr(backend, "record_format", "jsonl")
    sink: JsonlRecordSink | ArrowRecordSink | None = None
    try:
        sink = RECORD_SINKS[record_format](run_dir, name, repeat)
        resolved, costs = world
        ctx = RunContext(
            hypothesis=resolved, variant_name=name, variant=hyp.variants[name], repeat=repeat,
            seed=seed, run_dir=run_dir, sink=sink, costs=costs,
            progress=progress.task(_progress_label(hyp, name, repeat), len(requests)),
        )  # fmt: skip
        result = backend.run_variant(ctx, list(requests))
    except KeyboardInterrupt:
        entry.status = "interrupted"
        raise
    except UserError as exc:
        entry.status = "failed"
        entry.error = str(exc)
        raise
    except OSError as exc:
        entry.status = "failed"
        if exc.errno in STORAGE_ERRNOS:  # every later write fails too: stop the run
            entry.error = describe_os_error(exc, run_dir)
            raise
        _record_crash(entry, exc, run_dir)
        return
    except Exception as exc:  # a crashed run is recorded with its traceback: INCONCLUSIVE
        entry.status = "failed"
        _record_crash(entry, exc, run_dir)
        return
    finally:
        try:
            if sink is not None:
                sink.close()
        finally:
            entry.records = sink.count if sink is not None else 0
            entry.finished = _now()
            save()
    write_utilization_part(run_dir, name, repeat, result.utilization, record_format)
    write_events_part(run_dir, name, repeat, result.events, record_format)
    entry.samples = len(result.utilization)
    entry.events = len(result.events)
    entry.status = "ok"
    manifest.fidelity[name] = dict(result.fidelity)
    manifest.telemetry_source = result.telemetry_source
    if result.extra:
        entry.extra = result.extra
    save()


def _record_crash(entry: RunEntry, exc: Exception, run_dir: Path) -> None:
    entry.error = f"{type(exc).__name__}: {exc}"
    entry.error_file = _safe_name(ERROR_FILE.format(variant=entry.variant, repeat=entry.repeat))
    (run_dir / entry.error_file).write_text(
        "".join(traceback.format_exception(exc)), encoding="utf-8"
    )
    print(
        f"run {entry.variant} repeat {entry.repeat} failed: {entry.error} "
        f"(traceback: {run_dir / entry.error_file})",
        file=sys.stderr,
    )


def _safe_name(name: str) -> str:
    """A file name from a variant name (which may hold any characters)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
