"""Page rows of a Hugging Face dataset into a local JSONL trace, resumably.

Uses the datasets-server `/rows` API (at most 100 rows per page). Rows are written one
JSON object per line exactly as the dataset holds them (Bursted-ART and ART-Chat rows are
already in their loader's schema). Rerunning the same command appends after the complete
rows already in the file, so an interrupted download continues where it stopped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from btb_lab.errors import UserError

if TYPE_CHECKING:
    import httpx

__all__ = ["DATASETS_SERVER", "PAGE_ROWS", "FetchResult", "count_complete_rows", "fetch_rows"]

DATASETS_SERVER = "https://datasets-server.huggingface.co"
PAGE_ROWS = 100  # the API's largest page


@dataclass(frozen=True)
class FetchResult:
    """What a fetch did: rows already present, rows added, and the split's total."""

    path: Path
    existing_rows: int
    fetched_rows: int
    total_rows: int | None

    @property
    def rows_in_file(self) -> int:
        return self.existing_rows + self.fetched_rows


def count_complete_rows(path: Path) -> int:
    """Complete lines in `path`; a torn last line (interrupted write) is cut off."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with path.open("r+b") as handle:
            handle.truncate(cut)
        data = data[:cut]
    return sum(1 for line in data.splitlines() if line.strip())


def _get_page(
    client: httpx.Client, dataset: str, config: str, split: str, offset: int, length: int
) -> dict[str, Any]:
    import httpx

    params: dict[str, str | int] = {
        "dataset": dataset,
        "config": config,
        "split": split,
        "offset": offset,
        "length": length,
    }
    try:
        response = client.get(f"{DATASETS_SERVER}/rows", params=params)
    except httpx.TransportError as exc:
        raise UserError(
            f"cannot reach {DATASETS_SERVER} ({type(exc).__name__}: {exc}); are you "
            "offline? rows fetched so far are kept, rerun to resume"
        ) from None
    if response.status_code != 200:
        try:
            detail = response.json().get("error", response.text)
        except ValueError:
            detail = response.text
        raise UserError(
            f"datasets-server answered {response.status_code} for {dataset} "
            f"(config {config!r}, split {split!r}, offset {offset}): {str(detail)[:200]}"
        )
    payload: dict[str, Any] = response.json()
    return payload


def fetch_rows(
    dataset: str,
    out: Path,
    *,
    client: httpx.Client,
    split: str = "train",
    config: str = "default",
    rows: int | None = None,
    offset: int = 0,
    page_rows: int = PAGE_ROWS,
    on_progress: Callable[[int, int | None], None] | None = None,
) -> FetchResult:
    """Fetch rows `[offset, offset + rows)` (all remaining rows if `rows` is None).

    Resumes: rows already complete in `out` count as fetched, so paging starts after
    them. `on_progress(rows_in_file, target_rows)` is called after every page.
    """
    existing = count_complete_rows(out)
    target = rows
    start = offset + existing
    fetched = 0
    total: int | None = None
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a", encoding="utf-8") as handle:
        while target is None or existing + fetched < target:
            want = page_rows if target is None else min(page_rows, target - existing - fetched)
            page = _get_page(client, dataset, config, split, start + fetched, want)
            total = page.get("num_rows_total", total)
            page_items = page.get("rows", [])
            for item in page_items:
                if item.get("truncated_cells"):
                    raise UserError(
                        f"row {item.get('row_idx')} of {dataset} came back truncated "
                        f"({', '.join(item['truncated_cells'])}); download the parquet files "
                        "instead"
                    )
                handle.write(json.dumps(item["row"], separators=(",", ":")) + "\n")
            handle.flush()
            fetched += len(page_items)
            if target is None and total is not None:
                target = max(0, total - offset)
            if on_progress is not None:
                on_progress(existing + fetched, target)
            if not page_items or (total is not None and start + fetched >= total):
                break
    return FetchResult(out, existing, fetched, total)
