"""Run `btb-lab ARGS` and stop at a named point of a run, so a test can send a signal
exactly there: `python fault_harness.py POINT MARKER [GO] -- ARGS`.

At POINT the harness writes MARKER (holding the number of records already on disk), then
waits — for the test's signal, or until the file GO exists (to change the world under the
run, e.g. make its disk read-only, and let it go on). Points:

    manifest        after the run directory's first manifest.json
    records:N       after the first variant × repeat wrote N records
    between         when the second variant × repeat starts, the first one finished
    finalize        the records' parquet is written to its temporary file, not yet renamed
    report          summary.json is written, report.md not yet
    point:NAME      (sweeps) when the run of the point whose directory is NAME starts
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any


def main() -> None:
    point, marker = sys.argv[1], Path(sys.argv[2])
    # the points name "the first variant × repeat": one after another, unless a test asks
    # for the simulator's parallel variants (BTB_LAB_JOBS)
    os.environ.setdefault("BTB_LAB_JOBS", "1")
    rest = sys.argv[3:]
    go = Path(rest.pop(0)) if rest and rest[0] != "--" else None
    assert rest[0] == "--", sys.argv
    args = rest[1:]
    written = [0]
    replace_file = os.replace  # before the patch below

    def stop() -> None:
        # whole or not at all: the test reads the count as soon as the marker exists
        tmp = marker.with_name(marker.name + ".part")
        tmp.write_text(str(written[0]), encoding="utf-8")
        replace_file(tmp, marker)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # a signal ends this wait (KeyboardInterrupt)
            if go is not None and go.exists():
                return
            time.sleep(0.02)
        sys.exit(99)  # the test never signalled

    try:
        import btb_lab.results.store as store
    except ImportError:  # an older layout (checking that a test fails there)
        import btb_lab.results as store  # type: ignore[no-redef]
    import btb_lab.sim.backend as sim_backend

    # small record batches, so a stop after the first write leaves a variant half done
    if hasattr(sim_backend, "_WRITE_BATCH"):
        sim_backend._WRITE_BATCH = 100

    sinks = [0]

    def patch(sink_cls: Any) -> None:
        sink_init, sink_write = sink_cls.__init__, sink_cls.write

        def init(self: Any, run_dir: Path, variant: str, repeat: int) -> None:
            sinks[0] += 1
            if point == "between" and sinks[0] == 2:
                stop()
            if point.startswith("point:") and Path(run_dir).name == point.split(":", 1)[1]:
                stop()
            sink_init(self, run_dir, variant, repeat)

        def write(self: Any, records: Any) -> None:
            sink_write(self, records)
            written[0] = self.count if sinks[0] == 1 else written[0]
            if point.startswith("records:") and sinks[0] == 1 and self.count >= int(point[8:]):
                stop()

        sink_cls.__init__ = init
        sink_cls.write = write

    # the JSONL parts, and the simulator's Arrow parts where this checkout has them
    for name in ("JsonlRecordSink", "ArrowRecordSink"):
        if hasattr(store, name):
            patch(getattr(store, name))

    if point == "manifest":
        from btb_lab.results import manifest

        save = manifest.Manifest.save
        saves = [0]

        def first_save(self: Any, run_dir: Path) -> None:
            save(self, run_dir)
            saves[0] += 1
            if saves[0] == 1:
                stop()

        manifest.Manifest.save = first_save  # type: ignore[method-assign]

    real_replace = os.replace

    def replace(src: Any, dst: Any, *a: Any, **k: Any) -> None:
        name = Path(dst).name
        if (point == "finalize" and name == "requests.parquet") or (
            point == "report" and name == "report.md"
        ):
            stop()
        real_replace(src, dst, *a, **k)

    os.replace = replace  # type: ignore[assignment]

    from btb_lab.cli import main as cli_main

    sys.argv = ["btb-lab", *args]
    cli_main()


if __name__ == "__main__":
    main()
