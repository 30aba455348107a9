"""`transformers serve` with per-sequence SDPA (`inference/varlen_sdpa.py`):
`python -m flywheel.inference.transformers_serve`.

The server's generation engine runs in a spawned process, which imports this module again (as
`__mp_main__`), so the attention is switched at import time: in the server and in its engine.
"""

from __future__ import annotations

import sys

from transformers.cli.transformers import main

from flywheel.inference.varlen_sdpa import use_varlen_sdpa

use_varlen_sdpa()

if __name__ == "__main__":
    sys.argv[0] = "transformers"
    sys.exit(main())
