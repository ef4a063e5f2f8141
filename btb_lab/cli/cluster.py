"""`btb-lab router ...` and `btb-lab model ...` commands (real clusters)."""

from __future__ import annotations

import typer

__all__ = ["model_app", "router_app"]

router_app = typer.Typer(help="The in-process router as an OpenAI-compatible proxy.", no_args_is_help=True)
model_app = typer.Typer(help="Local test models.", no_args_is_help=True)
