"""`RolloutScoring`: how an agent env turns a finished rollout into its reward.

`score_rollout` runs the env's `verify` (→ `AgentResult.task_completed`), counts its key
decisions, then calls `compute_reward`, so a reward function can read the step-contract trajectory
fields. A verifier that raises on what the agent left (a file nested 100,000 deep, a number of 400
digits) has judged a failed task: the verdict is False with the reason in `AgentResult.verify_error`
(counted in `verifier_errors`), never an infra failure, which would drop the rollout and its group;
`InfraError` and `OSError` (the sandbox's) still are. The reward must be a finite number; one
outside the env's declared `reward_range` is kept as given, logged as an error and counted
(`rewards_out_of_range`), never silently clipped.
`_llm_judge` is the hermes-agent contract's judge (docs/architecture.md) on the env's own server.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from flywheel.environments.agent_loop import AgentResult
from flywheel.environments.errors import InfraError
from flywheel.environments.tool_context import ToolContext
from flywheel.environments.verify.rewards import judge_verdict, keyword_overlap

logger = logging.getLogger(__name__)
Item = dict[str, Any]


class RewardError(ValueError):
    """An env's reward function returned something that is not a finite number (a reward bug)."""


class RolloutScoring:
    """Mixed into `HermesAgentBaseEnv`; uses its `name`, `config`, `server`, `reward_range`,
    `key_decisions`, `format_prompt` and `compute_reward`."""

    rewards_out_of_range = 0
    verifier_errors = 0

    async def verify(self, item: Item, result: AgentResult, ctx: ToolContext) -> bool | None:
        """Whether the task is done, judged on the sandbox's final state (None: the env has no verifier).

        It runs on the event loop beside the other rollouts: sandbox commands and heavy parsing go in
        `asyncio.to_thread` (the built-in envs do), or every rollout waits for them."""
        return None

    def key_decisions_made(self, item: Item, result: AgentResult) -> float:
        """Share of `key_decisions` (tool names) the agent called at least once without an error."""
        if not self.key_decisions:
            return 0.0
        failed = {(e.turn, e.tool_name) for e in result.tool_errors}
        made, turn = set(), -1
        for message in result.messages:
            if message.get("role") != "assistant":
                continue
            turn += 1
            for call in message.get("tool_calls") or []:
                name = (call.get("function") or {}).get("name")
                if (turn, name) not in failed:
                    made.add(name)
        return sum(1 for k in self.key_decisions if k in made) / len(self.key_decisions)

    async def completed(self, item: Item, result: AgentResult, ctx: ToolContext) -> bool:
        """`result.task_completed`, verifying first when nobody has (a `compute_reward` called directly)."""
        if result.task_completed is None:
            result.task_completed = await self.verify(item, result, ctx)
        return bool(result.task_completed)

    async def score_rollout(self, item: Item, result: AgentResult, ctx: ToolContext) -> float:
        """`verify`, key decisions, then `compute_reward`; a reward outside `reward_range` is logged and counted."""
        result.task_completed = await self._verdict(item, result, ctx)
        result.key_decisions_hit = self.key_decisions_made(item, result)
        reward = await self.compute_reward(item, result, ctx)
        if not isinstance(reward, int | float) or not math.isfinite(reward):
            raise RewardError(f"{self.name}: compute_reward returned {reward!r} for item {item.get('item_id')}")
        low, high = self.reward_range
        if not low <= reward <= high:
            self.rewards_out_of_range += 1
            logger.error(
                "%s: reward %s for item %s is outside the declared reward_range %s (%d so far): a reward bug, "
                "or declare a wider range",
                self.name, reward, item.get("item_id"), self.reward_range, self.rewards_out_of_range,
            )  # fmt: skip
        return float(reward)

    async def _verdict(self, item: Item, result: AgentResult, ctx: ToolContext) -> bool | None:
        """`verify`; whatever the agent's output makes it raise is a failed task. `InfraError` and `OSError`
        stay infra failures: the sandbox's (a verifier maps the errors an agent can cause to False itself)."""
        try:
            return await self.verify(item, result, ctx)
        except (InfraError, OSError):
            raise
        except Exception as err:  # The agent's output, not our infrastructure, broke the verifier.
            self.verifier_errors += 1
            result.verify_error = f"{type(err).__name__}: {str(err)[:200]}"
            logger.warning("%s: item %s failed verification: %s", self.name, item.get("item_id"), result.verify_error)
            return False

    async def _llm_judge(self, item: Item, answer: str) -> float:
        """Grade `answer` against the item's reference with `self.server` in [0, 1].

        The judge answers a JSON verdict; when the call or its JSON fails, keyword overlap with the
        reference decides. One judge call per (item, answer): a second ask reads the first verdict.
        """
        judged: dict[tuple[str, str], float] = self.__dict__.setdefault("_judged", {})
        key = (str(item.get("item_id")), answer)
        if key not in judged:
            reference = str(item.get("reference") or item.get("answer") or "")
            if self.config.teacher == "oracle":  # No model server to judge with: the fallback decides.
                judged[key] = keyword_overlap(answer, reference)
            else:
                judged[key] = await judge_verdict(self.server, self.format_prompt(item), answer, reference)
        return judged[key]
