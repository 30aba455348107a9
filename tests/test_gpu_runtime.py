"""The GPU runtime (requirements/gpu.txt) as far as a CPU machine goes: in a fresh virtual environment
it resolves, vLLM included, to the versions the README names and without Prefect; and the training
stack it pins (an older transformers than this environment's) runs the tiny SFT and GRPO path on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import venv
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ROOT / "requirements" / "gpu.txt"
NAMED = {"vllm": "vLLM", "torch": "torch", "transformers": "transformers", "trl": "TRL", "deepspeed": "DeepSpeed"}
TRAINING_STACK = ("transformers", "huggingface-hub", "trl", "accelerate", "datasets", "tokenizers", "safetensors")
SMOKE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import transformers
    from flywheel.data import ArtifactStore
    from flywheel.training.grpo import GRPORunConfig
    from flywheel.training.registry import run_training
    from flywheel.training.sft import SFTRunConfig

    out, tiny = Path(sys.argv[1]), sys.argv[2]
    store = ArtifactStore(out / "store")
    rows = [{"messages": [{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": str(a + b)}]}
            for a in range(4) for b in range(4)]
    store.put("dataset", "sft", {"train.jsonl": "".join(json.dumps(r) + "\\n" for r in rows)})
    logs = str(out / "logs")
    sft = run_training(SFTRunConfig(policy_model=tiny, dataset="dataset/sft", total_steps=2, batch_size=2,
                                    max_length=128, logs_root=logs, output_name="sft"), store)
    rl = run_training(GRPORunConfig(policy_model=sft.id, total_steps=1, batch_size=2, num_rollouts_per_task=2,
                                    num_tasks=2, max_agent_turns=2, max_completion_length=48, difficulty="easy",
                                    logs_root=logs, output_name="rl"), store)
    print(json.dumps({"transformers": transformers.__version__, "steps": [sft.metrics["steps"], rl.metrics["steps"]]}))
    """
)


@pytest.fixture(scope="module")
def resolved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Every package of the GPU runtime and its version, as pip resolves the file in a fresh environment."""
    folder = tmp_path_factory.mktemp("gpu-runtime")
    venv.create(folder / "venv", with_pip=True)
    report = folder / "report.json"
    command = [str(folder / "venv" / "bin" / "python"), "-m", "pip", "install", "--dry-run", "--ignore-installed",
               "--quiet", "--report", str(report), "-r", str(RUNTIME)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    installs = json.loads(report.read_text())["install"]
    return {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in installs}


def test_the_gpu_runtime_resolves_to_the_versions_the_readme_names(resolved: dict[str, str]) -> None:
    readme = (ROOT / "README.md").read_text()
    for package, label in NAMED.items():
        pinned = Version(resolved[package]).base_version  # torch may resolve to a local +cpu build here.
        assert f"{label} {pinned}" in readme, (package, pinned)
    assert "prefect" not in resolved  # Its fastapi pin is why the runtime stands apart.
    assert Version(resolved["fastapi"]) < Version("0.137")


def test_the_gpu_runtimes_training_stack_runs_tiny_sft_and_grpo(
    resolved: dict[str, str], tiny_model: Path, tmp_path: Path
) -> None:
    """This environment with the runtime's versions of the training stack laid over it (transformers and
    huggingface-hub differ): the same code trains, on CPU torch."""
    overlay = [f"{name}=={resolved[name]}" for name in TRAINING_STACK if resolved[name] != version(name)]
    assert any(spec.startswith("transformers==") for spec in overlay)  # Otherwise the test proves nothing new.
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(tmp_path / "overlay"),
               *overlay]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "overlay"), str(ROOT)])}
    smoke = subprocess.run([sys.executable, "-c", SMOKE, str(tmp_path), str(tiny_model)], capture_output=True,
                           text=True, env=env, timeout=900)  # fmt: skip
    assert smoke.returncode == 0, smoke.stderr[-3000:]
    ran = json.loads(smoke.stdout.strip().splitlines()[-1])
    assert ran == {"transformers": resolved["transformers"], "steps": [2, 1]}
