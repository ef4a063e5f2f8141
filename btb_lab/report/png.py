"""Figures to PNG files: the Agg backend, and bytes rendered in memory without timestamps
(re-rendering gives the same file) and written atomically. Shared by the report's plots
and its timeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["META", "pyplot", "remove_partial", "save"]

META = {"Software": None}
# zlib level 1: about a third of level 6's encoding time for files about 15% larger
PNG = {"compress_level": 1}


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path, dpi: int = 100, *, close: bool = True) -> None:
    """PNG bytes rendered in memory, then written atomically (a full disk or a kill never
    leaves half an image); the figure is closed unless it is drawn again (`close`)."""
    import io

    from matplotlib.layout_engine import PlaceHolderLayoutEngine

    from btb_lab.results import write_atomic

    # tight_layout() leaves a do-nothing placeholder engine, and savefig runs a whole extra
    # draw before the real one when a figure has any engine: the layout is done, drop it
    if isinstance(fig.get_layout_engine(), PlaceHolderLayoutEngine):
        fig.set_layout_engine(None)
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=dpi, metadata=META, pil_kwargs=PNG)
    except BaseException:
        pyplot().close(fig)
        raise
    if close:
        pyplot().close(fig)
    write_atomic(path, buffer.getvalue())


def remove_partial(plots_dir: Path) -> None:
    """Remove the temporary files of figures a drawing child was writing when it was
    stopped (`write_atomic` renames each one into place only once it is whole)."""
    if plots_dir.is_dir():
        for tmp in plots_dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
