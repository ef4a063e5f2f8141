"""The shipped samples in experiments/workloads/ load, and their README commands remake them."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from btb_lab.cli import app
from btb_lab.config import WorkloadSpec
from btb_lab.workload import load_requests
from btb_lab.workload.audit import burst_audit

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "experiments" / "workloads"


def _readme_commands() -> list[list[str]]:
    text = (SAMPLES / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block is not None
    joined = block.group(1).replace("\\\n", " ")
    return [shlex.split(line)[1:] for line in joined.splitlines() if line.strip()]


@pytest.mark.parametrize("args", _readme_commands(), ids=lambda a: a[2])
def test_readme_command_reproduces_sample(args: list[str], tmp_path: Path) -> None:
    out_index = args.index("-o") + 1
    shipped = REPO / args[out_index]
    args = [*args[:out_index], str(tmp_path / shipped.name), *args[out_index + 1 :]]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert (tmp_path / shipped.name).read_bytes() == shipped.read_bytes()


def _burst_spread_s(time_scale: float) -> tuple[float, int]:
    spec = WorkloadSpec.model_validate(
        {
            "trace": {"path": "bursted_small.jsonl", "format": "bursted-art"},
            "time_scale": time_scale,
        }
    )
    requests = load_requests(spec, base_dir=SAMPLES, seed=0)
    assert len(requests) == 176
    assert {r.source for r in requests} == {"synthetic"}
    assert len({r.trace_id for r in requests}) == 2
    burst = [r.arrival_s for r in requests if r.group_id == "train-w000-burst0"]
    return max(burst) - min(burst), burst_audit(requests).deep.max_fanout


def test_bursted_sample_replays_with_time_scale() -> None:
    spread_s, fanout = _burst_spread_s(1.0)
    assert fanout == 50
    assert spread_s <= 8.0
    doubled_s, _ = _burst_spread_s(2.0)
    assert doubled_s == pytest.approx(2 * spread_s)
