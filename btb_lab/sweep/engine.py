"""Running a sweep: every point as its own run directory, skipping finished ones, on one
machine (in-process or a process pool) or as Ray tasks, then one table and one plot.

Layout of a sweep directory:

    <sweep dir>/sweep.json              the expanded plan (points, overrides, base file)
    <sweep dir>/points/<point id>/      one run directory per point (manifest, summary, ...)
    <sweep dir>/points/<point id>/point.json   written after the run finished
    <sweep dir>/table.csv, table.md, plot.png

A point is finished when its manifest says `complete: true`, its summary exists and its
point.json matches the point's overrides and the base file's digest; anything else is
rerun from scratch, so an interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from btb_lab import workers
from btb_lab.errors import UserError
from btb_lab.interrupts import Terminated
from btb_lab.sweep.plan import PointTask, SweepPoint, expand_points, overrides_digest
from btb_lab.sweep.series import point_series, write_series_plots
from btb_lab.sweep.spec import LoadedSweep, load_sweep, refuse_swept_seed
from btb_lab.sweep.table import build_table, write_outputs
from btb_lab.yamlio import compose_yaml

if TYPE_CHECKING:
    import pandas as pd

    from btb_lab.analysis.models import Summary
    from btb_lab.workload.loader import WorkloadCache

__all__ = [
    "RunPointFn",
    "SweepOutcome",
    "check_points",
    "default_sweep_dir",
    "is_point_complete",
    "plan_tasks",
    "read_summaries",
    "run_point",
    "run_sweep",
]

RunPointFn = Callable[[PointTask], None]
Executor = Literal["local", "ray"]


_workloads: list[WorkloadCache] = []  # this process's, while a sweep runs points in it


def _point_workloads() -> WorkloadCache:
    """The workload this process's points parsed or generated last: points replay the
    same trace file or generated windows with other settings, so the workload is made
    once per process (each point gets fresh requests)."""
    from btb_lab.workload.loader import WorkloadCache

    if not _workloads:
        _workloads.append(WorkloadCache())
    return _workloads[0]


def run_point(task: PointTask) -> None:
    """Run the base hypothesis with the point's overrides into `task.run_dir` (the
    default point runner; importable by name so process pools and Ray workers find it).

    A point draws its plots in its own process (`forked.inline`): the sweep's points
    already share the cores, and the process keeps matplotlib from its last point, where
    a report child would import it again for every point and the point process would pay
    copy-on-write faults on the pages it shares with that child."""
    from btb_lab.report import forked
    from btb_lab.runner import RunOptions, run_hypothesis

    options = RunOptions(
        out=Path(task.run_dir),
        overrides=dict(task.overrides),
        seed=task.seed,
        progress=False,
        workloads=_point_workloads(),
        sweep_point=task.point_id,
    )
    with forked.inline():
        run_hypothesis(Path(task.base_path), options)


@dataclass
class SweepOutcome:
    """What a sweep did and where its outputs are."""

    sweep_dir: Path
    points: list[SweepPoint]
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    table: pd.DataFrame | None = None
    outputs: dict[str, Path] = field(default_factory=dict)


# what a pass writes into the sweep directory after its points (`write_outputs`,
# `write_series_plots`)
SWEEP_OUTPUTS = ("table.csv", "table.md", "plot.png", "intervals.csv", "series.png", "pareto.png")


def default_sweep_dir(loaded: LoadedSweep) -> Path:
    """results/sweeps/<name>/ under the current directory: fixed, so reruns resume."""
    return Path("results") / "sweeps" / loaded.spec.name


def _file_digest(path: Path) -> str:
    return hashlib.blake2b(path.read_bytes(), digest_size=8).hexdigest()


def _point_record(task: PointTask, base_digest: str) -> dict[str, Any]:
    return {
        "point_id": task.point_id,
        "labels": task.labels,
        "overrides": task.overrides,
        "overrides_digest": overrides_digest(task.overrides),
        "base": task.base_path,
        "base_digest": base_digest,
        "seed": task.seed,
    }


def is_point_complete(
    task: PointTask, base_digest: str, stamps: dict[str, Any] | None = None
) -> bool:
    """True when the point's run finished, was made from the same inputs and still has
    its records (the table's intervals are computed from them). `stamps`: the trace
    stamps taken so far in this pass over the points (each file is read once)."""
    from btb_lab.results import Manifest

    run_dir = Path(task.run_dir)
    try:
        manifest = Manifest.load(run_dir)
        point = json.loads((run_dir / "point.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, UserError):
        return False
    if not manifest.complete or not (run_dir / "summary.json").is_file():
        return False
    if any(r.records for r in manifest.runs) and not (run_dir / "requests.parquet").is_file():
        return False  # the records it counts are gone: the table would drop the point
    if manifest.trace is not None and not _same_trace(manifest.trace, stamps):
        return False  # its trace file was changed (or removed) since
    if not _same_profiles(manifest.fidelity, Path(task.base_path).parent, stamps):
        return False  # a cost profile it ran on was changed (or removed) since
    expected = _point_record(task, base_digest)
    return all(point.get(k) == expected[k] for k in ("overrides_digest", "base_digest", "seed"))


def _same_profiles(
    fidelity: dict[str, dict[str, Any]], base_dir: Path, stamps: dict[str, Any] | None = None
) -> bool:
    """Whether every engine profile the point's variants ran on still has the contents
    they recorded (`costs.profile.sha256`; the path is relative to the hypothesis's
    folder, as the run read it). `stamps` keeps each file's digest for the pass."""
    import hashlib

    stamps = {} if stamps is None else stamps
    for facts in fidelity.values():
        recorded, where = facts.get("costs.profile.sha256"), facts.get("costs.profile.path")
        if recorded is None or where is None:
            continue
        path = base_dir / str(where)
        key = f"profile:{path.resolve()}"
        if key not in stamps:
            try:
                stamps[key] = hashlib.sha256(path.read_bytes()).hexdigest()
            except OSError:
                stamps[key] = None
        if stamps[key] != recorded:
            return False
    return True


def _same_trace(stamp: dict[str, Any], stamps: dict[str, Any] | None) -> bool:
    from btb_lab.results.manifest import same_contents
    from btb_lab.workload.trace_checks import trace_stamp

    stamps = {} if stamps is None else stamps
    try:
        path = str(stamp["path"])
        if path not in stamps:
            stamps[path] = trace_stamp(Path(path))
        now = stamps[path]
        return bool(now["path"] == path and same_contents(now, stamp))
    except (OSError, KeyError, TypeError):
        return False


def plan_tasks(
    loaded: LoadedSweep,
    sweep_dir: Path,
    *,
    seed: int | None = None,
    points: Sequence[SweepPoint] | None = None,
) -> list[PointTask]:
    """The sweep's points (`points` when the caller expanded them already) as runnable
    tasks, each with its own run directory."""
    base = str(loaded.base_path)
    chosen_seed = seed if seed is not None else loaded.spec.seed
    points = expand_points(loaded.spec) if points is None else points
    if chosen_seed is not None:
        refuse_swept_seed(loaded, points, f"--seed {seed}" if seed is not None else None)
    return [
        PointTask(
            point_id=p.point_id,
            labels=p.labels,
            base_path=base,
            overrides=p.overrides,
            run_dir=str((sweep_dir / "points" / p.point_id).resolve()),
            seed=chosen_seed,
        )
        for p in points
    ]


def check_points(loaded: LoadedSweep, tasks: Sequence[PointTask]) -> None:
    """Load the base hypothesis with every point's overrides before running anything, and
    check the `table:` block against the variants and classes the points have, so a bad
    override or table entry fails the sweep at once with `SWEEP:LINE: field: message`
    (a bad override at its line of the sweep file, never at a line of the base file)."""
    from btb_lab.errors import ValidationFailed
    from btb_lab.hypothesis import load_hypothesis

    problems: list[str] = []
    variants: list[set[str]] = []
    classes: set[str] = set()
    for task in tasks:
        origins = loaded.override_origins(task.labels, task.overrides)
        origins = {k: f"{v} (point {task.point_id})" for k, v in origins.items()}
        try:
            hyp = load_hypothesis(Path(task.base_path), dict(task.overrides), origins).hypothesis
        except ValidationFailed as exc:
            problems += [p for p in exc.problems if p not in problems]
            continue
        except UserError as exc:
            if str(exc) not in problems:
                problems.append(str(exc))
            continue
        variants.append(set(hyp.variants))
        classes |= {rule.name for rule in hyp.classes}
    if problems:
        more = len(problems) - 20
        tail = [f"{loaded.path}: ... and {more} more problems"] if more > 0 else []
        raise ValidationFailed(problems[:20] + tail)
    table = loaded.spec.table
    path = loaded.path
    every = set.intersection(*variants) if variants else set()
    some = set.union(*variants) if variants else set()
    for i, name in enumerate(table.variants or []):
        if name not in some:
            problems.append(
                f"{path}:{loaded.line('table', 'variants', i)}: table.variants.{i}: no point "
                f"has a variant {name!r}; variants: {', '.join(sorted(some))}"
            )
    if table.baseline is not None and table.baseline not in every:
        problems.append(
            f"{path}:{loaded.line('table', 'baseline')}: table.baseline: {table.baseline!r} is "
            f"not a variant of every point; variants of all points: {', '.join(sorted(every))}"
        )
    if table.scope != "all" and table.scope not in classes:
        choices = ", ".join(["all", *sorted(classes)])
        problems.append(
            f"{path}:{loaded.line('table', 'scope')}: table.scope: unknown class "
            f"{table.scope!r}; choose one of: {choices}"
        )
    if problems:
        raise ValidationFailed(problems)


def _run_into_temp(task: PointTask, run_fn: RunPointFn) -> dict[str, bytes]:
    """Ray worker body: run into a local temporary folder and return the files, so the
    results land in the driver's sweep directory even when the worker is another host."""
    with tempfile.TemporaryDirectory(prefix="btb-sweep-") as tmp:
        local_dir = Path(tmp) / task.point_id
        run_fn(replace(task, run_dir=str(local_dir)))
        return {
            str(p.relative_to(local_dir)): p.read_bytes()
            for p in sorted(local_dir.rglob("*"))
            if p.is_file()
        }


def _write_files(run_dir: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        target = run_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


# In a pool worker: whether one of its points was stopped (Ctrl-C, or SIGTERM passed on)
_worker_stopped: list[bool] = []


def _pool_point(run_fn: RunPointFn, task: PointTask) -> None:
    """`run_fn(task)` in a pool worker, which starts no point once one of its points was
    stopped: the executor hands a worker the next queued point as soon as its last one
    returns, interrupted or not, and a stopping sweep signals each worker once, so that
    point would run (or wait) to its end instead of stopping with the rest."""
    if _worker_stopped:
        raise KeyboardInterrupt("the sweep is stopping: point not started")
    try:
        run_fn(task)
    except KeyboardInterrupt:
        _worker_stopped.append(True)
        raise


def _measured_point(run_fn: RunPointFn, task: PointTask) -> int:
    """`_pool_point`, then the pool worker's peak resident memory in bytes."""
    _pool_point(run_fn, task)
    return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux's VmHWM; `ru_maxrss` elsewhere)."""
    with contextlib.suppress(OSError), open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource
    import sys

    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale


def auto_jobs(peak_bytes: int, available_bytes: int, cores: int) -> int:
    """How many points `--jobs 0` runs at once after its first: one per core, as many as
    fit in 70% of the memory available, each taking the first point's peak (a point's
    process holds its workload: hundreds of MB for a research-sized trace)."""
    fit = int(0.7 * available_bytes) // max(peak_bytes, 1)
    return max(1, min(cores, fit))


def _execute_local(
    tasks: Sequence[PointTask], run_fn: RunPointFn, jobs: int,
    done: Callable[[PointTask, str | None], None], say: Callable[[str], None],
) -> None:  # fmt: skip
    if jobs == 0:  # one per core, as memory allows: the first point alone measures it
        cores = workers.cores()
        if cores > 1 and len(tasks) > 1:
            peak = max(_run_pool(tasks[:1], run_fn, 1, done, measure=True), default=0)
            import psutil

            available = int(psutil.virtual_memory().available)
            jobs = auto_jobs(peak, available, cores)
            say(f"--jobs 0: the first point's process peaked at {peak / 2**20:,.0f} MiB, "
                f"{available / 2**30:,.1f} GiB available: {jobs} at once")  # fmt: skip
            tasks = tasks[1:]
    if jobs <= 1:
        for task in tasks:
            try:
                run_fn(task)
            except KeyboardInterrupt:
                raise
            except Exception as exc:
                done(task, _describe(exc))
            else:
                done(task, None)
        return
    _run_pool(tasks, run_fn, jobs, done)


def _run_pool(
    tasks: Sequence[PointTask], run_fn: RunPointFn, jobs: int,
    done: Callable[[PointTask, str | None], None], *, measure: bool = False,
) -> list[int]:  # fmt: skip
    """`tasks` in a pool of `jobs` processes; with `measure`, each finished point's process
    peak memory (bytes), returned."""
    peaks: list[int] = []
    pool = cf.ProcessPoolExecutor(max_workers=jobs)
    futures: dict[cf.Future[Any], PointTask] = {}
    point = _measured_point if measure else _pool_point
    try:
        futures = {pool.submit(point, run_fn, task): task for task in tasks}
        for fut in cf.as_completed(futures):
            err = fut.exception()
            if err is None and measure:
                peaks.append(int(fut.result()))
            done(futures[fut], None if err is None else _describe(err))
    except KeyboardInterrupt as exc:
        for fut in futures:
            fut.cancel()
        if isinstance(exc, Terminated):
            # SIGTERM reached this process only (Ctrl-C reaches the whole process group):
            # pass it on, so each running point stops the way Ctrl-C stops a run — its
            # records kept, its manifest marked interrupted — instead of running on.
            for proc in list(getattr(pool, "_processes", {}).values()):
                with contextlib.suppress(Exception):
                    proc.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return peaks


def _execute_ray(
    tasks: Sequence[PointTask], run_fn: RunPointFn,
    done: Callable[[PointTask, str | None], None],
) -> None:  # fmt: skip
    try:
        import ray
    except ImportError:
        raise UserError(
            "--executor ray needs Ray, an optional extra: pip install 'btb-lab[ray]'"
        ) from None
    started = False
    if not ray.is_initialized():
        # RAY_ADDRESS names an existing cluster; unset, ray.init() starts a local one.
        ray.init(
            address=os.environ.get("RAY_ADDRESS") or None,
            include_dashboard=False,
            log_to_driver=False,
        )
        started = True
    try:
        remote = ray.remote(num_cpus=1)(_run_into_temp)
        pending = {remote.remote(task, run_fn): task for task in tasks}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                task = pending.pop(ref)
                try:
                    files = ray.get(ref)
                except Exception as exc:
                    done(task, _describe(exc))
                    continue
                _write_files(Path(task.run_dir), files)
                done(task, None)
    finally:
        if started:
            ray.shutdown()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, UserError):
        return str(exc)
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def read_summaries(tasks: Sequence[PointTask]) -> dict[str, Summary | None]:
    """Each point's summary.json (None where the point has none or it is unreadable)."""
    from btb_lab.analysis.models import Summary

    out: dict[str, Summary | None] = {}
    for task in tasks:
        try:
            out[task.point_id] = Summary.load(Path(task.run_dir))
        except UserError:
            out[task.point_id] = None
    return out


def _baseline_name(loaded: LoadedSweep) -> str:
    if loaded.spec.table.baseline:
        return loaded.spec.table.baseline
    data = compose_yaml(loaded.base_path.read_text(encoding="utf-8"), loaded.base_path)[0] or {}
    baseline = loaded.spec.overrides.get("baseline", data.get("baseline"))
    if not isinstance(baseline, str):
        raise UserError(f"{loaded.base_path}: base hypothesis names no baseline")
    return baseline


def run_sweep(
    path: Path,
    *,
    jobs: int = 1,
    executor: Executor | None = None,
    out: Path | None = None,
    seed: int | None = None,
    run_fn: RunPointFn = run_point,
    validate: bool = True,
    echo: Callable[[str], None] | None = None,
) -> SweepOutcome:
    """Run (or resume) the sweep in `path` and write its table and plot.

    `run_fn` runs one point into `task.run_dir` (the real runner by default; tests inject
    a fake). `validate` loads the base hypothesis with every point's overrides first.
    """
    loaded = load_sweep(Path(path))
    if jobs < 0:
        raise UserError(f"--jobs must be 0 (one per core, as memory allows) or more (got {jobs})")
    chosen: Executor = executor or loaded.spec.executor
    sweep_dir = Path(out) if out is not None else default_sweep_dir(loaded)
    points = expand_points(loaded.spec)
    tasks = plan_tasks(loaded, sweep_dir, seed=seed, points=points)
    if validate:
        check_points(loaded, tasks)
    base_digest = _file_digest(loaded.base_path)
    say = echo or (lambda _msg: None)

    sweep_dir.mkdir(parents=True, exist_ok=True)
    plan_doc = {
        "name": loaded.spec.name,
        "sweep_file": str(loaded.path.resolve()),
        "base": str(loaded.base_path),
        "base_digest": base_digest,
        "seed": tasks[0].seed if tasks else seed,
        "points": [_point_record(t, base_digest) for t in tasks],
    }
    (sweep_dir / "sweep.json").write_text(
        json.dumps(plan_doc, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8"
    )

    # the last pass's table and plots go now: a pass stopped before it writes its own
    # leaves none, never the old points' numbers beside this pass's sweep.json
    for name in SWEEP_OUTPUTS:
        (sweep_dir / name).unlink(missing_ok=True)
    outcome = SweepOutcome(sweep_dir=sweep_dir, points=points)
    todo: list[PointTask] = []
    stamps: dict[str, Any] = {}  # a trace or profile shared by the points is read once
    for task in tasks:
        if is_point_complete(task, base_digest, stamps):
            outcome.skipped.append(task.point_id)
        else:
            run_dir = Path(task.run_dir)
            if run_dir.exists():  # an unfinished or stale run of this point: start over
                shutil.rmtree(run_dir)
            todo.append(task)
    say(
        f"sweep {loaded.spec.name}: {len(tasks)} points, {len(outcome.skipped)} already "
        f"finished, {len(todo)} to run ({chosen}, "
        f"jobs={(jobs or 'auto') if chosen == 'local' else 'ray'})"
    )

    finished = 0

    def done(task: PointTask, error: str | None) -> None:
        nonlocal finished
        finished += 1
        run_dir = Path(task.run_dir)
        if error is None and not (run_dir / "summary.json").is_file():
            error = "the run wrote no summary.json"
        if error is None:
            (run_dir / "point.json").write_text(
                json.dumps(_point_record(task, base_digest), indent=2, sort_keys=True,
                           default=str) + "\n",
                encoding="utf-8",
            )  # fmt: skip
            outcome.ran.append(task.point_id)
            say(f"[{finished}/{len(todo)}] {task.point_id}: done")
        else:
            outcome.failed[task.point_id] = error
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "error.txt").write_text(error + "\n", encoding="utf-8")
            say(f"[{finished}/{len(todo)}] {task.point_id}: FAILED: {error}")

    try:
        if todo and chosen == "ray":
            _execute_ray(todo, run_fn, done)
        elif todo:
            _execute_local(todo, run_fn, jobs, done, say)
    finally:
        _workloads.clear()  # points run in this process (`--jobs 1`) loaded it here

    summaries = read_summaries(tasks)
    baseline = _baseline_name(loaded)
    df = build_table(points, summaries, loaded.spec.table, baseline)
    label_columns = list(points[0].labels) if points else []
    variants = list(df.attrs.get("variants", []))
    title = f"Sweep {loaded.spec.name}" + (
        f": {loaded.spec.table.scope} requests" if loaded.spec.table.scope != "all" else ""
    )
    outcome.table = df
    outcome.outputs = write_outputs(
        df,
        sweep_dir,
        loaded.spec.table,
        label_columns=label_columns,
        variants=variants,
        title=title,
    )
    metric = loaded.spec.table.plot_metric or loaded.spec.table.metrics[0]
    series = point_series(tasks, variants, metric, loaded.spec.table.scope)
    outcome.outputs.update(
        write_series_plots(series, sweep_dir, label_columns, variants, metric, title)
    )
    return outcome
