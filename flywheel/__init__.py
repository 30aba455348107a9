"""flywheel: a data flywheel for tool-using LLM agents.

Its packages live in the repository's top-level folders (`data/`, `environments/`, `evaluation/`,
`flows/`, `inference/`, `training/`) and are imported as `flywheel.<package>` (pyproject.toml maps
them), so no generic top-level name of ours meets a user's.
"""
