"""User-facing errors: the CLI turns these into one clear message and exit code 2."""

from __future__ import annotations

import errno
from pathlib import Path

__all__ = ["STORAGE_ERRNOS", "OutputError", "UserError", "ValidationFailed", "describe_os_error"]

# What a full or read-only output device answers; a run stops at the first one (every
# later write would fail the same way) instead of recording it as a crashed variant.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})


class UserError(Exception):
    """A mistake in the user's input (file, flag, name); never shown with a traceback."""

    exit_code = 2


class ValidationFailed(UserError):
    """One or more problems in an input file; `problems` holds one line each."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


class OutputError(UserError):
    """Results could not be written (disk full, read-only, no permission): one line
    naming the directory, exit code 2."""


def describe_os_error(exc: OSError, where: Path | str | None = None) -> str:
    """One line for an OSError: `no space left on DIR` for a full device, else
    `PATH: reason` (`where` names the directory when the error names no file)."""
    name = exc.filename if exc.filename is not None else where
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        target = where if where is not None else (Path(name).parent if name else None)
        return f"no space left on {target}" if target is not None else "no space left on device"
    reason = exc.strerror or str(exc) or type(exc).__name__
    return f"{name}: {reason}" if name is not None else reason
