"""Corrections the NIXL connector needs on a CPU host, applied inside each vLLM server by
`btb_lab.cluster.vllm_nixl.BtbNixlConnector` (kept apart so they import without vLLM):

* `set_progress_delay`: nixl's Python API builds every agent with `pthrDelay = 0`, so the
  UCX progress thread polls with a zero timeout and spins a whole core per instance even
  when idle (`nixl_cu12/_api.py`; measured: 99% of a core idle, 2% with a 1 ms timeout).
  The thread still wakes at once on UCX events; the timeout is only its periodic wake-up.
* `kept_affinity`: the NIXL worker on CPU pins the thread that builds it, the model
  runner's main thread, to the last core of each NUMA node (`os.sched_setaffinity(0, …)`
  in vLLM's nixl base_worker), overriding VLLM_CPU_OMP_THREADS_BIND, so every NIXL
  instance's model ran on the same core.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["DEFAULT_PROGRESS_DELAY_US", "kept_affinity", "set_progress_delay"]

logger = logging.getLogger("btb_lab.nixl_cpu")

DEFAULT_PROGRESS_DELAY_US = 1000


class _BindingsWithDelay:
    """Stands in for the nixl bindings module inside `nixl._api`: every agent it creates
    gets `pthrDelay = delay_us`; everything else is the real module's."""

    def __init__(self, real: Any, delay_us: int) -> None:
        self._real = real
        self._delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # the binding's own name
        config.pthrDelay = self._delay_us
        return self._real.nixlAgent(name, config)


def set_progress_delay(delay_us: int, api: Any = None) -> bool:
    """Make agents created from now on poll with `delay_us`; False (and a warning) when
    this nixl build does not look as expected, in which case nothing changes."""
    if api is None:
        try:
            import nixl._api  # noqa: F401  (the import injects the real module)
        except ImportError:
            return False
        api = sys.modules.get("nixl._api")
    bindings = getattr(api, "nixlBind", None)
    if bindings is None or not hasattr(bindings, "nixlAgent"):
        logger.warning("nixl._api has no nixlBind.nixlAgent; NIXL progress delay left at 0")
        return False
    if isinstance(bindings, _BindingsWithDelay):
        bindings._delay_us = delay_us
        return True
    api.nixlBind = _BindingsWithDelay(bindings, delay_us)
    return True


@contextlib.contextmanager
def kept_affinity(enabled: bool = True) -> Iterator[None]:
    """Restore the calling thread's CPU set when the block ends."""
    before = os.sched_getaffinity(0) if enabled and hasattr(os, "sched_getaffinity") else None
    try:
        yield
    finally:
        if before is not None and os.sched_getaffinity(0) != before:
            os.sched_setaffinity(0, before)
