"""A task's sandbox set-up: the item's files and set-up commands, and finding the item of a
loop that was given only messages (a hand-built `evaluate`)."""

from __future__ import annotations

from typing import Any

from flywheel.environments.tool_context import ToolContext

Item = dict[str, Any]


def write_workspace(ctx: ToolContext, item: Item) -> None:
    """Write `item["files"]` into the sandbox and run `item["setup_commands"]` (a failure is infra)."""
    ctx.state["item"] = item  # For tools that depend on the task (the browser's one allowed site); never shown.
    for path, content in (item.get("files") or {}).items():
        ctx.write_file(path, content)
    for command in item.get("setup_commands") or []:
        outcome = ctx.terminal(command)
        if outcome["exit_code"] != 0:
            raise RuntimeError(f"setup command failed for {item.get('item_id')}: {command}: {outcome['output']}")


class WorkspaceItems:
    """Mixed into `HermesAgentBaseEnv`: items by prompt, so the env's server can set up any loop's sandbox."""

    def prepare_workspace(self, ctx: ToolContext, item: Item) -> None:
        """Set up `item`'s sandbox (an env with other needs overrides this)."""
        write_workspace(ctx, item)

    def remember_item(self, item: Item) -> Item:
        """Index `item` by its prompt, so a hand-built loop's sandbox gets its files (bounded)."""
        known: dict[str, Item] = self.__dict__.setdefault("_items_by_prompt", {})
        if len(known) >= 4096:
            known.clear()
        known[self.format_prompt(item)] = item  # type: ignore[attr-defined]
        return item

    def _prepare_workspace_for(self, ctx: ToolContext, messages: list[dict[str, Any]]) -> None:
        """Set up the sandbox of a loop that was given only messages, from its user prompt."""
        prompt = next((m.get("content") for m in messages if m.get("role") == "user"), None)
        item = self.__dict__.get("_items_by_prompt", {}).get(prompt) if isinstance(prompt, str) else None
        if item is not None:
            self.prepare_workspace(ctx, item)
