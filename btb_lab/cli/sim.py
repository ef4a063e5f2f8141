"""`btb-lab sim ...` commands: the cost table and the simulator benchmark."""

from __future__ import annotations

import json

import typer

__all__ = ["app"]

app = typer.Typer(help="Simulator commands: cost table, speed benchmark.", no_args_is_help=True)


def _fraction(value: float) -> float:
    # typer's range check let NaN through to "should be ≤ 1"; say what it is instead
    if not 0.01 <= value <= 1.0:  # False for NaN
        raise typer.BadParameter(f"{value} is not a number from 0.01 to 1")
    return value


@app.command("costs")
def costs(
    model: str = typer.Option("llama-3.3-70b", help="Model preset."),
    gpu: str = typer.Option("H100", help="GPU preset (A100, H100, H200, B200, B300, MI300X)."),
    gpus: int = typer.Option(4, min=1, help="GPUs per instance (tensor-parallel size)."),
    mfu: float = typer.Option(
        0.5, callback=_fraction, help="Model FLOP utilization, from 0.01 to 1."
    ),
    attention: bool = typer.Option(
        False,
        "--attention",
        help="Add a row with the prefill's attention term (costs.prefill_attention).",
    ),
) -> None:
    """Print milliseconds to make N tokens of KV resident: prefill vs disk/RDMA/RAM/HBM."""
    from btb_lab.model.hardware import make_instance, resolve_gpu, resolve_model
    from btb_lab.model.roofline import render_cost_table

    inst = make_instance(0, "C0", "C", resolve_gpu(gpu), gpus, resolve_model(model))
    typer.echo(render_cost_table(inst, mfu, attention=attention))


@app.command("bench")
def bench(
    requests: int = typer.Option(200_000, "--requests", min=1, help="Requests to replay."),
    repeats: int = typer.Option(3, min=1, help="Timed runs; the median is reported."),
    policy: str = typer.Option(
        "", help="Registered policy to route with (default: the built-in cache-aware rule)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Simulated requests/s and peak memory on a fixed, seeded workload (4 × 4×H100,
    llama-3.3-70b, at_admission, cache-aware routing)."""
    from dataclasses import asdict

    from btb_lab.sim.bench import run_bench

    result = run_bench(requests, repeats=repeats, policy=policy)
    if as_json:
        typer.echo(json.dumps(asdict(result)))
        return
    typer.echo(
        f"sim bench: {result.requests:,} requests, 4 × (4×H100) llama-3.3-70b, at_admission, "
        f"policy {result.policy}"
    )
    runs = ", ".join(f"{s:.2f}" for s in result.runs_s)
    typer.echo(f"  runs (s):          {runs}")
    typer.echo(f"  requests/s:        {result.requests_per_s:,.0f} (median of {repeats}, wall)")
    typer.echo(f"  requests/cpu-s:    {result.requests_per_cpu_s:,.0f} (median of {repeats})")
    typer.echo(f"  events:            {result.events:,}")
    typer.echo(f"  simulated time:    {result.simulated_s:,.0f} s")
    typer.echo(f"  peak RSS:          {result.peak_rss_bytes / 2**20:,.0f} MiB")
    typer.echo(f"  peak traced alloc: {result.peak_traced_bytes / 2**20:,.0f} MiB")
