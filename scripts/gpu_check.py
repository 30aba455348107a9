"""The steps of `scripts/gpu_check.sh`, each timed and recorded in one JSON summary; a failed step is
recorded with its error and the next one runs. `--dry-run` prints the steps and their commands."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flywheel.inference.server import vllm_cli  # noqa: E402

CONCURRENCY = 32  # Requests in flight, ours and `vllm bench serve` alike (8 groups of 4 rollouts).
H100_BF16_PEAK = 989e12  # Dense bf16 FLOP/s of an H100 / H200 SXM: the MFU denominator.
SERVED_NAME = "SmolLM2-135M-Instruct"


def bench_command(base_url: str, model: str, tokenizer: str, prompts: int = 256) -> list[str]:
    """`vllm bench serve` of the GPU runtime at our concurrency: chat requests shaped like an agent turn
    (long prompt, short reply); `tokenizer` is the served model's directory (its served name is neither
    a path nor a hub id)."""
    return [
        *vllm_cli(), "bench", "serve", "--backend", "openai-chat", "--base-url", base_url.removesuffix("/v1"),
        "--endpoint", "/v1/chat/completions", "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
        "--random-input-len", "768", "--random-output-len", "96", "--num-prompts", str(prompts),
        "--max-concurrency", str(CONCURRENCY),
    ]  # fmt: skip


def process_command(base_url: str, model: str, tokenizer: str, out: Path) -> list[str]:
    """Our `process` mode on tool_use_chain against the same server, `CONCURRENCY` rollouts in flight."""
    return [
        sys.executable, "environments/tool_use_chain.py", "process", "--env.total_steps", "32",
        "--env.group_size", "4", "--env.process_concurrency", str(CONCURRENCY // 4),
        "--env.data_path_to_save_groups", str(out), "--env.tokenizer_name", tokenizer,
        "--openai.base_url", base_url, "--openai.model_name", model, "--openai.server_type", "openai",
        "--openai.health_check", "false",
    ]  # fmt: skip


def requests_per_second(groups_file: Path) -> float:
    """Chat requests our run made per second: one per assistant turn of every stored rollout."""
    stats = json.loads(groups_file.with_suffix(".stats.json").read_text())
    turns = 0
    for line in groups_file.read_text().splitlines():
        group = json.loads(line)
        turns += sum(m.get("role") == "assistant" for msgs in group.get("messages", []) for m in msgs)
    return turns / stats["seconds"]


def bench_requests_per_second(output: str) -> float:
    match = re.search(r"Request throughput \(req/s\):\s*([\d.]+)", output)
    if not match:
        raise RuntimeError(f"no request throughput in vllm bench output: {output[-500:]}")
    return float(match.group(1))


class Summary:
    def __init__(self, out: Path) -> None:
        self.out, self.data = out, {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": {}}

    def step(self, name: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        started = time.perf_counter()
        try:
            result: dict[str, Any] | None = run()
            record = {"ok": True, **(result or {})}
        except Exception as err:  # A failed step is recorded; the next one still runs.
            result, record = None, {"ok": False, "error": f"{type(err).__name__}: {str(err)[-800:]}"}
        record["seconds"] = round(time.perf_counter() - started, 1)
        self.data["steps"][name] = record
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=2))
        print(f"[gpu_check] {name}: {json.dumps(record)[:400]}", flush=True)
        return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("gpu_check"))
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    if args.dry_run:
        url = "http://127.0.0.1:8000/v1"
        plan = {
            "steps": ["device", "rollouts_vs_vllm_bench", "sft_bf16", "grpo_vllm_colocate", "round_cuda"],
            "bench": bench_command(url, SERVED_NAME, "<smollm2 dir>"),
            "process": process_command(url, SERVED_NAME, "<smollm2 dir>", Path("<out>/tuc.jsonl")),
            "round": ["flywheel", "round", "--profile", "tiny", "--device", "cuda"],
        }
        print(json.dumps(plan, indent=2))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    summary = Summary(args.out)
    run_checks(summary, args.out.resolve())
    print(json.dumps(summary.data, indent=2))


def run_checks(summary: Summary, out: Path) -> None:
    import torch

    from flywheel.data import ArtifactStore
    from flywheel.inference import ModelServer, ServerConfig
    from flywheel.training.models import resolve_model

    store = ArtifactStore(out / "store")
    cuda = torch.cuda.is_available()
    summary.step("device", lambda: {"cuda": cuda, "name": torch.cuda.get_device_name(0) if cuda else None})
    model_dir = str(resolve_model("smollm2", store))

    def serve_and_compare() -> dict[str, Any]:
        config = ServerConfig(model=model_dir, backend="vllm", dtype="bfloat16", served_model_name=SERVED_NAME)
        with ModelServer(config) as server:
            groups = out / "tuc.jsonl"
            command = process_command(server.base_url, SERVED_NAME, model_dir, groups)
            subprocess.run(command, cwd=ROOT, check=True, capture_output=True, timeout=150)
            ours = requests_per_second(groups)
            bench = subprocess.run(
                bench_command(server.base_url, SERVED_NAME, model_dir), capture_output=True, text=True, timeout=150
            )
            theirs = bench_requests_per_second(bench.stdout + bench.stderr)
        return {"ours_req_s": round(ours, 2), "vllm_bench_req_s": theirs, "ratio": round(ours / theirs, 3),
                "concurrency": CONCURRENCY}  # fmt: skip

    summary.step("rollouts_vs_vllm_bench", serve_and_compare)
    summary.step("sft_bf16", lambda: sft_mfu(store, model_dir, out))
    summary.step("grpo_vllm_colocate", lambda: grpo_steps(store, model_dir, out))
    summary.step("round_cuda", lambda: tiny_round(out))


def sft_mfu(store: Any, model_dir: str, out: Path) -> dict[str, Any]:
    """20 bf16 SFT steps on oracle conversations; MFU = 6 * params * tokens / seconds / peak."""
    from benchmarks.sft_throughput import oracle_rows
    from flywheel.training.sft import SFTRunConfig, run_sft

    data = out / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in oracle_rows(model_dir, 64)))
    cfg = SFTRunConfig(
        policy_model=model_dir, dataset=str(data), device="cuda", total_steps=20, batch_size=16, max_length=1024,
        learning_rate=1e-4, logs_root=str(out / "logs"), output_name="gpu-sft",
    )  # fmt: skip
    manifest = run_sft(cfg, store)
    params = 134.5e6  # SmolLM2-135M
    seconds, tokens = manifest.metrics["wall_seconds"], manifest.metrics["tokens_processed"]
    mfu = 6 * params * tokens / seconds / H100_BF16_PEAK  # Wall time includes loading: a lower bound.
    return {"steps": manifest.metrics["steps"], "tokens": tokens, "seconds": seconds, "mfu": round(mfu, 4),
            "final_loss": manifest.metrics["final_loss"]}  # fmt: skip


def grpo_steps(store: Any, model_dir: str, out: Path) -> dict[str, Any]:
    from flywheel.training.grpo import GRPORunConfig
    from flywheel.training.registry import run_training

    cfg = GRPORunConfig(
        policy_model=model_dir, device="cuda", use_vllm=True, vllm_mode="colocate", total_steps=5,
        envs=["tool_use_chain"], difficulty="easy", batch_size=8, num_rollouts_per_task=4, max_completion_length=256,
        num_tasks=16, logs_root=str(out / "logs"), output_name="gpu-grpo",
    )  # fmt: skip
    manifest = run_training(cfg, store)
    return {k: manifest.metrics.get(k) for k in ("steps", "first_reward", "final_reward", "kl", "wall_seconds")}


def tiny_round(out: Path) -> dict[str, Any]:
    """`flywheel round` of the Prefect environment (FLYWHEEL_CLI; the GPU runtime has no Prefect)."""
    flywheel = os.environ.get("FLYWHEEL_CLI") or str(Path(sys.executable).parent / "flywheel")
    result = subprocess.run([flywheel, "--store", str(out / "round-store"), "round", "--profile", "tiny",
                             "--device", "cuda"], capture_output=True, text=True, timeout=240, cwd=ROOT)  # fmt: skip
    if result.returncode:
        raise RuntimeError(result.stderr[-800:])
    return {"summary": result.stdout[-600:]}


if __name__ == "__main__":
    main()
