"""Model resolution: built-ins prepared once into the store, refs, local dirs, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flywheel.data import ArtifactStore
from flywheel.training.models import TRAINING_TEMPLATE_FILE, ModelError, prepare_model, resolve_model


def test_tiny_model_is_a_chatml_llama_with_tool_template(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    config = json.loads((tiny_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 2
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tool = {"type": "function", "function": {"name": "ls", "description": "List", "parameters": {}}}
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
        tools=[tool],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text.startswith("<|im_start|>system\nS") and '"name": "ls"' in text
    assert text.endswith("<|im_start|>assistant\n")
    assert "{% generation %}" in (tiny_model / TRAINING_TEMPLATE_FILE).read_text()


def test_prepare_is_idempotent_and_force_rebuilds_identically(model_store: ArtifactStore, tiny_model: Path) -> None:
    first = prepare_model("tiny", model_store)
    assert prepare_model("tiny", model_store).id == first.id
    rebuilt = prepare_model("tiny", model_store, force=True)
    assert rebuilt.files["model.safetensors"] == first.files["model.safetensors"]  # Seeded: same bytes.


def test_resolve_accepts_refs_dirs_and_rejects_others(
    model_store: ArtifactStore, model_cache: Path, tiny_model: Path, tmp_path: Path
) -> None:
    manifest = model_store.manifest("model/tiny")
    assert resolve_model(manifest.id[:12], model_store, model_cache).name == manifest.id
    assert resolve_model(str(tiny_model), model_store, model_cache) == tiny_model
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_model(str(tmp_path), model_store, model_cache)
    with pytest.raises(ModelError, match="not a built-in"):
        resolve_model("no-such-org/no-such-model", model_store, model_cache)
    model_store.put("dataset", "d", {"x": b"1"})
    with pytest.raises(ModelError, match="is a dataset"):
        resolve_model("dataset/d", model_store, model_cache)
    with pytest.raises(ModelError, match="unknown built-in"):
        prepare_model("gpt5", model_store)
