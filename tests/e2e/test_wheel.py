"""An installed (non-editable) btb-lab works: build the wheel, install it into a fresh
virtual environment, run the demo hypothesis there and render its report. Templates and
every other package file must travel inside the wheel for this to pass.

The fresh environment gets btb-lab from the wheel only; its third-party dependencies are
borrowed from the project's environment through a `.pth` path entry (so the test needs
no network), which does not make the project's editable install visible to it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)


def test_wheel_installs_and_renders_a_report(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    built = run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "-w", str(dist), str(ROOT)],
        cwd=tmp_path,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = dist.glob("btb_lab-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "btb_lab/report/templates/report.md.j2" in names
    assert "btb_lab/py.typed" in names
    assert {"btb_lab/sim/_cachec.pyi", "btb_lab/workload/_hashc.pyi"} <= set(names)

    venv = tmp_path / "venv"
    made = run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    installed = run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", str(wheel)],
        cwd=tmp_path,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stdout + installed.stderr
    purelib = run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                  cwd=tmp_path).stdout.strip()  # fmt: skip
    (Path(purelib) / "project_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")

    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(ROOT / "hypotheses" / "btb.yaml", work / "btb.yaml")
    where = run([str(python), "-c", "import btb_lab; print(btb_lab.__file__)"], cwd=work)
    assert where.stdout.strip().startswith(str(venv)), where.stdout + where.stderr
    result = run(
        [str(venv / "bin" / "btb-lab"), "run", "btb.yaml", "--requests", "50", "--repeats", "1",
         "--no-progress", "--out", "run"],
        cwd=work,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    report = (work / "run" / "report.md").read_text(encoding="utf-8")
    assert report.startswith("# BTB: ")
    assert "**Verdict**: **" in report
    assert (work / "run" / "plots" / "latency_cdf.png").is_file()
    assert (work / "run" / "plots" / "timeline.png").is_file()
