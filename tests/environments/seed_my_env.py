"""A user's step environment, written to the contract in docs/architecture.md (its `...` filled in).

The agent must add two numbers with the `add` tool and answer with the sum.
"""

import json
import random

from flywheel.environments.base import Action, BaseEnvironment, State, StepResult

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def load_tasks(task_file: str) -> list[dict]:
    with open(task_file) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def execute_tool(action: Action) -> str:
    call = action.tool_calls[0]
    if call.name != "add":
        return f"Error: unknown tool {call.name}"
    return str(int(call.arguments["a"]) + int(call.arguments["b"]))


class MyEnv(BaseEnvironment):
    name = "my_env"

    def __init__(self, task_file: str):
        self.tasks = load_tasks(task_file)

    def reset(self, task_id: int = None) -> State:  # noqa: RUF013 (the contract's documented signature)
        self.task = self.tasks[task_id or random.randint(0, len(self.tasks) - 1)]
        return State(prompt=self.task["prompt"], initial_context=self.task.get("context", {}), tools=[ADD])

    def step(self, action: Action) -> StepResult:
        """action 是 agent 输出(文字 + 可能的工具调用)"""
        if action.is_tool_call:
            result = execute_tool(action)
            return StepResult(
                next_state=State(prompt=self.task["prompt"], observation=result, tools=[ADD]),
                reward=0,  # step-level 0,最后给总 reward
                done=False,
            )
        # agent 给了最终答案
        score = self.verify(action.text, self.task["expected"])
        return StepResult(
            next_state=None,
            reward=score,
            done=True,
        )

    def verify(self, agent_answer, expected):
        # 你的评分逻辑
        return 1.0 if agent_answer.strip() == expected else 0.0


def write_tasks(path: str, n: int = 10) -> None:
    """`n` addition tasks, one JSON object per line."""
    with open(path, "w") as handle:
        for i in range(n):
            task = {"prompt": f"What is {i} + {i + 7}? Use the add tool, then answer with the number only.",
                    "expected": str(2 * i + 7), "a": i, "b": i + 7}  # fmt: skip
            handle.write(json.dumps(task) + "\n")
