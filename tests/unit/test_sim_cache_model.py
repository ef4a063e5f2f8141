"""The prefix cache against a plain model of it, operation by operation.

`PrefixCache` skips reordering blocks that are pinned or about to be (see its docstring).
Both implementations (the Python classes and the compiled `_cachec`) are checked.
`Reordering` below is the cache as first written: one LRU of every resident block, every
block it is told to touch moved to the end, pinned ones requeued when eviction meets them.
Random interleavings of requests (locate, reuse, pin, insert, release) and of warm copies,
drops and demotions must give the same answers and leave the same state after every step.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

import pytest

from btb_lab.sim import cache as cache_module
from btb_lab.sim.cache import PrefixCache

BT = 16


class Reordering:
    """The model: the same rules, no shortcuts (only what the checks below call)."""

    def __init__(self, cap_blocks: int, ram_cap_blocks: int, disk: set[int] | None) -> None:
        self.cap_tokens = cap_blocks * BT
        self.ram_cap_blocks = ram_cap_blocks
        self.disk = disk
        self.reserved = 0
        self.hbm: OrderedDict[int, None] = OrderedDict()
        self.ram: OrderedDict[int, None] = OrderedDict()
        self.pins: dict[int, int] = {}
        self.pending: dict[int, float] = {}

    def _where(self, h: int) -> str | None:
        if h in self.hbm:
            return "hbm"
        if h in self.ram:
            return "ram"
        return "disk" if self.disk is not None and h in self.disk else None

    def locate(self, hashes: Sequence[int], now_s: float) -> tuple[int, int, int, int, int, float]:
        n_hbm = next((i for i, h in enumerate(hashes) if h not in self.hbm), len(hashes))
        n, n_ram, n_disk = n_hbm, 0, 0
        for h in hashes[n_hbm:]:
            tier = self._where(h)
            if tier is None:
                break
            n_ram += tier == "ram"
            n_disk += tier == "disk"
            n += 1
        m, ready = n, now_s
        for h in hashes[n:]:
            if h not in self.pending:
                break
            m, ready = m + 1, max(ready, self.pending[h])
        return n_hbm, n, n_ram, n_disk, m, ready

    def touch(self, hashes: Sequence[int], n: int) -> None:
        for h in hashes[:n]:
            self.hbm[h] = None
            self.hbm.move_to_end(h)
            self.ram.pop(h, None)

    def insert(self, hashes: Sequence[int], *, fit: bool = True) -> None:
        self.touch(hashes, len(hashes))
        for h in hashes:
            self.pending.pop(h, None)
        if fit:
            self.fit()

    def pin(self, hashes: Sequence[int], start: int, upto: int) -> int:
        for h in hashes[start:upto]:
            self.pins[h] = self.pins.get(h, 0) + 1
        return max(0, upto - start) * BT

    def insert_pinned(self, hashes: Sequence[int], start: int) -> int:
        self.insert(hashes, fit=False)
        return self.pin(hashes, start, len(hashes))

    def unpin(self, hashes: Sequence[int], n: int) -> None:
        for h in hashes[:n]:
            self.pins[h] -= 1
            if not self.pins[h]:
                del self.pins[h]
                self.hbm.move_to_end(h)

    def _to_ram(self, h: int) -> None:
        if self.ram_cap_blocks:
            self.ram[h] = None
            if len(self.ram) > self.ram_cap_blocks:
                old, _ = self.ram.popitem(last=False)
                if self.disk is not None:
                    self.disk.add(old)
        elif self.disk is not None:
            self.disk.add(h)

    def fit(self) -> None:
        excess = len(self.hbm) - (self.cap_tokens - self.reserved) // BT
        while excess > 0:
            h, _ = self.hbm.popitem(last=False)
            if h in self.pins:
                self.hbm[h] = None
            else:
                self._to_ram(h)
                excess -= 1

    def expect(self, hashes: Sequence[int], start: int, done_s: float) -> None:
        for h in hashes[start:]:
            if h not in self.hbm:
                self.pending[h] = done_s

    def drop(self, hashes: Sequence[int]) -> int:
        freed = [h for h in hashes if h in self.hbm and h not in self.pins]
        for h in hashes:
            self.ram.pop(h, None)
            self.pending.pop(h, None)
        for h in freed:
            del self.hbm[h]
        return len(freed)

    def demote(self, hashes: Sequence[int]) -> list[int]:
        if not self.ram_cap_blocks:
            return []
        moved = [h for h in hashes if h in self.hbm and h not in self.pins]
        for h in moved:
            del self.hbm[h]
            self.ram[h] = None
        while len(self.ram) > self.ram_cap_blocks:
            old, _ = self.ram.popitem(last=False)
            if self.disk is not None:
                self.disk.add(old)
        return moved

    def snapshot(self) -> tuple[list[int], dict[int, int], list[int], dict[int, float]]:
        unpinned = [h for h in self.hbm if h not in self.pins]
        return unpinned, dict(self.pins), list(self.ram), dict(self.pending)


def prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts over a few shared prefixes, so runs of blocks overlap as in a burst."""
    heads = [[1000 * k + i for i in range(rng.randint(1, 6))] for k in range(1, 5)]
    out = []
    for j in range(n):
        head = rng.choice(heads)
        out.append(
            head[: rng.randint(1, len(head))]
            + [-(j * 10 + i) - 1 for i in range(rng.randint(0, 3))]
        )
    return out


def fits(ref: Reordering, hashes: Sequence[int], cap: int) -> bool:
    """Admission, as the scheduler's: the pins after this one and the reservations fit."""
    return len(ref.pins.keys() | set(hashes)) * BT + ref.reserved <= cap * BT


def implementations() -> list[str]:
    names = ["python"]
    try:
        from btb_lab.sim import _cachec  # noqa: F401
    except ImportError:
        pass
    else:
        names.append("compiled")
    return names


def cache_class(name: str, monkeypatch: pytest.MonkeyPatch) -> type[PrefixCache]:
    monkeypatch.setenv(cache_module.IMPL_ENV, name)
    got, cls, _ = cache_module.implementation()
    assert got == name
    return cls  # type: ignore[no-any-return]


@pytest.mark.parametrize("impl", implementations())
@pytest.mark.parametrize("seed", range(40))
def test_the_cache_answers_and_evolves_as_the_reordering_model(
    seed: int, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(seed)
    cap, ram = rng.randint(6, 14), rng.choice([0, 0, 3, 6])
    disk_new: set[int] | None = set() if rng.random() < 0.5 else None
    disk_ref: set[int] | None = None if disk_new is None else set()
    new = cache_class(impl, monkeypatch)("C0", cap * BT, BT, ram_cap_blocks=ram, disk=disk_new)
    ref = Reordering(cap, ram, disk_ref)
    pool = prompts(rng, 30)
    jobs: list[dict] = []  # running requests: their prompt and how many blocks they pin
    now = 0.0
    for _step in range(400):
        now += rng.random()
        op = rng.random()
        if op < 0.35 or not jobs:  # a request starts its prefill (the scheduler's order)
            hashes = pool[rng.randrange(len(pool))]
            job = {"hashes": hashes, "n_pin": 0}
            got = new.locate(hashes, now)
            assert got == ref.locate(hashes, now)
            n_hbm, n, *_ = got
            n_use = n if n > n_hbm and rng.random() < 0.5 else n_hbm
            if n_use > n_hbm:
                new.promote(hashes, n_hbm, n_use)
            ref.touch(hashes, n_use)
            need = len(hashes) * BT
            if n_use and fits(ref, hashes[:n_use], cap):
                need -= new.pin(hashes, 0, n_use)
                ref.pin(hashes, 0, n_use)
                job["n_pin"] = n_use
            elif n_use:  # not pinned after all: a plain touch
                new.touch(hashes, n_use)
            new.expect(hashes, n_use, now + 1.0)
            ref.expect(hashes, n_use, now + 1.0)
            jobs.append(job)
        elif op < 0.55:  # a prefill completes: the prompt is resident and pinned
            job = rng.choice(jobs)
            if job.get("done") or not fits(ref, job["hashes"], cap):
                continue
            got = new.insert_pinned(job["hashes"], job["n_pin"])
            assert got == ref.insert_pinned(job["hashes"], job["n_pin"])
            job["n_pin"] = len(job["hashes"])
            job["done"] = True
            new.fit()
            ref.fit()
        elif op < 0.75:  # a request finishes
            job = jobs.pop(rng.randrange(len(jobs)))
            new.unpin(job["hashes"], job["n_pin"])
            ref.unpin(job["hashes"], job["n_pin"])
        elif op < 0.82:  # a warm copy lands
            hashes = rng.choice(pool)
            new.insert(hashes)
            ref.insert(hashes)
        elif op < 0.88:
            hashes = rng.choice(pool)
            assert new.drop(hashes) == ref.drop(hashes)
        elif op < 0.94:
            hashes = rng.choice(pool)
            assert new.demote(hashes) == ref.demote(hashes)
        else:  # the running requests' reservations change
            free = cap - len(ref.pins)
            new.reserved = ref.reserved = rng.randint(0, max(0, min(cap // 3, free))) * BT
            new.fit()
            ref.fit()
        assert new.snapshot() == ref.snapshot(), f"seed {seed}, step {_step}"
        assert disk_new == disk_ref
    new.fit()
    ref.fit()
    assert new.snapshot() == ref.snapshot()


class RoutedModel:
    """`RoutedBlocks` as first written: every noted block moved to the newest end in turn."""

    def __init__(self, cap_blocks: int) -> None:
        self.cap_blocks = cap_blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def note(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.cap_blocks:
            self.blocks.popitem(last=False)

    def lead(self, hashes: Sequence[int]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.blocks:
            n += 1
        return n


@pytest.mark.parametrize("impl", implementations())
@pytest.mark.parametrize("seed", range(40))
def test_routed_blocks_answer_and_evict_as_the_lru_model(
    seed: int, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts as tuples sharing their ids' objects (a trace's interned ids) and bursts
    of one prefix, asked and noted in random turns: the compiled walk's shortcuts (the last
    walk's answer, a prefix noted again moving as one run) never change an answer or the
    order in which blocks age out."""
    rng = random.Random(seed)
    monkeypatch.setenv(cache_module.IMPL_ENV, impl)
    assert cache_module.implementation()[0] == impl
    cap = rng.randint(3, 20)
    new, ref = cache_module.implementation()[2](cap), RoutedModel(cap)
    pool = [tuple(p) for p in prompts(rng, 30)]
    universe = sorted({h for p in pool for h in p})
    q: Sequence[int] = ()
    for step in range(400):
        p = rng.choice(pool)
        if rng.random() < 0.4:
            if rng.random() < 0.15:  # blocks noted twice in one request
                p = p + p[: rng.randint(1, len(p))] + p[-1:]
            new.note(p)
            ref.note(p)
            if rng.random() < 0.3:  # which blocks are held (asking drops the last walk)
                held = [h for h in universe if ref.lead((h,))]
                assert [h for h in universe if new.lead((h,))] == held, f"{seed}, {step}"
            continue
        if rng.random() < 0.3:  # the last question again, blocks noted since or not
            assert new.lead(q) == ref.lead(q), f"seed {seed}, step {step}"
            continue
        q = p[: rng.randint(0, len(p))] if rng.random() < 0.5 else p
        kind = rng.random()
        if kind < 0.15:
            q = list(q)
        elif kind < 0.3:  # equal ids in other objects
            q = tuple(int(str(h)) for h in q)
        elif kind < 0.4:  # a block that was never noted in the middle
            q = (*q[:1], 10**9, *q[1:])
        assert new.lead(q) == ref.lead(q), f"seed {seed}, step {step}"


@pytest.mark.parametrize("impl", implementations())
@pytest.mark.parametrize("seed", range(60))
def test_routed_blocks_keep_the_model_through_interleaved_bursts(
    seed: int, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bursts of several prefixes at once, each request its prefix plus blocks of its own,
    asked about on every instance and noted on one, as the engine does; now and then a
    prefix cut short, a block twice in one request, ids equal in other objects, another
    prefix's blocks inside one. The compiled view's remembered walks and stretches never
    change an answer or the order in which blocks age out (held sets asked with lists,
    which leave the memos alone)."""
    rng = random.Random(seed)
    monkeypatch.setenv(cache_module.IMPL_ENV, impl)
    cls = cache_module.implementation()[2]
    cap = rng.randint(6, 80)
    views = [(cls(cap), RoutedModel(cap)) for _ in range(rng.randint(1, 3))]
    heads = [tuple(range(1000 * k, 1000 * k + rng.randint(1, 40))) for k in range(1, 8)]
    next_id = 10**6
    universe: list[int] = sorted({h for head in heads for h in head})
    for step in range(400):
        head = rng.choice(heads)
        q = head[: rng.randint(1, len(head))] if rng.random() < 0.15 else head
        own = tuple(range(next_id, next_id + rng.randint(0, 2)))
        next_id += len(own)
        universe += own
        q = q + own
        kind = rng.random()
        cut = rng.randint(1, len(q))
        if kind < 0.05:
            q = q + q[:cut]
        elif kind < 0.1:
            q = tuple(int(str(h)) for h in q[:cut]) + q[cut:]
        elif kind < 0.15:
            other = rng.choice(heads)
            q = q[:1] + other[1 : rng.randint(1, len(other))] + q[1:]
        elif kind < 0.25:  # a prefix's later blocks first: another memo reaches them
            q = q[cut - 1 :] if rng.random() < 0.5 else q[cut - 1 :] + q[: cut - 1]
        for new, ref in views:
            assert new.lead(q) == ref.lead(q), f"seed {seed}, step {step}"
        if rng.random() < 0.7:
            new, ref = rng.choice(views)
            new.note(q)
            ref.note(q)
        if rng.random() < 0.25:
            for new, ref in views:
                held = [h for h in universe if ref.lead([h])]
                assert [h for h in universe if new.lead([h])] == held, f"{seed}, {step}"


@pytest.mark.parametrize("impl", implementations())
@pytest.mark.parametrize("seed", range(6))
def test_routed_blocks_keep_the_model_under_churn_of_counting_ids(
    seed: int, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ids that count up as a Mooncake trace's do, most prompts new, a few of them asked
    again: hundreds of live blocks, the compiled table grown several times and entries
    deleted from the middle of probe runs, and still every answer is the model's."""
    rng = random.Random(seed)
    monkeypatch.setenv(cache_module.IMPL_ENV, impl)
    cap = rng.randint(200, 700)
    new, ref = cache_module.implementation()[2](cap), RoutedModel(cap)
    next_id = rng.choice([0, 1 << 20, -(1 << 40)])
    seen: list[tuple[int, ...]] = []
    for step in range(600):
        if seen and rng.random() < 0.3:
            p = rng.choice(seen[-12:])
        else:
            n = rng.randint(1, 80)
            p = tuple(range(next_id, next_id + n))
            next_id += n + rng.choice([0, 0, 1, 7])
            seen.append(p)
        if rng.random() < 0.6:
            new.note(p)
            ref.note(p)
        q = rng.choice(seen[-40:])
        assert new.lead(q) == ref.lead(q), f"seed {seed}, step {step}"
    held = [h for p in seen for h in p if ref.lead((h,))]
    assert [h for p in seen for h in p if new.lead((h,))] == held
