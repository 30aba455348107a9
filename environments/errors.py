"""Errors of an agent rollout. `InfraError` drops a rollout and `ContextFull` ends it; the others go
back to the model."""


class AgentError(Exception):
    """Base class for everything that can go wrong inside a rollout."""


class ToolParseError(AgentError):
    """The model's text looked like a tool call but could not be parsed."""


class ToolCallError(AgentError):
    """A parsed tool call names an unknown tool or has bad arguments, or the tool failed."""


class SandboxViolation(ToolCallError):
    """The agent tried to leave its workspace (path escape, symlink out)."""


class ContextFull(AgentError):
    """The conversation no longer fits the model's context: the episode ends and is scored, like one
    out of turns. Dropped as infra, it would let a policy escape a failing score by talking long."""


class InfraError(AgentError):
    """Inference or sandbox infrastructure failed: the rollout is excluded, never scored 0."""
