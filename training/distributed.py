"""The processes of a distributed launch, before and after a Trainer exists.

`accelerate launch` (or torchrun) starts one process per GPU; accelerate's `PartialState` joins the
process group it set up (NCCL on GPUs, gloo on CPU), the same state the Trainer uses later. Files
every rank would write alike (the run folder's name, a fetched step checkpoint, the stored model)
are written once: rank 0 decides and the others follow.
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

T = TypeVar("T")


def launched() -> bool:
    """Whether this process is one rank of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def _state() -> Any:
    import torch
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())  # Without a GPU, gloo (as TrainingArguments' use_cpu).


def from_rank_zero(value: T) -> T:
    """`value` as rank 0 has it (every rank must call this)."""
    if not launched():
        return value
    from accelerate.utils import broadcast_object_list

    _state()
    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]


def is_main(local: bool = False) -> bool:
    """Rank 0 of the run (`local`: of this machine, which owns its disk)."""
    if not launched():
        return True
    state = _state()
    return state.is_local_main_process if local else state.is_main_process


def wait_for_everyone() -> None:
    if launched():
        _state().wait_for_everyone()
