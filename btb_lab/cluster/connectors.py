"""KV connectors on a real cluster, one class per `cluster.kv_connector.type`: what each
needs at launch (vLLM's `--kv-transfer-config` for the instance's role, environment,
side-channel ports, a shared folder) and how the router moves KV with it.

Every decision that moves KV reaches a connector as one `TransferJob`: make the KV of
`prompt` computed on `producer` resident on `consumer`, which then generates
`max_tokens` tokens (a prefill offload's decode, or max_tokens 1 for a BTB warm copy).

* `nixl` — vLLM's NixlConnector: the producer prefills with `do_remote_decode` and
  max_tokens 1; its answer carries `kv_transfer_params` (block ids, engine id, host and
  side-channel port), which go unchanged to the consumer, which reads the blocks.
* `example` — vLLM's ExampleConnector: the producer's KV goes to files in a shared folder
  keyed by the prompt's full blocks; the consumer, sent the same prompt after the
  producer answered, loads them (its tail block is recomputed).
* `mooncake` — vLLM's MooncakeConnector: the router names a transfer id, prefill and
  decode run at once, and the decoder pulls from the prefiller's bootstrap server.
* `none` — nothing moves: offloads run on the decode instance alone and warming is a
  speculative prefill there (the router handles both).

A consumer's fetch is measured from its own /metrics (external hits, NIXL bytes and
transfer time), scraped right before the consumer request and right after its first
token while no other fetch into that instance runs (`attribute_transfers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import socket
import tempfile
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from btb_lab.cluster.driver import ClientPool, RunClock, StreamResult, completion_payload
from btb_lab.cluster.telemetry import metrics_delta, scrape_one
from btb_lab.registry import Registry

if TYPE_CHECKING:
    from btb_lab.cluster.launcher import Endpoint
    from btb_lab.config.hypothesis import KVConnector

__all__ = [
    "CONNECTORS",
    "Connector",
    "InstanceConnector",
    "TransferIO",
    "TransferJob",
    "TransferMeter",
    "TransferResult",
    "build_connector",
    "free_ports",
]

NIXL_MODULE = "btb_lab.cluster.vllm_nixl"  # BtbNixlConnector, loaded by vLLM
DEFAULT_UCX_TLS_CPU = "tcp,self,sm"  # no RDMA or CUDA transports on a CPU host


def free_ports(host: str, count: int, *, avoid: set[int]) -> int:
    """The first of `count` consecutive ports the OS reports free right now (NIXL's side
    channel uses base + tensor-parallel rank), none of them in `avoid`."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            base = int(sock.getsockname()[1])
        span = range(base, base + count)
        if base + count > 65535 or any(p in avoid for p in span):
            continue
        try:
            with contextlib.ExitStack() as stack:
                for port in span[1:]:
                    s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    s.bind((host, port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports on {host}")


@dataclass(frozen=True, slots=True)
class InstanceConnector:
    """Launch facts of one instance's connector."""

    kv_config: str | None = None  # --kv-transfer-config JSON
    env: dict[str, str] = field(default_factory=dict)
    bootstrap_port: int | None = None  # Mooncake bootstrap server
    side_channel_port: int | None = None  # NIXL handshake listener
    scratch_dir: str | None = None  # created before launch, removed at teardown


@dataclass(frozen=True, slots=True)
class TransferJob:
    """Make `prompt`'s KV, computed on `producer`, resident on `consumer`, which then
    generates `max_tokens` tokens (streamed when `stream`)."""

    producer: int
    consumer: int
    prompt: Sequence[int]
    max_tokens: int
    stream: bool = True
    cold: bool = False  # the producer must not use its prefix cache (a PS without the session)
    tag: str = ""  # unique id of this transfer (logs, Mooncake transfer id)


@dataclass
class TransferResult:
    """Both legs of one transfer. `consume` carries the request's stamps: its `sent_s` is
    when the transfer started (the producer's send), and it is failed whenever either
    leg failed, with the failing leg named in `error` (Prefill:…, KVTransfer:…)."""

    consume: StreamResult
    prefill: StreamResult | None = None
    fetch: dict[str, float] | None = None  # consumer /metrics delta over its fetch

    @property
    def ok(self) -> bool:
        return self.consume.ok

    @property
    def transferred_tokens(self) -> int | None:
        """Prompt tokens whose KV reached the consumer through the connector."""
        if self.fetch is None:
            return None
        return int(self.fetch.get("external_prefix_cache_hits", 0.0))

    def record_extra(self) -> dict[str, float | int | str]:
        """What a RequestRecord keeps of the transfer (its `extra`)."""
        out: dict[str, float | int | str] = {}
        if self.fetch is not None:
            out["kv_transferred_tokens"] = int(self.fetch.get("external_prefix_cache_hits", 0))
            if "nixl_bytes" in self.fetch:
                out["kv_bytes"] = float(self.fetch["nixl_bytes"])
                out["kv_engine_transfer_s"] = round(float(self.fetch.get("nixl_xfer_s", 0)), 6)
        if self.prefill is not None and self.prefill.cached_tokens is not None:
            out["prefill_cached_tokens"] = int(self.prefill.cached_tokens)
        if self.consume.cached_tokens is not None:
            out["decode_cached_tokens"] = int(self.consume.cached_tokens)
        detail = self.consume.detail or (self.prefill.detail if self.prefill else None)
        if detail and not self.ok:
            out["error_detail"] = detail
        return out


# counters whose growth during one fetch belongs to that fetch
_FETCH_KEYS = (
    "external_prefix_cache_hits", "external_prefix_cache_queries", "prefix_cache_hits",
    "prefix_cache_queries", "prompt_tokens_local_compute", "prompt_tokens_local_cache_hit",
    "prompt_tokens_external_kv_transfer", "nixl_bytes", "nixl_xfer_s", "nixl_xfers",
    "nixl_failed_transfers",
)  # fmt: skip


class TransferMeter:
    """Per-instance fetch windows: with `enabled`, one fetch at a time into an instance,
    its /metrics scraped at both ends, so the delta is that fetch's alone."""

    def __init__(self, client: ClientPool, endpoints: Sequence[Endpoint], *, enabled: bool) -> None:
        self.client = client
        self.endpoints = list(endpoints)
        self.enabled = enabled
        self._locks = [asyncio.Lock() for _ in self.endpoints]

    @contextlib.asynccontextmanager
    async def window(self, instance: int) -> AsyncIterator[_Window]:
        if not self.enabled:
            yield _Window(self, instance, None)
            return
        async with self._locks[instance]:
            before = await scrape_one(self.client, self.endpoints[instance])
            win = _Window(self, instance, None if "error" in before else before)
            try:
                yield win
            finally:
                await win.close()


class _Window:
    def __init__(self, meter: TransferMeter, instance: int, before: dict[str, Any] | None):
        self.meter = meter
        self.instance = instance
        self.before = before
        self.delta: dict[str, float] | None = None

    async def close(self) -> None:
        """Scrape the end of the window (once)."""
        if self.before is None or self.delta is not None:
            return
        after = await scrape_one(self.meter.client, self.meter.endpoints[self.instance])
        if "error" in after:
            self.before = None
            return
        grown = metrics_delta(self.before, after)
        self.delta = {k: float(grown[k]) for k in _FETCH_KEYS if k in grown}


@dataclass
class TransferIO:
    """What a connector needs to talk to the instances."""

    client: ClientPool
    clock: RunClock
    endpoints: Sequence[Endpoint]
    model: str
    meter: TransferMeter
    timeout_s: float | None = None

    def url(self, instance: int) -> str:
        return self.endpoints[instance].base_url + "/v1/completions"


async def fetch_measured(io: TransferIO, consumer: int, body: dict[str, Any]) -> TransferResult:
    """Send the consumer's request inside a fetch window: the window closes (and the
    next fetch into this instance may start) at its first token or its failure."""
    first = asyncio.Event()
    async with io.meter.window(consumer) as win:
        task = asyncio.create_task(
            io.client.stream_completion(
                io.url(consumer), body, io.clock, timeout_s=io.timeout_s,
                on_first_token=first.set,
            )
        )  # fmt: skip
        waiter = asyncio.create_task(first.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            waiter.cancel()
        await win.close()
    res = await task
    return TransferResult(consume=res, fetch=win.delta)


def _failed(sent_s: float, error: str, detail: str | None = None) -> StreamResult:
    return StreamResult(sent_s=sent_s, error=error, detail=detail)


def _merge_legs(prefill: StreamResult, result: TransferResult) -> TransferResult:
    """The consumer leg as the request's record sees it: sent when the producer was."""
    result.prefill = prefill
    res = result.consume
    res.sent_s = min(res.sent_s, prefill.sent_s)
    if not res.ok:
        res.error = f"KVTransfer:{res.error}"
    return result


class Connector:
    """Base class: subclasses set `name`, implement `instance_config` and `transfer`."""

    name: ClassVar[str] = ""
    moves_kv: ClassVar[bool] = True

    def __init__(self, spec: KVConnector) -> None:
        self.spec = spec

    def kv_role(self, group_role: str) -> str:
        return self.spec.roles.get(group_role, self.spec.role)  # type: ignore[call-overload]

    # launch --------------------------------------------------------------------------
    def scratch_dir(self) -> str | None:
        """A folder every instance of one launch shares, or None."""
        return None

    def instance_config(
        self,
        *,
        group_role: str,
        host: str,
        device: str,
        tensor_parallel: int,
        used_ports: set[int],
        scratch_dir: str | None,
    ) -> InstanceConnector:
        raise NotImplementedError

    # runtime -------------------------------------------------------------------------
    async def transfer(self, io: TransferIO, job: TransferJob) -> TransferResult:
        raise NotImplementedError


CONNECTORS: Registry[type[Connector]] = Registry("kv connector")


def build_connector(spec: KVConnector) -> Connector:
    return CONNECTORS.get(spec.type)(spec)


@CONNECTORS.register("none")
class NoConnector(Connector):
    """No KV moves between instances."""

    name: ClassVar[str] = "none"
    moves_kv: ClassVar[bool] = False

    def instance_config(self, **_: Any) -> InstanceConnector:
        return InstanceConnector()

    async def transfer(self, io: TransferIO, job: TransferJob) -> TransferResult:
        raise RuntimeError("connector none moves no KV")


@CONNECTORS.register("nixl")
class NixlConnector(Connector):
    """vLLM's NixlConnector (read-based): producer prefill first, then the consumer reads
    the producer's blocks named in the producer's `kv_transfer_params`."""

    name: ClassVar[str] = "nixl"

    def buffer_device(self, device: str) -> str:
        if self.spec.kv_buffer_device is not None:
            return self.spec.kv_buffer_device
        return "cpu" if device == "cpu" else "cuda"

    def instance_config(
        self,
        *,
        group_role: str,
        host: str,
        device: str,
        tensor_parallel: int,
        used_ports: set[int],
        scratch_dir: str | None,
    ) -> InstanceConnector:
        side = free_ports(host, tensor_parallel, avoid=used_ports)
        used_ports.update(range(side, side + tensor_parallel))
        config: dict[str, Any] = {
            "kv_role": self.kv_role(group_role),
            "kv_buffer_device": self.buffer_device(device),
            "kv_load_failure_policy": "fail",  # a failed read fails the request, visibly
        }
        delay = self.spec.nixl_progress_delay_us
        if delay is None:
            config["kv_connector"] = "NixlConnector"
        else:
            config["kv_connector"] = "BtbNixlConnector"
            config["kv_connector_module_path"] = NIXL_MODULE
            config["kv_connector_extra_config"] = {"progress_delay_us": delay}
        env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)}
        if device == "cpu" and "UCX_TLS" not in os.environ:
            env["UCX_TLS"] = DEFAULT_UCX_TLS_CPU
        return InstanceConnector(
            kv_config=json.dumps(config, sort_keys=True), env=env, side_channel_port=side
        )

    async def transfer(self, io: TransferIO, job: TransferJob) -> TransferResult:
        produce = {"do_remote_decode": True, "do_remote_prefill": False}
        body = completion_payload(io.model, job.prompt, 1, stream=False, kv_transfer_params=produce)
        if job.cold:
            # A prefill service without the session's cache: a unique salt makes the
            # producer's prefix cache miss, so it computes the prompt cold as modeled.
            body["cache_salt"] = f"cold-{job.tag}"
        prefill = await io.client.stream_completion(
            io.url(job.producer), body, io.clock, timeout_s=io.timeout_s
        )
        if not prefill.ok:
            return TransferResult(
                consume=_failed(prefill.sent_s, f"Prefill:{prefill.error}", prefill.detail),
                prefill=prefill,
            )
        params = prefill.body.get("kv_transfer_params")
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            detail = f"producer answered kv_transfer_params={params!r} (is it a kv_producer?)"
            return TransferResult(
                consume=_failed(prefill.sent_s, "Prefill:NoKVTransferParams", detail),
                prefill=prefill,
            )
        decode = completion_payload(
            io.model, job.prompt, job.max_tokens, stream=job.stream, kv_transfer_params=params
        )
        return _merge_legs(prefill, await fetch_measured(io, job.consumer, decode))


@CONNECTORS.register("example")
class ExampleConnector(Connector):
    """vLLM's ExampleConnector: every instance saves the KV of each new prompt to files in
    the shared folder and loads any prompt found there (keyed by its full blocks)."""

    name: ClassVar[str] = "example"

    def scratch_dir(self) -> str:
        base = self.spec.shared_storage_path or tempfile.gettempdir()
        return os.path.join(os.path.abspath(base), f"btb-kv-{uuid.uuid4().hex[:12]}")

    def instance_config(
        self,
        *,
        group_role: str,
        host: str,
        device: str,
        tensor_parallel: int,
        used_ports: set[int],
        scratch_dir: str | None,
    ) -> InstanceConnector:
        if scratch_dir is None:
            raise ValueError("the example connector needs its shared folder")
        config = {
            "kv_connector": "ExampleConnector",
            "kv_role": self.kv_role(group_role),
            "kv_connector_extra_config": {"shared_storage_path": scratch_dir},
        }
        return InstanceConnector(
            kv_config=json.dumps(config, sort_keys=True), scratch_dir=scratch_dir
        )

    async def transfer(self, io: TransferIO, job: TransferJob) -> TransferResult:
        body = completion_payload(io.model, job.prompt, 1, stream=False)
        if job.cold:
            # the salt defeats the producer's prefix cache; its files are keyed by tokens
            body["cache_salt"] = f"cold-{job.tag}"
        # The files exist once the producer has answered: its forward pass wrote them.
        prefill = await io.client.stream_completion(
            io.url(job.producer), body, io.clock, timeout_s=io.timeout_s
        )
        if not prefill.ok:
            return TransferResult(
                consume=_failed(prefill.sent_s, f"Prefill:{prefill.error}", prefill.detail),
                prefill=prefill,
            )
        decode = completion_payload(io.model, job.prompt, job.max_tokens, stream=job.stream)
        return _merge_legs(prefill, await fetch_measured(io, job.consumer, decode))


@CONNECTORS.register("mooncake")
class MooncakeConnector(Connector):
    """vLLM's MooncakeConnector: the router names a transfer id; the prefiller runs the
    prompt with `do_remote_decode` while the decoder, told the prefiller's bootstrap
    address and engine id, pulls the KV and decodes, both at once."""

    name: ClassVar[str] = "mooncake"

    def __init__(self, spec: KVConnector) -> None:
        super().__init__(spec)
        self._engine_ids: dict[int, str] = {}
        self._ids = itertools.count()

    def instance_config(
        self,
        *,
        group_role: str,
        host: str,
        device: str,
        tensor_parallel: int,
        used_ports: set[int],
        scratch_dir: str | None,
    ) -> InstanceConnector:
        config = {
            "kv_connector": "MooncakeConnector",
            "kv_role": self.kv_role(group_role),
            "kv_connector_extra_config": {"mooncake_protocol": self.spec.protocol},
        }
        # Co-located instances on one host need distinct bootstrap ports.
        boot = free_ports(host, 1, avoid=used_ports)
        used_ports.add(boot)
        return InstanceConnector(
            kv_config=json.dumps(config, sort_keys=True),
            env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(boot)},
            bootstrap_port=boot,
        )

    async def engine_id(self, io: TransferIO, instance: int) -> str:
        """The prefiller's engine id from its Mooncake bootstrap server (`/query`)."""
        if instance not in self._engine_ids:
            boot = io.endpoints[instance].bootstrap_url
            if boot is None:
                raise RuntimeError(f"instance {io.endpoints[instance].name} has no bootstrap")
            resp = await io.client.get(boot + "/query")
            resp.raise_for_status()
            data = resp.json()
            self._engine_ids[instance] = str(data[min(data, key=int)]["engine_id"])
        return self._engine_ids[instance]

    def params(
        self, io: TransferIO, producer: int, engine_id: str, transfer_id: str
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """`kv_transfer_params` of the producer (prefill for remote decode) and of the
        consumer (pull from the producer's bootstrap server)."""
        produce = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}
        consume = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_bootstrap_addr": io.endpoints[producer].bootstrap_url,
            "remote_engine_id": engine_id,
            "transfer_id": transfer_id,
        }
        return produce, consume

    async def transfer(self, io: TransferIO, job: TransferJob) -> TransferResult:
        start = io.clock.now()
        try:
            engine_id = await self.engine_id(io, job.producer)
        except Exception as exc:  # bootstrap unreachable: a failed request, not a crash
            return TransferResult(consume=_failed(start, f"Bootstrap:{type(exc).__name__}"))
        transfer_id = f"xfer-{job.tag}-{next(self._ids)}"
        produce, consume = self.params(io, job.producer, engine_id, transfer_id)
        prefill_body = completion_payload(
            io.model, job.prompt, 1, stream=False, kv_transfer_params=produce
        )
        if job.cold:
            prefill_body["cache_salt"] = f"cold-{transfer_id}"
        decode_body = completion_payload(
            io.model, job.prompt, job.max_tokens, stream=job.stream, kv_transfer_params=consume
        )
        prefill_task = asyncio.create_task(
            io.client.stream_completion(
                io.url(job.producer), prefill_body, io.clock, timeout_s=io.timeout_s
            )
        )
        try:
            result = await fetch_measured(io, job.consumer, decode_body)
        except BaseException:
            prefill_task.cancel()
            raise
        prefill = await prefill_task
        result.prefill = prefill
        if not prefill.ok and result.consume.ok:
            result.consume.ok = False
            result.consume.error = f"Prefill:{prefill.error}"
        return result
