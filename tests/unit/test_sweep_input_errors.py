"""Sweep and ablate input refused before any point runs, one line per problem at its line
of the sweep file, exit 2: a grid value, axis choice or listed point that makes a point
twice (it shared the first one's run directory and failed on its files after the first
ran), and an ablation its waterfall cannot be built from (it ran all 14 steps first, then
blamed a `table.variants` the file did not have)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from btb_lab.errors import UserError
from btb_lab.sweep import expand_points, load_sweep
from btb_lab.sweep.ablate import ablation_sweep, headline_column
from tests.helpers import cli, write_small


def sweep_file(folder: Path, body: str, name: str = "s.yaml") -> Path:
    write_small(folder)
    path = folder / name
    path.write_text("name: s\nbase: hs.yaml\n" + body, encoding="utf-8")
    return path


# ---------------------------------------------------------------- one point twice


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("grid: {seed: [1, 1]}\n",
         ":3: grid.seed.1: value 1 repeats grid.seed.0 (line 3): both make point 1-"),
        ("grid:\n  seed:\n    - 1\n    - 2\n    - 1\n",
         ":7: grid.seed.2: value 1 repeats grid.seed.0 (line 5): both make point 1-"),
        # equal values written differently: the same id
        ("grid:\n  sim.x:\n    - {a: 1, b: 2}\n    - {b: 2, a: 1}\n",
         (':6: grid.sim.x.1: value {"a":1,"b":2} repeats grid.sim.x.0 (line 5): both make '
         "point")),
        # equal values whose ids differ: the same run made twice
        ("grid:\n  seed:\n    - 1\n    - 1.0\n",
         ":6: grid.seed.1: value 1 repeats grid.seed.0 (line 5): both make the same point"),
        # labels that give one id
        ("axes:\n  wl:\n    a b: {seed: 2}\n    a-b: {seed: 2}\n",
         ":6: axes.wl.a-b: repeats axes.wl.a b (line 5): both make point a-b-"),
        ("points:\n  - {label: p q}\n  - {label: p-q}\n",
         ":5: points.1: repeats points.0 (line 4): both make point p-q-"),
    ],
)  # fmt: skip
def test_a_point_made_twice_is_refused_at_its_line(
    tmp_path: Path, body: str, expected: str
) -> None:
    path = sweep_file(tmp_path, body)
    result = cli("sweep", path, "--dry-run")
    assert result.code == 2, result.output
    assert not result.traceback, result.output
    assert f"{path}{expected}" in result.err
    assert len(result.err.strip().splitlines()) == 1, result.err


def test_a_repeat_crossed_with_an_axis_is_one_problem_and_nothing_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    body = "axes:\n  wl:\n    a: {}\n    b: {sim.x: 1}\ngrid: {seed: [1, 2, 1]}\n"
    path = sweep_file(tmp_path, body)
    result = cli("sweep", path, "--jobs", "1", "--out", tmp_path / "out")
    assert result.code == 2, result.output
    assert not result.traceback, result.output
    lines = result.err.strip().splitlines()  # the repeat makes two points twice: one line
    assert len(lines) == 1, result.err
    assert lines[0].startswith(
        f"error: {path}:7: grid.seed.2: value 1 repeats grid.seed.0 (line 7): both make point "
    )
    assert lines[0].endswith("; list each value once")
    assert not (tmp_path / "out").exists()


def test_distinct_values_still_make_distinct_points(tmp_path: Path) -> None:
    body = "grid:\n  seed: [1, 2, 3]\n  sim.x: [true, 1, '1', {a: 1}, {a: 2}]\n"
    points = expand_points(load_sweep(sweep_file(tmp_path, body)).spec)
    assert len({p.point_id for p in points}) == 15  # `1` and `'1'`: one label, two points


def test_an_ablation_whose_steps_change_nothing_for_its_policies_still_loads(
    tmp_path: Path,
) -> None:
    # the small hypothesis has no cache-aware or BTB variant: the router steps add no
    # override, so neighbouring steps have equal overrides (but labels of their own)
    path = sweep_file(tmp_path, "axes:\n  setup:\n    one: {}\n")
    doc = ablation_sweep(load_sweep(path), "infer-sim")
    steps = list(doc["axes"]["step"].values())
    assert steps[0] == steps[1]
    written = tmp_path / "ablation.yaml"
    written.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    assert len(expand_points(load_sweep(written).spec)) == len(steps)


# ----------------------------------------------------------------------- ablate


def test_ablate_refuses_a_sweep_without_one_axis_before_any_point_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    path = sweep_file(tmp_path, "grid: {seed: [1]}\n")
    result = cli("ablate", path, "--jobs", "1", "--out", tmp_path / "abl")
    assert result.code == 2, result.output
    assert not result.traceback, result.output
    assert result.err.strip().splitlines() == [
        (
            f"error: {path}:1: axes: an ablation needs exactly one axis (its setups, the "
            "waterfall's rows); this sweep has none"
        ),
        (
            f"{path}:3: grid: an ablation takes its setups from one axis and would drop a grid; "
            "make it the axis or top-level `overrides`"
        ),
    ]
    assert "table.variants" not in result.err  # the file has no table block
    assert not (tmp_path / "abl").exists()  # nothing written, no point run


def test_ablate_refuses_two_axes_a_points_list_and_a_step_axis(tmp_path: Path) -> None:
    body = "points:\n  - {label: p}\naxes:\n  setup: {one: {}}\n  step: {a: {}}\n"
    path = sweep_file(tmp_path, body)
    result = cli("ablate", path, "--out", tmp_path / "abl")
    assert result.code == 2, result.output
    lines = result.err.strip().removeprefix("error: ").splitlines()
    assert lines == [
        (
            f"{path}:5: axes: an ablation needs exactly one axis (its setups, the waterfall's "
            "rows); this sweep has 2: setup, step"
        ),
        (
            f"{path}:3: points: an ablation takes its setups from one axis and would drop a "
            "points list; make it the axis or top-level `overrides`"
        ),
        f"{path}:7: axes.step: an axis named 'step' is the ablation's own",
    ]
    assert not (tmp_path / "abl").exists()


def test_without_a_table_block_the_headline_is_the_base_hypothesis_first_variant(
    tmp_path: Path,
) -> None:
    # no `table.variants`: the table shows every variant, so the waterfall follows the
    # first one besides the baseline (it claimed `table.variants` named none)
    from btb_lab.sweep.ablate import check_ablation

    loaded = load_sweep(sweep_file(tmp_path, "axes:\n  setup:\n    one: {}\n"))
    assert headline_column(loaded, "base") == "ttft_mean reduction % (fast vs base)"
    assert check_ablation(loaded, "infer-sim") == (
        "ttft_mean reduction % (fast vs base)",
        "setup",
    )


def test_a_base_with_only_its_baseline_is_refused_naming_the_base_file(tmp_path: Path) -> None:
    from btb_lab.sweep.ablate import check_ablation

    write_small(tmp_path, "one.yaml", **{"  fast:\n    router: {policy: round_robin}\n": ""})
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nbase: one.yaml\naxes: {setup: {one: {}}}\n", encoding="utf-8")
    with pytest.raises(UserError) as exc:
        check_ablation(load_sweep(path), "infer-sim")
    assert str(exc.value) == (
        f"{tmp_path / 'one.yaml'}: variants: the waterfall follows a variant's reduction "
        "against the baseline 'base'; name a variant besides it"
    )


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ("table:\n  variants: [base]\n",
         (":5: table.variants: the waterfall follows a variant's reduction against the "
         "baseline 'base'; name a variant besides it")),
        ("table:\n  variants: [fast]\n",
         (":5: table.variants: the waterfall follows a reduction against the baseline "
         "'base', which is not listed")),
    ],
)  # fmt: skip
def test_ablate_refuses_a_table_without_a_headline_at_its_line(
    tmp_path: Path, table: str, expected: str
) -> None:
    path = sweep_file(tmp_path, "axes: {setup: {one: {}}}\n" + table)
    result = cli("ablate", path, "--out", tmp_path / "abl")
    assert result.code == 2, result.output
    assert not result.traceback, result.output
    assert f"{path}{expected}" in result.err
    assert not (tmp_path / "abl").exists()


def test_ablation_table_keeps_its_headline_when_the_sweep_turns_reductions_off(
    tmp_path: Path,
) -> None:
    path = sweep_file(tmp_path, "axes: {setup: {one: {}}}\ntable: {reductions: false}\n")
    assert ablation_sweep(load_sweep(path), "infer-sim")["table"]["reductions"] is True


def test_a_grid_key_that_makes_a_new_variant_is_blamed_at_its_line(tmp_path: Path) -> None:
    # the new variant lacks its router: the error was placed at the base file's variants
    path = sweep_file(tmp_path, "grid:\n  variants.nope.router.params.replicas: [2]\n")
    result = cli("sweep", path, "--dry-run")
    assert result.code == 2, result.output
    assert f"{path}:4: grid.variants.nope.router.params.replicas (point " in result.err
    assert "variants.nope.router.policy: required field is missing" in result.err
    assert "hs.yaml" not in result.err
