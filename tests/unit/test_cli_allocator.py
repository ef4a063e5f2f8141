"""The CLI's choice of pyarrow's allocator: the C library's unless the user picked one
(mimalloc's pool held 20-80 MiB more peak RSS on the long-prefix benchmarks)."""

from __future__ import annotations

import subprocess
import sys

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
