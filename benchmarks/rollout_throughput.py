"""Rollout throughput: stock atroposlib `process` vs ours, same env, same latency-injected server.

Run: .venv/bin/python benchmarks/rollout_throughput.py [--latency 0.2] [--groups 1024] [--concurrency 32]
     [--processes 2] [--profile]

A local OpenAI-compatible server answers every chat request after `--latency` seconds with a
final answer, up to `--slots` requests at once (its saturated throughput is `slots / latency`,
measured directly with a load generator). The same ToolUseChainEnv (sandbox, verifier,
tokenisation included) then runs groups of 4 rollouts three ways: through atroposlib's stock
`BaseEnv.process_manager` (one group at a time), through ours in one process (`--concurrency`
groups in flight), and through ours in `--processes` processes (`process_workers`; the spawned
workers' start-up, ~6 s of imports on this machine, is inside the timed run). Prints groups/s of
each, the speed-ups over stock (goal >= 12x), and our request rate as a fraction of the server's
saturated rate (goal >= 0.8).

`--profile` adds a third run of ours under `rollout_phases.PhaseProfiler` and prints the CPU ms
per rollout of each phase (sandbox set-up and tear-down, agent loop + SDK, tools, verifier,
tokenisation, ...) and of the inference server per request. It runs apart from the timed runs:
its hooks slow what they measure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jsonlines

ROOT = Path(__file__).resolve().parents[1]

_SERVER = """
import asyncio, json, sys, time
from aiohttp import web
latency, slots = float(sys.argv[2]), int(sys.argv[3])
gate = asyncio.Semaphore(slots)
async def models(request):
    return web.json_response({"object": "list", "data": [{"id": "bench", "object": "model"}]})
async def chat(request):
    await request.read()
    async with gate:
        await asyncio.sleep(latency)
    return web.json_response({
        "id": "x", "object": "chat.completion", "created": int(time.time()), "model": "bench",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "All done."}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}})
app = web.Application()
app.add_routes([web.get("/v1/models", models), web.post("/v1/chat/completions", chat)])
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


async def saturated_rate(base_url: str, requests: int, concurrency: int) -> float:
    """Requests/s the server sustains when flooded (its ceiling), measured with aiohttp."""
    import aiohttp

    gate = asyncio.Semaphore(concurrency)
    body = {"model": "bench", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def one() -> None:
            async with gate, session.post(f"{base_url}/chat/completions", json=body) as response:
                response.raise_for_status()
                await response.read()

        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(requests)))
        return requests / (time.perf_counter() - started)


def make_env(base_url: str, tokenizer: str, groups: int, concurrency: int, out: Path, processes: int = 1):  # type: ignore[no-untyped-def]
    from atroposlib.envs.base import APIServerConfig

    from flywheel.environments.tool_use_chain import ToolUseChainEnv

    server = APIServerConfig(
        base_url=base_url, model_name="bench", api_key="x", server_type="openai", health_check=False,
        num_max_requests_at_once=1024,
    )  # fmt: skip
    env = ToolUseChainEnv(
        server_configs=[server], tokenizer_name=tokenizer, group_size=4, total_steps=groups,
        process_concurrency=concurrency, max_agent_turns=2, data_path_to_save_groups=str(out),
        ensure_scores_are_not_same=False, use_wandb=False, difficulty="easy", process_workers=processes,
    )  # fmt: skip
    env.process_mode = True
    env.n_groups_to_process = groups
    env.group_size_to_process = 4
    return env


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU of a live process (Linux `/proc/<pid>/stat`)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_run(coroutine_factory) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    asyncio.run(coroutine_factory())
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--slots", type=int, default=64, help="requests the server handles at once")
    parser.add_argument("--groups", type=int, default=1024)
    parser.add_argument("--stock-groups", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=32, help="groups in flight in each of our processes")
    parser.add_argument("--processes", type=int, default=2, help="processes of the multi-process run")
    parser.add_argument("--tokenizer", default=None, help="local tokenizer dir (default: the prepared tiny model)")
    parser.add_argument("--profile", action="store_true", help="also print CPU ms per rollout by phase")
    args = parser.parse_args()

    from atroposlib.envs.base import BaseEnv

    from flywheel.data import ArtifactStore
    from flywheel.inference import free_port, wait_until_healthy
    from flywheel.training.models import resolve_model

    tokenizer = args.tokenizer or str(resolve_model("tiny", ArtifactStore()))
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(port), str(args.latency), str(args.slots)])
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_until_healthy(base_url, 30, server)
        ceiling = asyncio.run(saturated_rate(base_url, args.slots * 8, args.slots * 2))
        with tempfile.TemporaryDirectory() as tmp:
            stock = make_env(base_url, tokenizer, args.stock_groups, 1, Path(tmp, "stock.jsonl"))
            stock.jsonl_writer = jsonlines.open(Path(tmp, "stock.jsonl"), "w")  # What stock BaseEnv opens.
            stock_s = timed_run(lambda: BaseEnv.process_manager(stock))
            rates = {}
            for processes in (1, args.processes):
                out = Path(tmp, f"ours-{processes}.jsonl")
                seconds = timed_run(
                    make_env(base_url, tokenizer, args.groups, args.concurrency, out, processes).process_manager
                )
                rates[processes] = len(out.read_text().splitlines()) / seconds
            if args.profile:
                from rollout_phases import PhaseProfiler

                profiler = PhaseProfiler()
                profiled = make_env(
                    base_url, tokenizer, min(args.groups, 256), args.concurrency, Path(tmp, "profiled.jsonl")
                )
                server_cpu = process_cpu_seconds(server.pid)
                profiler.run(profiled)
                server_cpu = process_cpu_seconds(server.pid) - server_cpu
    finally:
        server.kill()
    stock_rate = args.stock_groups / stock_s
    print(f"server ceiling: {ceiling:.0f} requests/s ({args.slots} slots x {args.latency * 1000:.0f} ms)")
    print(f"stock atroposlib process: {stock_rate:.2f} groups/s")
    for processes, rate in rates.items():
        fraction = rate * 4 / ceiling  # One model call per rollout (the reply is a final answer).
        print(
            f"flywheel process, {processes} process(es) x concurrency {args.concurrency}: {rate:.2f} groups/s, "
            f"{rate / stock_rate:.1f}x stock (goal >= 12x), {fraction:.2f} of the server's saturated rate (goal >= 0.8)"
        )
    if args.profile:
        print(f"\nCPU per rollout by phase ({profiler.rollouts} rollouts in a separate, profiled run):")
        print(profiler.table(server_cpu, profiler.rollouts))


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()
