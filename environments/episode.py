"""`AgentEpisodes`: `reset` / `step` / `score` on a built-in env itself (the step contract's gym view).

For people who drive an env step by step. No tokenizer and no inference server are needed: the
caller is the policy. A reply without a tool call ends the episode, which is then scored by the
env's own verifier in the sandbox the actions changed (the same `score_rollout` the agent loop
uses). One episode at a time; `shutdown()` releases the sandbox and whatever `setup` started.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from flywheel.environments.agent.messages import messages_with_json_arguments
from flywheel.environments.agent_loop import AgentResult, sanitize
from flywheel.environments.base import Action, BaseEnvironment, State, StepResult, ToolCall
from flywheel.environments.errors import AgentError
from flywheel.environments.tool_context import ToolContext


class AgentEpisodes(BaseEnvironment):
    """The gym view of a `HermesAgentBaseEnv` (mixed into it; uses its tools, prompts and verifier)."""

    _episode: State | None = None
    _episode_ctx: ToolContext | None = None
    _episode_item: dict[str, Any] | None = None
    _episode_result: AgentResult | None = None
    _episode_done: bool = False
    _gym_loop: asyncio.AbstractEventLoop | None = None

    def _ready(self) -> asyncio.AbstractEventLoop:
        """The gym view's own event loop; the env's `setup` runs on it on first use."""
        if self._gym_loop is None:
            self._gym_loop = asyncio.new_event_loop()
            self._gym_loop.run_until_complete(self.setup())  # type: ignore[attr-defined]
        return self._gym_loop

    def _run(self, coroutine: Any) -> Any:
        return self._ready().run_until_complete(coroutine)

    def reset(self, task_id: Any = None) -> State:
        """Start task `task_id` (an index into the env's training tasks; None: the next one)."""
        self.close_episode()
        if task_id is None:
            item = self._run(self.get_next_item())  # type: ignore[attr-defined]
        else:
            self._ready()
            item = self.stream.item(int(task_id))  # type: ignore[attr-defined]
        schemas, _ = self._resolve_tools_for_group()  # type: ignore[attr-defined]
        ctx = ToolContext(f"{item.get('item_id', 'task')}-{uuid.uuid4().hex[:8]}")
        self.prepare_workspace(ctx, item)  # type: ignore[attr-defined]
        messages = self.build_messages(item, schemas)  # type: ignore[attr-defined]
        self._episode_ctx, self._episode_item = ctx, item
        self._episode_result = AgentResult(messages=messages)
        self._episode = State(
            prompt=messages[-1]["content"], tools=schemas, messages=messages, task_id=task_id, initial_context={}
        )
        return self._episode

    def step(self, action: Action | str | dict[str, Any]) -> StepResult:
        """Apply one action; a reply without tool calls (or the last allowed turn) ends and scores it."""
        state, result, ctx = self._episode, self._episode_result, self._episode_ctx
        if state is None or result is None or ctx is None:
            raise RuntimeError("call reset() before step()")
        if self._episode_done:  # Its reward is given: a later action must not run tools or be scored again.
            raise RuntimeError("the episode is over (step returned done=True): call reset() for the next one")
        action = _as_action(action, self.config.tool_call_parser)  # type: ignore[attr-defined]
        assistant: dict[str, Any] = {"role": "assistant", "content": action.text}
        if action.tool_calls:
            assistant["tool_calls"] = [call.as_message_entry() for call in action.tool_calls]
        state.messages.append(sanitize(assistant))
        state.turn += 1
        result.turns_used = state.turn
        if not action.is_tool_call or state.turn >= self.config.max_agent_turns:  # type: ignore[attr-defined]
            result.finished_naturally = not action.is_tool_call
            self._episode_done = True
            reward = self.score(result)
            info = {"turns": state.turn, "finished_naturally": result.finished_naturally}
            return StepResult(state, reward, True, info | {"task_completed": result.task_completed})
        tools = self.tools_by_name()  # type: ignore[attr-defined]
        outputs = []
        for call in action.tool_calls:
            try:
                if call.name not in tools:
                    raise AgentError(f"unknown tool '{call.name:.80}'; available: {', '.join(sorted(tools))}")
                text = sanitize(tools[call.name](ctx, call.arguments))  # A file name need not be UTF-8.
            except AgentError as err:
                error = sanitize(str(err))
                text = f"Error: {error}"
                result.record_tool_error(state.turn - 1, call.name, call.arguments, error)
            state.messages.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": text})
            outputs.append(text)
        state.observation = "\n".join(outputs)
        return StepResult(state, 0.0, False, {"turns": state.turn, "tool_calls": [c.name for c in action.tool_calls]})

    def score(self, trajectory: AgentResult | list[dict[str, Any]]) -> float:
        """The env's verifier on the current episode's sandbox, for a finished trajectory."""
        if self._episode_ctx is None or self._episode_item is None:
            raise RuntimeError("no episode to score: call reset() first")
        if not isinstance(trajectory, AgentResult):
            trajectory = AgentResult(messages=messages_with_json_arguments(list(trajectory)))
            trajectory.turns_used = sum(1 for m in trajectory.messages if m.get("role") == "assistant")
        return self._run(self.score_rollout(self._episode_item, trajectory, self._episode_ctx))  # type: ignore[attr-defined]

    def close_episode(self) -> None:
        """Release the current episode's sandbox (idempotent)."""
        if self._episode_ctx is not None:
            self._episode_ctx.cleanup()
        self._episode = self._episode_ctx = self._episode_item = self._episode_result = None
        self._episode_done = False

    def shutdown(self) -> None:
        """End the episode and release what `setup` started (servers, clients)."""
        self.close_episode()
        if self._gym_loop is not None:
            self._gym_loop.run_until_complete(self.close())  # type: ignore[attr-defined]
            self._gym_loop.close()
            self._gym_loop = None


def _as_action(action: Action | str | dict[str, Any], parser: str) -> Action:
    """An `Action` from an `Action`, raw reply text, or an oracle's `{"tool": ..}` / `{"calls": [..]}` /
    `{"final": ..}` dict."""
    if isinstance(action, Action):
        return action
    if isinstance(action, str):
        return Action.from_reply(action, parser)
    if isinstance(action, dict) and isinstance(action.get("tool"), str):
        return Action.call(action["tool"], **(action.get("arguments") or {}))
    batch = action.get("calls") if isinstance(action, dict) else None
    if isinstance(batch, list) and batch and all(isinstance(one, dict) and isinstance(one.get("tool"), str)
                                                 for one in batch):  # fmt: skip
        return Action(tool_calls=[ToolCall(one["tool"], one.get("arguments") or {}) for one in batch])
    if isinstance(action, dict) and isinstance(action.get("final"), str):
        return Action(text=action["final"])
    raise TypeError(f"an action is an Action, reply text, {{'tool': ..., 'arguments': ...}}, {{'calls': [tool "
                    f"calls]}} or {{'final': text}}, not {action!r:.80}")  # fmt: skip
