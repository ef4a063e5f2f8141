"""Known answers for the decode-segment arithmetic and the shared-prefix read count."""

from __future__ import annotations

import pytest

from btb_lab.sim.decode import TIME_EPS_S, SharedPrefixReads, segment_s, steps_reaching


def test_segment_duration_is_the_arithmetic_series_of_step_times() -> None:
    # steps take c0, c0 + c1, c0 + 2 c1, ...: 3 steps of (2, 2.5, 3) s take 7.5 s
    assert segment_s(3, 2.0, 0.5, 0.0) == 7.5
    assert segment_s(0, 2.0, 0.5, 0.0) == 0.0
    assert segment_s(1, 2.0, 0.5, 0.0) == 2.0
    assert segment_s(4, 1.0, 0.0, 0.0) == 4.0
    assert segment_s(3, 2.0, 0.5, 10.0) == 17.5


def test_segment_end_keeps_the_engine_operation_order() -> None:
    """The start is added before the growth term: (start + k·c0) + c1·k(k-1)/2, which
    differs in the last bit from start + (k·c0 + c1·k(k-1)/2) for these values."""
    start, k, c0, c1 = 0.939, 2, 0.893, 0.039
    assert segment_s(k, c0, c1, start) == (start + k * c0) + c1 * k * (k - 1) * 0.5
    assert segment_s(k, c0, c1, start) != start + (k * c0 + c1 * k * (k - 1) * 0.5)
    # with no start the plain duration comes out, bit for bit
    assert segment_s(k, c0, c1, 0.0) == k * c0 + c1 * k * (k - 1) * 0.5


def test_steps_reaching_exact_boundaries_with_growth() -> None:
    # c0 = 1, c1 = 2: step i takes 1 + 2i, so k steps take exactly k² seconds
    assert [segment_s(k, 1.0, 2.0, 0.0) for k in range(5)] == [0.0, 1.0, 4.0, 9.0, 16.0]
    assert steps_reaching(4.0, 1.0, 2.0) == 2  # on a boundary: that boundary
    assert steps_reaching(9.0, 1.0, 2.0) == 3
    assert steps_reaching(4.0 + 1e-9, 1.0, 2.0) == 3  # just past it: the next one
    assert steps_reaching(9.0 - 1e-9, 1.0, 2.0) == 3  # just before: this one
    assert steps_reaching(0.5, 1.0, 2.0) == 1


def test_steps_reaching_without_growth_and_at_zero() -> None:
    assert steps_reaching(3.0, 1.0, 0.0) == 3
    assert steps_reaching(2.5, 1.0, 0.0) == 3
    assert steps_reaching(0.0, 1.0, 0.0) == 0
    assert steps_reaching(-1.0, 1.0, 2.0) == 0


def test_steps_reaching_tolerates_round_off_below_a_boundary() -> None:
    # within TIME_EPS_S below a boundary still counts as reaching it, beyond it does not
    assert steps_reaching(3.0 + TIME_EPS_S / 2, 1.0, 0.0) == 3
    assert steps_reaching(3.0 + 3 * TIME_EPS_S, 1.0, 0.0) == 4


@pytest.mark.parametrize(("c0", "c1"), [(0.0213, 3.1e-8), (1e-3, 1e-3), (0.5, 0.0), (7e-3, 2e-6)])
def test_steps_reaching_is_the_smallest_k_by_the_duration_formula(c0: float, c1: float) -> None:
    """Against a brute-force scan over the same formula, on boundaries and between."""
    for k in range(0, 400, 7):
        for elapsed in (segment_s(k, c0, c1, 0.0), segment_s(k, c0, c1, 0.0) + 0.37 * c0):
            want = next(
                j for j in range(10_000) if segment_s(j, c0, c1, 0.0) >= elapsed - TIME_EPS_S
            )
            if elapsed <= 0:
                want = 0
            assert steps_reaching(elapsed, c0, c1) == want


def test_shared_prefix_reads_count_each_block_once() -> None:
    reads = SharedPrefixReads(block_tokens=16)
    assert reads.join((1, 2, 3), 3) == 0  # first sequence: nothing read twice
    assert reads.join((1, 2, 9), 2) == 2 * 16  # blocks 1, 2 already read
    assert reads.join((1, 5), 2) == 16
    assert reads.refs == {1: 3, 2: 2, 3: 1, 5: 1}
    assert reads.dup_tokens == 3 * 16
    assert reads.leave((1, 2, 3), 3) == 2 * 16  # it shared 1 and 2 with others
    assert reads.refs == {1: 2, 2: 1, 5: 1}
    assert reads.dup_tokens == 16
    assert reads.leave((1, 2, 9), 2) == 16
    assert reads.leave((1, 5), 2) == 0
    assert (reads.refs, reads.dup_tokens) == ({}, 0)
