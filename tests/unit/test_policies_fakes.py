"""A hand-built ClusterView for policy tests: fixed loads, resident block sets, a linear
cost model. Holds no tests itself; the test_policies_* modules import it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from btb_lab.policies.base import InstanceLoad
from btb_lab.records import Request


@dataclass
class FakeCosts:
    """Prefill at a per-instance token rate; transfer = setup + tokens / rate."""

    prefill_tokens_per_s: dict[int, float] = field(default_factory=dict)
    default_prefill_tokens_per_s: float = 8333.0
    transfer_setup_s: float = 1.0
    transfer_tokens_per_s: float = 1e6

    def prefill_s(self, instance: int, tokens: int, cached_tokens: int = 0) -> float:
        rate = self.prefill_tokens_per_s.get(instance, self.default_prefill_tokens_per_s)
        return tokens / rate

    def transfer_s(self, tokens: int, source: int, target: int) -> float:
        return self.transfer_setup_s + tokens / self.transfer_tokens_per_s


@dataclass
class FakeView:
    """`routed[i]`: blocks the router believes instance i holds; `complete[i]`: blocks
    whose KV is complete there (defaults to `routed`)."""

    loads: list[InstanceLoad]
    routed: dict[int, set[int]] = field(default_factory=dict)
    complete: dict[int, set[int]] | None = None
    now: float = 0.0
    cost_model: FakeCosts = field(default_factory=FakeCosts)

    @property
    def now_s(self) -> float:
        return self.now

    @property
    def instances(self) -> Sequence[InstanceLoad]:
        return self.loads

    @property
    def costs(self) -> FakeCosts:
        return self.cost_model

    @staticmethod
    def _leading(held: set[int], block_hashes: Sequence[int]) -> int:
        n = 0
        for block in block_hashes:
            if block not in held:
                break
            n += 1
        return n

    def match_blocks(self, instance: int, block_hashes: Sequence[int]) -> int:
        return self._leading(self.routed.get(instance, set()), block_hashes)

    def complete_blocks(self, instance: int, block_hashes: Sequence[int]) -> int:
        source = self.routed if self.complete is None else self.complete
        return self._leading(source.get(instance, set()), block_hashes)

    def host_blocks(self, instance: int, block_hashes: Sequence[int]) -> int:
        return self.complete_blocks(instance, block_hashes)


def cluster(
    loads: Sequence[int],
    *,
    outstanding: Sequence[int] | None = None,
    roles: Sequence[str] | None = None,
) -> list[InstanceLoad]:
    """Instances with the given loads (all running), outstanding tokens and roles."""
    outstanding = outstanding or [0] * len(loads)
    roles = roles or ["C"] * len(loads)
    return [
        InstanceLoad(
            index=i,
            name=f"i{i}",
            role=roles[i],
            running=load,
            waiting=0,
            outstanding_tokens=outstanding[i],
        )
        for i, load in enumerate(loads)
    ]


def request(
    rid: str = "r",
    *,
    blocks: Sequence[int] = (),
    input_tokens: int | None = None,
    session: str | None = None,
    arrival_s: float = 0.0,
    block_tokens: int = 512,
) -> Request:
    """A request whose prompt is exactly its blocks unless `input_tokens` says otherwise."""
    tokens = input_tokens if input_tokens is not None else max(1, len(blocks) * block_tokens)
    return Request(
        request_id=rid,
        arrival_s=arrival_s,
        input_tokens=tokens,
        output_tokens=16,
        block_hashes=tuple(blocks),
        block_tokens=block_tokens,
        session_id=session,
    )
