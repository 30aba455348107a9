"""`BaseEnvironment`: the gym-style view of any agent env — `reset` / `step` / `score`.

For people who drive an env step by step and for trainers that own the generation loop (TRL GRPO).
An action is the model's raw reply text (tool calls are parsed from it) or a dict
`{"tool": name, "arguments": {...}}`. A reply without a tool call ends the episode and is scored
by the env's own verifier in the sandbox the actions changed.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from environments.agent_loop import AgentResult
from environments.errors import AgentError
from environments.hermes_base_env import HermesAgentBaseEnv, _prepare_workspace
from environments.tool_call_parsers import ParsedToolCall, get_parser
from environments.tool_context import ToolContext


@dataclass
class State:
    """What the agent sees: the latest observation and the whole conversation so far."""

    task_id: str
    observation: str
    messages: list[dict[str, Any]]
    turn: int = 0
    item: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass
class StepResult:
    next_state: State
    reward: float
    done: bool
    info: dict[str, Any]

    def __iter__(self):  # Unpacks as the gym-style `(next_state, reward, done, info)` tuple.
        return iter((self.next_state, self.reward, self.done, self.info))


class BaseEnvironment:
    """Wraps a set-up `HermesAgentBaseEnv`: one episode at a time, synchronous."""

    def __init__(self, env: HermesAgentBaseEnv) -> None:
        self.env = env
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(env.setup())
        self._tools = {t.name: t for t in env.extra_tools()}
        schemas, names = env._resolve_tools_for_group()
        from environments.tools import TOOLSETS

        self._tools.update({t.name: t for ts in TOOLSETS.values() for t in ts if t.name in names})
        self.tool_schemas = schemas
        self.parser = get_parser(env.config.tool_call_parser)
        self.state: State | None = None
        self._ctx: ToolContext | None = None

    @classmethod
    def make(cls, env_cls: type[HermesAgentBaseEnv], **config: Any) -> BaseEnvironment:
        """`BaseEnvironment.make(ToolUseChainEnv, difficulty="easy", max_steps=20)`."""
        return cls(env_cls(**config))

    def reset(self, task_id: str | int | None = None) -> State:
        """Start an episode on task `task_id` (an index into the env's task stream, or the next one)."""
        self.close_episode()
        if isinstance(task_id, int) or (isinstance(task_id, str) and task_id.isdigit()):
            item = self.env.stream.item(int(task_id))
        else:
            item = self._loop.run_until_complete(self.env.get_next_item())
        sandbox_id = f"{item.get('item_id', 'task')}-{uuid.uuid4().hex[:8]}"
        self._ctx = ToolContext(sandbox_id)
        _prepare_workspace(self._ctx, item)
        messages = self.env.build_messages(item, self.tool_schemas)
        self.state = State(sandbox_id, messages[-1]["content"], messages, 0, item)
        return self.state

    def step(self, action: str | dict[str, Any]) -> StepResult:
        """Apply one action; a final answer (no tool call) ends and scores the episode."""
        if self.state is None or self._ctx is None:
            raise RuntimeError("call reset() before step()")
        state = self.state
        if isinstance(action, dict):
            calls, content = [ParsedToolCall(action["tool"], action.get("arguments", {}))], ""
        else:
            parsed = self.parser.parse(action)
            calls, content = parsed.tool_calls, parsed.content
        assistant: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            assistant["tool_calls"] = [c.as_message_entry() for c in calls]
        state.messages.append(assistant)
        state.turn += 1
        if not calls or state.turn >= self.env.config.max_agent_turns:
            reward = self.score(state.messages)
            return StepResult(state, reward, True, {"turns": state.turn, "finished_naturally": not calls})
        outputs = []
        for call in calls:
            tool = self._tools.get(call.name)
            try:
                if tool is None:
                    raise AgentError(f"unknown tool '{call.name}'")
                text = tool(self._ctx, call.arguments)
            except AgentError as err:
                text = f"Error: {err}"
            state.messages.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": text})
            outputs.append(text)
        state.observation = "\n".join(outputs)
        return StepResult(state, 0.0, False, {"turns": state.turn, "tool_calls": [c.name for c in calls]})

    def score(self, trajectory: list[dict[str, Any]] | AgentResult) -> float:
        """The env's verifier on the current episode's sandbox, for a finished trajectory."""
        if self.state is None or self._ctx is None:
            raise RuntimeError("no episode to score: call reset() first")
        result = trajectory if isinstance(trajectory, AgentResult) else AgentResult(messages=list(trajectory))
        result.turns_used = result.turns_used or sum(1 for m in result.messages if m.get("role") == "assistant")
        reward = self._loop.run_until_complete(self.env.compute_reward(self.state.item, result, self._ctx))
        return float(min(1.0, max(0.0, reward)))

    def close_episode(self) -> None:
        if self._ctx is not None:
            self._ctx.cleanup()
            self._ctx = None

    def close(self) -> None:
        """End the episode and release what the env started."""
        self.close_episode()
        self._loop.run_until_complete(self.env.teardown())
        self._loop.close()

    def __repr__(self) -> str:
        task = json.dumps(self.state.task_id) if self.state else None
        return f"BaseEnvironment({self.env.name}, task={task})"
