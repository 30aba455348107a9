"""Piece-wise tokenisation gives exactly the ids and masks of whole-text tokenisation, on every env's
oracle conversations and on content built to break a piece boundary; a tokenizer that disagrees
keeps the exact way."""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from flywheel.environments.agent.conversation_tokens import ConversationTokenizer
from flywheel.environments.registry import TASK_FAMILIES, env_class
from flywheel.environments.task_stream import DIFFICULTIES, TaskStream

# Tool results and replies that sit against a piece boundary: leading and trailing whitespace (BPE
# merges runs of it), a special token's text inside content, empty content, non-ASCII.
AWKWARD = ["\n\n  result\n\n", " ", "", "<|im_end|> not the end", "Ünïcödé ✓ 数据", "\t\ttabs", "ends with space "]


def _conversation(env: str, item: dict[str, Any], tool_output: str) -> list[dict[str, Any]]:
    """The oracle's demonstration of `item` as a chat: its calls, a tool result each, its final answer."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": item["prompt"]},
    ]
    for turn, action in enumerate(item["oracle"]):
        if "final" in action:
            messages.append({"role": "assistant", "content": action["final"]})
            continue
        calls = action.get("calls") or [action]
        messages.append({
            "role": "assistant", "content": "",
            "tool_calls": [
                {"id": f"c{turn}-{n}", "type": "function", "function": {"name": c["tool"], "arguments": c["arguments"]}}
                for n, c in enumerate(calls)
            ],
        })  # fmt: skip
        for n, c in enumerate(calls):
            messages.append({"role": "tool", "tool_call_id": f"c{turn}-{n}", "name": c["tool"], "content": tool_output})
    return messages


def _oracle_conversations() -> list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """Two items of every env at every difficulty, with that env's tool schemas."""
    out = []
    for (env, difficulty), output in zip(itertools.product(TASK_FAMILIES, DIFFICULTIES), itertools.cycle(AWKWARD)):
        cls = env_class(env)
        mix = {f"{c}/{d}": float(d == difficulty) for c in cls.categories for d in DIFFICULTIES}
        schemas = [tool.schema() for tool in cls(tokenizer_name="unused").tools_by_name().values()]
        for item in TaskStream(env, cls.make_task, tuple(cls.categories), seed=0, mix=mix).items(2):
            out.append((_conversation(env, item, output), item.get("tools") or schemas))
    return out


def test_piecewise_ids_and_masks_equal_whole_text_tokenisation_on_every_env(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)  # SmolLM2's.
    tokens = ConversationTokenizer(tokenizer)
    conversations = _oracle_conversations()
    assert len(conversations) == 2 * len(TASK_FAMILIES) * len(DIFFICULTIES)
    for messages, schemas in conversations:
        fast = tokens(messages, schemas)
        assert fast == tokens.exact(messages, schemas), json.dumps(messages)[:300]
        whole = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=True, return_dict=False)
        assert fast[0] == list(whole)
        assert any(m != -100 for m in fast[1])
    assert tokens.piecewise is True  # It checked the first conversation and kept the fast way.


@pytest.mark.parametrize("reply", AWKWARD)
def test_awkward_replies_keep_their_mask_boundaries(tiny_model: Path, reply: str) -> None:
    tokens = ConversationTokenizer(AutoTokenizer.from_pretrained(tiny_model))
    messages = [
        {"role": "system", "content": reply},
        {"role": "user", "content": reply + "count the files"},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": reply},
        {"role": "assistant", "content": reply + "done"},
    ]
    assert tokens(messages, []) == tokens.exact(messages, [])


def _text_special_tokenizer() -> PreTrainedTokenizerFast:
    """A real fast tokenizer that tokenises its special tokens' text (`split_special_tokens`), one token
    a character but for the merge `a<`: in the whole text a reply ending in `a` merges with the `</s>`
    after it, which a piece cut before `</s>` cannot see."""
    chars = sorted(set("userassistant:ab </>"))
    vocab = {c: i for i, c in enumerate(chars)} | {"a<": len(chars)}
    backend = Tokenizer(models.BPE(vocab, merges=[("a", "<")]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", split_special_tokens=True)
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}:{{ m.content }}</s>{% endfor %}"
    tokenizer.chat_template += "{% if add_generation_prompt %}assistant:{% endif %}"
    return tokenizer


def test_a_tokenizer_that_tokenises_pieces_differently_keeps_the_exact_way(caplog: pytest.LogCaptureFixture) -> None:
    tokenizer = _text_special_tokenizer()
    tokens = ConversationTokenizer(tokenizer)
    messages = [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "b a"}]
    assert tokens._piecewise(messages, tokens._renderer([], {})) != tokens.exact(messages, [])  # They differ here.
    with caplog.at_level(logging.WARNING):
        assert tokens(messages, []) == tokens.exact(messages, [])
    assert tokens.piecewise is False and "differs from whole-text tokenisation" in caplog.text
    longer = [*messages, {"role": "user", "content": "b"}, {"role": "assistant", "content": "a"}]
    assert tokens(longer, []) == tokens.exact(longer, [])  # And stays exact.
