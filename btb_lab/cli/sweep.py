"""`btb-lab sweep` command."""

from __future__ import annotations

import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    """Add the sweep command to the main app."""
    return None
