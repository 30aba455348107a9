"""Write the README's results table from a store (`flows/results.py`).

.venv/bin/python scripts/results_table.py --store .flywheel                   # print it
.venv/bin/python scripts/results_table.py --store .flywheel --write README.md # replace it in the README
"""

from __future__ import annotations

import argparse
from pathlib import Path

from flywheel.data import ArtifactStore
from flywheel.flows.results import results_table, write_into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default=".flywheel", help="a store with finished rounds")
    parser.add_argument("--write", type=Path, help="a markdown file whose results markers to fill")
    args = parser.parse_args()
    table = results_table(ArtifactStore(args.store))
    if args.write:
        write_into(args.write, table)
    else:
        print(table)


if __name__ == "__main__":
    main()
