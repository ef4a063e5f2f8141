"""Session affinity (the seed's agentic baseline, hypothesis H7): every turn of a session
goes to the instance that served its previous turn, whose prefix cache holds the
conversation, until that instance's load exceeds `overload_factor` × the mean load.

First turns, and turns whose affinity broke, are placed by least outstanding tokens (the
seed's `ongoing_tokens` score). The session table is shared with the offload family.

`session_count` (H8, the elastic-prefill log's next direction) keeps that rule for every
later turn but places first turns by the number of *active heavy sessions* per instance:
the log's key learning is that imbalance is decided at turn-1 placement, where a snapshot
of ongoing tokens forgets the sessions that are between turns and will come back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

from pydantic import Field

from btb_lab.config.base import ParamsModel, StrictModel
from btb_lab.policies.base import POLICIES, ClusterView, Decision, InstanceLoad, Policy
from btb_lab.policies.common import least_outstanding, require_params, serving
from btb_lab.records import Request

__all__ = [
    "SessionAffinity",
    "SessionAffinityParams",
    "SessionCount",
    "SessionCountParams",
    "SessionTable",
]

# Why a request landed where it did (also the route label of `session_affinity`).
STICKY = "STICKY"  # the session's instance, not overloaded
NEW = "NEW"  # first turn of a session seen by this router
BROKEN = "BROKEN"  # affinity broke: the session's instance was overloaded
NO_SESSION = "NO_SESSION"  # request without a session id


# The stick / break rule's two knobs, one definition for every policy with sticky sessions.
OverloadFactor = Annotated[
    float,
    Field(
        gt=0,
        description="Session affinity breaks when the session's instance has load (running "
        "+ waiting) above this × the mean load of serving instances (seed OVERLOAD_FACTOR).",
    ),
]
OverloadMinLoad = Annotated[
    int,
    Field(
        ge=0,
        description="Session affinity holds while the session's instance has at most this "
        "load (running + waiting), whatever the mean: at light load (mean 0.25, home 1) "
        "overload_factor alone breaks it for one request. 0: overload_factor alone (the "
        "seed's rule).",
    ),
]


class SessionAffinityParams(ParamsModel):
    """Parameters of session-affinity routing."""

    overload_factor: OverloadFactor = 2.0
    overload_min_load: OverloadMinLoad = 0


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
        self,
        request: Request,
        candidates: Sequence[InstanceLoad],
        overload_factor: float,
        min_load: int = 0,
    ) -> tuple[InstanceLoad, str]:
        """Pick the instance for `request` and say why (STICKY, NEW, BROKEN, NO_SESSION);
        binds the session to the pick. The home is overloaded above `overload_factor` ×
        the mean load and above `min_load`."""
        session = request.session_id
        if session is None:
            return least_outstanding(candidates), NO_SESSION
        home_index = self._home.get(session)
        home = next((inst for inst in candidates if inst.index == home_index), None)
        if home is None:
            chosen, reason = least_outstanding(candidates), NEW
        else:
            mean_load = sum(inst.load for inst in candidates) / len(candidates)
            if home.load <= max(overload_factor * mean_load, min_load):
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
        cfg = self.cfg
        chosen, reason = self.sessions.place(
            request, serving(view), cfg.overload_factor, cfg.overload_min_load
        )
        return Decision(instance=chosen.index, route=reason)


class SessionCountParams(SessionAffinityParams):
    """session_affinity's stickiness, plus what makes a session heavy and active."""

    heavy_input_tokens: int = Field(
        32_768,
        ge=1,
        description="A session is heavy once one of its prompts has at least this many "
        "tokens (the offload family's HEAVY threshold).",
    )
    active_s: float = Field(
        30.0,
        gt=0,
        description="A session stays active on its instance while a turn is in flight and "
        "for this many seconds after its last turn finished (the think time before its "
        "next turn).",
    )
    count: Literal["heavy", "all"] = Field(
        "heavy",
        description="Which active sessions first turns are balanced over: the heavy ones "
        "(the seed's proposal) or all of them.",
    )


@dataclass(slots=True)
class _SessionState:
    """What session_count remembers of one session."""

    heavy: bool = False
    in_flight: int = 0
    last_done_s: float = float("-inf")


@POLICIES.register("session_count")
class SessionCount(Policy):
    """First turns go to the instance with the fewest active heavy sessions (ties: fewest
    outstanding tokens, then load, then index); later turns stick as in
    session_affinity, and a broken affinity is re-placed by outstanding tokens as there.
    Routes: NEW, STICKY, BROKEN, NO_SESSION."""

    name: ClassVar[str] = "session_count"
    Params: ClassVar[type[StrictModel]] = SessionCountParams

    def __init__(self, params: StrictModel, *, seed: int = 0) -> None:
        super().__init__(params, seed=seed)
        self.cfg = require_params(params, SessionCountParams)
        self.sessions = SessionTable()
        self._state: dict[str, _SessionState] = {}
        self._members: dict[int, set[str]] = {}  # instance → sessions that may count there

    def is_active(self, session_id: str, now_s: float) -> bool:
        """Whether `session_id` has a turn in flight or finished one within `active_s`."""
        state = self._state.get(session_id)
        if state is None:
            return False
        return state.in_flight > 0 or now_s - state.last_done_s <= self.cfg.active_s

    def active_sessions(self, instance: int, now_s: float) -> int:
        """Active sessions on `instance` that count (heavy ones, or all with `count: all`);
        forgets the ones that went idle."""
        members = self._members.get(instance)
        if not members:
            return 0
        idle = [s for s in members if not self.is_active(s, now_s)]
        members.difference_update(idle)
        if self.cfg.count == "all":
            return len(members)
        return sum(1 for s in members if self._state[s].heavy)

    def route(self, request: Request, view: ClusterView) -> Decision:
        candidates = serving(view)
        session = request.session_id
        if session is None:
            return Decision(instance=least_outstanding(candidates).index, route=NO_SESSION)
        state = self._state.get(session)
        if state is None:
            state = self._state[session] = _SessionState()
        if request.input_tokens >= self.cfg.heavy_input_tokens:
            state.heavy = True
        if self.sessions.home(session) is None:
            now_s = view.now_s
            chosen = min(
                candidates,
                key=lambda inst: (
                    self.active_sessions(inst.index, now_s),
                    inst.outstanding_tokens,
                    inst.load,
                    inst.index,
                ),
            )
            self.sessions.bind(session, chosen.index)
            reason = NEW
        else:
            old = self.sessions.home(session)
            chosen, reason = self.sessions.place(
                request, candidates, self.cfg.overload_factor, self.cfg.overload_min_load
            )
            if old is not None and old != chosen.index:
                self._members.get(old, set()).discard(session)
        state.in_flight += 1
        self._members.setdefault(chosen.index, set()).add(session)
        return Decision(instance=chosen.index, route=reason)

    def on_finish(self, request: Request, instance: int, now_s: float) -> None:
        if request.session_id is None:
            return
        state = self._state.get(request.session_id)
        if state is None or state.in_flight <= 0:
            return
        state.in_flight -= 1
        state.last_done_s = max(state.last_done_s, now_s)
