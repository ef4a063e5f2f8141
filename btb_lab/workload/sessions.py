"""Closed-loop session replay (`workload.session_replay`), the one rule both worlds apply:
a request of turn k of a session is sent only once every request of the session's earlier
turns has finished (or failed), since its prompt holds their answers.

- `closed`: it goes at its arrival time or at that last finish, whichever is later.
- `closed_think`: it goes at that last finish plus the trace's gap before it (its arrival
  less the latest arrival of the session's earlier turns), read as the agent's think
  time: a true closed loop, where a late answer delays every later turn. This suits
  generated agentic sessions, whose gaps are exactly think times; a recorded trace's
  gaps also hold the recorded service time, which this would count twice.

Requests of one turn do not wait for each other, and requests without a session never
wait. Open replay (the default, no gate) sends every request at its arrival time, as the
trace recorded it: under a load heavier than the trace's, a turn may then arrive before
the answer it continues, and find the previous turn's KV not yet cached.
"""

from __future__ import annotations

from collections import deque

from btb_lab.records import Request

__all__ = ["SessionGate", "session_gate"]

_Key = tuple[str, str]  # (trace_id, session_id): sessions are per window


class _Session:
    __slots__ = ("arrivals", "held", "last_finish_s", "running")

    def __init__(self) -> None:
        self.running: dict[int, int] = {}  # sent (or scheduled), unfinished requests per turn
        self.held: deque[Request] = deque()  # waiting for earlier turns, in arrival order
        self.arrivals: dict[int, float] = {}  # latest trace arrival per turn
        self.last_finish_s = 0.0

    def blocks(self, turn: int) -> bool:
        return any(t < turn for t in self.running)


class SessionGate:
    """When each request may be sent (`arrive`); the held ones come back from `finish`
    when the turns before theirs are done. `think`: closed_think's rule."""

    __slots__ = ("_sessions", "held_total", "think")

    def __init__(self, *, think: bool = False) -> None:
        self.think = think
        self._sessions: dict[_Key, _Session] = {}
        self.held_total = 0  # requests sent later than their arrival, over the run

    def arrive(self, request: Request, now_s: float) -> float | None:
        """When `request`, arriving now, is sent: now (never before its arrival), a later
        time (closed_think), or None: held until `finish` returns it."""
        due_s = max(now_s, request.arrival_s)  # a driver's sleep may end a moment early
        if request.session_id is None:
            return due_s
        key = (request.trace_id, request.session_id)
        session = self._sessions.get(key)
        if session is None:
            session = self._sessions[key] = _Session()
        turn = request.turn
        arrivals = session.arrivals
        arrivals[turn] = max(arrivals.get(turn, request.arrival_s), request.arrival_s)
        if session.held or session.blocks(turn):
            session.held.append(request)
            self.held_total += 1
            return None
        send_s = max(due_s, self._send_s(session, request))
        session.running[turn] = session.running.get(turn, 0) + 1
        if send_s > due_s:
            self.held_total += 1
        return send_s

    def finish(
        self, trace_id: str, session_id: str | None, turn: int, now_s: float
    ) -> list[tuple[float, Request]]:
        """A sent request of this session and turn finished (or failed) now: the held
        requests that may go, each with when (now, or later under closed_think)."""
        if session_id is None:
            return []
        session = self._sessions[(trace_id, session_id)]
        running = session.running
        left = running[turn] - 1
        if left:
            running[turn] = left
        else:
            del running[turn]
        session.last_finish_s = max(session.last_finish_s, now_s)
        held = session.held
        released: list[tuple[float, Request]] = []
        while held and not session.blocks(held[0].turn):
            request = held.popleft()
            running[request.turn] = running.get(request.turn, 0) + 1
            released.append((max(now_s, self._send_s(session, request)), request))
        return released

    def _send_s(self, session: _Session, request: Request) -> float:
        """The earliest send the rule allows once the earlier turns are done: the arrival
        (closed), or the last finish plus the think gap (closed_think; a first turn
        goes at its arrival)."""
        if not self.think:
            return request.arrival_s
        earlier = [a for t, a in session.arrivals.items() if t < request.turn]
        if not earlier:
            return request.arrival_s
        return session.last_finish_s + (request.arrival_s - max(earlier))

    @property
    def holding(self) -> int:
        """Requests held now (none once a replay has drained)."""
        return sum(len(s.held) for s in self._sessions.values())


def session_gate(replay: str) -> SessionGate | None:
    """The gate of a `workload.session_replay` value; None for open replay."""
    if replay == "open":
        return None
    return SessionGate(think=replay == "closed_think")
