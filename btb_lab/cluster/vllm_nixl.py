"""vLLM's NixlConnector with the CPU-host corrections of `btb_lab.cluster.nixl_cpu`
(progress-thread poll timeout, model thread affinity), loaded by vLLM itself through
`kv_connector_module_path`: this module runs inside the vLLM server, never in btb-lab, and
imports vLLM. Both corrections are `kv_connector_extra_config` keys (`progress_delay_us`,
`keep_affinity`); the transfer protocol is vLLM's, unchanged.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

from btb_lab.cluster.nixl_cpu import DEFAULT_PROGRESS_DELAY_US, kept_affinity, set_progress_delay

__all__ = ["BtbNixlConnector"]

logger = logging.getLogger("vllm.btb_lab")  # under vLLM's logger: same format, same log


class BtbNixlConnector(NixlConnector):
    """NixlConnector with the progress-thread delay and the thread affinity corrected."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        delay_us = extra.get("progress_delay_us", DEFAULT_PROGRESS_DELAY_US)
        delayed = delay_us is not None and set_progress_delay(int(delay_us))
        keep = bool(extra.get("keep_affinity", True))
        with kept_affinity(keep):
            super().__init__(vllm_config, role, kv_cache_config)
        logger.info(
            "BtbNixlConnector (%s): NIXL progress-thread poll timeout %s us; model thread "
            "CPUs %s",
            role, delay_us if delayed else "0 (nixl default)",
            sorted(os.sched_getaffinity(0)) if keep else "as NIXL pinned them",
        )  # fmt: skip
