"""What the timeline plot draws, from stored data only: the run's events, completed where
a backend did not record a kind by reconstructions from the request records, the
workload's burst windows, and request routes counted per instance and time bin.

Reconstructions (`origin` `records`), used only for a variant × repeat whose stored
events lack that kind:

- `waiting` / `running` from each request's stamps. Simulator records carry the queue and
  prefill times, so a co-located request waits from its send until its prefill starts
  (first token − prefill − KV load) and runs until it finishes; an offloaded one waits
  and prefills on its prefill instance, its KV moves (`kv_transfer_s`), and it runs on its
  decode instance from its first token (taken to be admitted there at once). Real-cluster
  records have no queue time: every request in flight counts as running.
- `kv_transfer` of offloaded requests: [first token − kv_transfer_s, first token].

Aggregation keeps a million-request timeline cheap: counters are runs on a fixed grid
(`events.step_runs`), routes are counts per (instance, route, time bin).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from btb_lab.analysis.scopes import rows_where, variant_rows
from btb_lab.events import LOAD_INTERVAL_S, interval_arrays
from btb_lab.records import EVENT_COLUMNS

__all__ = [
    "BURST_MIN_RATE_PER_S",
    "BURST_MIN_REQUESTS",
    "burst_windows",
    "reconstruct_events",
    "route_counts",
    "timeline_events",
]

# A group of requests (same group_id) is a burst when it has at least this many requests
# arriving at least this fast (the demo: 96 in 8 s; a shared system prompt's background
# traffic: a dozen over minutes).
BURST_MIN_REQUESTS = 8
BURST_MIN_RATE_PER_S = 1.0


def _frame(
    variant: str, repeat: int, kind: str, instance: str,
    runs: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> pd.DataFrame:  # fmt: skip
    starts, ends, values = runs
    return pd.DataFrame({
        "variant": variant, "repeat": repeat, "time_s": starts, "kind": kind,
        "instance": instance, "peer": "", "request_id": "", "value": values, "end_s": ends,
        "label": "", "origin": "records",
    }, columns=list(EVENT_COLUMNS))  # fmt: skip


# what a reconstruction reads of a variant × repeat's records
_RECONSTRUCT_COLUMNS = [
    "ok", "sent_s", "first_token_s", "finish_s", "prefill_s", "kv_load_s", "kv_transfer_s",
    "queue_s", "instance", "prefill_instance", "request_id", "input_tokens",
]  # fmt: skip


def reconstruct_events(
    records: pd.DataFrame, variant: str, repeat: int, interval_s: float | None = None
) -> pd.DataFrame:
    """`waiting`, `running` and `kv_transfer` events of one variant × repeat rebuilt from
    its records (see the module docstring). The grid is LOAD_INTERVAL_S, coarser for long
    runs (at most about 4,000 intervals: more than a plot shows)."""
    rows = variant_rows(records, variant, _RECONSTRUCT_COLUMNS, repeat)
    rows = rows_where(rows, rows["ok"].astype(bool))
    if rows.empty:
        return pd.DataFrame(columns=list(EVENT_COLUMNS))
    if interval_s is None:
        span = float(np.nanmax(rows["finish_s"].to_numpy(float)) - rows["sent_s"].min())
        interval_s = max(LOAD_INTERVAL_S, span / 4000)
    sent = rows["sent_s"].to_numpy(float)
    first = rows["first_token_s"].to_numpy(float)
    finish = rows["finish_s"].to_numpy(float)
    prefill = rows["prefill_s"].to_numpy(float)
    load = rows["kv_load_s"].to_numpy(float)
    transfer = rows["kv_transfer_s"].to_numpy(float)
    decode_inst = rows["instance"].astype(str).to_numpy()
    p_inst = rows["prefill_instance"].astype(object).to_numpy()
    offloaded = pd.notna(p_inst)  # None, NaN: co-located; so is an empty name
    offloaded[offloaded] = p_inst[offloaded].astype(str) != ""
    # rows with queue / prefill stamps (the simulator's, an offload's) place the admission;
    # a real co-located request only says it was in flight
    timed = (rows["queue_s"].to_numpy(float) > 0) | (prefill > 0)
    # co-located: admission = prefill start; offloaded: prefill instance until the KV moves
    p_done = np.where(offloaded, first - transfer, first)
    admit = np.where(timed, p_done - prefill - load, sent)
    admit = np.clip(admit, sent, None)
    waiting: dict[str, list[np.ndarray]] = {}
    running: dict[str, list[np.ndarray]] = {}

    def add(store: dict[str, list[np.ndarray]], names: np.ndarray, a: np.ndarray,
            b: np.ndarray) -> None:  # fmt: skip
        if names.size == 0:  # e.g. no co-located request when every one was offloaded
            return
        codes, uniques = pd.factorize(names)
        order = np.argsort(codes, kind="stable")
        cuts = np.cumsum(np.bincount(codes, minlength=len(uniques)))[:-1]
        for name, part in zip(uniques, np.split(order, cuts), strict=True):
            store.setdefault(str(name), []).append(np.stack([a[part], b[part]]))

    prefill_names = np.where(offloaded, p_inst.astype(str), decode_inst)
    add(waiting, prefill_names, sent, admit)
    colo = ~offloaded
    add(running, decode_inst[colo], admit[colo], finish[colo])
    if offloaded.any():
        add(running, prefill_names[offloaded], admit[offloaded], p_done[offloaded])
        add(running, decode_inst[offloaded], first[offloaded], finish[offloaded])
        moved = offloaded
        transfers = pd.DataFrame({
            "variant": variant, "repeat": repeat, "time_s": p_done[moved], "kind": "kv_transfer",
            "instance": decode_inst[moved].astype(str), "peer": p_inst[moved].astype(str),
            "request_id": rows["request_id"].astype(str).to_numpy()[moved],
            "value": rows["input_tokens"].to_numpy(float)[moved], "end_s": first[moved],
            "label": "", "origin": "records",
        }, columns=list(EVENT_COLUMNS))  # fmt: skip
    frames = [transfers] if offloaded.any() else []
    for kind, store in (("waiting", waiting), ("running", running)):
        for name, parts in sorted(store.items()):
            spans = np.concatenate(parts, axis=1)
            runs = interval_arrays(spans[0], spans[1], interval_s)
            frames.append(_frame(variant, repeat, kind, name, runs))
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame(columns=list(EVENT_COLUMNS))
    return pd.concat(frames, ignore_index=True)


def timeline_events(records: pd.DataFrame, events: pd.DataFrame) -> pd.DataFrame:
    """Stored events, plus reconstructions for every (variant, repeat, kind) of waiting,
    running and kv_transfer the backend did not record."""
    frames = [events] if not events.empty else []
    have: set[tuple[Any, Any, Any]] = set()
    if not events.empty:  # the distinct keys first, not a Python step per event
        keys = events[["variant", "repeat", "kind"]].drop_duplicates()
        have = set(zip(keys["variant"], keys["repeat"], keys["kind"], strict=True))
    # (variant, repeat) pairs in order of appearance, as a groupby without sorting gives
    # them, without materializing each group's rows
    pairs = records[["variant", "repeat"]].drop_duplicates()
    for variant, repeat in zip(pairs["variant"], pairs["repeat"], strict=True):
        missing = {
            k for k in ("waiting", "running", "kv_transfer") if (variant, repeat, k) not in have
        }
        if not missing:
            continue
        if missing == {"kv_transfer"}:
            offloads = variant_rows(records, variant, ["prefill_instance"], repeat)
            if not offloads["prefill_instance"].notna().any():
                continue  # nothing was offloaded: there is no transfer to rebuild
        rebuilt = reconstruct_events(records, str(variant), int(str(repeat)))
        frames.append(rebuilt[rebuilt["kind"].isin(missing)])
    if not frames:
        return pd.DataFrame(columns=list(EVENT_COLUMNS))
    return pd.concat(frames, ignore_index=True)


def burst_windows(records: pd.DataFrame, variant: str, repeat: int) -> pd.DataFrame:
    """[start_s, end_s] of every burst among one variant × repeat's requests: a group with
    at least BURST_MIN_REQUESTS requests arriving at BURST_MIN_RATE_PER_S or faster."""
    rows = variant_rows(records, variant, ["group_id", "arrival_s"], repeat)
    rows = rows[rows["group_id"].notna()]
    if rows.empty:
        return pd.DataFrame(columns=["group_id", "start_s", "end_s", "requests"])
    spans = rows.groupby("group_id")["arrival_s"].agg(["min", "max", "size"])
    rate = (spans["size"] - 1) / (spans["max"] - spans["min"]).clip(lower=1e-9)
    bursts = spans[(spans["size"] >= BURST_MIN_REQUESTS) & (rate >= BURST_MIN_RATE_PER_S)]
    return (
        bursts.rename(columns={"min": "start_s", "max": "end_s", "size": "requests"})
        .reset_index()
        .sort_values("start_s", kind="stable")
        .reset_index(drop=True)
    )


def route_counts(records: pd.DataFrame, variant: str, repeat: int, bin_s: float) -> pd.DataFrame:
    """Requests per (instance, route, arrival bin) of one variant × repeat: columns
    instance, route, bin_start_s, requests."""
    rows = variant_rows(records, variant, ["instance", "route", "arrival_s"], repeat)
    bins = np.floor(rows["arrival_s"].to_numpy(float) / bin_s) * bin_s
    known = ~np.isnan(bins)  # a groupby leaves out a missing key
    if not known.any():
        return pd.DataFrame(columns=["instance", "route", "bin_start_s", "requests"])
    # one integer key per (instance, route, bin), each part coded in sorted order, so that
    # sorting the keys sorts as a three-column groupby would, without grouping strings
    inst_codes, inst_names = pd.factorize(rows["instance"].astype(str).to_numpy()[known], sort=True)
    route_codes, route_names = pd.factorize(rows["route"].astype(str).to_numpy()[known], sort=True)
    bin_values, bin_codes = np.unique(bins[known], return_inverse=True)
    key = (inst_codes.astype(np.int64) * len(route_names) + route_codes) * len(bin_values)
    keys, requests = np.unique(key + bin_codes, return_counts=True)
    inst_route, bin_of = np.divmod(keys, len(bin_values))
    inst_of, route_of = np.divmod(inst_route, len(route_names))
    return pd.DataFrame({
        "instance": np.asarray(inst_names, dtype=object)[inst_of],
        "route": np.asarray(route_names, dtype=object)[route_of],
        "bin_start_s": bin_values[bin_of], "requests": requests.astype(np.int64),
    })  # fmt: skip
