"""Figures to PNG files: the Agg backend, and bytes rendered in memory without timestamps
(re-rendering gives the same file) and written atomically. Shared by the report's plots
and its timeline."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from btb_lab.report.forked import Forked, Warm

__all__ = ["META", "pyplot", "save", "stop_drawing"]

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


def stop_drawing(child: Forked | Warm | None, plots_dir: Path) -> None:
    """Stop a drawing child (this process's drawing failed or was stopped, or the run
    was); a figure it was writing goes with it: `write_atomic` renames each one into
    place only once it is whole, and the temporary file it leaves is removed here."""
    if child is not None and child.close() and plots_dir.is_dir():
        for tmp in plots_dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
