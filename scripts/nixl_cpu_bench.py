"""Decode wall time with and without a NIXL KV transfer between two vLLM CPU instances.

    .venv/bin/python scripts/nixl_cpu_bench.py [--stock] [--own-session] [--busy] [--n 8]

Starts a producer P (kv_producer, core 0) and a consumer D (kv_consumer, core 1 mod
cores) serving the tiny model as the launcher does, then for each of n prompts: P
prefills it for remote decode (max_tokens 1), D reads the KV over NIXL and decodes 16
tokens (streamed: TTFT and E2E); and D decodes a fresh prompt of the same length with no
transfer, for comparison. Prints each pair, the medians, and what D's /metrics say NIXL
moved. `--stock` runs vLLM's NixlConnector unchanged (nixl's zero progress-thread poll
timeout, the model thread pinned by NIXL); `--own-session` starts each server in its own
session, as the launcher used to; `--busy` keeps P prefilling other 1,500-token prompts
meanwhile. With all three, 0.1 s transfers took 20–100 s here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from btb_lab.cluster.driver import RunClock, completion_payload, stream_completion  # noqa: E402
from btb_lab.cluster.launcher import Launcher, plan_instances, tail_lines  # noqa: E402
from btb_lab.config.hypothesis import ClusterSpec  # noqa: E402

MODEL = ROOT / ".models" / "tiny-llama"
PROMPT_TOKENS = 480
OUTPUT_TOKENS = 16


def cluster(stock: bool) -> ClusterSpec:
    args = ["--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "2048",
            "--max-num-seqs", "8"]  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "{cpu}"}
    return ClusterSpec.model_validate(
        {
            "instances": [{"role": "PS", "count": 1}, {"role": "C", "count": 1}],
            "kv_connector": {
                "type": "nixl", "roles": {"PS": "kv_producer", "C": "kv_consumer"},
                "nixl_progress_delay_us": None if stock else 1000,
            },
            "launch": {"served_model": str(MODEL), "device": "cpu",
                       "extra_args": {"PS": args, "C": args}, "env": {"PS": env, "C": env}},
        }
    )  # fmt: skip


def prompt(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128, 1024) for _ in range(n)]


async def measure(p_url: str, d_url: str, n: int) -> list[tuple[float, float, float, float, float]]:
    rows = []
    clock = RunClock()
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        for i in range(n):
            tokens = prompt(i)
            body = completion_payload(
                str(MODEL), tokens, 1, stream=False,
                kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False},
            )  # fmt: skip
            pre = await stream_completion(client, p_url + "/v1/completions", body, clock)
            if not pre.ok:
                raise RuntimeError(f"prefill failed: {pre.error} {pre.detail}")
            params = pre.body["kv_transfer_params"]
            dec_body = completion_payload(
                str(MODEL), tokens, OUTPUT_TOKENS, kv_transfer_params=params
            )
            dec = await stream_completion(client, d_url + "/v1/completions", dec_body, clock)
            plain_body = completion_payload(str(MODEL), prompt(10_000 + i), OUTPUT_TOKENS)
            plain = await stream_completion(client, d_url + "/v1/completions", plain_body, clock)
            if not (dec.ok and plain.ok):
                raise RuntimeError(f"decode failed: {dec.error} {dec.detail} / {plain.error}")
            assert pre.finish_s is not None
            assert dec.first_token_s is not None
            assert dec.last_chunk_s is not None
            assert plain.first_token_s is not None
            assert plain.last_chunk_s is not None
            row = (
                pre.finish_s - pre.sent_s,
                dec.first_token_s - dec.sent_s,
                dec.last_chunk_s - dec.sent_s,
                plain.first_token_s - plain.sent_s,
                plain.last_chunk_s - plain.sent_s,
            )
            rows.append(row)
            print(
                f"{i}: prefill on P {row[0]:.3f} s | with transfer: TTFT {row[1]:.3f} s "
                f"E2E {row[2]:.3f} s | no transfer: TTFT {row[3]:.3f} s E2E {row[4]:.3f} s",
                flush=True,
            )
    return rows


def keep_busy(p_url: str, stop: threading.Event) -> None:
    with httpx.Client(timeout=600, trust_env=False) as client:
        i = 0
        while not stop.is_set():
            body = {"model": str(MODEL), "prompt": prompt(50_000 + i, 1500), "max_tokens": 1}
            client.post(p_url + "/v1/completions", json=body)
            i += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stock", action="store_true", help="vLLM's NixlConnector unchanged")
    parser.add_argument("--own-session", action="store_true", help="a session per server")
    parser.add_argument("--busy", action="store_true", help="P prefills other prompts meanwhile")
    parser.add_argument("--n", type=int, default=8, help="transfers to measure")
    args = parser.parse_args()
    specs = plan_instances(cluster(args.stock), model=str(MODEL), block_tokens=64)
    logs = Path(tempfile.mkdtemp(prefix="nixl-bench-"))
    launcher = Launcher(logs, ready_timeout_s=900)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        if args.own_session:
            for spec in specs:
                log = (logs / f"{spec.name}.log").open("ab")
                procs.append(subprocess.Popen(
                    list(spec.command), stdout=log, stderr=subprocess.STDOUT,
                    env={**os.environ, **spec.env}, start_new_session=True,
                ))  # fmt: skip
            with httpx.Client(timeout=2, trust_env=False) as c:
                for spec in specs:
                    while True:
                        try:
                            if c.get(spec.base_url + "/health").status_code == 200:
                                break
                        except httpx.HTTPError:
                            pass
                        time.sleep(0.5)
            p_url, d_url = specs[0].base_url, specs[1].base_url
        else:
            p_ep, d_ep = launcher.start(specs)
            p_url, d_url = p_ep.base_url, d_ep.base_url
        stop = threading.Event()
        if args.busy:
            threading.Thread(target=keep_busy, args=(p_url, stop), daemon=True).start()
        rows = asyncio.run(measure(p_url, d_url, args.n))
        stop.set()
        med = [statistics.median(col) for col in zip(*rows[1:], strict=True)]  # first: handshake
        worst = [max(col) for col in zip(*rows, strict=True)]
        cols = ("prefill", "with transfer TTFT", "E2E", "no transfer TTFT", "E2E")
        for label, values in (("median (after the first)", med), ("max", worst)):
            print(
                label + ": " + " | ".join(f"{c} {v:.3f}" for c, v in zip(cols, values, strict=True))
            )
        text = httpx.get(d_url + "/metrics", timeout=10).text
        from btb_lab.cluster.telemetry import parse_vllm_metrics

        m = parse_vllm_metrics(text)
        xfers = m.get("nixl_xfers", 0.0) or 1.0
        print(
            f"D's /metrics: {m.get('external_prefix_cache_hits', 0):.0f} tokens transferred in "
            f"{m.get('nixl_xfers', 0):.0f} transfers, {m.get('nixl_bytes', 0) / 2**20:.2f} MiB, "
            f"NIXL transfer time {m.get('nixl_xfer_s', 0) / xfers * 1e3:.1f} ms per transfer"
        )
    except BaseException:
        for spec in specs:
            print(f"--- {spec.name}\n{tail_lines(logs / f'{spec.name}.log', 20)}", file=sys.stderr)
        raise
    finally:
        launcher.stop()
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


if __name__ == "__main__":
    main()
