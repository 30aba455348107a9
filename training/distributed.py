"""The processes of a distributed launch, before and after a Trainer exists.

`accelerate launch` (or torchrun) starts one process per GPU; accelerate's `PartialState` joins the
process group it set up (NCCL on GPUs, gloo on CPU), the same state the Trainer uses later. Files
every rank would write alike (the run folder's name, a fetched step checkpoint, the stored model)
are written once: rank 0 decides and the others follow.
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

from flywheel.training.device import one_gpu_per_process

T = TypeVar("T")


def launched() -> bool:
    """Whether this process is one rank of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def deepspeed_launch() -> bool:
    """Whether `accelerate launch` started this process for DeepSpeed."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def _state() -> Any:
    import torch
    from accelerate import PartialState

    if torch.cuda.is_available():
        return PartialState()
    if deepspeed_launch():  # Accelerate joins DeepSpeed's group only off CPU; named, gloo counts every rank.
        return PartialState(backend="gloo")
    return PartialState(cpu=True)  # Gloo, as TrainingArguments' use_cpu.


def training_arguments(config_class: type[T], kwargs: dict[str, Any]) -> T:
    """A TRL config (`SFTConfig`, `GRPOConfig`, ...) from `kwargs`, on this launch's process group.

    DeepSpeed on several CPU processes (the ZeRO-3 test's set-up) needs the state `_state` made
    (`accelerator_config.use_configured_state`): transformers' own set-up would count one process.
    """
    if (kwargs.get("accelerator_config") or {}).get("use_configured_state"):
        _state()
    return one_gpu_per_process(config_class(**kwargs))


def from_rank_zero(value: T) -> T:
    """`value` as rank 0 has it (every rank must call this)."""
    if not launched():
        return value
    from accelerate.utils import broadcast_object_list

    _state()
    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]


def this_device() -> Any:
    """This rank's device (`cuda:<local rank>` on GPUs)."""
    return _state().device


def my_share(items: list[T]) -> list[T]:
    """This rank's share of `items`: every item goes to exactly one rank."""
    if not launched():
        return items
    state = _state()
    return items[state.process_index :: state.num_processes]


def gathered(items: list[T]) -> list[T]:
    """Every rank's `items`, concatenated in rank order, on every rank (every rank must call this)."""
    if not launched():
        return items
    from accelerate.utils import gather_object

    _state()
    return gather_object(items)


def is_main(local: bool = False) -> bool:
    """Rank 0 of the run (`local`: of this machine, which owns its disk)."""
    if not launched():
        return True
    state = _state()
    return state.is_local_main_process if local else state.is_main_process


def wait_for_everyone() -> None:
    if launched():
        _state().wait_for_everyone()
