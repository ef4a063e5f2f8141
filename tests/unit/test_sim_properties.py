"""Property-based invariants of the engine over random small workloads and decisions:
no request lost or duplicated, time never backwards, TTFT never below the modeled
prefill of the uncached tokens, cache occupancy within budget, pinned + reserved KV within
budget and pinned blocks never evicted (checked at every event by `audit=True`), with and
without KV prefix sharing, warm copies never before their source is complete under after_prefill."""

from __future__ import annotations

import random
from typing import ClassVar

from hypothesis import given, settings
from hypothesis import strategies as st

from btb_lab.config.costs import CostSettings
from btb_lab.config.sim import SimSettings
from btb_lab.model.costmodel import RooflineCostModel
from btb_lab.model.hardware import GPU_PRESETS, ModelSpec, make_instance
from btb_lab.model.roofline import prefill_s
from btb_lab.policies.base import ClusterView, Decision, Policy, WarmAction
from btb_lab.records import Request, RequestRecord
from btb_lab.sim.backend import run_engine

# A fat-KV model on one GPU: ~12k tokens of KV, so caches evict and batches fill.
FAT = ModelSpec("fat", 20e9, 20e9, 2, 80, 64, 128)
BT = 512


class RandomDecisions(Policy):
    """Seeded random routing that exercises every Decision field."""

    name: ClassVar[str] = "random_decisions"

    def __init__(self, seed: int) -> None:
        super().__init__(Policy.Params(), seed=seed)
        self.rng = random.Random(seed)

    def route(self, request: Request, view: ClusterView) -> Decision:
        rng = self.rng
        n = len(view.instances)
        target = rng.randrange(n)
        kind = rng.random()
        if kind < 0.2:
            return Decision(
                target,
                "OFFLOAD",
                prefill_instance=rng.randrange(n),
                prefill_cold=rng.random() < 0.5,
            )
        if kind < 0.45 and request.block_hashes:
            nb = len(request.block_hashes)
            # often a source still prefilling the prefix: the copy must wait for it
            src = rng.randrange(n)
            mode = "rdma" if rng.random() < 0.7 else "prefill"
            warm = WarmAction(src, rng.randrange(n), rng.randint(1, nb), mode)  # type: ignore[arg-type]
            return Decision(target, "WARM", warm=(warm,))
        return Decision(target)


workloads = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=0.5),  # gap to the previous arrival (s)
        st.integers(min_value=0, max_value=5),  # prefix family
        st.integers(min_value=1, max_value=8),  # blocks
        st.integers(min_value=1, max_value=60),  # output tokens
    ),
    min_size=1,
    max_size=40,
)


def build(rows: list[tuple[float, int, int, int]]) -> list[Request]:
    reqs = []
    t = 0.0
    for i, (gap, fam, nb, out) in enumerate(rows):
        t += gap * gap  # many near-simultaneous arrivals
        hashes = (*tuple(fam * 100 + j for j in range(nb - 1)), 10000 + i)
        reqs.append(Request(f"r{i}", t, nb * BT - 7, out, hashes, BT))
    return reqs


@settings(max_examples=60, deadline=None)
@given(
    rows=workloads,
    seed=st.integers(min_value=0, max_value=10_000),
    visibility=st.sampled_from(["after_prefill", "at_admission"]),
    view=st.sampled_from(["routed", "resident"]),
    layerwise=st.booleans(),
    disk=st.booleans(),
    max_batch=st.integers(min_value=1, max_value=6),
    sharing=st.booleans(),
    shared_attn=st.booleans(),
)
def test_engine_invariants(
    rows: list[tuple[float, int, int, int]],
    seed: int,
    visibility: str,
    view: str,
    layerwise: bool,
    disk: bool,
    max_batch: int,
    sharing: bool,
    shared_attn: bool,
) -> None:
    insts = [make_instance(i, f"C{i}", "C", GPU_PRESETS["H100"], 1, FAT) for i in range(3)]
    sim = SimSettings(
        kv_visibility=visibility,  # type: ignore[arg-type]
        router_view=view,  # type: ignore[arg-type]
        layerwise=layerwise,
        disk_tier=disk,
        max_batch=max_batch,
        kv_prefix_sharing=sharing,
        shared_prefix_attention=shared_attn and sharing,
        host_ram_bytes=8 * BT * insts[0].kv_bytes_per_token,
    )
    reqs = build(rows)
    recs: list[RequestRecord] = []
    # audit=True checks time order, KV and cache budgets and batch limits at every event
    _, stats, engine = run_engine(
            RooflineCostModel(insts, CostSettings()), sim, RandomDecisions(seed), reqs,
            recs.append, audit=True,
        )  # fmt: skip

    ids = [r.request_id for r in recs]
    assert sorted(ids) == sorted(r.request_id for r in reqs)  # none lost, none twice
    by_id = {r.request_id: r for r in reqs}
    for rec in recs:
        assert rec.ok, rec.error
        assert rec.first_token_s is not None
        assert rec.finish_s is not None
        assert rec.arrival_s <= rec.first_token_s <= rec.finish_s
        prefill_inst = insts[int((rec.prefill_instance or rec.instance)[1:])]
        floor = prefill_s(prefill_inst, by_id[rec.request_id].input_tokens - rec.cached_tokens, 0.5)
        assert rec.first_token_s - rec.arrival_s >= floor - 1e-9
        assert rec.prefill_s >= floor - 1e-9
        assert rec.queue_s >= -1e-9
        assert rec.kv_transfer_s >= 0
        assert rec.decode_s >= 0
        assert 0 <= rec.cached_tokens <= rec.input_tokens
    for entry in engine.warm_log:
        assert entry.start_s >= entry.decided_s
        if visibility == "after_prefill":
            assert entry.start_s >= entry.source_complete_s - 1e-12
    assert stats["failed"] == 0
    for inst in engine.insts:  # every reference and reservation was released
        assert (inst.cache.n_pinned(), inst.cache.reserved) == (0, 0)
        assert (inst.shared.refs, inst.shared.dup_tokens, inst.ctx_base) == ({}, 0, 0)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.floats(min_value=0.0, max_value=0.3),
            st.integers(min_value=0, max_value=1),  # two prefix families: heavy sharing
            st.integers(min_value=1, max_value=14),  # up to ~60% of the KV budget
            st.integers(min_value=1, max_value=200),
        ),
        min_size=1,
        max_size=30,
    ),
    seed=st.integers(min_value=0, max_value=10_000),
    visibility=st.sampled_from(["after_prefill", "at_admission"]),
    max_batch=st.integers(min_value=1, max_value=12),
)
def test_sharing_under_memory_pressure_keeps_the_budget(
    rows: list[tuple[float, int, int, int]], seed: int, visibility: str, max_batch: int
) -> None:
    """Two instances under shared-prefix bursts near the KV budget, sharing on and off:
    admission never overcommits pinned + reserved KV and no pinned block is evicted
    (audit), every request completes and every reference is released."""
    insts = [make_instance(i, f"C{i}", "C", GPU_PRESETS["H100"], 1, FAT) for i in range(2)]
    reqs = build(rows)
    for sharing in (True, False):
        sim = SimSettings(
            kv_visibility=visibility,
            max_batch=max_batch,
            kv_prefix_sharing=sharing,
            host_ram_bytes=4 * BT * insts[0].kv_bytes_per_token,
        )
        recs: list[RequestRecord] = []
        _, _, engine = run_engine(
            RooflineCostModel(insts, CostSettings()), sim, RandomDecisions(seed), reqs,
            recs.append, audit=True,
        )  # fmt: skip
        assert sorted(r.request_id for r in recs) == sorted(r.request_id for r in reqs)
        assert all(r.ok for r in recs)
        for inst in engine.insts:
            assert (inst.cache.n_pinned(), inst.cache.reserved) == (0, 0)
