"""Data contracts between pipeline stages: Request (workload out), RequestRecord (backend
out), UtilSample (telemetry) and EventRecord (what the router, the engine and the
policy did over time: bursts detected, warm copies, KV transfers, queue and batch
sizes). Plain slotted dataclasses: the simulator creates millions of them, so they stay
cheap; validation happens at the edges.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "BURST_JOB_KINDS",
    "DERIVED_COLUMNS",
    "EVENT_COLUMNS",
    "EVENT_KINDS",
    "RECORD_COLUMNS",
    "STORED_COLUMNS",
    "UTIL_COLUMNS",
    "EventRecord",
    "Request",
    "RequestRecord",
    "UtilSample",
    "derive_timings",
]


@dataclass(slots=True)
class Request:
    """One request to replay. `block_hashes` has one id per `block_tokens`-token block of the
    prompt; two requests share a prefix exactly as far as their leading ids agree."""

    request_id: str
    arrival_s: float
    input_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...] = ()
    block_tokens: int = 512
    session_id: str | None = None
    group_id: str | None = None
    trace_id: str = "0"
    source: str = "trace"
    turn: int = 1
    klass: str | None = None  # exported as column "class"
    # request metadata a router may read: the job a request belongs to as its client
    # labels it (Bursted-ART `metadata.job_kind`, e.g. "labeling"); a hint, not the truth
    job_kind: str | None = None


# Job kinds of Bursted-ART's burst-shaped jobs (the BTB write-up: data labeling, batch
# scoring / extraction, sub-agent fan-out); decoy jobs may carry them as well.
BURST_JOB_KINDS: tuple[str, ...] = ("labeling", "batch_extraction", "subagent_fanout")


@dataclass(slots=True)
class RequestRecord:
    """One row per request per variant per repeat. Backends stamp raw times only;
    ttft_s / tpot_s / e2e_s are derived from them by `derive_timings` when the records
    are stored (they are never set by a backend)."""

    variant: str
    repeat: int
    request_id: str
    trace_id: str
    source: str
    session_id: str | None
    instance: str  # instance that decoded (and prefilled unless prefill_instance is set)
    route: str  # e.g. COLO, HEAVY_OFFLOAD, WARM_HIT, PS
    arrival_s: float  # target send time (workload arrival after time_scale)
    sent_s: float  # actual send time
    first_token_s: float | None
    finish_s: float | None
    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    ok: bool = True
    error: str | None = None
    klass: str | None = None
    turn: int = 1
    group_id: str | None = None
    prefill_instance: str | None = None
    cache_tier: str | None = None  # where cached tokens came from: hbm, ram, disk, remote
    queue_s: float = 0.0  # time waiting for admission
    kv_load_s: float = 0.0  # loading cached KV from a lower tier
    kv_transfer_s: float = 0.0  # moving KV between instances (offload pull / warm wait)
    prefill_s: float = 0.0  # computing the uncached prompt tokens
    decode_s: float = 0.0
    extra: dict[str, float | int | str] = field(default_factory=dict)


@dataclass(slots=True)
class UtilSample:
    """Utilization of one device (GPU, or a process / simulated instance) at one time."""

    time_s: float
    instance: str
    device: str  # "gpu0", "proc", "sim"
    utilization: float  # 0..1
    memory_bytes: float = 0.0
    source: str = "sim"  # sim | nvml | psutil


@dataclass(slots=True)
class EventRecord:
    """One thing that happened at a time on the run's clock, the same record in both worlds
    (`events.parquet`, one row per event per variant per repeat). Kinds:

    - `waiting` / `running`: `instance`'s queue depth / running batch became `value` at
      `time_s` (a step function: it holds until the next event of that kind there);
    - `burst_detected`: the policy marked a prefix active (`label` its key, `value` the
      arrivals that fired it, `request_id` the one that did);
    - `warm_copy`: a prefix copy to `instance` from `peer` (`label` rdma / prefill), started
      at `time_s`, resident at `end_s` (NaN when it never landed), `value` its tokens;
    - `kv_transfer`: the KV of an offloaded request (`request_id`) moving from its prefill
      instance `peer` to its decode instance `instance`, `time_s` → `end_s`, `value` tokens;
    - `cache_action`: a policy's cache action on `instance` (`label` evict / demote /
      promote), `time_s` → `end_s` on its host link, `value` the tokens freed or moved.

    `origin` says who recorded it: `engine` and `router` watch the work itself, `policy`
    its decisions, `vllm_metrics` periodic /metrics scrapes, `records` a reconstruction
    from request records' time stamps."""

    time_s: float
    kind: str
    instance: str = ""
    peer: str = ""
    request_id: str = ""
    value: float = 0.0
    end_s: float | None = None
    label: str = ""
    origin: str = "engine"


EVENT_KINDS: tuple[str, ...] = ("waiting", "running", "burst_detected", "warm_copy",
                                "kv_transfer")  # fmt: skip
EVENT_COLUMNS: tuple[str, ...] = (
    "variant", "repeat", "time_s", "kind", "instance", "peer", "request_id", "value",
    "end_s", "label", "origin",
)  # fmt: skip


# What a backend stamps (one JSONL row per record in the run's parts/).
RECORD_COLUMNS: tuple[str, ...] = (
    "variant", "repeat", "request_id", "trace_id", "source", "session_id", "class",
    "instance", "route", "arrival_s", "sent_s", "first_token_s", "finish_s",
    "input_tokens", "output_tokens", "cached_tokens", "ok", "error",
    "turn", "group_id", "prefill_instance", "cache_tier", "queue_s", "kv_load_s",
    "kv_transfer_s", "prefill_s", "decode_s",
)  # fmt: skip
DERIVED_COLUMNS: tuple[str, ...] = ("ttft_s", "tpot_s", "e2e_s")
# The columns of `requests.parquet`: the raw stamps plus the latencies derived from them.
STORED_COLUMNS: tuple[str, ...] = (
    *RECORD_COLUMNS[: RECORD_COLUMNS.index("finish_s") + 1],
    *DERIVED_COLUMNS,
    *RECORD_COLUMNS[RECORD_COLUMNS.index("finish_s") + 1 :],
)

UTIL_COLUMNS: tuple[str, ...] = (
    "variant", "repeat", "time_s", "instance", "device", "utilization", "memory_bytes", "source",
)  # fmt: skip


def derive_timings(frame: pd.DataFrame) -> pd.DataFrame:
    """A copy of `frame` (RECORD_COLUMNS) with ttft_s, e2e_s and tpot_s computed from the raw
    stamps, as vLLM's benchmark counts them: TTFT = first token − send, E2E = finish −
    send, TPOT = (E2E − TTFT) / (output tokens − 1) for outputs longer than one token.
    Failed requests get NaN. The one formula both `requests.parquet` and the analysis use."""
    import numpy as np

    sent = _float_array(frame["sent_s"])
    first = _float_array(frame["first_token_s"])
    finish = _float_array(frame["finish_s"])
    ok = frame["ok"].to_numpy(bool)
    tokens = frame["output_tokens"].to_numpy(float)
    # numpy on the columns' arrays: the same float64 operations as on the Series, without
    # aligning indexes (a million-row run's report computed these in about 0.4 s)
    ttft = np.where(ok, first - sent, np.nan)
    e2e = np.where(ok, finish - sent, np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = np.where(ok & (tokens > 1), (e2e - ttft) / (tokens - 1), np.nan)
    derived = {"ttft_s": ttft, "e2e_s": e2e, "tpot_s": tpot}
    # stored columns are dropped and inserted again where they were: overwriting a column
    # in place copies the block of every other float column it shares
    columns = list(frame.columns)
    places = sorted((columns.index(name), name) for name in derived if name in columns)
    out = frame.drop(columns=[name for _, name in places])
    for place, name in places:
        out.insert(place, name, derived.pop(name))
    for name, values in derived.items():
        out[name] = values
    return out


def _float_array(column: pd.Series) -> Any:
    """A stamp column as float64 values, NaN where it holds no number (JSONL parts of a
    cluster run may hold None)."""
    import pandas as pd

    if column.dtype == "float64":
        return column.to_numpy()
    return pd.to_numeric(column, errors="coerce").to_numpy(float)
