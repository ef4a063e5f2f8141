"""Closed-loop session replay (`workload.session_replay: closed`), the one rule both worlds
apply: a request of turn k of a session is sent only once every request of the session's
earlier turns has finished (or failed), since its prompt holds their answers; it goes at
its arrival time or at that last finish, whichever is later. Requests of one turn do not
wait for each other, and requests without a session never wait.

Open replay (the default) sends every request at its arrival time, as the trace recorded
it: under a load heavier than the trace's, a turn may then arrive before the answer it
continues, and find the previous turn's KV not yet cached.
"""

from __future__ import annotations

from collections import deque

from btb_lab.records import Request

__all__ = ["SessionGate"]

_Key = tuple[str, str]  # (trace_id, session_id): sessions are per window


class SessionGate:
    """Which requests may be sent now; the held ones come back from `finish` when the
    turns before theirs are done. Counts are per (trace_id, session_id)."""

    __slots__ = ("_held", "_running", "held_total")

    def __init__(self) -> None:
        self._running: dict[_Key, dict[int, int]] = {}  # unfinished requests per turn
        self._held: dict[_Key, deque[Request]] = {}  # in arrival order
        self.held_total = 0  # requests that had to wait, over the run

    def arrive(self, request: Request) -> bool:
        """Whether `request` may be sent now; False: it is held until `finish` returns it."""
        turn = request.turn
        if request.session_id is None:
            return True
        key = (request.trace_id, request.session_id)
        held = self._held.get(key)
        running = self._running.setdefault(key, {})
        if held or any(t < turn for t in running):
            self._held.setdefault(key, deque()).append(request)
            self.held_total += 1
            return False
        running[turn] = running.get(turn, 0) + 1
        return True

    def finish(self, trace_id: str, session_id: str | None, turn: int) -> list[Request]:
        """A sent request of this session and turn finished (or failed): the held requests
        that may go now, in arrival order."""
        if session_id is None:
            return []
        key = (trace_id, session_id)
        running = self._running[key]
        left = running[turn] - 1
        if left:
            running[turn] = left
        else:
            del running[turn]
        held = self._held.get(key)
        released: list[Request] = []
        while held and not any(t < held[0].turn for t in running):
            request = held.popleft()
            running[request.turn] = running.get(request.turn, 0) + 1
            released.append(request)
        if not running and not held:
            self._running.pop(key, None)
            self._held.pop(key, None)
        return released

    @property
    def holding(self) -> int:
        """Requests held now (none once a replay has drained)."""
        return sum(len(q) for q in self._held.values())
