"""Golden headline numbers of every shipped simulator hypothesis, run as shipped.

Each hypothesis in hypotheses/ whose backend is `sim` runs in full; its verdict, the
primary comparison, a few headline metrics per variant and a digest of its records
(requests.parquet, every column but `extra`, floats at full precision) are compared with
tests/golden/headlines.json. A deliberate change of the simulator, a policy or a workload
generator changes them: regenerate with `make golden` (BTB_UPDATE_GOLDEN=1) and say in the
commit why the numbers moved. The structural checks run in update mode too.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

from btb_lab.analysis.models import Summary
from btb_lab.records import STORED_COLUMNS
from btb_lab.results import Manifest
from btb_lab.runner import RunOptions, run_hypothesis

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("headlines.json")
UPDATE = os.environ.get("BTB_UPDATE_GOLDEN") == "1"
METRICS = ("ttft_p50", "ttft_p90", "ttft_mean", "tpot_p90", "e2e_p50")


def shipped_sim_hypotheses() -> list[Path]:
    out = []
    for path in sorted((ROOT / "hypotheses").glob("*.yaml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and data.get("backend", "sim") == "sim":
            out.append(path)
    return out


def records_digest(run_dir: Path) -> str:
    frame = pd.read_parquet(run_dir / "requests.parquet")
    text = frame[list(STORED_COLUMNS)].to_csv(index=False, float_format="%.17g")
    return hashlib.sha256(text.encode()).hexdigest()


def headline(run_dir: Path) -> dict[str, Any]:
    summary = Summary.load(run_dir)
    verdict = summary.verdict
    variants = {}
    for name, v in summary.variants.items():
        variants[name] = {"n": v.all.n, "ok": v.all.ok, "gpu_imbalance": v.gpu.imbalance}
        variants[name].update({m: v.all.value(m) for m in METRICS})
    primaries = {
        name: None
        if vv.primary is None
        else {"change": vv.primary.change, "ci_low": vv.primary.ci_low,
              "ci_high": vv.primary.ci_high, "outcome": vv.primary.outcome}
        for name, vv in verdict.variants.items()
    }  # fmt: skip
    return {
        "verdict": verdict.word,
        "reason": verdict.reason,
        "primary": primaries,
        "variants": variants,
        "records_sha256": records_digest(run_dir),
    }


def close(a: Any, b: Any, path: str = "") -> list[str]:
    """Differences between two JSON-like values; floats equal to 1e-9 relative."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                out.append(f"{path}.{key}: only in {'golden' if key in a else 'this run'}")
            else:
                out += close(a[key], b[key], f"{path}.{key}")
        return out
    if isinstance(a, float) and isinstance(b, float):
        return [] if math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15) else [f"{path}: {a} → {b}"]
    return [] if a == b else [f"{path}: {a!r} → {b!r}"]


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text(encoding="utf-8")) if GOLDEN.is_file() else {}


@pytest.mark.parametrize("path", shipped_sim_hypotheses(), ids=lambda p: p.stem)
def test_headline_numbers_are_pinned(path: Path, tmp_path: Path, golden: dict[str, Any]) -> None:
    outcome = run_hypothesis(path, RunOptions(out=tmp_path / "run", progress=False))
    run_dir = outcome.run_dir
    manifest = Manifest.load(run_dir)
    # structural invariants, checked in update mode too
    assert manifest.complete
    assert all(r.status == "ok" for r in manifest.runs)
    frame = pd.read_parquet(run_dir / "requests.parquet")
    per_run = frame.groupby(["variant", "repeat"])["request_id"]
    assert (per_run.nunique() == per_run.size()).all()  # no request twice
    sizes = frame.groupby(["variant", "repeat"]).size().to_dict()
    assert sizes == {(r.variant, r.repeat): r.requests for r in manifest.runs}  # none lost
    got = headline(run_dir)
    assert got["reason"]
    if UPDATE:
        data = json.loads(GOLDEN.read_text(encoding="utf-8")) if GOLDEN.is_file() else {}
        data[path.stem] = got
        GOLDEN.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        return
    assert path.stem in golden, f"no golden numbers for {path.name}: run `make golden`"
    diffs = close(golden[path.stem], got)
    assert not diffs, f"{path.name} moved (`make golden` if deliberate):\n" + "\n".join(diffs)
