"""`btb-lab router serve`: the in-process router exposed as an OpenAI-compatible proxy
(`/v1/completions` with streaming passthrough), so external load tools can drive a
hypothesis variant's policy against real instances. Binds 127.0.0.1 by default. A body's
`metadata.job_kind` becomes the request's job kind for the policy and is not forwarded.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from btb_lab.cluster.driver import ClientPool, RunClock
from btb_lab.cluster.launcher import Endpoint
from btb_lab.cluster.router import Router
from btb_lab.records import Request

if TYPE_CHECKING:
    from starlette.applications import Starlette

__all__ = ["build_proxy_app", "make_router", "prompt_block_hashes"]


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


def build_proxy_app(router: Router, *, block_tokens: int) -> Starlette:
    """A Starlette app that routes each completion with `router`'s policy and streams
    the chosen instance's answer back unchanged."""
    from starlette.applications import Starlette
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    ids = itertools.count()
    pool: ClientPool = router.client

    async def completions(http: HttpRequest) -> Response:
        body: dict[str, Any] = await http.json()
        prompt = body.get("prompt", [])
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            return JSONResponse({"error": "batched prompts are not supported"}, status_code=400)
        n_in = len(prompt) if isinstance(prompt, list) else max(1, len(prompt) // 4)
        # the router's own metadata (`{"job_kind": ...}`, a hint for btb_hint) stops here
        metadata = body.pop("metadata", None)
        job_kind = metadata.get("job_kind") if isinstance(metadata, dict) else None
        req = Request(
            request_id=f"proxy-{next(ids)}",
            arrival_s=router.clock.now(),
            input_tokens=n_in,
            output_tokens=int(body.get("max_tokens") or 16),
            block_hashes=prompt_block_hashes(prompt, block_tokens),
            block_tokens=block_tokens,
            session_id=body.get("user"),
            job_kind=job_kind if isinstance(job_kind, str) and job_kind else None,
        )
        decision = router.policy.route(req, router.state)
        inst = decision.instance
        if isinstance(prompt, list):
            for action in decision.warm:
                router.start_warm(action, req, list(prompt))
        tokens = req.input_tokens + req.output_tokens
        url = router.endpoints[inst].base_url + http.url.path
        router.state.begin(inst, tokens, req.block_hashes)
        shard = pool.lease()
        client = pool.clients[shard]
        upstream = client.build_request("POST", url, json=body)
        try:
            resp = await client.send(upstream, stream=True)
        except Exception as exc:
            router.state.end(inst, tokens)
            pool.release(shard)
            return JSONResponse({"error": f"upstream {type(exc).__name__}"}, status_code=502)

        async def relay() -> AsyncIterator[bytes]:
            first = True
            try:
                async for chunk in resp.aiter_raw():
                    if first:
                        router.state.prefilled(inst, req.block_hashes)
                        first = False
                    yield chunk
            finally:
                await resp.aclose()
                router.state.end(inst, tokens)
                pool.release(shard)
                router.policy.on_finish(req, inst, router.clock.now())

        headers = {"x-btb-instance": router.endpoints[inst].name, "x-btb-route": decision.route}
        return StreamingResponse(
            relay(),
            status_code=resp.status_code,
            media_type=resp.headers.get("content-type"),
            headers=headers,
        )

    async def models(http: HttpRequest) -> Response:
        resp = await pool.get(router.endpoints[0].base_url + "/v1/models")
        return Response(resp.content, resp.status_code, media_type="application/json")

    async def health(http: HttpRequest) -> Response:
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
            }
        )  # fmt: skip

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
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
