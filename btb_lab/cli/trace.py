"""`btb-lab trace ...`: generate, inspect, audit, convert and fetch request traces.

Time: files hold raw arrival times. A hypothesis's `workload.time_scale` multiplies every
inter-arrival gap at replay (above 1 calmer, below 1 denser; time_scale=10 is a heavier
load than 20), after re-basing each window (trace_id) to its first request.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from btb_lab.errors import UserError

if TYPE_CHECKING:
    from btb_lab.workload.formats import LoadedTrace

__all__ = ["app"]

TIME_HELP = (
    "Time: arrivals are stored unscaled; a hypothesis's workload.time_scale multiplies "
    "every inter-arrival gap at replay (>1 calmer, <1 denser; 10 is heavier than 20), "
    "with each window (trace_id) re-based to its first request."
)

app = typer.Typer(
    help="Generate, inspect, audit, convert and fetch request traces. " + TIME_HELP,
    no_args_is_help=True,
)

FORMAT_OPT = typer.Option(
    "auto", "--format", "-f", help="mooncake, bursted-art, art-chat, or auto (by fields)."
)
BLOCK_OPT = typer.Option(512, "--block-tokens", help="Tokens per hash block in the file.")
SKIP_OPT = typer.Option(False, "--skip-bad-rows", help="Count malformed rows, don't fail.")
SCALE_OPT = typer.Option(
    1.0, "--time-scale", help="Preview a replay: multiply every inter-arrival gap by this."
)


def _check_new_output(out: Path, force: bool) -> None:
    """A trace file written earlier is not replaced without a word (a generated or
    converted workload may be the only copy of what a run replayed)."""
    if out.is_dir():
        raise UserError(f"--out {out}: is a directory; name a file")
    if out.exists() and not force:
        raise UserError(f"--out {out}: the file exists; --force replaces it")


def _load(
    path: Path, fmt: str, block_tokens: int, skip_bad_rows: bool, time_scale: float | None
) -> tuple[str, LoadedTrace]:
    """The trace with its format's name, its arrivals as a replay at `time_scale` lays
    them out (None: as stored); a trace with no requests is refused as auto-detection
    refuses it, whichever format was named (statistics of nothing would only hide a
    wrong file or format)."""
    from btb_lab.workload.formats import detect_format, load_trace
    from btb_lab.workload.loader import apply_time_scale
    from btb_lab.workload.trace_checks import check_block_tokens

    if time_scale is not None and (not math.isfinite(time_scale) or time_scale <= 0):
        raise UserError(f"--time-scale must be a finite number > 0 (got {time_scale:g})")
    check_block_tokens(block_tokens, "--block-tokens")
    name = detect_format(path) if fmt == "auto" else fmt
    loaded = load_trace(path, name, block_tokens=block_tokens, skip_bad_rows=skip_bad_rows)
    if loaded.bad_rows:
        typer.echo(f"skipped {len(loaded.bad_rows)} malformed rows:", err=True)
        for message in loaded.bad_rows[:10]:
            typer.echo(f"  {message}", err=True)
    if not loaded.requests:
        if loaded.bad_rows:
            raise UserError(
                f"{path}: trace has no requests ({len(loaded.bad_rows)} malformed rows skipped)"
            )
        raise UserError(f"{path}: trace file is empty")
    if time_scale is None:
        return name, loaded
    # as a replay lays them out, at every scale (1 too): each window re-based to its
    # first request, the windows one after another, not on top of one another
    loaded.requests = apply_time_scale(loaded.requests, time_scale)
    if not all(math.isfinite(r.arrival_s) for r in loaded.requests):
        raise UserError(f"--time-scale {time_scale:g}: arrival times overflow to infinity; "
                        "use a smaller value")  # fmt: skip
    return name, loaded


@app.command(
    "generate",
    short_help="Generate a workload as bursted-art JSONL.",
    help="Generate a workload and write it in the bursted-art schema. " + TIME_HELP,
)
def generate_cmd(
    kind: str = typer.Argument(help="Generator: bursted, seed_bursty, agentic, poisson, gamma."),
    out: Path = typer.Option(..., "--out", "-o", help="Output JSONL file."),
    param: list[str] = typer.Option(
        [], "--param", "-p", help="Generator parameter key=value (repeatable)."
    ),
    seed: int = typer.Option(0, "--seed", min=0, help="Random seed (same seed, same file)."),
    block_tokens: int = typer.Option(512, "--block-tokens", help="Tokens per hash block."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output file."),
) -> None:
    from btb_lab.workload.generators import GenContext, generate
    from btb_lab.workload.trace_checks import check_block_tokens
    from btb_lab.workload.writer import write_bursted_art
    from btb_lab.yamlio import parse_assignments

    if out.suffix == ".parquet":  # the loaders go by the suffix: JSONL there would not load
        raise UserError(
            f"--out {out}: generate writes JSONL; write a .jsonl file and turn it into "
            "parquet with `btb-lab trace convert`"
        )
    _check_new_output(out, force)
    check_block_tokens(block_tokens, "--block-tokens")
    requests = generate(
        kind,
        parse_assignments("--param", param)[0],
        GenContext(seed=seed, block_tokens=block_tokens),
    )
    rows = write_bursted_art(requests, out)
    typer.echo(f"wrote {rows} rows to {out}")


@app.command(
    "inspect",
    short_help="Statistics of a trace file.",
    help="Rows, span, arrival rate, length percentiles, block reuse, sessions, windows and "
    "sources of a trace. " + TIME_HELP,
)
def inspect_cmd(
    path: Path = typer.Argument(help="Trace file (JSONL or parquet)."),
    fmt: str = FORMAT_OPT,
    block_tokens: int = BLOCK_OPT,
    skip_bad_rows: bool = SKIP_OPT,
    time_scale: float = SCALE_OPT,
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    import json

    from btb_lab.workload.summary import trace_summary
    from btb_lab.workload.trace_checks import milliseconds_hint

    name, loaded = _load(path, fmt, block_tokens, skip_bad_rows, time_scale)
    summary: dict[str, Any] = {
        "file": str(path),
        "format": name,
        "skipped_rows": len(loaded.bad_rows),
    }
    summary |= trace_summary(loaded.requests)
    hint = milliseconds_hint(name, summary["rows"], summary["span_s"], time_scale)
    if hint is not None:
        summary["note"] = hint
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{path.name} ({name})", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    rate = summary["arrival_rate_per_s"]
    table.add_row("rows", f"{summary['rows']:,}")
    table.add_row("skipped rows", str(summary["skipped_rows"]))
    table.add_row("span", f"{summary['span_s']:.1f} s")
    table.add_row("arrival rate", f"{rate:.3f} /s" if rate else "-")
    for key in ("input_tokens", "output_tokens"):
        p = summary[key]
        table.add_row(
            key.replace("_", " "),
            f"p50 {p['p50']:,.0f}  p90 {p['p90']:,.0f}  p99 {p['p99']:,.0f}",
        )
    table.add_row("blocks (distinct)", f"{summary['blocks']:,} ({summary['distinct_blocks']:,})")
    table.add_row("block reuse ratio", f"{summary['block_reuse_ratio']:.3f}")
    table.add_row("sessions", str(summary["sessions"]))
    table.add_row("windows", str(summary["windows"]))
    for window, count in summary["per_window"].items():
        table.add_row(f"  window {window}", f"{count:,}")
    for source, count in summary["per_source"].items():
        table.add_row(f"  source {source}", f"{count:,}")
    Console().print(table)
    if hint is not None:
        typer.echo(f"note: {hint}", err=True)


@app.command(
    "audit",
    short_help="The seed's burst audit of a trace file.",
    help="The seed's burst audit: largest synchronized deep-prefix fan-out (≥ 16 shared "
    "leading blocks, arrivals within 10 s, turns of one session counted once), the number "
    "of such events, and the shallow variant (8 blocks, 60 s). " + TIME_HELP,
)
def audit_cmd(
    path: Path = typer.Argument(help="Trace file (JSONL or parquet)."),
    fmt: str = FORMAT_OPT,
    block_tokens: int = BLOCK_OPT,
    skip_bad_rows: bool = SKIP_OPT,
    time_scale: float = SCALE_OPT,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    import json

    from btb_lab.workload.audit import burst_audit

    name, loaded = _load(path, fmt, block_tokens, skip_bad_rows, time_scale)
    audit = burst_audit(loaded.requests)
    if as_json:
        typer.echo(json.dumps({"file": str(path), "format": name} | audit.to_dict(), indent=2))
        return
    for label, result in (("deep", audit.deep), ("shallow", audit.shallow)):
        # no group at all when no request has that many blocks (JSON keeps its null)
        largest = result.largest_group or f"none (no request has ≥ {result.depth_blocks} blocks)"
        typer.echo(
            f"{label}: {result.depth_blocks} blocks / {result.window_s:g} s: "
            f"max fan-out {result.max_fanout}, events {result.events} "
            f"(≥ {result.min_fanout} requests), largest {largest}"
        )


@app.command(
    "convert",
    short_help="Rewrite a Bursted-ART trace as parquet that loads to the same requests.",
    help="Rewrite a Bursted-ART trace (JSONL or parquet) as parquet with the loaded block "
    "ids as integers: the same requests, ids and order on every load, without parsing and "
    "hashing a string per block (smaller and faster to load for large traces). The "
    "written file is read back and compared with the source before the command succeeds. "
    + TIME_HELP,
)
def convert_cmd(
    path: Path = typer.Argument(help="Bursted-ART trace file (JSONL or parquet)."),
    out: Path = typer.Option(..., "--out", "-o", help="Output parquet file."),
    skip_bad_rows: bool = typer.Option(
        False, "--skip-bad-rows", help="Leave malformed rows out of the output, don't fail."
    ),
    force: bool = typer.Option(False, "--force", help="Replace an existing output file."),
) -> None:
    from btb_lab.workload.formats import detect_format, load_trace
    from btb_lab.workload.writer import write_bursted_art_parquet

    fmt = detect_format(path)
    if fmt != "bursted-art":
        raise UserError(
            f"{path}: a {fmt} trace; convert rewrites Bursted-ART traces (the other formats "
            "carry integer block ids already)"
        )
    if out.suffix != ".parquet":
        raise UserError(f"--out {out}: the output must be a .parquet file")
    if out.exists() and out.resolve() == path.resolve():
        raise UserError(f"--out {out}: the output would overwrite the source")
    _check_new_output(out, force)
    # One token per block: every id count passes the loader's check here; a run checks
    # the ids against its own block size when it loads the converted file.
    _, loaded = _load(path, fmt, 1, skip_bad_rows, None)
    import tempfile

    # a name of its own beside the output (never the source's, nor an earlier one's);
    # loaders go by the suffix
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{out.stem}.", suffix=".partial.parquet",
                                    dir=out.parent)  # fmt: skip
    except OSError as exc:
        raise UserError(f"--out {out}: cannot write there ({exc.strerror or exc})") from None
    os.close(fd)
    partial = Path(name)
    umask = os.umask(0o022)
    os.umask(umask)
    partial.chmod(0o666 & ~umask)  # as any other output (mkstemp makes it private)
    try:
        try:
            rows = write_bursted_art_parquet(loaded.requests, partial)
        except OverflowError:
            raise UserError(
                f"{path}: a block id does not fit in 64 bits; keep the file as it is"
            ) from None
        try:
            again = load_trace(partial, fmt, block_tokens=1, skip_bad_rows=False)
        except UserError as exc:
            raise UserError(
                f"{path}: the parquet file did not load back ({exc}); not written"
            ) from None
        if again.bad_rows or again.requests != loaded.requests:
            raise UserError(
                f"{path}: the parquet file did not load to the same requests; not written"
            )
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
    skipped = f", {len(loaded.bad_rows)} malformed rows left out" if loaded.bad_rows else ""
    typer.echo(f"wrote {rows:,} rows to {out} ({out.stat().st_size:,} bytes{skipped})")


@app.command(
    "fetch",
    short_help="Download Hugging Face dataset rows, resumably.",
    help="Download dataset rows from the Hugging Face datasets-server API into JSONL, "
    "resumably (rerun the same command to continue; a file holding other rows is "
    "refused). " + TIME_HELP,
)
def fetch_cmd(
    dataset: str = typer.Argument(help="Dataset id, e.g. shreybirmiwal/Bursted-ART."),
    out: Path = typer.Option(..., "--out", "-o", help="JSONL file (appended to on resume)."),
    split: str = typer.Option("train", "--split", help="Split name."),
    config: str = typer.Option("default", "--config", help="Dataset config (subset)."),
    rows: int | None = typer.Option(None, "--rows", min=1, help="Rows to fetch (default all)."),
    offset: int = typer.Option(0, "--offset", min=0, help="First row index to fetch."),
) -> None:
    import httpx
    from rich.progress import Progress

    from btb_lab.workload.fetch import fetch_rows

    with Progress(transient=True) as progress, httpx.Client(timeout=30.0) as client:
        task = progress.add_task(f"fetching {dataset}", total=rows)

        def on_progress(done: int, target: int | None) -> None:
            progress.update(task, completed=done, total=target)

        result = fetch_rows(
            dataset,
            out,
            client=client,
            split=split,
            config=config,
            rows=rows,
            offset=offset,
            on_progress=on_progress,
        )
    typer.echo(
        f"{out}: {result.rows_in_file} rows ({result.existing_rows} already there, "
        f"{result.fetched_rows} fetched)"
    )
