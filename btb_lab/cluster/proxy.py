"""`btb-lab router serve`: the in-process router exposed as an OpenAI-compatible proxy
(`/v1/completions` with streaming passthrough), so external load tools can drive a
hypothesis variant's policy against real instances. Binds 127.0.0.1 by default. A body's
`metadata.job_kind` becomes the request's job kind for the policy and is not forwarded.

What it refuses: a malformed request (not JSON, not an object, a bad `prompt`,
`max_tokens` or `user`) gets 400 with a message, a body over MAX_BODY_BYTES gets 413
before it is parsed; an instance that refuses connections is routed around.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from btb_lab.cluster.driver import ClientPool, RunClock
from btb_lab.cluster.launcher import Endpoint
from btb_lab.cluster.router import Router
from btb_lab.records import Request

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request as HttpRequest

__all__ = [
    "MAX_BODY_BYTES",
    "BadRequest",
    "UpstreamHealth",
    "build_proxy_app",
    "make_router",
    "parse_completion",
    "prompt_block_hashes",
]


def prompt_block_hashes(prompt: Sequence[int] | str, block_tokens: int) -> tuple[int, ...]:
    """Chained blake2b ids of the prompt's full blocks (token ids; for text, blocks of
    4·block_tokens characters), so equal prefixes get equal leading ids."""
    if isinstance(prompt, str):
        step = 4 * block_tokens
        pieces = [prompt[i : i + step].encode() for i in range(0, len(prompt) - step + 1, step)]
    else:
        pieces = [
            json.dumps(list(prompt[i : i + block_tokens])).encode()
            for i in range(0, len(prompt) - block_tokens + 1, block_tokens)
        ]
    out = []
    h = hashlib.blake2b(digest_size=8)
    for piece in pieces:
        h.update(piece)
        out.append(int.from_bytes(h.copy().digest(), "big") >> 1)
    return tuple(out)


# A request body larger than this is refused with 413 before it is parsed: a one-million-
# token prompt sent as token ids is about 7 MB of JSON, so 16 MiB leaves room for any real
# prompt while a 100 MB body can never stall the event loop (and /health) while it parses.
MAX_BODY_BYTES = 16 * 2**20
# After a failed connection an upstream is skipped this long, then tried again.
RETRY_AFTER_S = 5.0


class BadRequest(Exception):
    """A malformed completion request: answered 400 (or `status`) with this message."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class UpstreamHealth:
    """Which instances the proxy may send to: one that refused a connection is skipped for
    `retry_after_s` (the policy's choice is then routed around it), and every failure is
    counted, so a dead instance costs one failed attempt per period, not half the traffic."""

    names: list[str]
    retry_after_s: float = RETRY_AFTER_S
    clock: Callable[[], float] = time.monotonic
    failures: list[int] = field(default_factory=list)
    down_until: list[float] = field(default_factory=list)
    failovers: int = 0
    dropped_streams: int = 0  # answers an upstream cut after its status went out
    offloads_not_split: int = 0  # the proxy runs an offload decision on its decode instance

    def __post_init__(self) -> None:
        self.failures = [0] * len(self.names)
        self.down_until = [-math.inf] * len(self.names)

    def usable(self, instance: int) -> bool:
        return self.clock() >= self.down_until[instance]

    def failed(self, instance: int) -> None:
        self.failures[instance] += 1
        self.down_until[instance] = self.clock() + self.retry_after_s

    def succeeded(self, instance: int) -> None:
        self.down_until[instance] = -math.inf

    def alternative(self, instance: int, router: Router, tried: set[int]) -> int | None:
        """The healthy instance to use instead: same role first, then the least loaded."""
        loads = router.state.instances
        role = router.endpoints[instance].role
        candidates = [
            i for i in range(len(self.names)) if i not in tried and i != instance and self.usable(i)
        ]
        if not candidates:
            return None
        return min(
            candidates,
            key=lambda i: (
                router.endpoints[i].role != role,
                loads[i].running,
                loads[i].outstanding_tokens,
                i,
            ),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "instances": [
                {"name": name, "healthy": self.usable(i), "failures": self.failures[i]}
                for i, name in enumerate(self.names)
            ],
            "failovers": self.failovers,
            "dropped_streams": self.dropped_streams,
            "offloads_not_split": self.offloads_not_split,
        }


def parse_completion(raw: bytes) -> tuple[dict[str, Any], list[int] | str, int, str | None]:
    """(body, prompt, max_tokens, user) of a `/v1/completions` request, or `BadRequest`."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("'prompt' is required")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        raise BadRequest("batched prompts are not supported")
    if isinstance(prompt, list):
        if not all(type(t) is int and t >= 0 for t in prompt):
            raise BadRequest("'prompt' must be a string or a list of token ids (integers ≥ 0)")
    elif not isinstance(prompt, str):
        raise BadRequest("'prompt' must be a string or a list of token ids (integers ≥ 0)")
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = 16
    elif type(max_tokens) is not int or max_tokens < 1:
        raise BadRequest(f"'max_tokens' must be an integer ≥ 1, got {max_tokens!r}")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest("'user' must be a string")
    return body, prompt, max_tokens, user


async def _read_body(http: HttpRequest, limit: int) -> bytes:
    declared = http.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise BadRequest(f"request body over {limit:,} bytes", status=413)
        except ValueError:
            raise BadRequest("bad Content-Length") from None
    chunks: list[bytes] = []
    size = 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"request body over {limit:,} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


# a relayed event stream holds back at most this much of an event not yet whole
MAX_HELD_EVENT_BYTES = 1 << 20


def _events_end(data: bytes) -> int:
    """Where the whole events in `data` end (after the last blank line, in any of SSE's
    line endings), or 0; past MAX_HELD_EVENT_BYTES without one, all of it."""
    seps = (b"\n\n", b"\r\r", b"\r\n\r\n")
    end = max((i + len(sep) for sep in seps if (i := data.rfind(sep)) >= 0), default=0)
    if not end and len(data) > MAX_HELD_EVENT_BYTES:
        return len(data)
    return end


def build_proxy_app(
    router: Router,
    *,
    block_tokens: int,
    max_body_bytes: int = MAX_BODY_BYTES,
    retry_after_s: float = RETRY_AFTER_S,
    clock: Callable[[], float] = time.monotonic,
) -> Starlette:
    """A Starlette app that routes each completion with `router`'s policy and streams
    the chosen instance's answer back unchanged. A malformed request is a 400 with a
    message, a body over `max_body_bytes` a 413; an instance that refuses connections
    is routed around for `retry_after_s` (its failures counted in /router/state)."""
    import httpx
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    ids = itertools.count()
    pool: ClientPool = router.client
    health = UpstreamHealth(
        [e.name for e in router.endpoints], retry_after_s=retry_after_s, clock=clock
    )

    async def completions(http: HttpRequest) -> Response:
        try:
            raw = await _read_body(http, max_body_bytes)
            body, prompt, max_tokens, user = parse_completion(raw)
        except BadRequest as exc:
            return JSONResponse({"error": str(exc)}, status_code=exc.status)
        n_in = len(prompt) if isinstance(prompt, list) else max(1, len(prompt) // 4)
        # the router's own metadata (`{"job_kind": ...}`, a hint for btb_hint) stops here
        metadata = body.pop("metadata", None)
        job_kind = metadata.get("job_kind") if isinstance(metadata, dict) else None
        if metadata is not None:  # forward the body without it
            raw = json.dumps(body).encode()
        req = Request(
            request_id=f"proxy-{next(ids)}",
            arrival_s=router.clock.now(),
            input_tokens=n_in,
            output_tokens=max_tokens,
            block_hashes=prompt_block_hashes(prompt, block_tokens),
            block_tokens=block_tokens,
            session_id=user,
            job_kind=job_kind if isinstance(job_kind, str) and job_kind else None,
        )
        decision = router.policy.route(req, router.state)
        if isinstance(prompt, list):
            for action in decision.warm:
                router.start_warm(action, req, list(prompt))
        tokens = req.input_tokens + req.output_tokens
        inst, route = decision.instance, decision.route
        tried: set[int] = set()
        while True:
            if not health.usable(inst) or inst in tried:
                alternative = health.alternative(inst, router, tried)
                if alternative is None:
                    router.policy.on_finish(req, inst, router.clock.now())
                    return JSONResponse(
                        {"error": "no healthy upstream", "health": health.as_dict()},
                        status_code=502,
                    )
                inst, route = alternative, f"{decision.route}+failover"
                health.failovers += 1
            tried.add(inst)
            url = router.endpoints[inst].base_url + http.url.path
            router.state.begin(inst, tokens, req.block_hashes)
            shard = pool.lease()
            client = pool.clients[shard]
            upstream = client.build_request(
                "POST", url, content=raw, headers={"content-type": "application/json"}
            )
            try:
                resp = await client.send(upstream, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout):  # never reached it: go on
                router.state.end(inst, tokens)
                pool.release(shard)
                health.failed(inst)
                continue
            except Exception as exc:
                router.state.end(inst, tokens)
                pool.release(shard)
                health.failed(inst)
                router.policy.on_finish(req, inst, router.clock.now())
                return JSONResponse({"error": f"upstream {type(exc).__name__}"}, status_code=502)
            health.succeeded(inst)
            break
        chosen = inst
        router.count_route(route, chosen)
        if decision.prefill_instance not in (None, chosen):
            health.offloads_not_split += 1
        # a plain event stream is relayed whole events at a time, so a cut upstream
        # leaves no half event before the error event that ends it
        event_stream = "text/event-stream" in resp.headers.get(
            "content-type", ""
        ) and not resp.headers.get("content-encoding")

        async def relay() -> AsyncIterator[bytes]:
            first = True
            held = b""  # an event stream's bytes past its last complete event
            try:
                async for chunk in resp.aiter_raw():
                    if first:
                        router.state.prefilled(chosen, req.block_hashes)
                        first = False
                    if event_stream:
                        held += chunk
                        end = _events_end(held)
                        if not end:
                            continue
                        chunk, held = held[:end], held[end:]
                    yield chunk
                if held:
                    yield held
            except httpx.HTTPError as exc:
                # the status went out already: end an event stream with an error event (as
                # vLLM's own mid-stream errors) rather than cut it and log a traceback
                health.failed(chosen)
                health.dropped_streams += 1
                if not event_stream:
                    raise  # any other body is cut: the client must not read it as whole
                message = f"upstream {router.endpoints[chosen].name}: {type(exc).__name__}"
                error = {"error": {"message": message, "type": "upstream_error"}}
                yield b"data: " + json.dumps(error).encode() + b"\n\n"
            finally:
                await resp.aclose()
                router.state.end(chosen, tokens)
                pool.release(shard)
                router.policy.on_finish(req, chosen, router.clock.now())

        headers = {"x-btb-instance": router.endpoints[chosen].name, "x-btb-route": route}
        return StreamingResponse(
            relay(),
            status_code=resp.status_code,
            media_type=resp.headers.get("content-type"),
            headers=headers,
        )

    async def models(http: HttpRequest) -> Response:
        healthy = [i for i in range(len(router.endpoints)) if health.usable(i)] or [0]
        try:
            resp = await pool.get(router.endpoints[healthy[0]].base_url + "/v1/models")
        except Exception as exc:
            health.failed(healthy[0])
            return JSONResponse({"error": f"upstream {type(exc).__name__}"}, status_code=502)
        return Response(resp.content, resp.status_code, media_type="application/json")

    async def health_check(http: HttpRequest) -> Response:
        return Response(b"", 200)

    async def state(http: HttpRequest) -> Response:
        """The router's view (for debugging a policy against live traffic)."""
        return JSONResponse(
            {
                "instances": [
                    {"name": i.name, "role": i.role, "in_flight": i.running,
                     "outstanding_tokens": i.outstanding_tokens}
                    for i in router.state.instances
                ],
                "stats": router.stats.as_dict(),
                "health": health.as_dict(),
            }
        )  # fmt: skip

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health_check, methods=["GET"]),
            Route("/router/state", state, methods=["GET"]),
        ]
    )


def make_router(
    endpoints: list[Endpoint],
    policy: Any,
    costs: Any,
    *,
    client: ClientPool,
    model: str,
    connector: Any = "none",
) -> Router:
    """A Router for the proxy (prompts arrive as token ids; no workload prompts). Warm
    copies go through `connector` (a KVConnector spec or a type name)."""
    return Router(
        endpoints, policy, costs, client=client, clock=RunClock(), model=model,
        prompt_fn=lambda r: [], variant="proxy", connector=connector,
    )  # fmt: skip
