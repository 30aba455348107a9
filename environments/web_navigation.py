"""WebNavigationEnv: browse a generated shop on 127.0.0.1 and answer from what the pages show.

The env starts one `ShopSite` HTTP server (`web/site.py`) in `setup()` and stops it in
`teardown()`; the agent uses browser-like tools (`web/browser.py`: open_url, follow_link, search,
submit_form) and answers with `submit_answer` (typed: integer ids, a number for a price). The
verifier checks that submission against the shop's ground truth.

    python environments/web_navigation.py process --env.total_steps 8 --env.tokenizer_name MODEL_DIR \
        --env.data_path_to_save_groups out/web.jsonl --openai.base_url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from flywheel.environments.agent.policies import ScriptedPolicy
from flywheel.environments.agent_loop import AgentResult
from flywheel.environments.hermes_base_env import HermesAgentEnvConfig
from flywheel.environments.task_env import TaskEnv
from flywheel.environments.tasks import web_tasks as tasks
from flywheel.environments.tool_context import ToolContext
from flywheel.environments.web.browser import WEB_TOOLS
from flywheel.environments.web.site import ShopSite


class WebNavigationEnvConfig(HermesAgentEnvConfig):
    """Browser tools only; pages take a few turns each."""

    enabled_toolsets: list[str] = Field(default_factory=list, description="No shell or file tools.")
    max_agent_turns: int = 24


class WebNavigationEnv(TaskEnv):
    name = "web_navigation"
    env_config_cls = WebNavigationEnvConfig
    make_task = tasks.make_task
    categories = tasks.CATEGORIES

    async def setup(self) -> None:
        self.site = ShopSite().start()
        await super().setup()

    async def teardown(self) -> None:
        self.site.stop()

    def extra_tools(self) -> list[Any]:
        return WEB_TOOLS

    def format_prompt(self, item: dict[str, Any]) -> str:
        return item["prompt"].replace("{site}", self.site.base_url)

    def oracle_policy(self, item: dict[str, Any]) -> ScriptedPolicy:
        actions = json.loads(json.dumps(item["oracle"]).replace("{site}", self.site.base_url))
        return ScriptedPolicy(actions, self.config.tool_call_parser)

    async def verify(self, item: dict[str, Any], result: AgentResult, ctx: ToolContext) -> bool:
        return tasks.verify(item, ctx.state.get("answer"))


if __name__ == "__main__":
    WebNavigationEnv.cli()
