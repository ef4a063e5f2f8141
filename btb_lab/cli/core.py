"""Core commands: validate, run, report, log, list."""

from __future__ import annotations

import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    """Add the core commands to the main app."""

    @app.command()
    def version() -> None:
        """Print the btb-lab version."""
        from btb_lab import __version__

        typer.echo(__version__)
