"""A small, fast fake of vLLM's OpenAI server for tests and the load-driver benchmark.

It streams `/v1/completions` like vLLM (SSE chunks, final usage chunk with cached tokens),
keeps a block-level prefix cache so cached-token counts and `/metrics` counters behave,
and checks the KV connector exchanges. Mooncake (`kv_protocol="mooncake"`): a prefill
marked `do_remote_decode` must carry a `transfer_id` and `max_tokens` 1, and a decode
marked `do_remote_prefill` must name the prefiller's bootstrap address, its engine id and
the same transfer id, which it verifies by asking the prefiller (as vLLM's decoder pulls
KV from it). NIXL (`kv_protocol="nixl"`): the prefill answers `kv_transfer_params` naming
its engine, request and address, and the decode must bring them back unchanged; it pulls
the prompt's blocks it does not hold from that address, counting them as external hits,
by source, and as NIXL bytes. Plain ASGI served by uvicorn: no framework overhead, so
the benchmark measures the driver, not the fake.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FakeConfig", "FakeVLLM", "main", "serve_in_thread"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

CACHE_BLOCK_TOKENS = 16  # vLLM's default KV block size; hits count whole blocks


@dataclass
class FakeConfig:
    """Behaviour knobs; delays are per token so tests stay fast and deterministic."""

    name: str = "fake"
    model: str = "fake-model"
    engine_id: str = "engine-fake"
    token_delay_s: float = 0.0  # between streamed tokens
    prefill_delay_per_token_s: float = 0.0  # for uncached prompt tokens
    stall_s: float = 0.0  # sleep before the first token (ReadTimeout tests)
    fail_status: int | None = None  # answer every completion with this status
    kv_wait_s: float = 5.0  # how long a decode waits for its prefill to finish
    kv_protocol: str = "mooncake"  # "nixl", or "none" (no connector: params are ignored)
    kv_bytes_per_token: int = 1024  # NIXL bytes counted per transferred token
    kv_fail: str | None = None  # "http": a KV fetch answers 500; "stream": an error event


@dataclass
class _Transfer:
    prompt: list[int]
    done: asyncio.Event = field(default_factory=asyncio.Event)
    pulled: bool = False


def _block_keys(prompt: list[int], salt: str = "") -> list[str]:
    """Chained digests of full cache blocks: block i's key covers tokens 0..(i+1)·16
    (and the request's cache salt, as in vLLM)."""
    keys = []
    h = hashlib.blake2b(salt.encode(), digest_size=8)
    for start in range(0, len(prompt) - CACHE_BLOCK_TOKENS + 1, CACHE_BLOCK_TOKENS):
        h.update(json.dumps(prompt[start : start + CACHE_BLOCK_TOKENS]).encode())
        keys.append(h.copy().hexdigest())
    return keys


class FakeVLLM:
    """The ASGI application. State (cache, counters, transfers) lives on the object so
    tests can inspect it."""

    def __init__(self, config: FakeConfig | None = None) -> None:
        self.config = config or FakeConfig()
        self.cache: set[str] = set()
        self.counters: dict[str, float] = {
            "prefix_cache_queries": 0.0,
            "prefix_cache_hits": 0.0,
            "external_prefix_cache_queries": 0.0,
            "external_prefix_cache_hits": 0.0,
            "ttft_sum": 0.0,
            "ttft_count": 0.0,
            "local_compute": 0.0,
            "local_cache_hit": 0.0,
            "external_kv_transfer": 0.0,
            "nixl_bytes": 0.0,
            "nixl_xfers": 0.0,
            "nixl_xfer_s": 0.0,
        }
        self.running = 0
        self.transfers: dict[str, _Transfer] = {}
        self.requests: list[dict[str, Any]] = []  # every completion body received
        self.errors: list[str] = []  # protocol violations seen
        self.address: tuple[str, int] | None = None  # where this fake is served (from ASGI)
        self._ids = itertools.count()

    # -- ASGI ---------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if method == "GET" and path == "/health":
            await _respond(send, 200, b"")
        elif method == "GET" and path == "/metrics":
            await _respond(send, 200, self.metrics_text().encode(), "text/plain; version=0.0.4")
        elif method == "GET" and path == "/v1/models":
            body = {"object": "list", "data": [{"id": self.config.model, "object": "model"}]}
            await _respond_json(send, 200, body)
        elif method == "GET" and path == "/query":  # Mooncake bootstrap server
            await _respond_json(send, 200, {"0": {"engine_id": self.config.engine_id}})
        elif method == "GET" and path.startswith("/kv/"):
            await self._serve_kv(path[4:], send)
        elif method == "POST" and path == "/v1/completions":
            body = json.loads(await _read_body(receive) or b"{}")
            self.address = self.address or tuple(scope.get("server") or ("127.0.0.1", 0))
            await self._completion(body, send)
        else:
            await _respond(send, 404, b"not found")

    # -- completions --------------------------------------------------------------------
    def _reject(self, reason: str) -> tuple[int, dict[str, Any]]:
        self.errors.append(reason)
        return 400, {"error": {"message": reason, "type": "BadRequestError"}}

    async def _completion(self, body: dict[str, Any], send: Send) -> None:
        cfg = self.config
        self.requests.append(body)
        if cfg.fail_status is not None:
            await _respond_json(send, cfg.fail_status, {"error": {"message": "injected"}})
            return
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            status, err = self._reject("prompt must be a list of token ids")
            await _respond_json(send, status, err)
            return
        max_tokens = int(body.get("max_tokens", 16))
        params = body.get("kv_transfer_params") or {}
        if cfg.kv_protocol == "none":  # a server without a connector ignores the params
            params = {}
        external = 0
        nixl = cfg.kv_protocol == "nixl"
        if nixl and (params.get("do_remote_decode") or params.get("do_remote_prefill")):
            await self._nixl_completion(body, prompt, max_tokens, params, send)
            return
        if params.get("do_remote_decode"):
            if not params.get("transfer_id"):
                await _respond_json(send, *self._reject("do_remote_decode without transfer_id"))
                return
            if max_tokens != 1 or body.get("stream"):
                await _respond_json(
                    send, *self._reject("remote-decode prefill must be max_tokens 1, no stream")
                )
                return
        if params.get("do_remote_prefill"):
            missing = [
                k
                for k in ("remote_bootstrap_addr", "remote_engine_id", "transfer_id")
                if not params.get(k)
            ]
            if missing:
                await _respond_json(send, *self._reject(f"remote prefill missing {missing}"))
                return
            ok, detail = await self._pull(params, prompt)
            if not ok:
                await _respond_json(send, *self._reject(detail))
                return
            external = len(prompt)
        self.running += 1
        started = time.perf_counter()
        try:
            keys = _block_keys(prompt, str(body.get("cache_salt") or ""))
            hit_blocks = 0
            for key in keys:
                if key not in self.cache:
                    break
                hit_blocks += 1
            cached = hit_blocks * CACHE_BLOCK_TOKENS
            self.counters["prefix_cache_queries"] += len(prompt)
            self.counters["prefix_cache_hits"] += cached
            ext_part = max(0, external - cached)
            self.counters["local_cache_hit"] += cached
            self.counters["external_kv_transfer"] += ext_part
            self.counters["local_compute"] += len(prompt) - cached - ext_part
            if params.get("do_remote_prefill"):
                self.counters["external_prefix_cache_queries"] += len(prompt)
                self.counters["external_prefix_cache_hits"] += external
                cached = max(cached, external)
            delay = cfg.stall_s + cfg.prefill_delay_per_token_s * (len(prompt) - cached)
            if delay > 0:
                await asyncio.sleep(delay)
            self.cache.update(keys)
            if params.get("do_remote_decode"):
                self.transfers.setdefault(params["transfer_id"], _Transfer(prompt)).prompt = prompt
                self.transfers[params["transfer_id"]].done.set()
            usage = {
                "prompt_tokens": len(prompt),
                "completion_tokens": max_tokens,
                "total_tokens": len(prompt) + max_tokens,
                "prompt_tokens_details": {"cached_tokens": cached},
            }
            self.counters["ttft_sum"] += time.perf_counter() - started
            self.counters["ttft_count"] += 1
            if body.get("stream"):
                await self._stream(send, max_tokens, usage, body)
            else:
                out = {
                    "id": "cmpl-fake",
                    "object": "text_completion",
                    "model": cfg.model,
                    "choices": [{"index": 0, "text": "x" * max_tokens, "finish_reason": "length"}],
                    "usage": usage,
                    "kv_transfer_params": None,
                }
                await _respond_json(send, 200, out)
        finally:
            self.running -= 1

    # -- NIXL ---------------------------------------------------------------------------
    async def _nixl_completion(
        self,
        body: dict[str, Any],
        prompt: list[int],
        max_tokens: int,
        params: dict[str, Any],
        send: Send,
    ) -> None:
        """vLLM's NixlConnector exchange: a remote-decode prefill answers the handle of
        its blocks; a remote-prefill decode brings it back, pulls what it lacks, decodes."""
        keys = _block_keys(prompt, str(body.get("cache_salt") or ""))
        hit = 0
        for key in keys:
            if key not in self.cache:
                break
            hit += 1
        local = min(hit * CACHE_BLOCK_TOKENS, len(prompt))
        if params.get("do_remote_decode"):
            if max_tokens != 1 or body.get("stream"):
                await _respond_json(
                    send, *self._reject("remote-decode prefill must be max_tokens 1, no stream")
                )
                return
            delay = self.config.prefill_delay_per_token_s * (len(prompt) - local)
            if delay > 0:  # the producer computes what it does not hold
                await asyncio.sleep(delay)
            rid = f"req-{next(self._ids)}"
            self.transfers[rid] = _Transfer(prompt)
            self.transfers[rid].done.set()
            self.cache.update(keys)
            self._count_prompt(prompt, local, 0)
            host, port = self.address or ("127.0.0.1", 0)
            handle = {
                "do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [list(range(len(keys) + 1))],
                "remote_engine_id": self.config.engine_id, "remote_request_id": rid,
                "remote_host": host, "remote_port": port, "remote_num_tokens": len(prompt),
                "tp_size": 1, "remote_prefill_cached_tokens": local,
            }  # fmt: skip
            usage = {"prompt_tokens": len(prompt), "completion_tokens": 1,
                     "prompt_tokens_details": {"cached_tokens": local}}  # fmt: skip
            answer = {"id": "cmpl-fake", "object": "text_completion", "model": self.config.model,
                      "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                      "usage": usage, "kv_transfer_params": handle}  # fmt: skip
            await _respond_json(send, 200, answer)
            return
        missing = [
            k for k in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
            if params.get(k) is None
        ]  # fmt: skip
        if missing:
            await _respond_json(send, *self._reject(f"remote prefill missing {missing}"))
            return
        if self.config.kv_fail == "http":
            await _respond_json(send, 500, {"error": {"message": "KV load failed (injected)"}})
            return
        if self.config.stall_s > 0:  # a fetch that never finishes in time
            await asyncio.sleep(self.config.stall_s)
        ok, detail = await self._nixl_pull(params, prompt)
        if not ok:
            await _respond_json(send, *self._reject(detail))
            return
        pulled = len(prompt) - local
        self.counters["external_prefix_cache_queries"] += len(prompt)
        self.counters["external_prefix_cache_hits"] += pulled
        self.counters["nixl_bytes"] += pulled * self.config.kv_bytes_per_token
        self.counters["nixl_xfers"] += 1
        self.counters["nixl_xfer_s"] += 0.001
        self._count_prompt(prompt, local, pulled)
        self.cache.update(keys)
        if self.config.kv_fail == "stream":
            await self._stream_error(send)
            return
        reported = int(params.get("remote_prefill_cached_tokens") or 0)  # as vLLM reports it
        usage = {
            "prompt_tokens": len(prompt), "completion_tokens": max_tokens,
            "prompt_tokens_details": {"cached_tokens": reported},
        }  # fmt: skip
        if body.get("stream"):
            await self._stream(send, max_tokens, usage, body)
        else:
            text = "x" * max_tokens
            out: dict[str, Any] = {
                "id": "cmpl-fake", "object": "text_completion", "model": self.config.model,
                "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                "usage": usage, "kv_transfer_params": None,
            }  # fmt: skip
            await _respond_json(send, 200, out)

    def _count_prompt(self, prompt: list[int], local: int, external: int) -> None:
        self.counters["prefix_cache_queries"] += len(prompt)
        self.counters["prefix_cache_hits"] += local
        self.counters["local_cache_hit"] += local
        self.counters["external_kv_transfer"] += external
        self.counters["local_compute"] += len(prompt) - local - external

    async def _nixl_pull(self, params: dict[str, Any], prompt: list[int]) -> tuple[bool, str]:
        """Read the prefill's blocks from the producer named in the handle."""
        import httpx

        base = f"http://{params['remote_host']}:{params['remote_port']}"
        url = f"{base}/kv/{params['remote_request_id']}"
        async with httpx.AsyncClient(timeout=self.config.kv_wait_s + 5, trust_env=False) as c:
            try:
                resp = await c.get(url, params={"engine_id": params["remote_engine_id"]})
            except httpx.HTTPError as exc:
                return False, f"NIXL read from {base} failed: {type(exc).__name__}"
        if resp.status_code != 200:
            return False, f"NIXL read from {url}: {resp.status_code} {resp.text}"
        data = resp.json()
        if data.get("engine_id") != params["remote_engine_id"]:
            return False, "remote_engine_id does not name the producer"
        if data.get("prompt") != prompt:
            return False, "the producer's blocks do not hold this prompt"
        return True, ""

    async def _stream_error(self, send: Send) -> None:
        """A stream that fails after it started, as vLLM reports a failed KV load."""
        await send({
            "type": "http.response.start", "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        })  # fmt: skip
        err = json.dumps({"error": {"message": "KV load failed (injected)", "code": 500}})
        body = f"data: {err}\n\ndata: [DONE]\n\n".encode()
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _stream(
        self, send: Send, max_tokens: int, usage: dict[str, Any], body: dict[str, Any]
    ) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        head = (
            b'data: {"id":"cmpl-fake","object":"text_completion",'
            b'"choices":[{"index":0,"text":"x","finish_reason":'
        )
        for i in range(max_tokens):
            if i and self.config.token_delay_s > 0:
                await asyncio.sleep(self.config.token_delay_s)
            finish = b'"length"' if i == max_tokens - 1 else b"null"
            await send(
                {
                    "type": "http.response.body",
                    "body": head + finish + b"}]}\n\n",
                    "more_body": True,
                }
            )
        tail = b""
        if (body.get("stream_options") or {}).get("include_usage"):
            tail = (
                b'data: {"id":"cmpl-fake","choices":[],"usage":'
                + json.dumps(usage).encode()
                + b"}\n\n"
            )
        last = tail + b"data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": last, "more_body": False})

    async def _pull(self, params: dict[str, Any], prompt: list[int]) -> tuple[bool, str]:
        """Ask the named prefiller for the transfer, as a decoder pulls KV from it."""
        import httpx

        url = f"{params['remote_bootstrap_addr'].rstrip('/')}/kv/{params['transfer_id']}"
        async with httpx.AsyncClient(timeout=self.config.kv_wait_s + 5, trust_env=False) as c:
            try:
                resp = await c.get(url, params={"engine_id": params["remote_engine_id"]})
            except httpx.HTTPError as exc:
                return False, f"KV pull from {url} failed: {type(exc).__name__}"
        if resp.status_code != 200:
            return False, f"KV pull from {url}: {resp.status_code} {resp.text}"
        data = resp.json()
        if data.get("prompt") != prompt[: len(data.get("prompt") or [])]:
            return False, "pulled KV does not match the decode prompt's prefix"
        return True, ""

    async def _serve_kv(self, transfer_id: str, send: Send) -> None:
        """Hand a finished prefill's KV to a decoder (waits for the prefill, like vLLM)."""
        transfer = self.transfers.setdefault(transfer_id, _Transfer([]))
        try:
            await asyncio.wait_for(transfer.done.wait(), self.config.kv_wait_s)
        except TimeoutError:
            await _respond_json(send, 404, {"error": f"no prefill for {transfer_id}"})
            return
        transfer.pulled = True
        await _respond_json(
            send, 200, {"engine_id": self.config.engine_id, "prompt": transfer.prompt}
        )

    def metrics_text(self) -> str:
        """Prometheus text with vLLM's metric names (a subset)."""
        c = self.counters
        label = f'{{engine="0",model_name="{self.config.model}"}}'
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{label} {float(self.running)}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{label} 0.0",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{label} {min(1.0, len(self.cache) / 10000):.6f}",
        ]
        for name in (
            "prefix_cache_queries",
            "prefix_cache_hits",
            "external_prefix_cache_queries",
            "external_prefix_cache_hits",
        ):
            lines += [f"# TYPE vllm:{name}_total counter", f"vllm:{name}_total{label} {c[name]}"]
        lines.append("# TYPE vllm:prompt_tokens_by_source_total counter")
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
            lines.append(
                f'vllm:prompt_tokens_by_source_total{{engine="0",model_name="{self.config.model}",'
                f'source="{source}"}} {c[source]}'
            )
        prompt = c["local_compute"] + c["local_cache_hit"] + c["external_kv_transfer"]
        lines += [
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{label} {prompt}",
        ]
        for name, key in (
            ("nixl_bytes_transferred", "nixl_bytes"),
            ("nixl_xfer_time_seconds", "nixl_xfer_s"),
        ):
            lines += [
                f"# TYPE vllm:{name} histogram",
                f"vllm:{name}_count{label} {c['nixl_xfers']}",
                f"vllm:{name}_sum{label} {c[key]}",
            ]
        lines += [
            "# TYPE vllm:time_to_first_token_seconds histogram",
            (
                f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",'
                f'model_name="{self.config.model}"}} {c["ttft_count"]}'
            ),
            f"vllm:time_to_first_token_seconds_count{label} {c['ttft_count']}",
            f"vllm:time_to_first_token_seconds_sum{label} {c['ttft_sum']}",
        ]  # fmt: skip
        return "\n".join(lines) + "\n"


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        msg = await receive()
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(chunks)


async def _respond(send: Send, status: int, body: bytes, ctype: str = "text/plain") -> None:
    headers = [(b"content-type", ctype.encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _respond_json(send: Send, status: int, body: Any) -> None:
    await _respond(send, status, json.dumps(body).encode(), "application/json")


@contextlib.contextmanager
def serve_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve an ASGI app on a background thread; yields its base URL."""
    import uvicorn

    from btb_lab.cluster.launcher import free_port

    port = port or free_port(host)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", lifespan="off", access_log=False
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"fake server on port {port} failed to start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join()


def main(argv: list[str] | None = None) -> None:
    """`python -m btb_lab.cluster.fake_server --port P`: a separate process for the bench
    (so the fake gets its own core)."""
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-delay-s", type=float, default=0.0)
    parser.add_argument("--stall-s", type=float, default=0.0)
    parser.add_argument("--engine-id", default="engine-fake")
    args = parser.parse_args(argv)
    app = FakeVLLM(
        FakeConfig(token_delay_s=args.token_delay_s, stall_s=args.stall_s, engine_id=args.engine_id)
    )
    loop = "uvloop" if _has("uvloop") else "asyncio"
    http = "httptools" if _has("httptools") else "h11"
    uvicorn.run(
        app, host=args.host, port=args.port, log_level="warning", access_log=False,
        lifespan="off", loop=loop, http=http,
    )  # fmt: skip


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    main()
