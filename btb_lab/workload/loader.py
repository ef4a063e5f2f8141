"""The workload entry point: a `WorkloadSpec` becomes the ordered `Request`s to replay.

Order of operations: load (trace or generator) → order by window, then arrival →
`offset` / `requests` slice → re-base each window to its first request → multiply every
gap by `time_scale` → lay windows end to end (`window_gap_s` apart) → set `block_tokens`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from operator import attrgetter
from pathlib import Path

from pydantic import ValidationError

from btb_lab.collector import paused
from btb_lab.config.workload import WorkloadSpec
from btb_lab.errors import UserError, ValidationFailed
from btb_lab.records import Request
from btb_lab.workload.formats import FORMATS, LoadedTrace, load_trace
from btb_lab.workload.generators import GENERATORS, GenContext, parse_params
from btb_lab.workload.variation import vary_requests

__all__ = [
    "RequestList",
    "WorkloadCache",
    "apply_time_scale",
    "load_requests",
    "trace_path",
    "validate_workload_spec",
]


class RequestList(list[Request]):
    """The requests to replay, plus the malformed rows skipped under `skip_bad_rows`."""

    def __init__(self, requests: list[Request], skipped: list[str] | None = None) -> None:
        super().__init__(requests)
        self.skipped: list[str] = list(skipped or [])

    @property
    def skipped_rows(self) -> int:
        """How many malformed rows were skipped (each one's message is in `skipped`)."""
        return len(self.skipped)


_REQUEST_FIELDS = attrgetter(*Request.__slots__)  # every field, in `Request`'s order


class WorkloadCache:
    """The workload this process parsed or generated last, for the next load of the same
    one: a run's later repeats replay its trace file (each with its own seed for
    `variation`), and a sweep's points replay one file or one generated workload with
    other settings. Each load hands out fresh `Request` objects, since `load_requests` and
    the variation move arrivals in place; they share the block-id tuples. A file changed
    on disk (size or modification time) is parsed again."""

    def __init__(self) -> None:
        self._key: tuple[object, ...] | None = None  # the last workload only
        self._kept = LoadedTrace([])

    def load(self, path: Path, fmt: str, *, block_tokens: int, skip_bad_rows: bool) -> LoadedTrace:
        def parse() -> LoadedTrace:
            return load_trace(path, fmt, block_tokens=block_tokens, skip_bad_rows=skip_bad_rows)

        try:
            stat = path.stat()
        except OSError:  # gone meanwhile: the loader says what is wrong with it
            return parse()
        key = ("trace", path.resolve(), stat.st_size, stat.st_mtime_ns, fmt, block_tokens,
               skip_bad_rows)  # fmt: skip
        return self._fresh(key, parse)

    def generated(self, key: str, generate: Callable[[], LoadedTrace]) -> LoadedTrace:
        """What `generate` gives, made once per `key` (the generator, its params, seed and
        block size: generators are deterministic in these)."""
        return self._fresh(("generated", key), generate)

    def _fresh(self, key: tuple[object, ...], make: Callable[[], LoadedTrace]) -> LoadedTrace:
        if key != self._key:
            self._kept, self._key = make(), key
        return LoadedTrace(
            [Request(*_REQUEST_FIELDS(r)) for r in self._kept.requests],
            list(self._kept.bad_rows),
        )


def trace_path(spec: WorkloadSpec, base_dir: Path) -> Path:
    """The trace file a workload replays (relative paths: from the hypothesis's folder)."""
    assert spec.trace is not None
    path = Path(spec.trace.path)
    return path if path.is_absolute() else base_dir / path


def validate_workload_spec(spec: WorkloadSpec, base_dir: Path) -> None:
    """Cheap checks at validate time: names, generator params, trace file existence.

    Raises `ValidationFailed` with one `workload.<field path>: <problem>` line each, so
    the hypothesis loader can point at the YAML line of the field.
    """
    problems: list[str] = []
    if spec.trace is not None:
        if spec.trace.format not in FORMATS:
            problems.append(
                f"workload.trace.format: unknown trace format {spec.trace.format!r}; "
                f"choose one of: {', '.join(FORMATS.names())}"
            )
        path = trace_path(spec, base_dir)
        if path.is_dir():
            problems.append(f"workload.trace.path: {path}: is a directory, not a trace file")
        elif path.exists() and not path.is_file():  # a pipe or a device: read more than once
            problems.append(
                f"workload.trace.path: {path}: not a regular file (a pipe or a device); "
                "write the trace to a file first"
            )
        elif not path.is_file():
            problems.append(f"workload.trace.path: trace file not found: {path}")
    if spec.generator is not None:
        kind = spec.generator.kind
        if kind not in GENERATORS:
            problems.append(
                f"workload.generator.kind: unknown workload generator {kind!r}; "
                f"choose one of: {', '.join(GENERATORS.names())}"
            )
        else:
            model = GENERATORS.get(kind).params_model
            try:
                params = model.model_validate(spec.generator.params)
            except ValidationError as exc:
                valid = ", ".join(sorted(model.model_fields))
                for err in exc.errors():
                    loc = ".".join(str(part) for part in err["loc"])
                    where = f"workload.generator.params{'.' + loc if loc else ''}"
                    hint = f" (valid params: {valid})" if err["type"] == "extra_forbidden" else ""
                    problems.append(f"{where}: {err['msg']}{hint}")
            else:
                real_trace = getattr(params, "real_trace", None)
                if real_trace:
                    path = Path(real_trace)
                    path = path if path.is_absolute() else base_dir / path
                    if not path.is_file():
                        problems.append(f"workload.generator.params.real_trace: not found: {path}")
    if problems:
        raise ValidationFailed(problems)


def apply_time_scale(
    requests: list[Request], time_scale: float, window_gap_s: float = 0.0
) -> list[Request]:
    """Re-base each window to its first request, scale gaps, lay windows end to end.

    Windows keep the order in which they first appear in `requests`. Mutates and returns
    the same objects ordered by their new arrival times.
    """
    windows: dict[str, list[Request]] = {}
    for request in requests:
        windows.setdefault(request.trace_id, []).append(request)
    out: list[Request] = []
    window_start_s = 0.0
    for members in windows.values():
        members.sort(key=lambda r: r.arrival_s)
        first_s = members[0].arrival_s
        for request in members:
            request.arrival_s = window_start_s + (request.arrival_s - first_s) * time_scale
        out.extend(members)
        window_start_s = members[-1].arrival_s + window_gap_s
    return out


def load_requests(
    spec: WorkloadSpec, *, base_dir: Path, seed: int, cache: WorkloadCache | None = None
) -> RequestList:
    """The requests a hypothesis replays, ordered by arrival, with `time_scale` applied;
    a trace file is parsed, or a generator's workload made, once across the loads that
    share `cache` (a generator that reads a file runs every time). The cyclic collector
    is paused meanwhile: the requests and their block-id tuples hold no cycles."""
    with paused():
        return _load_requests(spec, base_dir=base_dir, seed=seed, cache=cache)


def _load_requests(
    spec: WorkloadSpec, *, base_dir: Path, seed: int, cache: WorkloadCache | None
) -> RequestList:
    validate_workload_spec(spec, base_dir)
    if spec.trace is not None:
        path = trace_path(spec, base_dir)
        loaded = (load_trace if cache is None else cache.load)(
            path,
            spec.trace.format,
            block_tokens=spec.block_tokens,
            skip_bad_rows=spec.trace.skip_bad_rows,
        )
        if not loaded.requests:
            skipped = f" ({len(loaded.bad_rows)} malformed rows skipped)" if loaded.bad_rows else ""
            raise UserError(f"{path}: trace has no requests{skipped}")
    else:
        assert spec.generator is not None
        entry = GENERATORS.get(spec.generator.kind)
        params = parse_params(spec.generator.kind, spec.generator.params)
        ctx = GenContext(seed=seed, block_tokens=spec.block_tokens, base_dir=base_dir)

        def generate() -> LoadedTrace:
            return LoadedTrace(entry.generate(params, ctx))

        if cache is None or getattr(params, "real_trace", None):  # a file: read it afresh
            loaded = generate()
        else:
            key = json.dumps(
                [spec.generator.kind, params.model_dump(mode="json"), seed, spec.block_tokens],
                sort_keys=True,
            )
            loaded = cache.generated(key, generate)
    rows = loaded.requests
    if spec.variation is not None:
        rows = vary_requests(rows, spec.variation, seed, stage="windows")
    window_order: dict[str, int] = {}
    for request in rows:
        window_order.setdefault(request.trace_id, len(window_order))
    ordered = sorted(
        enumerate(rows),
        key=lambda item: (window_order[item[1].trace_id], item[1].arrival_s, item[0]),
    )
    selected = [request for _, request in ordered][spec.offset :]
    if spec.requests is not None:
        selected = selected[: spec.requests]
    if not selected:
        raise UserError(
            f"workload: no requests left after offset={spec.offset}"
            + (f", requests={spec.requests}" if spec.requests is not None else "")
        )
    for request in selected:
        request.block_tokens = spec.block_tokens
    scaled = apply_time_scale(selected, spec.time_scale, spec.window_gap_s)
    if spec.variation is not None:
        scaled = vary_requests(scaled, spec.variation, seed, stage="jitter")
    if not all(math.isfinite(r.arrival_s) for r in scaled):
        jitter = spec.variation.arrival_jitter_s if spec.variation is not None else 0.0
        raise UserError(
            "workload: arrival times overflow to infinity after time_scale="
            f"{spec.time_scale:g}, window_gap_s={spec.window_gap_s:g}"
            + (f" and variation.arrival_jitter_s={jitter:g}" if jitter else "")
            + "; use smaller values"
        )
    return RequestList(scaled, loaded.bad_rows)
