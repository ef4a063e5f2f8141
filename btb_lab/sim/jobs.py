"""The pieces of work in an instance's waiting queue, one class per kind, and the warm
copy a transfer event carries (with its audit record).

Every job has `hashes` (its prompt's leading block hashes), `need` (KV tokens it reserves
while admitted; while waiting, its full cost) and `enq_s` (when it was last queued).
Request jobs also carry the request and the record the engine stamps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias

from btb_lab.records import Request, RequestRecord

__all__ = [
    "DecodeJob",
    "Job",
    "KVJob",
    "PrefillJob",
    "ReqJob",
    "WarmCopy",
    "WarmJob",
    "WarmLogEntry",
    "admission_cost",
    "kv_need",
    "pin_prompt",
]


class PinnedBlocks(Protocol):
    """What the KV accounting here asks of an instance's cache (`cache.PrefixCache`)."""

    def pin_count(self, h: int) -> int: ...
    def lead_pinned(self, hashes: Sequence[int]) -> int: ...
    def pin(self, hashes: Sequence[int], start: int, upto: int) -> int: ...
    def insert_pinned(self, hashes: Sequence[int], start: int) -> int: ...


def kv_need(prompt_tokens: int, req: Request) -> tuple[int, int]:
    """KV tokens a request reserves to decode, and the slack credit in them. It holds its
    prompt (`prompt_tokens`, whole hashed blocks with sharing) and its output, which first
    fills the slack of the prompt's last block as in a paged cache: `max(prompt_tokens,
    input + output)`. The credit (output tokens in that slack) holds only while no other
    running request pins the same last block (`pin_prompt`): two cannot write one block."""
    slack = min(req.output_tokens, prompt_tokens - req.input_tokens)
    return prompt_tokens + req.output_tokens - slack, slack


def pin_prompt(cache: PinnedBlocks, job: ReqJob | PrefillJob | KVJob, upto: int = -1) -> int:
    """Pin `job`'s prompt blocks from its `n_pin` up to `upto` (every block: inserting the
    missing ones, as resident); returns the tokens that leave its reservation: the blocks
    pinned, less its slack credit (`kv_need`) when this pins its last block and another
    running request pins that block already (the first holder keeps its credit)."""
    n = len(job.hashes)
    last_before = job.n_pin == n
    if upto < 0:
        pinned = cache.insert_pinned(job.hashes, job.n_pin)
        job.n_pin = n
    else:
        pinned = cache.pin(job.hashes, job.n_pin, upto)
        job.n_pin = upto
    slack = job.slack
    if slack and not last_before and job.n_pin == n and cache.pin_count(job.hashes[-1]) > 1:
        job.slack = 0
        return pinned - slack
    return pinned


def admission_cost(cache: PinnedBlocks, job: Job, block_tokens: int, reusable: bool) -> int:
    """KV that admitting `job` adds at most (sharing): its full cost less the leading
    prompt blocks already pinned here, which it will reuse without new memory, plus the
    slack credit it loses when they include its last block. Cold prefills, warm jobs and
    received KV that is not `reusable` share nothing."""
    if isinstance(job, WarmJob) or not job.hashes:
        return job.need
    if isinstance(job, PrefillJob | KVJob) and job.cold:
        return job.need
    if isinstance(job, KVJob) and not reusable:
        return job.need
    lead = cache.lead_pinned(job.hashes)
    shared = job.slack if lead == len(job.hashes) else 0
    return job.need - lead * block_tokens + shared


class ReqJob:
    """A co-located request: prefill here, then decode here."""

    __slots__ = (
        "admit_s",
        "ctx_off",
        "enq_s",
        "hashes",
        "n_pin",
        "n_shared",
        "need",
        "park_s",
        "parked",
        "rec",
        "req",
        "run_s",
        "slack",
    )

    def __init__(self, req: Request, rec: RequestRecord, need: int, slack: int = 0) -> None:
        self.req = req
        self.rec = rec
        self.hashes: Sequence[int] = req.block_hashes
        self.need = need
        self.slack = slack  # see kv_need
        self.enq_s = 0.0
        self.admit_s = 0.0  # admission all_that_fit: when admitted (its prefill waits)
        self.run_s = 0.0  # admission all_that_fit: its prefill's duration
        self.ctx_off = 0  # context tokens it adds to the batch's ctx_base while decoding
        self.n_pin = 0  # leading blocks of `hashes` pinned on this instance
        self.n_shared = 0  # leading blocks counted in the batch's shared prefix reads
        self.parked = False  # waited once for a warm copy (never twice)
        self.park_s = 0.0  # when it was parked


class PrefillJob:
    """Prefill here for another (decode) instance, then ship the KV there."""

    __slots__ = (
        "admit_s",
        "cold",
        "decode_inst",
        "enq_s",
        "hashes",
        "n_pin",
        "need",
        "park_s",
        "parked",
        "prefill_inst",
        "prefill_start_s",
        "prompt_tokens",
        "rec",
        "req",
        "run_s",
        "slack",
    )

    def __init__(
        self,
        req: Request,
        rec: RequestRecord,
        prompt_tokens: int,
        *,
        prefill_inst: int,
        decode_inst: int,
        cold: bool,
    ) -> None:
        self.req = req
        self.rec = rec
        self.hashes: Sequence[int] = req.block_hashes
        self.prompt_tokens = prompt_tokens  # KV its prompt occupies, here and at the decoder
        self.need = prompt_tokens  # no output here
        self.slack = 0
        self.enq_s = 0.0
        self.n_pin = 0
        self.prefill_inst = prefill_inst
        self.decode_inst = decode_inst
        self.cold = cold  # the prefill ignores cached prefixes (Decision.prefill_cold)
        self.parked = False
        self.park_s = 0.0
        self.prefill_start_s = 0.0
        self.admit_s = 0.0
        self.run_s = 0.0


class KVJob:
    """Decode here from KV a prefill instance shipped (the second half of a PrefillJob)."""

    __slots__ = (
        "cold", "ctx_off", "enq_s", "hashes", "n_pin", "n_shared", "need", "rec", "req", "slack",
    )  # fmt: skip

    def __init__(
        self, req: Request, rec: RequestRecord, need: int, slack: int = 0, *, cold: bool
    ) -> None:
        self.req = req
        self.rec = rec
        self.hashes: Sequence[int] = req.block_hashes
        self.need = need
        self.slack = slack  # see kv_need
        self.enq_s = 0.0
        self.n_pin = 0
        self.n_shared = 0
        self.ctx_off = 0
        # the prefill was cold: admission counts none of its blocks as already pinned here
        self.cold = cold


class WarmJob:
    """Recompute a prefix here to warm the cache; no request behind it, reserves nothing."""

    __slots__ = (
        "admit_s",
        "copy_s",
        "enq_s",
        "hashes",
        "need",
        "request_id",
        "run_s",
        "source",
        "start_s",
        "tokens",
    )

    def __init__(
        self,
        hashes: Sequence[int],
        tokens: int,
        request_id: str,
        *,
        copy_s: float = -1.0,
        source: str = "",
    ) -> None:
        self.hashes = hashes
        self.tokens = tokens  # tokens to prefill: the prefix's blocks, whole
        self.request_id = request_id  # the request whose arrival asked for it (events)
        self.need = 0
        self.enq_s = 0.0
        self.start_s = 0.0  # when its prefill started (events)
        # warm_copy_blocks_target: an RDMA copy run on the target's compute queue for
        # copy_s seconds (from `source`) instead of a recompute; -1: a recompute
        self.copy_s = copy_s
        self.source = source
        self.admit_s = 0.0
        self.run_s = 0.0


Job: TypeAlias = ReqJob | PrefillJob | KVJob | WarmJob
DecodeJob: TypeAlias = ReqJob | KVJob  # the jobs that join a decode batch


class WarmCopy:
    """A warming copy in flight from `source` to `target`: the payload of its transfer
    event."""

    __slots__ = ("hashes", "request_id", "source", "start_s", "target", "tokens")

    def __init__(
        self,
        source: int,
        target: int,
        hashes: Sequence[int],
        start_s: float,
        tokens: int,
        request_id: str,
    ) -> None:
        self.source = source
        self.target = target
        self.hashes = hashes
        self.start_s = start_s  # when it starts moving (after its source and the link)
        self.tokens = tokens
        self.request_id = request_id  # the request whose arrival asked for it


@dataclass(slots=True, frozen=True)
class WarmLogEntry:
    """One warming copy, for audits: it must never start before its source is complete."""

    source: int
    target: int
    n_blocks: int
    decided_s: float
    start_s: float
    source_complete_s: float  # when the copied blocks were complete on the source
    done_s: float
