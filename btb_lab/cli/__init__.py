"""The thin typer CLI: each command parses, loads, calls one library function, prints.

Heavy imports (pandas, matplotlib, httpx) happen inside commands so `--help` is instant.
Command groups live in sibling modules, one per pipeline area.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

import typer

from btb_lab.cli import calibrate, cluster, core, sim, sweep, trace
from btb_lab.errors import UserError

__all__ = ["app", "entry", "main"]

app = typer.Typer(
    name="btb-lab",
    help="Experiment harness and hypothesis-log runner for LLM-inference research.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
core.register(app)
app.add_typer(trace.app, name="trace")
app.add_typer(sim.app, name="sim")
app.add_typer(cluster.router_app, name="router")
app.add_typer(cluster.model_app, name="model")
sweep.register(app)
calibrate.register(app)


def main() -> None:
    """Entry point: a user mistake prints one message and exits 2, never a traceback.

    Input the library could not read (an OSError such as a full disk or a missing
    permission, text that is not UTF-8, YAML or parquet it cannot parse) is reported the
    same way; set BTB_LAB_DEBUG=1 to see the traceback instead. SIGTERM is handled like
    Ctrl-C in every command (exit 143 instead of 130).
    """
    from btb_lab.interrupts import exit_code, terminate_interrupts, terminated

    use_system_allocator()
    try:
        # Without standalone mode click returns a command's exit code instead of exiting.
        with terminate_interrupts():
            rc = app(standalone_mode=False)
    except UserError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt as exc:
        typer.echo("interrupted", err=True)
        sys.exit(exit_code(exc))
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except Exception as exc:  # click's usage errors arrive here in non-standalone mode
        from pydantic import ValidationError

        if isinstance(exc, typer.Abort):  # click turns KeyboardInterrupt into Abort
            typer.echo("interrupted", err=True)
            cause = exc.__cause__ or exc.__context__
            sys.exit(exit_code(cause) if isinstance(cause, KeyboardInterrupt) else 130)
        # typer vendors click; its usage errors derive from the public TyperException
        if isinstance(exc, typer.TyperException) and hasattr(exc, "show"):
            exc.show()
            sys.exit(getattr(exc, "exit_code", 2))  # usage errors: 2
        if isinstance(exc, ValidationError):  # settings built from user input outside a file
            for err in exc.errors():
                where = ".".join(str(p) for p in err["loc"]) or "(input)"
                typer.echo(f"error: {where}: {err['msg']}", err=True)
            sys.exit(2)
        message = _unreadable_input(exc)
        if message is None or os.environ.get("BTB_LAB_DEBUG"):
            raise
        typer.echo(f"error: {message}", err=True)
        sys.exit(2)
    if rc == 130 and terminated():  # typer turns every KeyboardInterrupt into exit 130
        rc = 128 + signal.SIGTERM
    if isinstance(rc, int) and rc:
        sys.exit(rc)


# pyarrow's default mimalloc pool keeps what a columnar read or a parquet conversion
# freed: 20-80 MiB more peak RSS on the benchmarks' long-prefix cases than the C
# library's allocator, at no measured speed difference (benchmarks/README.md)
ARROW_POOL_ENV = "ARROW_DEFAULT_MEMORY_POOL"


def use_system_allocator() -> None:
    """pyarrow's buffers from the C library's allocator for this command and the processes
    it starts, unless the user chose a pool. Set before pyarrow's first allocation (the
    CLI imports it only inside commands); results do not depend on it."""
    os.environ.setdefault(ARROW_POOL_ENV, "system")


def entry() -> None:
    """The `btb-lab` console script: `main`, then the process ends without the
    interpreter's teardown of every module and object (about 0.25 s after a run with
    pandas, pyarrow and matplotlib loaded: 6% of a small run), once exit handlers have
    run and output is flushed. Every file btb-lab writes is closed (or renamed into
    place) before `main` returns; a traceback, or threads still running, take the
    interpreter's normal exit."""
    try:
        main()
    except SystemExit as exc:
        code = exc.code
    else:
        code = 0
    _exit_now(code)


def _exit_now(code: object) -> None:
    import atexit
    import threading

    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if run_exit_handlers is None or threading.active_count() > 1:
        sys.exit(code)  # type: ignore[arg-type]  # SystemExit takes any object
    if code is None:
        code = 0
    elif not isinstance(code, int):  # as the interpreter does: the message, exit 1
        print(code, file=sys.stderr)
        code = 1
    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe got what it got
            stream.flush()
    os._exit(code)


def _unreadable_input(exc: Exception) -> str | None:
    """One line for the errors of reading or writing files the commands do not catch
    themselves; None for anything else (a bug, shown with its traceback)."""
    from btb_lab.errors import describe_os_error

    if isinstance(exc, OSError):
        return describe_os_error(exc)
    if isinstance(exc, UnicodeDecodeError):
        return f"input is not UTF-8 text ({exc.reason} at byte {exc.start})"
    module = type(exc).__module__ or ""
    if module.startswith("yaml"):
        return f"YAML: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    if module.startswith("pyarrow"):
        return f"unreadable parquet or Arrow data: {str(exc).splitlines()[0]}"
    return None
