"""`vllm.sampling_params` of the stand-in: what TRL imports from it."""

from dataclasses import dataclass


@dataclass
class StructuredOutputsParams:
    regex: str | None = None
