"""Write the README's results table from a store (`flows/results.py`).

.venv/bin/python scripts/results_table.py --store .flywheel                   # print it
.venv/bin/python scripts/results_table.py --store .flywheel --write README.md # replace it in the README
.venv/bin/python scripts/results_table.py --store .flywheel --runs            # + per difficulty, curricula
"""

from __future__ import annotations

import argparse
from pathlib import Path

from flywheel.data import ArtifactStore
from flywheel.flows.results import curriculum_table, difficulty_table, results_table, write_into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default=".flywheel", help="a store with finished rounds")
    parser.add_argument("--write", type=Path, help="a markdown file whose results markers to fill")
    parser.add_argument("--runs", action="store_true", help="also the tables per difficulty and of the curricula")
    args = parser.parse_args()
    store = ArtifactStore(args.store)
    table = results_table(store)
    if args.write:
        write_into(args.write, table)
    else:
        print(table)
    if args.runs:
        print(f"\nHeld-out success per env and difficulty:\n\n{difficulty_table(store)}")
        print(f"\nThe curriculum each round mined, and what the next round trained on:\n\n{curriculum_table(store)}")


if __name__ == "__main__":
    main()
