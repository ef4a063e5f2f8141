"""`btb-lab router ...` and `btb-lab model ...` commands (real clusters)."""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path

import typer

__all__ = ["model_app", "router_app"]

router_app = typer.Typer(
    help="The in-process router as an OpenAI-compatible proxy.", no_args_is_help=True
)
model_app = typer.Typer(help="Local test models.", no_args_is_help=True)


@router_app.command("serve")
def serve(
    hypothesis: Path = typer.Option(..., "--hypothesis", help="Hypothesis YAML file."),
    variant: str = typer.Option(..., "--variant", help="Variant whose policy routes."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="Port of the proxy."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address the proxy binds to."),
) -> None:
    """Launch (or attach to) the hypothesis's instances and serve the variant's router
    on /v1/completions until Ctrl-C; instances stop on exit."""
    import uvicorn

    from btb_lab.cluster.backend import make_client, resolve_served_model
    from btb_lab.cluster.launcher import (
        Launcher,
        http_url,
        plan_endpoints,
        plan_instances,
        sigterm_raises,
    )
    from btb_lab.cluster.proxy import build_proxy_app, make_router
    from btb_lab.config.variants import resolve_variant
    from btb_lab.errors import UserError
    from btb_lab.hypothesis.loader import load_hypothesis
    from btb_lab.model.costmodel import build_cost_model
    from btb_lab.policies import build_policy

    loaded = load_hypothesis(hypothesis)
    if variant not in loaded.hypothesis.variants:
        names = ", ".join(loaded.hypothesis.variants)
        raise UserError(f"{hypothesis}: no variant {variant!r}; variants: {names}")
    hyp = resolve_variant(loaded.hypothesis, variant)
    launch = hyp.cluster.launch
    model = resolve_served_model(hyp)
    spec = hyp.variants[variant].router
    policy = build_policy(spec.policy, spec.params, seed=hyp.seed)
    # Bind before launching anything: a port in use is one clear error, not a bind
    # failure after the instances started and the router said where it listens.
    sock = _listen(host, port)
    if not _loopback(sock):
        typer.echo(
            f"warning: the router listens on {host}, reachable from other machines; it has "
            "no authentication (the default --host 127.0.0.1 keeps it on this machine)",
            err=True,
        )
    with (
        sock,
        sigterm_raises(),
        Launcher(
            Path("results") / "router-serve" / "instances",
            ready_timeout_s=launch.ready_timeout_s,
            stop_grace_s=launch.stop_grace_s,
        ) as launcher,
    ):
        if launch.endpoints:
            endpoints = plan_endpoints(hyp.cluster)
        else:
            specs = plan_instances(hyp.cluster, model=model, block_tokens=hyp.workload.block_tokens)
            endpoints = launcher.start(specs)
        client = make_client(
            request_timeout_s=launch.request_timeout_s,
            connect_timeout_s=launch.connect_timeout_s,
            max_connections=launch.max_connections,
        )
        router = make_router(
            endpoints, policy, build_cost_model(hyp, loaded.base_dir), client=client,
            model=model, connector=hyp.cluster.kv_connector,
        )  # fmt: skip
        app = build_proxy_app(router, block_tokens=hyp.workload.block_tokens)
        for ep in endpoints:
            typer.echo(f"{ep.name} ({ep.role}) {ep.base_url}")
        typer.echo(f"router ({spec.policy}) on {http_url(host, port)}/v1/completions")
        # the app has no startup or shutdown work: without the lifespan task, a Ctrl-C
        # as the server starts has nothing to cancel (uvicorn logged its CancelledError)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        server.run(sockets=[sock])


def _listen(host: str, port: int) -> socket.socket:
    """A bound socket for the proxy (a UserError naming host and port when it is taken)."""
    from btb_lab.errors import UserError

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise UserError(f"--host {host}: {exc.strerror or exc}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def _loopback(sock: socket.socket) -> bool:
    """Whether the bound socket is reachable from this machine only."""
    import ipaddress

    address = ipaddress.ip_address(sock.getsockname()[0].split("%")[0])
    return address.is_loopback


BENCH_MAX_S = 600  # the longest `router bench` (its requests at its rate)


@router_app.command("bench")
def bench(
    requests: int = typer.Option(3000, "--requests", help="Requests to send."),
    rate: float = typer.Option(600.0, "--rate", help="Target arrival rate (requests/s)."),
    output_tokens: int = typer.Option(4, "--output-tokens", help="Tokens per response."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Drive a local fast fake OpenAI server with short requests; report the sustained
    rate and the driver's send lag (target ≥ 500 req/s with p99 lag < 5 ms)."""
    from btb_lab.cluster.bench import run_bench
    from btb_lab.errors import UserError

    if not 1 <= requests <= 1_000_000:
        raise UserError(f"--requests must be 1 to 1,000,000 (got {requests})")
    if not 1 <= output_tokens <= 4096:
        raise UserError(f"--output-tokens must be 1 to 4,096 (got {output_tokens})")
    if not (math.isfinite(rate) and rate > 0):
        raise UserError(f"--rate must be a finite number of requests/s > 0 (got {rate:g})")
    if requests / rate > BENCH_MAX_S:
        raise UserError(
            f"--requests {requests} at --rate {rate:g}/s would take {requests / rate:,.0f} s; "
            f"the bench runs at most {BENCH_MAX_S} s"
        )
    result = run_bench(requests=requests, rate_rps=rate, output_tokens=output_tokens)
    if as_json:
        typer.echo(json.dumps(result.as_dict()))
        return
    typer.echo(
        f"load driver ({result.loop}): {result.requests} requests at {result.target_rate_rps:g}/s "
        f"target → sustained {result.sustained_rps:.1f} req/s, ok {result.ok}; send lag "
        f"p50 {result.lag_p50_ms:.2f} ms, p99 {result.lag_p99_ms:.2f} ms, "
        f"max {result.lag_max_ms:.2f} ms"
    )


@model_app.command("make-tiny")
def make_tiny(
    out_dir: Path = typer.Argument(..., help="Folder to write the model into."),
    vocab_size: int = typer.Option(1024, "--vocab-size", help="Tokenizer vocabulary size."),
    seed: int = typer.Option(0, "--seed", help="Seed of weights and tokenizer corpus."),
) -> None:
    """Write a tiny random-weight Llama (hidden 256, 4 heads, 2 KV heads, 2 layers) and a
    byte-level BPE tokenizer, made locally without downloads."""
    from btb_lab.cluster.tiny_model import make_tiny_llama

    path = make_tiny_llama(out_dir, vocab_size=vocab_size, seed=seed)
    typer.echo(str(path))
