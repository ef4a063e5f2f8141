"""SIGTERM handled like Ctrl-C: while `terminate_interrupts()` is active, SIGTERM raises
`Terminated` (a KeyboardInterrupt) in the main thread, so every partial-results path
that handles Ctrl-C (records kept, manifest marked interrupted, report rendered) runs for
a `kill` or a job scheduler's stop too."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # every command imports this module; only the cluster driver runs asyncio
    import asyncio

__all__ = [
    "Terminated",
    "cancel_on_terminate",
    "exit_code",
    "terminate_interrupts",
    "terminated",
]

# SIGTERMs this process received while `terminate_interrupts` was active
_received: list[int] = []


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived; handled exactly as Ctrl-C, exit status 128 + signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def exit_code(exc: BaseException) -> int:
    """130 for Ctrl-C, 143 for SIGTERM (128 + the signal number, as shells report it)."""
    return 128 + int(getattr(exc, "signum", signal.SIGINT))


@contextmanager
def terminate_interrupts() -> Iterator[None]:
    """SIGTERM raises `Terminated` while active (a no-op off the main thread)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        _received.append(signum)
        raise Terminated(signum)

    with _on_sigterm(handler):
        yield


@contextmanager
def _on_sigterm(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    """`handler` for SIGTERM while active, the previous one after (main thread only: a
    no-op elsewhere, where Python cannot install signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def cancel_on_terminate(task: Callable[[], asyncio.Task[Any] | None]) -> Iterator[list[int]]:
    """While an event loop runs `task()`: SIGTERM cancels that task, as asyncio.Runner does
    for Ctrl-C, instead of raising `Terminated` inside whatever callback is running (an
    event loop reports an exception raised in a transport's callback and carries on, so
    the run would finish as if never stopped). Yields the signals received; the caller
    raises `Terminated` once the cancelled task has unwound. A second SIGTERM raises at
    once. A no-op off the main thread."""
    got: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        _received.append(signum)
        got.append(signum)
        main = task()
        if len(got) == 1 and main is not None and not main.done():
            main.cancel()
            main.get_loop().call_soon_threadsafe(lambda: None)  # wake the loop
            return
        raise Terminated(signum)

    with _on_sigterm(handler):
        yield got


def terminated() -> bool:
    """Whether a SIGTERM arrived (click reports any KeyboardInterrupt as exit 130)."""
    return bool(_received)
