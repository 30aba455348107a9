"""A CPU stand-in for vLLM's offline engine (`vllm.LLM`), for tests: the surface TRL's colocated
generation calls (`generate` on token ids with per-token log-probs, `load_weights` through
`llm_engine.model_executor.driver_worker.model_runner.model`, `reset_prefix_cache`, `sleep`,
`wake_up`, `llm_engine.model_config.max_model_len`), run by the transformers model on CPU.

Like vLLM with `logprobs_mode="processed_logprobs"`, a token's log-prob is taken after temperature,
top-k and top-p: what the sampler drew it from. Every generation is recorded in `GENERATED` (and,
when `VLLM_STAND_IN_LOG` names a file, appended to it as JSON lines) so a test can compare what
was sampled with what was trained. `VLLM_STAND_IN_SCRIPT=module:function` makes the replies
`function(decoded prompt)` (their log-probs still the model's); `VLLM_STAND_IN_SKEW` adds that much
to every reported log-prob (a wrong log-prob the trainer's importance correction must notice).
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

__version__ = "0.27.0"  # Inside TRL 1.16's supported range (0.22-0.31), before its stateful weight-transfer API.

GENERATED: list[dict[str, Any]] = []
ENGINES: list[LLM] = []  # Every engine made in this process, for a test to read its counters.


@dataclass
class SamplingParams:
    n: int = 1
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    max_tokens: int = 16
    logprobs: int | None = None
    seed: int | None = None
    structured_outputs: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


class _Runner:
    """`model_runner.model`: vLLM loads weights by the trainer's parameter names."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.loaded = 0

    def load_weights(self, weights: Any) -> None:
        params = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor.to(params[name].dtype))
                self.loaded += 1


class LLM:
    def __init__(self, model: str, max_model_len: int | None = None, seed: int = 0, **engine: Any) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.engine_args = engine
        self.runner = _Runner(self.model)
        max_len = max_model_len or self.model.config.max_position_embeddings
        self.llm_engine = SimpleNamespace(
            model_executor=SimpleNamespace(
                driver_worker=SimpleNamespace(model_runner=SimpleNamespace(model=self.runner))
            ),
            model_config=SimpleNamespace(max_model_len=max_len),
        )
        self.generator = torch.Generator().manual_seed(seed)
        eos = self.model.generation_config.eos_token_id
        self.stops = set(eos if isinstance(eos, list) else [eos]) - {None}
        script = os.environ.get("VLLM_STAND_IN_SCRIPT")
        self.script = self.tokenizer = None
        if script:
            from transformers import AutoTokenizer

            module, _, name = script.partition(":")
            self.script = getattr(importlib.import_module(module), name)
            self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.skew = float(os.environ.get("VLLM_STAND_IN_SKEW", "0"))
        self.prefix_resets = 0
        self.sleeping = False
        ENGINES.append(self)

    def sleep(self, level: int = 1) -> None:
        self.sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.sleeping = False

    def reset_prefix_cache(self) -> bool:
        self.prefix_resets += 1
        return True

    def generate(self, prompts: list[dict[str, Any]], sampling_params: SamplingParams | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:  # fmt: skip
        params = sampling_params or SamplingParams()
        limit = self.llm_engine.model_config.max_model_len
        for prompt in prompts:  # As vLLM's input check: one prompt over the context fails the whole call.
            if len(prompt["prompt_token_ids"]) > limit:
                raise ValueError(f"The decoder prompt (length {len(prompt['prompt_token_ids'])}) is longer than the "
                                 f"maximum model length of {limit}.")  # fmt: skip
        outputs = []
        for index, prompt in enumerate(prompts):
            ids = list(prompt["prompt_token_ids"])
            new, logprobs = self._reply(ids, params)
            record = {"prompt_ids": ids, "token_ids": new, "logprobs": logprobs}
            GENERATED.append(record)
            if os.environ.get("VLLM_STAND_IN_LOG"):
                with open(os.environ["VLLM_STAND_IN_LOG"], "a") as log:
                    log.write(json.dumps(record) + "\n")
            per_token = [{token: Logprob(lp + self.skew, rank=1)} for token, lp in zip(new, logprobs, strict=True)]
            finish = "stop" if new and new[-1] in self.stops else "length"
            completion = CompletionOutput(0, "", new, per_token if params.logprobs is not None else None, finish)
            outputs.append(RequestOutput(str(index), ids, [completion]))
        return outputs

    def _reply(self, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[float]]:
        """Sampled (or scripted) token ids and each one's processed log-prob, one forward per token."""
        scripted = None
        if self.script is not None:
            text = self.script(self.tokenizer.decode(prompt))
            scripted = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
            scripted = scripted[: params.max_tokens]
        new: list[int] = []
        logprobs: list[float] = []
        past = None
        step_ids = torch.tensor([prompt])
        with torch.no_grad():
            while len(new) < params.max_tokens:
                out = self.model(step_ids, past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = _processed(out.logits[0, -1].float(), params)
                if scripted is not None:
                    token = scripted[len(new)]
                elif params.temperature == 0:
                    token = int(torch.argmax(logits))
                else:
                    token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=self.generator))
                logprobs.append(float(torch.log_softmax(logits, -1)[token]))
                new.append(token)
                if token in self.stops or (scripted is not None and len(new) == len(scripted)):
                    break
                step_ids = torch.tensor([[token]])
        return new, logprobs


def _processed(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits as vLLM's sampler sees them: divided by the temperature, then top-k and top-p applied."""
    if params.temperature and params.temperature > 0:
        logits = logits / params.temperature
    if params.top_k and params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        beyond = torch.cumsum(torch.softmax(ordered, -1), -1) - torch.softmax(ordered, -1) > params.top_p
        logits = logits.masked_fill(beyond.scatter(0, order, beyond), float("-inf"))
    return logits
