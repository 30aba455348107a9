"""The step contract (docs/architecture.md): `BaseEnvironment` with `reset` / `step` / `score`.

    class MyEnv(BaseEnvironment):
        def reset(self, task_id=None) -> State: ...
        def step(self, action: Action) -> StepResult: ...

`reset` starts an episode and returns what the agent sees first; `step` takes the agent's
`Action` (its reply text and any tool calls) and returns the `StepResult` (next state, reward,
done, info). Rewards usually come at the end: 0 for intermediate steps, the verifier's score when
`done`. Every built-in env is a `BaseEnvironment`, and a user's subclass runs everywhere a
built-in does (process / evaluate / serve, GRPO, `AtroposRunner`, a flywheel round) through one
adapter, `flywheel.environments.adapter.StepEnvAdapter`, which turns each model reply into an `Action` and
each `next_state` into the next tool or user message.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from flywheel.environments.tool_call_parsers import ParsedToolCall, get_parser

ToolCall = ParsedToolCall


@dataclass
class State:
    """What the agent sees.

    `prompt` opens the episode; `observation` is the latest text for the agent (a tool's output
    after a tool call; empty means "show `prompt`"). `tools` are the OpenAI tool schemas the agent
    may call in this state (none: a plain question-and-answer episode).
    """

    prompt: str
    initial_context: dict[str, Any] = field(default_factory=dict)
    observation: str = ""
    tools: list[dict[str, Any]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    task_id: Any = None
    turn: int = 0

    @property
    def text(self) -> str:
        """The text the agent is shown next."""
        return self.observation or self.prompt


@dataclass
class Action:
    """One reply of the agent: its text and the tool calls it made (possibly none)."""

    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def is_tool_call(self) -> bool:
        return bool(self.tool_calls)

    @classmethod
    def from_reply(cls, reply: str, parser: str = "hermes") -> Action:
        """Parse raw model text (tool calls in the parser's format) into an `Action`."""
        parsed = get_parser(parser).parse(reply)
        return cls(text=parsed.content, tool_calls=list(parsed.tool_calls))

    @classmethod
    def call(cls, tool: str, **arguments: Any) -> Action:
        """`Action.call("write_file", path="a.txt", content="x")`: one tool call."""
        return cls(tool_calls=[ToolCall(tool, arguments)])


@dataclass
class StepResult:
    """The outcome of one step; unpacks as the gym-style `(next_state, reward, done, info)`."""

    next_state: State | None
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.next_state, self.reward, self.done, self.info))


class BaseEnvironment:
    """An agent environment, one episode at a time: `reset`, then `step` until `done`.

    Class attributes a subclass may set: `name` (the registry name), `reward_range` (rewards
    outside it are logged and counted as reward bugs, never silently clipped) and
    `key_decisions` (names of the decisions a good trajectory makes; see `AgentResult`).
    """

    name: ClassVar[str | None] = None
    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    key_decisions: ClassVar[tuple[str, ...]] = ()

    def reset(self, task_id: Any = None) -> State:
        """Start an episode on task `task_id` (None: the env picks one)."""
        raise NotImplementedError

    def step(self, action: Action) -> StepResult:
        """Apply the agent's action; when `done`, `reward` is the episode's score."""
        raise NotImplementedError

    def score(self, trajectory: Any) -> float:
        """Score a finished trajectory (envs that give the reward in `step` need not implement it)."""
        raise NotImplementedError(f"{type(self).__name__} gives its reward in step(); it has no score()")
