"""Model-server throughput on CPU: `transformers serve` settings side by side, on the requests an
agentic evaluation sends (a held-out task's first turn: system prompt, tool schemas, task).

Run: .venv/bin/python benchmarks/serve_throughput.py [--model smollm2] [--requests 16] [--max-tokens 128]
     [--concurrency 16 4] [--agentic EVAL_SIZE]

Each setting serves the same model in turn and answers the same `--requests` chat requests, at
most `--concurrency` in flight at once (as a round's `eval.concurrency` rollouts are; several
values: each setting is measured at each). Printed per setting: wall seconds, completion tokens per
second, and the speed-up over the first setting (the shipped default) at the first concurrency.

`--agentic EVAL_SIZE` measures whole evaluations instead: every env's first EVAL_SIZE held-out
tasks through the full agent loop (every turn re-sends the growing conversation, so the KV cache's
size and prefix reuse count, which first turns alone never exercise). Printed per setting: wall
seconds, the speed-up, the success rate and a digest of every reply: greedy decoding, but a
different batch composition sums floats in a different order and can flip a near-tie token, so
the digest tells whether a setting changed any answer, and the success rate whether it mattered.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import tempfile
import time
from typing import Any

import httpx

from flywheel.data import ArtifactStore
from flywheel.environments.registry import TASK_FAMILIES, env_class
from flywheel.evaluation.agentic import AgenticEvalConfig, run_agentic_eval
from flywheel.flows.round_config import profile
from flywheel.inference import ModelServer, ServerConfig
from flywheel.training.models import resolve_model

SETTINGS: dict[str, dict[str, Any]] = {
    "shipped default": {},
    "one attention mask per step": {"varlen_sdpa": False},  # The library's SDPA over the whole packed batch.
    "8192 batch tokens": {"cb_max_batch_tokens": 8192},  # transformers' own default.
    "256 batch tokens": {"cb_max_batch_tokens": 256},
    "5 % RAM for KV, 256-token blocks": {"cb_max_memory_percent": 0.05, "cb_block_size": 256},  # The old default.
    "5 % RAM for KV": {"cb_max_memory_percent": 0.05},
    "256-token blocks": {"cb_block_size": 256},  # The library's: prefixes reused only in whole 256-token blocks.
    "30 % RAM for KV": {"cb_max_memory_percent": 0.30},
    "no sdpa gqa": {"sdpa_gqa": False},
    "eager attention": {"extra_args": ["--attn-implementation", "eager"]},
    "no continuous batching": {"continuous_batching": False},
    "bfloat16 weights": {"dtype": "bfloat16"},  # x0.97 on an AVX512-BF16 EPYC (--agentic 3): overhead-bound.
}


def first_turns(model_dir: str, count: int) -> list[dict[str, Any]]:
    """`count` first-turn chat requests, taken round robin from every task family's held-out items."""
    requests = []
    for index in range(count):
        env = env_class(TASK_FAMILIES[index % len(TASK_FAMILIES)])(tokenizer_name=model_dir, eval_size=count)
        asyncio.run(env.setup())
        schemas, _ = env._resolve_tools_for_group()
        item = env.eval_items[index // len(TASK_FAMILIES)]
        requests.append({"messages": env.build_messages(item, schemas), "tools": schemas})
    return requests


async def answer_all(
    base_url: str, model: str, requests: list[dict[str, Any]], max_tokens: int, concurrency: int
) -> int:
    """Send the requests, `concurrency` in flight at a time; the completion tokens of all answers."""
    slots = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=3600) as client:

        async def one(request: dict[str, Any]) -> int:
            body = request | {"model": model, "max_tokens": max_tokens, "temperature": 0.0}
            async with slots:
                response = await client.post("/chat/completions", json=body)
            response.raise_for_status()
            return response.json()["usage"]["completion_tokens"]

        return sum(await asyncio.gather(*(one(request) for request in requests)))


def agentic_eval(base_url: str, model: str, model_dir: str, eval_size: int, concurrency: int) -> dict[str, Any]:
    """Wall seconds, success rate and a digest of every reply of one agentic evaluation (the default
    round's turn and reply caps) against the server."""
    round_caps = profile("default")
    cfg = AgenticEvalConfig(
        base_url=base_url, model_name=model, tokenizer=model_dir, eval_size=eval_size, concurrency=concurrency,
        max_agent_turns=round_caps.max_agent_turns, max_token_length=round_caps.max_token_length,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        store = ArtifactStore(tmp)
        started = time.perf_counter()
        manifest = run_agentic_eval(cfg, store)
        seconds = time.perf_counter() - started
        texts = [store.read_bytes(manifest.id, f"samples/{name}.jsonl") for name in cfg.envs]
    samples = [json.loads(line) for text in texts for line in text.splitlines()]
    replies = [
        [m.get("content"), [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]]
        for s in samples for m in s["messages"] if m["role"] == "assistant"
    ]  # fmt: skip
    digest = hashlib.sha256(json.dumps(replies).encode()).hexdigest()[:12]  # Tool-call ids are random: left out.
    return {"seconds": seconds, "success": manifest.metrics["success_rate"], "replies": digest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--only", nargs="*", default=list(SETTINGS), help="Settings (the first is the baseline).")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16], help="Requests in flight at once.")
    parser.add_argument("--agentic", type=int, metavar="EVAL_SIZE", help="Whole agentic evaluations instead.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:  # A built-in model is prepared once, then found in the cache.
        model_dir = str(resolve_model(args.model, ArtifactStore(tmp)))
    requests = [] if args.agentic else first_turns(model_dir, args.requests)
    baseline = None
    for name in args.only:
        with ModelServer(ServerConfig(model=model_dir, **SETTINGS[name])) as server:
            for concurrency in args.concurrency:
                label = f"{name}, {concurrency} in flight"
                if args.agentic:
                    run = agentic_eval(server.base_url, server.model_name or "", model_dir, args.agentic, concurrency)
                    baseline = baseline or run["seconds"]
                    print(f"{label:36s} {run['seconds']:7.1f} s x{baseline / run['seconds']:.2f}  success "
                          f"{run['success']:.3f}  replies {run['replies']}", flush=True)  # fmt: skip
                    continue
                started = time.perf_counter()
                answer = answer_all(server.base_url, server.model_name or "", requests, args.max_tokens, concurrency)
                tokens = asyncio.run(answer)
                seconds = time.perf_counter() - started
                rate = tokens / seconds
                baseline = baseline or rate
                print(f"{label:36s} {seconds:7.1f} s {tokens:6d} tokens {rate:7.1f} tokens/s x{rate / baseline:.2f}",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
