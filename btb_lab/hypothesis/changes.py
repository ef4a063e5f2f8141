"""Whether a hypothesis file still says what a stored run of it ran: `list` and
`log append` show a run's verdict next to the file, which may have been edited since."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from btb_lab.errors import UserError, ValidationFailed

__all__ = ["changed_since"]


def _resolved(data: dict[str, Any]) -> dict[str, Any]:
    """A hypothesis as a manifest stores it, its defaults filled in by today's model (a
    run stored before a field existed did not change for that)."""
    from btb_lab.config import Hypothesis
    from btb_lab.redact import redact_value

    # stored by another version of the model: compared as stored
    with contextlib.suppress(ValueError):
        data = Hypothesis.model_validate(data).model_dump(mode="json", by_alias=True)
    return dict(redact_value(data))


def changed_since(path: Path, ran: dict[str, Any]) -> str | None:
    """How the hypothesis file at `path` differs from `ran`, the resolved hypothesis a run
    stored ("verdict differs", "verdict, workload differ", "it no longer validates"), or
    None when it runs the same. Comments and layout do not count."""
    from btb_lab.hypothesis.loader import load_hypothesis

    try:
        now = load_hypothesis(path).hypothesis.model_dump(mode="json", by_alias=True)
    except (UserError, ValidationFailed):
        return "it no longer validates"
    now, then = _resolved(now), _resolved(ran)
    keys = sorted(k for k in set(now) | set(then) if now.get(k) != then.get(k))
    if not keys:
        return None
    return ", ".join(keys) + (" differs" if len(keys) == 1 else " differ")
