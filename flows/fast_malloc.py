"""tcmalloc for the `flywheel` process tree, where it is installed.

CPU torch has no caching allocator: every activation, gradient and logits chunk of a step is a
malloc and a free, and glibc hands each large block back to the kernel (munmap) and maps it anew
on the next step, so every step page-faults its working set again. SmolLM2's SFT on 2 cores spent a
third of its CPU time in the kernel that way; with tcmalloc, which keeps freed blocks for reuse,
the same steps ran 1.66x faster end to end at a lower peak, with identical losses (`benchmarks/allocator.py`).
PyTorch's own CPU launcher (`python -m torch.backends.xeon.run_cpu`) preloads it the same way.

The command re-executes itself once with the library in LD_PRELOAD; every process it starts
(model servers, training launches, the temporary Prefect server) inherits it.
`FLYWHEEL_MALLOC=system` keeps glibc's malloc.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from collections.abc import Sequence

LIBRARY = "tcmalloc_minimal"
OPT_OUT = "FLYWHEEL_MALLOC"


def fast_malloc_env(environ: dict[str, str] | None = None) -> dict[str, str] | None:
    """The environment that preloads tcmalloc; None when it is loaded already, opted out of, or not
    installed (apt: libtcmalloc-minimal4)."""
    environ = dict(os.environ if environ is None else environ)
    preloaded = environ.get("LD_PRELOAD", "")
    if sys.platform != "linux" or environ.get(OPT_OUT) == "system" or f"lib{LIBRARY}" in preloaded:
        return None
    library = ctypes.util.find_library(LIBRARY)
    if library is None:
        return None
    # tcmalloc reports every allocation over 1 GB on stderr; a model's weights or a logits block can be one.
    environ.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 40))
    return environ | {"LD_PRELOAD": " ".join(filter(None, (library, preloaded)))}


def reexec_with_fast_malloc(command: Sequence[str]) -> None:
    """Replace this process with `command` under tcmalloc; return (and go on as is) when there is nothing to do."""
    environ = fast_malloc_env()
    if environ is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execvpe(command[0], list(command), environ)  # A bare command name is looked up on PATH.


if (
    __name__ == "__main__"
):  # `python -m flywheel.flows.fast_malloc COMMAND...`: run a command under tcmalloc (`make test`).
    if len(sys.argv) < 2:
        sys.exit("usage: python -m flywheel.flows.fast_malloc COMMAND [ARGS...]")
    reexec_with_fast_malloc(sys.argv[1:])
    os.execvp(sys.argv[1], sys.argv[1:])  # Nothing to preload: the command as it is.
