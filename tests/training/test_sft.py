"""SFT with TRL on the tiny model: the assistant mask, the loss moving, the NaN guard."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from flywheel.data import ArtifactStore, lineage
from flywheel.training.run_logs import MetricsCallback, NonFiniteError, NonFiniteGuard, RunDir
from flywheel.training.sft import SFTRunConfig, run_sft, tokenize_rows, trainer_args, training_template

ADD_PARAMETERS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": ADD_PARAMETERS}}]


def conversation(a: int, b: int) -> dict:
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
    return {
        "messages": [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "add", "content": str(a + b)},
            {"role": "assistant", "content": f"The sum is {a + b}."},
        ],
        "tools": [],
    }


def test_assistant_mask_decodes_to_exactly_the_assistant_turns(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    row = conversation(2, 3) | {"tools": TOOLS}
    out = tokenize_rows(tokenizer, [row], training_template(tiny_model, tokenizer), 4096)
    ids, mask = out["input_ids"][0], out["assistant_masks"][0]
    kept = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    dropped = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    expected = (
        '\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'
        "\nThe sum is 5.<|im_end|>\n"
    )
    assert kept == expected
    assert "What is 2 plus 3?" in dropped and "Use tools." in dropped and "<tool_response>\n5" in dropped
    assert '"name": "add"' in dropped  # The tool schema is in the (unmasked) system turn.


def test_a_conversation_longer_than_max_length_is_left_out_or_cut_with_figures(
    tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Cut at max_length, a conversation would teach its first tool call and never its answer: by default it
    is left out; `truncate` cuts it; either way the warning says so, and when none fits the error says what
    to raise."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    short, long = conversation(2, 3) | {"tools": TOOLS}, conversation(123456, 654321) | {"tools": TOOLS}
    template = training_template(tiny_model, tokenizer)
    fits = len(tokenize_rows(tokenizer, [short], template, 4096)["input_ids"][0])
    with caplog.at_level("WARNING", logger="flywheel.training.sft"):
        out = tokenize_rows(tokenizer, [long, short, long], template, fits)
    assert out["input_ids"] == tokenize_rows(tokenizer, [short], template, fits)["input_ids"]
    assert "2 of 3 conversations exceed max_length" in caplog.text and "left out" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="flywheel.training.sft"):
        cut = tokenize_rows(tokenizer, [long, short], template, fits, overlong="truncate")
    assert [len(ids) for ids in cut["input_ids"]] == [fits, fits] and "assistant tokens are cut off" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="flywheel.training.sft"):
        tokenize_rows(tokenizer, [short], template, fits)
    assert caplog.text == ""
    with pytest.raises(ValueError, match=f"none of 1 conversations fits max_length={fits - 1}: raise max_length"):
        tokenize_rows(tokenizer, [short], template, fits - 1)
    # Cut inside the prompt, a conversation keeps no assistant token: truncate leaves it out too.
    system_and_user = short["messages"][:2]
    prompt = len(
        tokenizer.apply_chat_template(system_and_user, tools=TOOLS, chat_template=template, return_dict=True)[
            "input_ids"
        ]
    )
    with pytest.raises(ValueError, match=f"none of 2 conversations fits max_length={prompt}"):
        tokenize_rows(tokenizer, [short, long], template, prompt, overlong="truncate")


@pytest.fixture
def sft_rows(tmp_path: Path) -> Path:
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(conversation(a, b)) + "\n" for a in range(4) for b in range(4)))
    return path


@pytest.mark.parametrize("mixed_precision", [False, True], ids=["fp32", "bf16-autocast"])
def test_sft_moves_the_loss_and_the_weights(
    model_store: ArtifactStore, tiny_model: Path, sft_rows: Path, tmp_path: Path, mixed_precision: bool
) -> None:
    """In fp32 and under bf16 autocast alike (the CPU default where bf16 is native): the saved weights stay fp32."""
    from safetensors.torch import load_file

    cfg = SFTRunConfig(
        policy_model="tiny",
        dataset=str(sft_rows),
        total_steps=20,
        batch_size=4,
        learning_rate=5e-3,
        max_length=128,
        logs_root=str(tmp_path / "logs"),
        output_name="sft-test",
        mixed_precision=mixed_precision,
    )
    assert trainer_args(cfg, tmp_path / "out").bf16 is mixed_precision
    manifest = run_sft(cfg, model_store)
    assert manifest.kind == "checkpoint" and manifest.metrics["steps"] == 20
    assert manifest.metrics["final_loss"] < 0.8 * manifest.metrics["first_loss"]
    assert lineage(model_store, manifest.id).parents[0].manifest.name == "tiny"
    trained = load_file(str(model_store.materialize(manifest.id, tmp_path / "c") / "model.safetensors"))
    base = load_file(str(tiny_model / "model.safetensors"))
    changed = [k for k in base if not torch.equal(base[k], trained[k])]
    assert len(changed) >= len(base) // 2
    assert {t.dtype for t in trained.values()} == {torch.float32}
    metrics = [json.loads(line) for line in next((tmp_path / "logs").glob("run-*")).joinpath("metrics.jsonl").open()]
    assert sum("loss" in m for m in metrics) == 20
    assert "run/sft-test" in model_store.refs()


def test_nan_guard_stops_a_poisoned_run_and_keeps_the_last_good_checkpoint(tiny_model: Path, tmp_path: Path) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rows = [conversation(a, 1) for a in range(8)]
    data = tokenize_rows(tokenizer, rows, training_template(tiny_model, tokenizer), 128)
    poison = 49000  # A token id no clean row uses; the model turns it into NaN.
    data["input_ids"][5] = [*data["input_ids"][5][:-1], poison]
    model = AutoModelForCausalLM.from_pretrained(tiny_model)

    def poisoned(module, args, output):  # type: ignore[no-untyped-def]
        hit = (args[0] == poison).any()
        return output * torch.where(hit, torch.tensor(float("nan")), torch.tensor(1.0))

    model.get_input_embeddings().register_forward_hook(poisoned)
    cfg = SFTRunConfig(dataset="x", total_steps=8, batch_size=1, max_length=128, save_steps=2)
    run = RunDir(tmp_path, "nan")
    trainer = SFTTrainer(
        model=model,
        args=trainer_args(cfg, run.checkpoints),
        train_dataset=Dataset.from_dict(data),
        processing_class=tokenizer,
        callbacks=[MetricsCallback(run), NonFiniteGuard()],
    )
    trainer.args.data_seed = None
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(trainer.train_dataset)
    with pytest.raises(NonFiniteError, match="step 6"):
        trainer.train()
    saved = sorted(p.name for p in run.checkpoints.glob("checkpoint-*"))
    assert saved == ["checkpoint-2", "checkpoint-4"]
    from safetensors.torch import load_file

    weights = load_file(str(run.checkpoints / "checkpoint-4" / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert all(math.isfinite(m["loss"]) for m in run.read_metrics() if "loss" in m and m["step"] <= 5)


def test_wandb_reporting_works_offline_without_a_key(
    model_store: ArtifactStore, sft_rows: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = SFTRunConfig(dataset=str(sft_rows), total_steps=2, batch_size=2, max_length=128, report_to=["wandb"],
                       logs_root=str(tmp_path / "logs"), output_name="sft-wandb")  # fmt: skip
    assert run_sft(cfg, model_store).metrics["steps"] == 2
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_packing_keeps_the_loss_on_exactly_the_assistant_tokens(tiny_model: Path, tmp_path: Path) -> None:
    """CUDA SFT packs conversations into one padding-free sequence: the loss still covers exactly each
    conversation's assistant tokens (our `assistant_masks`), and positions restart at every conversation,
    so none attends to another's."""
    from collections import Counter

    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from flywheel.training.sft import sft_kwargs

    assert sft_kwargs(SFTRunConfig(dataset="d", device="cuda"), tmp_path)["packing"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rows = [conversation(a, b) for a in range(3) for b in range(3)]
    data = tokenize_rows(tokenizer, rows, training_template(tiny_model, tokenizer), 512)
    kwargs = sft_kwargs(SFTRunConfig(dataset="d", device="cpu", max_length=512, batch_size=2), tmp_path)
    trainer = SFTTrainer(model=str(tiny_model), args=SFTConfig(**kwargs | {"packing": True}),
                         train_dataset=Dataset.from_dict(data), processing_class=tokenizer)  # fmt: skip
    packed = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    assert len(packed) < len(rows)  # Several conversations to a sequence.
    batch = trainer.data_collator(packed)
    labels, positions = batch["labels"][0].tolist(), batch["position_ids"][0].tolist()
    starts = [i for i, position in enumerate(positions) if position == 0]
    conversations = [tuple(labels[a:b]) for a, b in zip(starts, [*starts[1:], len(labels)], strict=True)]
    expected = [tuple(i if m else -100 for i, m in zip(ids, mask, strict=True))
                for ids, mask in zip(data["input_ids"], data["assistant_masks"], strict=True)]  # fmt: skip
    assert Counter(conversations) == Counter(expected)
    assert batch["cu_seq_lens_q"].tolist() == [*starts, len(labels)]
