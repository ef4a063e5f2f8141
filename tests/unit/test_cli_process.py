"""What the CLI does to its process: pyarrow's allocator is the C library's unless the user
picked one (mimalloc's pool held 20-80 MiB more peak RSS on the long-prefix benchmarks),
and the console script ends without the interpreter's teardown but with every exit code,
exit handler and byte of output of a normal exit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import python_env

# the pool pyarrow gives after a command ran in this process
PROBE = (
    "import sys; from btb_lab.cli import main; sys.argv = ['btb-lab', 'version']\n"
    "try:\n    main()\nexcept SystemExit:\n    pass\n"
    "import pyarrow as pa; print(pa.default_memory_pool().backend_name)"
)


def _pool_after_a_command(**env: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
        env=python_env(**env), timeout=120,
    )  # fmt: skip
    return done.stdout.strip().splitlines()[-1]


def test_commands_use_the_system_allocator_for_arrow() -> None:
    assert _pool_after_a_command() == "system"


@pytest.mark.parametrize("pool", ["mimalloc", "jemalloc"])
def test_a_pool_the_user_chose_is_kept(pool: str) -> None:
    import pyarrow as pa

    if pool not in pa.supported_memory_backends():
        pytest.skip(f"this pyarrow has no {pool}")
    assert _pool_after_a_command(ARROW_DEFAULT_MEMORY_POOL=pool) == pool


# the console script's entry in a child: an exit handler that writes `marker`, optionally a
# thread still running when the command ends, then `btb-lab ARGS`
ENTRY = """
import atexit, sys, threading, time
from pathlib import Path
marker, thread, args = Path(sys.argv[1]), sys.argv[2] == "thread", sys.argv[3:]
atexit.register(marker.write_text, "exit handler ran")
if thread:
    def late():
        time.sleep(0.3)
        Path(str(marker) + ".thread").write_text("thread finished")
    threading.Thread(target=late).start()
from btb_lab import cli
sys.argv = ["btb-lab", *args]
cli.entry() if marker.name == "marker" else cli.main()
"""


def _entry(
    tmp_path: Path, *args: str, thread: bool = False, marker: str = "marker"
) -> subprocess.CompletedProcess[str]:
    """`btb-lab ARGS` through `entry` (through `main` and the normal exit, with any other
    `marker` name)."""
    return subprocess.run(
        [sys.executable, "-c", ENTRY, str(tmp_path / marker), "thread" if thread else "-",
         *args], capture_output=True, text=True, check=False, env=python_env(), timeout=120,
    )  # fmt: skip


def test_the_console_script_keeps_output_codes_and_exit_handlers(tmp_path: Path) -> None:
    done = _entry(tmp_path, "list", "--policies")
    assert done.returncode == 0
    # every byte the normal exit gives
    assert done.stdout == _entry(tmp_path, "list", "--policies", marker="normal").stdout
    assert len(done.stdout) > 1000
    assert (tmp_path / "marker").read_text() == "exit handler ran"
    bad = _entry(tmp_path, "validate", str(tmp_path / "missing.yaml"))
    assert bad.returncode == 2
    assert "no such hypothesis file" in bad.stderr


def test_a_thread_still_running_gets_the_normal_exit(tmp_path: Path) -> None:
    done = _entry(tmp_path, "version", thread=True)
    assert done.returncode == 0
    assert (tmp_path / "marker.thread").read_text() == "thread finished"
    assert (tmp_path / "marker").read_text() == "exit handler ran"


def test_a_message_exit_prints_it_and_exits_1(tmp_path: Path) -> None:
    from btb_lab import cli

    probe = (
        "import sys; from btb_lab import cli\n"
        "def main():\n    sys.exit('stopped: a message')\n"
        "cli.main = main\ncli.entry()"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=False, env=python_env(), timeout=120)  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip() == "stopped: a message"
    assert callable(cli.entry)
