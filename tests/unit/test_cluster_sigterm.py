"""SIGTERM during the load driver's event loop stops the run as Ctrl-C does, wherever it
lands: even inside a transport callback, where an exception raised by the signal handler
would be reported by the loop and dropped, and the run would go on to the end."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from btb_lab.cluster.driver import run_async
from btb_lab.interrupts import Terminated, terminate_interrupts


class KillOnData(asyncio.Protocol):
    """A server that sends this process SIGTERM from inside `data_received`."""

    def data_received(self, data: bytes) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        self.reached = True  # the handler runs before this line


async def talk_then_finish() -> str:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(KillOnData, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"x")
    await writer.drain()
    await asyncio.sleep(2.0)  # the signal arrives during this wait
    writer.close()
    server.close()
    return "finished"


def test_sigterm_inside_a_transport_callback_stops_the_run() -> None:
    with terminate_interrupts(), pytest.raises(Terminated) as caught:
        run_async(talk_then_finish())
    assert caught.value.signum == signal.SIGTERM


def test_a_run_without_signals_returns_its_result() -> None:
    async def quick() -> int:
        await asyncio.sleep(0)
        return 7

    assert run_async(quick()) == 7
