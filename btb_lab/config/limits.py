"""Upper bounds on the values that decide how much memory or time a run takes.

Each bound sits far above anything a real experiment uses, so it only ever refuses a typo
or a hostile file (`count: 100000000000`, `sample_interval_s: 1e-9`) with a clear message
before the run starts, instead of a MemoryError or a hang after it did. The reason for
each number is in its comment and in the description of the fields that use it.
"""

from __future__ import annotations

__all__ = [
    "MAX_BLOCK_TOKENS",
    "MAX_BOOTSTRAP_SAMPLES",
    "MAX_GPUS_PER_INSTANCE",
    "MAX_INSTANCES",
    "MAX_REPEATS",
    "MAX_REQUESTS",
    "MAX_SWEEP_POINTS",
    "MAX_TOKENS",
    "MAX_TURN",
    "MAX_UTIL_SAMPLES",
    "MIN_SAMPLE_INTERVAL_S",
]

# Requests one run replays: ten times the one-million-request simulator benchmark (1.2 GB
# peak RSS, README "Performance"); ten million already needs about 12 GB.
MAX_REQUESTS = 10_000_000

# Tokens in one prompt or one output: ten times the longest context window of current
# models (1M tokens). Block ids and, on a real cluster, prompts scale with it.
MAX_TOKENS = 10_000_000

# Tokens in one prefix-hash block: 2^20 is beyond any engine's block, and keeps the block
# arithmetic (ceil(tokens / block) in int64) from overflowing.
MAX_BLOCK_TOKENS = 1 << 20

# A request's turn in its session: a session has no more turns than a run has requests.
MAX_TURN = MAX_REQUESTS

# Instances in one instance group: the shipped hypotheses use at most 16; the simulator
# keeps per-instance caches and bins, so a million instances exhausts memory.
MAX_INSTANCES = 10_000

# GPUs per instance (the tensor-parallel size): an NVL72 rack is 72 GPUs.
MAX_GPUS_PER_INSTANCE = 1024

# Repeats of every variant: statistics settle after a handful; each repeat is a full run.
MAX_REPEATS = 1000

# Bootstrap resamples: 1,000 is the default and 10,000 already gives a stable 95%
# interval; each resample recomputes the metric in Python.
MAX_BOOTSTRAP_SAMPLES = 100_000

# Simulated utilization sampling: no finer than 10 ms, ten times finer than the real
# cluster's 10 Hz NVML sampling it is compared with.
MIN_SAMPLE_INTERVAL_S = 0.01

# Utilization samples of one simulated run (instances × sampled periods): a week-long
# trace sampled every second on 16 instances is 9.7 million.
MAX_UTIL_SAMPLES = 10_000_000

# Points of one sweep: every point is a full run; the shipped sweeps have at most 12.
MAX_SWEEP_POINTS = 10_000
