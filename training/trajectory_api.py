"""The trainer's side of atropos-mode GRPO: scored groups from atroposlib's `run-api`, checked, as TRL rollouts.

`run-api` (atroposlib 0.4) knows no policy version, keeps its queue when a trainer registers again
(a shared one would hand a resumed run what its killed run left), and hands out whatever it was
sent. So the checks are the trainer's: a group must be `group_size` rollouts whose masks train only the ids
they mark, with finite scores and the policy version it was sampled with; a group older than
`max_async_level` steps is refused (dropped: a bounded age keeps the step close to on-policy, as
prime-rl's async level does). A younger group is trained as sampled: on CPU without correction
(in-process generation gives no sampling log-probs), on vLLM with TRL's importance-sampling
correction against the log-probs the group carries (`inference_logprobs`; 1.0, atroposlib's filler,
where a token's is unknown), per token and truncated (TIS), which covers its age as well as the
engine's numerics. Every refusal is counted by reason and logged with the step's metrics.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx

from flywheel.inference.server import wait_for_http

logger = logging.getLogger(__name__)

UNKNOWN_LOGPROB = 1.0  # Atroposlib's filler where no log-prob applies (none is > 0); JSON has no NaN.


def logprobs_to_json(logprobs: list[float]) -> list[float]:
    """Sampling log-probs for JSON: an unknown one (NaN) as the filler."""
    return [UNKNOWN_LOGPROB if math.isnan(lp) else lp for lp in logprobs]


def logprobs_from_json(values: list[float]) -> list[float]:
    """Sampling log-probs from JSON: the filler back to NaN (no correction for that token)."""
    return [math.nan if lp == UNKNOWN_LOGPROB else float(lp) for lp in values]


class RunApi:
    """The calls a trainer makes to atroposlib's `run-api`."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.client = httpx.Client(base_url=self.url, timeout=30)

    def register(
        self, batch_size: int, max_token_len: int, num_steps: int, starting_step: int, checkpoint_dir: str
    ) -> None:
        """Register as the trainer (every envs' `batch_size` is ours) and start the envs' clock."""
        body = {
            "wandb_group": "flywheel", "wandb_project": "flywheel", "batch_size": batch_size,
            "max_token_len": max_token_len, "checkpoint_dir": checkpoint_dir, "save_checkpoint_interval": 0,
            "starting_step": starting_step, "num_steps": num_steps,
        }  # fmt: skip
        self.client.post("/register", json=body).raise_for_status()
        self.client.get("/batch").raise_for_status()  # The first poll lets envs register.

    def close(self) -> None:
        self.client.close()

    def batch(self) -> list[dict[str, Any]]:
        """The groups of the next batch `run-api` has ready (none yet: empty)."""
        response = self.client.get("/batch")
        response.raise_for_status()
        return response.json().get("batch") or []

    def wait_until_up(self, timeout: float = 60) -> None:
        wait_for_http(f"{self.url}/status", timeout, "run-api")


def group_problem(group: Any, group_size: int, vocab_size: int) -> str | None:
    """Why `group` cannot be trained on (None: it can)."""
    if not isinstance(group, dict):
        return "not a group"
    tokens, masks, scores = group.get("tokens"), group.get("masks"), group.get("scores")
    if not (isinstance(tokens, list) and isinstance(masks, list) and isinstance(scores, list)):
        return "tokens, masks or scores missing"
    if not len(tokens) == len(masks) == len(scores) == group_size:
        return f"{len(tokens)} sequences, {len(masks)} masks, {len(scores)} scores: not a group of {group_size}"
    for ids, mask in zip(tokens, masks, strict=True):
        if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
            return "a mask that does not cover its sequence"
        if any(not isinstance(i, int) or not 0 <= i < vocab_size for i in ids):
            return "a token id outside the vocabulary"
        if any(m != -100 and m != i for i, m in zip(ids, mask, strict=True)):
            return "a mask that trains other ids than its sequence's"
        if all(m == -100 for m in mask):
            return "a sequence with nothing to train on"
    if any(isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s) for s in scores):
        return "a score that is not a finite number"
    logprobs = group.get("inference_logprobs")
    if logprobs is not None and not (
        isinstance(logprobs, list)
        and len(logprobs) == group_size
        and all(isinstance(lps, list) and len(lps) == len(ids) for lps, ids in zip(logprobs, tokens, strict=True))
        and all(
            not isinstance(lp, bool)
            and isinstance(lp, int | float)
            and (m == -100 or -math.inf < lp <= 0 or lp == UNKNOWN_LOGPROB)
            for lps, mask in zip(logprobs, masks, strict=True)
            for lp, m in zip(lps, mask, strict=True)
        )
    ):
        return f"sampling log-probs that are not one per token, <= 0 (or {UNKNOWN_LOGPROB}) where the mask trains"
    overrides = group.get("overrides")
    if overrides is not None and not (
        isinstance(overrides, list) and len(overrides) == group_size and all(isinstance(o, dict) for o in overrides)
    ):
        return "overrides that are not one dict a sequence"
    version = (group.get("group_overrides") or {}).get("policy_version")
    if isinstance(version, bool) or not isinstance(version, int):
        return "no policy version"
    return None


class GroupQueue:
    """Checked groups from `run-api`, handed to the trainer a step's worth at a time.

    It waits while the workers make progress (`progress()`, the policy endpoint's replies, grows, or a
    group is accepted) and fails with what it knows after `wait` seconds without any, as soon as
    `problem()` names a reason no group can come, or after `max_refused` groups refused in a row.
    """

    def __init__(
        self,
        api: RunApi,
        group_size: int,
        max_async_level: int,
        vocab_size: int,
        wait: float = 600,
        hint: str = "",
        progress: Callable[[], int] = lambda: 0,
        problem: Callable[[], str | None] = lambda: None,
        max_refused: int = 100,
    ) -> None:
        self.api = api
        self.hint = hint  # What to look at when no group comes.
        self.progress = progress
        self.problem = problem
        self.max_refused = max_refused
        self._refused_in_a_row = 0
        self.group_size = group_size
        self.max_async_level = max_async_level
        self.vocab_size = vocab_size
        self.wait = wait
        self.refused: Counter[str] = Counter()
        self.ages: list[int] = []  # Of the groups trained on, in steps.
        self._pending: list[dict[str, Any]] = []

    def take(self, count: int, step: int) -> list[dict[str, Any]]:
        """`count` groups to train step `step + 1` on (the weights are version `step`), none older than
        `max_async_level` steps; waits for `run-api` up to `wait` seconds without a new group."""
        ready: list[dict[str, Any]] = []
        last_progress, seen = time.monotonic(), self.progress()
        while True:
            kept = []
            for group in self._pending:
                age = step - group["group_overrides"]["policy_version"]
                if age > self.max_async_level:
                    self._refuse("stale")
                elif age < 0:  # Weights this run never had: another run's groups.
                    self._refuse("from_another_run")
                elif len(ready) < count:
                    ready.append(group)
                    self.ages.append(age)
                    self._refused_in_a_row, last_progress = 0, time.monotonic()
                else:
                    kept.append(group)
            self._pending = kept
            if len(ready) == count:
                return ready
            if (now := self.progress()) != seen:
                last_progress, seen = time.monotonic(), now
            why = self.problem() or (
                f"no progress from the env workers in {self.wait:.0f} s" if time.monotonic() - last_progress > self.wait
                else f"{self._refused_in_a_row} groups refused in a row" if self._refused_in_a_row >= self.max_refused
                else None
            )  # fmt: skip
            if why:
                raise RuntimeError(
                    f"no trainable group from run-api ({self.api.url}), {len(ready)} of {count} in hand: {why} "
                    f"(refused so far: {json.dumps(dict(self.refused))}){self.hint}"
                )
            batch = self.api.batch()
            if not batch:
                time.sleep(0.2)
            for group in batch:
                if problem := group_problem(group, self.group_size, self.vocab_size):
                    self._refuse("malformed")
                    logger.warning("a group from run-api refused: %s", problem)
                else:
                    self._pending.append(group)

    def _refuse(self, reason: str) -> None:
        self.refused[reason] += 1
        self._refused_in_a_row += 1


def atropos_rollout_func(queue: GroupQueue, group_size: int, max_completion_length: int) -> Any:
    """TRL `rollout_func(prompts, trainer)`: the step's rollouts are groups from `run-api`, not the
    prompts' (the dataset only sets how many): `len(prompts) // group_size` groups, consecutive."""

    def rollout(prompts: list[Any], trainer: Any) -> dict[str, list[Any] | None]:
        groups = queue.take(len(prompts) // group_size, trainer.state.global_step)
        out: dict[str, Any] = {k: [] for k in ("prompt_ids", "completion_ids", "env_mask", "env_reward")}
        corrects = getattr(trainer, "use_vllm", False)  # TRL corrects with them on vLLM only.
        out["logprobs"] = [] if corrects else None  # On CPU the trainer scores the old policy itself.
        out |= {"task_completed": [], "env": [], "retokenized": []}
        for group in groups:
            overrides = group.get("overrides") or [{}] * group_size
            logprobs = group.get("inference_logprobs") or [None] * group_size
            rows = zip(group["tokens"], group["masks"], group["scores"], overrides, logprobs, strict=True)  # Checked.
            for ids, mask, score, extra, sampled in rows:
                start = next(i for i, m in enumerate(mask) if m != -100)
                out["prompt_ids"].append(ids[:start])
                out["completion_ids"].append(ids[start:][:max_completion_length])
                if corrects:
                    known = sampled[start:][:max_completion_length] if sampled else None
                    unknown = [math.nan] * len(out["completion_ids"][-1])
                    out["logprobs"].append(logprobs_from_json(known) if known is not None else unknown)
                out["env_mask"].append([int(m != -100) for m in mask[start:][:max_completion_length]])
                out["env_reward"].append(float(score))
                completed = (extra or {}).get("task_completed")  # None: the env did not say; full reward counts.
                out["task_completed"].append(bool(completed) if completed is not None else score >= 1.0)
                out["env"].append(group["group_overrides"].get("env", "env"))
                out["retokenized"].append(bool((extra or {}).get("retokenized")))
        return out

    return rollout
