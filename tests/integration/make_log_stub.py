"""A stand-in for `btb-lab` under `scripts/make_log.sh` (its `BTB`), so the script's fault
handling is tested in seconds: `run` copies a real run directory made once by the test
(renamed to the hypothesis's id), `log append` is the real command. Either can stop at a
named point and wait there for the test's signal:

    STUB_BLOCK=run:h2       `run hypotheses/h2.yaml` writes STUB_MARKERS/run-h2, then waits
    STUB_BLOCK=append:h2    `log append` of h2's run waits before writing the log
    STUB_FAIL=h2            `run hypotheses/h2.yaml` fails (exit 1)
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import time
from pathlib import Path


def _wait_at(point: str) -> None:
    if os.environ.get("STUB_BLOCK") != point:
        return
    markers = Path(os.environ["STUB_MARKERS"])
    markers.mkdir(parents=True, exist_ok=True)
    (markers / point.replace(":", "-")).write_text(str(os.getpid()), encoding="utf-8")
    time.sleep(120)  # until the test's signal; SIGTERM ends the process (exit 143)
    sys.exit(99)  # the test never sent it


def run(argv: list[str]) -> int:
    file = Path(argv[0])
    out = Path(argv[argv.index("--out") + 1])
    name = file.stem
    if os.environ.get("STUB_FAIL") == name:
        print(f"{file}: failing on purpose", file=sys.stderr)
        return 1
    shutil.copytree(os.environ["STUB_TEMPLATE"], out)
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    hid = name.upper()
    manifest["hypothesis"]["id"] = hid
    manifest["hypothesis_id"] = hid
    manifest["run_id"] = f"{out.name}-{name}-{secrets.token_hex(3)}"
    manifest["run_dir"] = str(out)
    manifest_path.write_text(json.dumps(manifest), encoding="utf-8")
    _wait_at(f"run:{name}")
    return 0


def log_append(argv: list[str]) -> int:
    run_dir = Path(argv[0])
    _wait_at(f"append:{run_dir.parent.name}")
    from btb_lab.cli import main

    sys.argv = ["btb-lab", "log", "append", *argv]
    main()
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["run"]:
        sys.exit(run(args[1:]))
    if args[:2] == ["log", "append"]:
        sys.exit(log_append(args[2:]))
    sys.exit(f"make_log_stub: unexpected arguments {args}")
