"""Page rows of a Hugging Face dataset into a local JSONL trace, resumably.

Uses the datasets-server `/rows` API (at most 100 rows per page). Rows are written one
JSON object per line exactly as the dataset holds them (Bursted-ART and ART-Chat rows are
already in their loader's schema). Rerunning the same command appends after the complete
rows already in the file, so an interrupted download continues where it stopped; the
file's last row is first compared with the source's row at that place, so a file holding
another dataset, split or offset is refused instead of mixed into.
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
    """Complete rows in `path` (a torn last line, an interrupted write, does not count)."""
    return _resumable(path)[0]


def _resumable(path: Path) -> tuple[int, int, dict[str, Any] | None]:
    """(complete rows, bytes they take, the last of them) of an earlier fetch into `path`;
    nothing is changed here: a torn last line is cut only once new rows arrive. A file
    that is not rows of JSON objects (a parquet trace, notes) is refused, never cut."""
    if not path.exists():
        return 0, 0, None
    if not path.is_file():
        raise UserError(f"{path}: not a file; fetch into a new JSONL file")
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    lines = [line for line in data[:keep].splitlines() if line.strip()]
    row: Any = None
    for line in lines[:1] + lines[-1:]:
        try:
            row = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError):
            row = None
        if not isinstance(row, dict):
            raise UserError(
                f"{path}: exists and is not rows of JSON objects (an earlier fetch to "
                "resume); fetch into a new file"
            )
    if data[keep:].strip() and not lines:
        raise UserError(f"{path}: exists and holds no complete row; fetch into a new file")
    return len(lines), keep, row


def _check_same_source(
    client: httpx.Client, dataset: str, config: str, split: str, index: int,
    last: dict[str, Any], path: Path,
) -> None:  # fmt: skip
    """A resumed fetch continues the same rows: the file's last row must be row `index`
    of this dataset, config and split (another source's rows, or another `--offset`,
    would be mixed into one trace without a word)."""
    page = _get_page(client, dataset, config, split, index, 1)
    rows = [item.get("row") for item in page.get("rows", [])]
    if rows[:1] != [last]:
        raise UserError(
            f"{path}: its last row is not row {index} of {dataset} (config {config!r}, "
            f"split {split!r}): it holds another fetch (another dataset, split or "
            "--offset); fetch into a new file, or resume with that fetch's options"
        )


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
    existing, keep, last = _resumable(out)
    target = rows
    start = offset + existing
    if last is not None and (target is None or existing < target):
        _check_same_source(client, dataset, config, split, start - 1, last, out)
    fetched = 0
    total: int | None = None
    handle: Any = None  # opened once the first page is in: a failed fetch changes nothing
    try:
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
            if page_items and handle is None:
                out.parent.mkdir(parents=True, exist_ok=True)
                if out.exists() and out.stat().st_size > keep:
                    with out.open("r+b") as torn:  # the interrupted write's torn last line
                        torn.truncate(keep)
                handle = out.open("a", encoding="utf-8")
            for item in page_items:
                handle.write(json.dumps(item["row"], separators=(",", ":")) + "\n")
            if handle is not None:
                handle.flush()
            fetched += len(page_items)
            if target is None and total is not None:
                target = max(0, total - offset)
            if on_progress is not None:
                on_progress(existing + fetched, target)
            if not page_items or (total is not None and start + fetched >= total):
                break
    finally:
        if handle is not None:
            handle.close()
    return FetchResult(out, existing, fetched, total)
