"""Benchmarks through lm-evaluation-harness's Python API; results and samples go to the store.

Backends: `hf` (CPU, fixed batch size), `vllm` (GPU), and `local-completions` /
`local-chat-completions` against any OpenAI-compatible server (tokenizer from the local model
dir, so it works offline). Tasks: the shipped suite (`evaluation/suite.py`), any user folder of
lm-eval YAML (`include_path`, like `lm_eval --include_path`), and standard benchmarks by name
when their data is in the local HF cache (lm-eval then indexes its bundled tasks, ~80 s).
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from flywheel.data import ArtifactStore, Manifest
from flywheel.evaluation.suite import SUITE_TASKS, store_suite, write_suite

logger = logging.getLogger(__name__)
_LOGLIKELIHOOD_TASKS = {"flywheel_tool_select"}


class LMEvalConfig(BaseModel):
    """One lm-eval run."""

    backend: Literal["hf", "vllm", "local-completions", "local-chat-completions"] = Field(
        default="hf", description="lm-eval model backend."
    )
    tasks: list[str] = Field(default=list(SUITE_TASKS), description="Task names (suite, include path, or bundled).")
    include_path: str | None = Field(default=None, description="A folder of user task YAML (lm_eval --include_path).")
    server_url: str | None = Field(default=None, description="OpenAI-compatible base URL for local-* backends.")
    server_model: str | None = Field(default=None, description="Model name the server expects.")
    batch_size: int = Field(
        default=32,
        ge=1,
        description="Fixed batch size ('auto' hangs on CPU). 32 on 2 cores: SmolLM2 on the suite in 45 s (8: 65 s; "
        "64: 48 s), decode steps being bound by per-step overhead.",
    )
    limit: int | None = Field(default=None, ge=1, description="Docs per task (None: all).")
    suite_size: int = Field(default=30, ge=1, description="Items per shipped suite task.")
    apply_chat_template: bool = Field(default=True, description="Render prompts with the model's chat template.")
    system_instruction: str = Field(default="You are a helpful assistant.", description="System message.")
    tensor_parallel_size: int = Field(default=1, ge=1, description="vllm backend: GPUs.")
    name: str = Field(default="lm-eval", description="Name of the eval artifact.")


def model_args(cfg: LMEvalConfig, model_dir: Path) -> dict[str, Any]:
    """lm-eval `model_args` for the backend (pure: unit-tested for every backend)."""
    if cfg.backend == "hf":
        return {"pretrained": str(model_dir), "dtype": "float32"}
    if cfg.backend == "vllm":
        return {"pretrained": str(model_dir), "tensor_parallel_size": cfg.tensor_parallel_size, "dtype": "auto"}
    if not cfg.server_url:
        raise ValueError(f"backend {cfg.backend} needs server_url (an OpenAI-compatible base URL)")
    endpoint = "chat/completions" if cfg.backend == "local-chat-completions" else "completions"
    return {
        "model": cfg.server_model or str(model_dir),
        "base_url": f"{cfg.server_url.rstrip('/')}/{endpoint}",
        "tokenizer": str(model_dir),
        "tokenizer_backend": "huggingface",
        "num_concurrent": 4,
        "max_retries": 3,
        "tokenized_requests": False,
    }


def run_lm_eval(cfg: LMEvalConfig, store: ArtifactStore, model_dir: Path, model_ref: str | None = None) -> Manifest:
    """Evaluate and store an `eval` artifact (results.json + samples) with model and eval sets as parents."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    started = time.perf_counter()
    tasks = list(cfg.tasks)
    if cfg.backend == "local-chat-completions":
        skipped = [t for t in tasks if t in _LOGLIKELIHOOD_TASKS]
        if skipped:
            logger.warning("chat completions give no log-likelihoods: skipping %s", ", ".join(skipped))
        tasks = [t for t in tasks if t not in _LOGLIKELIHOOD_TASKS]
    evalset = store_suite(store, cfg.suite_size)
    with tempfile.TemporaryDirectory(prefix="flywheel-suite-") as tmp:
        include = [str(write_suite(Path(tmp), cfg.suite_size))] + ([cfg.include_path] if cfg.include_path else [])
        known_locally = TaskManager(include_path=include, include_defaults=False).all_tasks
        need_bundled = any(t not in known_locally for t in tasks)
        manager = TaskManager(include_path=include, include_defaults=need_bundled)
        unknown = [t for t in tasks if t not in manager.all_tasks]
        if unknown:
            raise ValueError(f"unknown lm-eval task(s) {unknown}; check the names or pass include_path")
        results = lm_eval.simple_evaluate(
            model=cfg.backend,
            model_args=model_args(cfg, model_dir),
            tasks=tasks,
            batch_size=cfg.batch_size,
            device="cpu" if cfg.backend == "hf" else None,
            limit=cfg.limit,
            task_manager=manager,
            apply_chat_template=cfg.apply_chat_template,
            system_instruction=cfg.system_instruction,
            log_samples=True,
            bootstrap_iters=200,
            confirm_run_unsafe_code=False,
        )
    samples = results.pop("samples", {})
    summary = {
        "results": results.get("results", {}),
        "versions": results.get("versions", {}),
        "n-samples": results.get("n-samples", {}),
        "config": {"backend": cfg.backend, "tasks": tasks, "limit": cfg.limit},
    }
    files = {"results.json": json.dumps(summary, indent=2, default=str)}
    for task, records in samples.items():
        files[f"samples/{task}.jsonl"] = "".join(json.dumps(_sample(task, r), default=str) + "\n" for r in records)
    parents = [evalset.id] + ([model_ref] if model_ref else [])
    metrics = {
        f"{task}/{key.split(',')[0]}": value
        for task, values in summary["results"].items()
        for key, value in values.items()
        if isinstance(value, int | float) and "stderr" not in key
    }
    metrics["wall_seconds"] = round(time.perf_counter() - started, 1)
    manifest = store.put("eval", cfg.name, files, parents=parents, params=cfg.model_dump(), metrics=metrics)
    logger.info("lm-eval %s: %s", cfg.name, {k: round(v, 3) for k, v in metrics.items()})
    return manifest


def _sample(task: str, record: dict[str, Any]) -> dict[str, Any]:
    """One per-doc record, flat: doc fields (category, difficulty), response, metrics."""
    doc = record.get("doc", {})
    metrics = {k: record[k] for k in record if k in ("acc", "valid_call", "exact_match", "acc_norm")}
    response = record.get("filtered_resps") or record.get("resps")
    return {
        "task": task,
        "doc_id": record.get("doc_id"),
        "category": doc.get("category", task),
        "difficulty": doc.get("difficulty", "unknown"),
        "prompt": doc.get("prompt") or doc.get("question") or "",
        "target": record.get("target"),
        "response": response,
        "metrics": metrics,
        "success": bool(metrics.get("acc", metrics.get("exact_match", 0))),
    }


def model_ref_of(store: ArtifactStore, spec: str) -> str | None:
    """The store id behind a model spec (None for plain directories)."""
    return store.try_resolve(f"model/{spec}", spec)


def main(argv: list[str] | None = None) -> None:
    """`python -m flywheel.evaluation.lm_eval_runner CONFIG_JSON STORE_URL MODEL_DIR [MODEL_REF]`: one run in this
    interpreter (a GPU stage runs it in the GPU runtime, where vLLM is); prints the eval artifact's id."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config, store_url, model_dir, *ref = sys.argv[1:] if argv is None else argv
    cfg = LMEvalConfig.model_validate_json(Path(config).read_text())
    print(run_lm_eval(cfg, ArtifactStore(store_url), Path(model_dir), ref[0] if ref else None).id)


if __name__ == "__main__":
    main()
