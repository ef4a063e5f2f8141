"""User-facing errors: the CLI turns these into one clear message and exit code 2."""

from __future__ import annotations

__all__ = ["UserError", "ValidationFailed"]


class UserError(Exception):
    """A mistake in the user's input (file, flag, name); never shown with a traceback."""

    exit_code = 2


class ValidationFailed(UserError):
    """One or more problems in an input file; `problems` holds one line each."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))
