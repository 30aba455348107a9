"""SFT throughput: our SFT stage vs a plain TRL script, same data, model and steps, side by side.

Run: .venv/bin/python benchmarks/sft_throughput.py [--model tiny] [--steps 10] [--repeats 2] [--fp32]

The data are oracle trajectories of ToolUseChainEnv (curated). "Ours" is `flywheel.training.sft.run_sft`
end to end (tokenisation with assistant masks, training, checkpoint into the store); "plain" is
the script a TRL user writes: `load_dataset("json")` + `SFTTrainer(assistant_only_loss=True)` +
`save_model`. Both train on the same tokens, in the device's precision (bf16 autocast where the
CPU has bf16 dot products); the ratio is plain wall time / ours (goal >= 0.95). `--fp32` also runs
our stage without autocast and prints what mixed precision buys (fp32 wall time / ours).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

PLAIN = """
import sys, torch
from datasets import load_dataset
from trl import SFTConfig, SFTTrainer
model_dir, data, out, steps, bf16 = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1"
torch.set_num_threads(1)
args = SFTConfig(output_dir=out, max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-4, max_length=1024,
                 assistant_only_loss=True, use_cpu=True, bf16=bf16, gradient_checkpointing=False, logging_steps=1,
                 save_strategy="no", report_to="none", disable_tqdm=True, seed=0)
trainer = SFTTrainer(model=model_dir, args=args, train_dataset=load_dataset("json", data_files=data, split="train"))
trainer.train()
trainer.save_model(out + "/final")
"""


def oracle_rows(tokenizer_dir: str, count: int) -> list[dict]:
    from flywheel.data.curation import curate
    from flywheel.environments.tool_use_chain import ToolUseChainEnv

    env = ToolUseChainEnv(tokenizer_name=tokenizer_dir, teacher="oracle", group_size=1, difficulty="easy")

    async def collect() -> list[dict]:
        await env.setup()
        return [(await env.collect_trajectories(env.stream.item(i)))[0] for i in range(count)]

    rows = curate(asyncio.run(collect()), []).sft
    return [{"messages": r["messages"], "tools": r["tools"]} for r in rows]


def main() -> None:
    import subprocess
    import sys

    from flywheel.data import ArtifactStore
    from flywheel.training.device import cpu_computes_bf16
    from flywheel.training.models import resolve_model
    from flywheel.training.sft import SFTRunConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--fp32", action="store_true", help="Also time our stage without bf16 autocast.")
    args = parser.parse_args()
    bf16 = cpu_computes_bf16()
    store = ArtifactStore()
    model_dir = str(resolve_model(args.model, store))
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp, "sft.jsonl")
        data.write_text("".join(json.dumps(r) + "\n" for r in oracle_rows(model_dir, 16)))

        def ours(name: str, mixed_precision: bool | None = None) -> float:
            started = time.perf_counter()
            cfg = SFTRunConfig(policy_model=args.model, dataset=str(data), total_steps=args.steps, batch_size=4,
                               learning_rate=1e-4, logs_root=f"{tmp}/logs", output_name=name,
                               mixed_precision=mixed_precision)  # fmt: skip
            script = (
                "from flywheel.training.sft import *; from flywheel.data import ArtifactStore; "
                f"run_sft(SFTRunConfig.model_validate_json({cfg.model_dump_json()!r}), ArtifactStore())"
            )
            subprocess.run([sys.executable, "-c", script], check=True, capture_output=True)  # fmt: skip
            return time.perf_counter() - started

        ratios, precision = [], []
        for repeat in range(args.repeats):
            started = time.perf_counter()
            subprocess.run([sys.executable, "-c", PLAIN, model_dir, str(data), f"{tmp}/plain{repeat}", str(args.steps),
                            str(int(bf16))], check=True, capture_output=True)  # fmt: skip
            plain = time.perf_counter() - started
            stage = ours(f"bench{repeat}")
            ratios.append(plain / stage)
            line = f"repeat {repeat}: plain TRL {plain:.1f} s, flywheel SFT stage {stage:.1f} s (bf16 autocast: {bf16})"
            if args.fp32:
                fp32 = ours(f"fp32-{repeat}", mixed_precision=False)
                precision.append(fp32 / stage)
                line += f", fp32 {fp32:.1f} s"
            print(line, flush=True)
    print(f"\nSFT throughput, ours / plain TRL (same tokens; median): {statistics.median(ratios):.2f}   (goal >= 0.95)")
    if precision:
        print(f"mixed precision: fp32 / bf16 autocast wall time (median): {statistics.median(precision):.2f}")


if __name__ == "__main__":
    main()
