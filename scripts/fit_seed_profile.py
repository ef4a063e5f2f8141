"""Fit hypotheses/profiles/seed-elastic.yaml, the elastic-prefill hypotheses' cost profile,
to the seed's own figures (../shared/seeds/elastic-prefill-hypothesis-log.txt):

- prefill: its cost model `(input − cached) / 8333` (H2's root cause): 8,333 uncached
  prompt tokens per second, cached tokens free;
- decode: TPOT90 = 0.0761 s of its baseline reference (8C plain, fresh restart, 200
  requests, time scale 20), which here is H7's `of_2.0` (8 co-located instances without a
  connector, session affinity at OVERLOAD_FACTOR 2.0; H2–H4's `affinity` is the same run).

    PYTHONPATH=. .venv/bin/python scripts/fit_seed_profile.py [--out PATH] [--check]

`--check` refits and compares with the file instead of writing it (exit 1 if they
differ). The other baseline figures (TTFT50, TTFT90, E2E50) are not fitted; the profile
records them beside the fitted simulator's values.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from btb_lab.calibrate.figures import PublishedFigures, fit_to_figures

ROOT = Path(__file__).resolve().parents[1]
HYPOTHESIS = ROOT / "hypotheses" / "h7.yaml"
VARIANT = "of_2.0"
OUT = ROOT / "hypotheses" / "profiles" / "seed-elastic.yaml"

SEED_FIGURES = PublishedFigures(
    prefill_tokens_per_s=8333.0,
    tpot_s=0.0761,
    tpot_percentile=90.0,
    source="the elastic-prefill seed's published figures",
    baseline="its 8-instance baseline (8C plain, session affinity, 200 requests, time scale 20)",
    checks={"ttft_p50": 1.075, "ttft_p90": 9.384, "e2e_p50": 5.075},
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="profile file to write")
    parser.add_argument("--check", action="store_true", help="compare with --out, write nothing")
    args = parser.parse_args()
    fit = fit_to_figures(HYPOTHESIS, VARIANT, SEED_FIGURES, name="seed-elastic")
    m = fit.profile.measured_on
    print(f"decode scale {fit.decode_scale:.6g} after {len(fit.evaluations)} simulator runs")
    print(f"TPOT90 fitted {fit.tpot_fit_s:.6f} s, held out {fit.tpot_holdout_s:.6f} s, "
          f"target {SEED_FIGURES.tpot_s} s")  # fmt: skip
    for name, pair in m.get("not_fitted", {}).items():
        print(f"{name}: seed {pair['figure_s']:g} s, simulator {pair['simulator_s']:.3f} s "
              "(not fitted)")  # fmt: skip
    if args.check:
        shipped = yaml.safe_load(args.out.read_text(encoding="utf-8"))
        fresh = fit.profile.model_dump(mode="json", exclude_none=True)
        if shipped != fresh:
            print(f"{args.out}: differs from a fresh fit", file=sys.stderr)
            return 1
        print(f"{args.out}: matches a fresh fit")
        return 0
    fit.profile.save(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
