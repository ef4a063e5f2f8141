"""Session affinity (the seed's agentic baseline, hypothesis H7): every turn of a session
goes to the instance that served its previous turn, whose prefix cache holds the
conversation, until that instance's load exceeds `overload_factor` × the mean load.

First turns, and turns whose affinity broke, are placed by least outstanding tokens (the
seed's `ongoing_tokens` score). The session table is shared with the offload family.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pydantic import Field

from btb_lab.config.base import StrictModel
from btb_lab.policies.base import POLICIES, ClusterView, Decision, InstanceLoad, Policy
from btb_lab.policies.common import least_outstanding, require_params, serving
from btb_lab.records import Request

__all__ = ["SessionAffinity", "SessionAffinityParams", "SessionTable"]

# Why a request landed where it did (also the route label of `session_affinity`).
STICKY = "STICKY"  # the session's instance, not overloaded
NEW = "NEW"  # first turn of a session seen by this router
BROKEN = "BROKEN"  # affinity broke: the session's instance was overloaded
NO_SESSION = "NO_SESSION"  # request without a session id


class SessionAffinityParams(StrictModel):
    """Parameters of session-affinity routing."""

    overload_factor: float = Field(
        2.0,
        gt=0,
        description="Affinity breaks when the session's instance has load (running + "
        "waiting) above this × the mean load of serving instances (seed OVERLOAD_FACTOR).",
    )


class SessionTable:
    """Session id → home instance, with the stick / break / place rule."""

    def __init__(self) -> None:
        self._home: dict[str, int] = {}

    def home(self, session_id: str) -> int | None:
        """The instance a session is bound to, if any."""
        return self._home.get(session_id)

    def bind(self, session_id: str, instance: int) -> None:
        """Move a session (e.g. to the instance that decoded its offloaded turn)."""
        self._home[session_id] = instance

    def __len__(self) -> int:
        return len(self._home)

    def place(
        self, request: Request, candidates: Sequence[InstanceLoad], overload_factor: float
    ) -> tuple[InstanceLoad, str]:
        """Pick the instance for `request` and say why (STICKY, NEW, BROKEN, NO_SESSION);
        binds the session to the pick."""
        session = request.session_id
        if session is None:
            return least_outstanding(candidates), NO_SESSION
        home_index = self._home.get(session)
        home = next((inst for inst in candidates if inst.index == home_index), None)
        if home is None:
            chosen, reason = least_outstanding(candidates), NEW
        else:
            mean_load = sum(inst.load for inst in candidates) / len(candidates)
            if home.load <= overload_factor * mean_load:
                return home, STICKY
            # Breaking affinity only to land on the same instance would not break it.
            others = [inst for inst in candidates if inst.index != home.index] or [home]
            chosen, reason = least_outstanding(others), BROKEN
        self._home[session] = chosen.index
        return chosen, reason


@POLICIES.register("session_affinity")
class SessionAffinity(Policy):
    """Sticky sessions with an overload escape. Routes: STICKY, NEW, BROKEN, NO_SESSION."""

    name: ClassVar[str] = "session_affinity"
    Params: ClassVar[type[StrictModel]] = SessionAffinityParams

    def __init__(self, params: StrictModel, *, seed: int = 0) -> None:
        super().__init__(params, seed=seed)
        self.cfg = require_params(params, SessionAffinityParams)
        self.sessions = SessionTable()

    def route(self, request: Request, view: ClusterView) -> Decision:
        chosen, reason = self.sessions.place(request, serving(view), self.cfg.overload_factor)
        return Decision(instance=chosen.index, route=reason)
