"""The security boundary: where an agent's commands run (`box`), how they are jailed (`jail`), file
access beneath the workspace (`files`), and the workspace a task starts with (`workspace`).
Importable and testable without the agent loop."""
