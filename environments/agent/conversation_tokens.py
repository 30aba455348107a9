"""A conversation's token ids and the mask that keeps its assistant tokens, for the trainer.

The exact way (`ConversationTokenizer.exact`): tokenise the whole rendering and, for each assistant
message, the renderings of the prefixes around it; an assistant span runs from the end of the
prefix before it (with the generation prompt) to the end of the prefix that includes it. That
works for any chat template whose rendering of a prefix is a prefix of the whole (ChatML, Llama 3,
...), but it tokenises every prefix again, and the first piece of every rendering is the system
message with the tool schemas (~600 of a short rollout's ~700 tokens): ~6 ms of a rollout's
~12 ms of CPU (`benchmarks/rollout_throughput.py --profile`).

The piece-wise way gives the same ids: a tokenizer splits its input at special tokens before it
tokenises, so the rendering is cut before each special token and each piece is tokenised alone,
through a cache (the system piece is tokenised once a run, not once a prefix). A prefix's length
is the pieces before its end plus the part of the piece it ends in. Whether that equals the exact
way depends on the tokenizer (one that adds a prefix space to every input would not), so the first
conversation is tokenised both ways, and a tokenizer that disagrees keeps the exact way (with a
warning); a conversation whose prefix renderings are not prefixes of the whole does too.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

Tokens = tuple[list[int], list[int]]
_MAX_CACHED_TOKENS = 2_000_000  # ~70 MB of ids; past it the cache starts again.


class ConversationTokenizer:
    """`(tokens, masks)` of a conversation, piece-wise once the tokenizer has shown it agrees."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        specials = [
            token.content
            for token in tokenizer.added_tokens_decoder.values()
            if token.special and not (token.lstrip or token.rstrip or token.single_word)
        ]
        self._cut = re.compile("(?=" + "|".join(map(re.escape, sorted(specials, key=len, reverse=True))) + ")")
        self.piecewise: bool | None = None if specials else False  # None: not checked yet.
        self._pieces: dict[str, list[int]] = {}
        self._cached_tokens = 0
        self._lock = threading.Lock()

    def __call__(
        self, messages: list[dict[str, Any]], tool_schemas: list[dict[str, Any]], cache: dict[str, str] | None = None
    ) -> Tokens:
        """`cache` holds renderings across calls (a group's rollouts share their prompt)."""
        render = self._renderer(tool_schemas, {} if cache is None else cache)
        if self.piecewise is False:
            return self._exact(messages, render)
        fast = self._piecewise(messages, render)
        if self.piecewise is None:
            with self._lock:
                if self.piecewise is None:
                    exact = self._exact(messages, render)
                    self.piecewise = fast == exact
                    if not self.piecewise:
                        logger.warning(
                            "%s: piece-wise tokenisation differs from whole-text tokenisation; tokenising whole texts",
                            type(self.tokenizer).__name__,
                        )
                        return exact
        return fast if self.piecewise and fast is not None else self._exact(messages, render)

    def exact(self, messages: list[dict[str, Any]], tool_schemas: list[dict[str, Any]]) -> Tokens:
        """Whole renderings tokenised, every prefix again (the reference the piece-wise way must equal)."""
        return self._exact(messages, self._renderer(tool_schemas, {}))

    def _renderer(self, tool_schemas: list[dict[str, Any]], cache: dict[str, str]) -> Callable[..., str]:
        def render(part: list[dict[str, Any]], generation_prompt: bool) -> str:
            key = json.dumps([part, generation_prompt], sort_keys=True, default=str)
            if key not in cache:
                cache[key] = self.tokenizer.apply_chat_template(
                    part, tools=tool_schemas or None, tokenize=False, add_generation_prompt=generation_prompt
                )
            return cache[key]

        return render

    def _exact(self, messages: list[dict[str, Any]], render: Callable[..., str]) -> Tokens:
        def ids(text: str) -> list[int]:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

        tokens = ids(render(messages, False))
        masks = [-100] * len(tokens)
        for index, message in enumerate(messages):
            if message["role"] == "assistant":
                start = len(ids(render(messages[:index], True)))
                end = min(len(ids(render(messages[: index + 1], False))), len(tokens))
                masks[start:end] = tokens[start:end]
        return tokens, masks

    def _piecewise(self, messages: list[dict[str, Any]], render: Callable[..., str]) -> Tokens | None:
        """None when a prefix's rendering is not a prefix of the whole (then only the exact way holds)."""
        text = render(messages, False)
        starts, tokens = [], []
        position = 0
        for piece in self._cut.split(text):
            if piece:
                starts.append((position, len(tokens)))
                tokens += self._ids(piece)
                position += len(piece)
        masks = [-100] * len(tokens)
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, through = render(messages[:index], True), render(messages[: index + 1], False)
            if not (text.startswith(before) and text.startswith(through)):
                return None
            start, end = self._length(text, len(before), starts), self._length(text, len(through), starts)
            masks[start:end] = tokens[start:end]
        return tokens, masks

    def _length(self, text: str, end: int, starts: list[tuple[int, int]]) -> int:
        """Tokens in `text[:end]`: the whole pieces before `end`, plus the piece it cuts, tokenised up to it."""
        position, count = next((p, c) for p, c in reversed(starts) if p <= end) if starts else (0, 0)
        return count + (len(self._ids(text[position:end])) if end > position else 0)

    def _ids(self, piece: str) -> list[int]:
        ids = self._pieces.get(piece)
        if ids is None:
            ids = list(self.tokenizer(piece, add_special_tokens=False)["input_ids"])
            if self._cached_tokens + len(ids) > _MAX_CACHED_TOKENS:
                self._pieces.clear()
                self._cached_tokens = 0
            self._pieces[piece] = ids
            self._cached_tokens += len(ids)
        return ids
