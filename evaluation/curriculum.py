"""The curriculum: the champion's held-out outcomes -> what the next round generates and trains on.

Each slice (env, category, difficulty) gets a class from Wilson intervals on its success rate:

- *unsolved* (upper bound under `low`, or no success seen yet - a slice the champion never
  solved gives rejection sampling nothing to keep): teacher demonstrations for SFT;
- *learnable* (in between, with a success seen): the champion's own rollouts (rejection-sampled
  into SFT rows and preference pairs) and GRPO tasks, both weighted by learnability p(1 - p);
- *mastered* (lower bound over `high`): a small replay share of the champion's own rollouts
  (its successes keep what it does there in SFT: a teacher's different procedure made it forget),
  and the category's next difficulty unlocks (it stays unlocked in later rounds);
- *locked*: a harder difficulty whose easier one is not mastered yet: nothing.

A held-out set has only a few items per slice, so thin evidence climbs to the slice's parents
(env x difficulty, then env) until an interval is decisive, as long as the slice's own outcomes
point the same way; every row says which level decided.
The generation budget is split over the slices to teach (unsolved, learnable) by weight (an
unsolved slice 1, a learnable one 4p(1 - p): 1 at even odds; largest remainder), and each mastered
slice's replay comes on top of it, so every decision - slice, class, weight, groups - is recorded
and generation follows it exactly.

Teacher data goes where it can teach. Horizons grow with difficulty, and a slice's turn budget is
its horizon (`turns`: 1.5 x its teacher's calls, at least the round's `max_turns`), so a longer slice
gets its budget when it unlocks, once its category's shorter slice is mastered (a horizon
curriculum: a student first learns the 5-call procedure, then the 30-call one). Of the unsolved
slices only the easiest (easiest difficulty, then fewest teacher turns) are taught this round: while
the champion solves no slice yet (a base model, which first has to learn the tool-call format from a
few procedures), at most `focus` of them; once it solves some, every one - a success that made no tool
call (declining an irrelevance task, which a model that does nothing passes) is no sign of that; and never more than the
budget left after the learnable slices gives `min_teacher_groups` each. The others wait for a later
round.

A round the gate keeps out for want of confidence still taught something: the next round carries its
rollouts into its SFT set (`flows/flywheel.py`), and an unsolved slice it taught (or carried) that
its candidate solved with a tool call is `carried`: no new teacher groups, outside the focus, so the
focus moves on to the next slices instead of repeating the kept-out round's plan. With nothing else
left to teach, the carried slices are taught anew.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from typing import Any, Literal

from pydantic import BaseModel, Field

from flywheel.environments.registry import env_name, teacher_turns
from flywheel.environments.task_stream import DIFFICULTIES, turn_budget
from flywheel.evaluation.suite import SUITE_TEACHERS

SliceClass = Literal["unsolved", "learnable", "mastered", "locked"]
SOURCES = {"unsolved": "teacher", "learnable": "policy", "mastered": "policy", "locked": None}


class CurriculumConfig(BaseModel):
    """Thresholds and weights of the curriculum (a form in the UI, part of the round profile)."""

    low: float = Field(default=0.3, gt=0, lt=1, description="Unsolved: success upper bound under this.")
    high: float = Field(default=0.7, gt=0, lt=1, description="Mastered: success lower bound over this.")
    z: float = Field(
        default=1.96,
        gt=0,
        description="Wilson interval width (1.96: 95 %; the CPU presets use 1.0, 68 %, as "
        "they hold out one or two items per slice).",
    )
    replay: float = Field(
        default=0.5,
        ge=0,
        description="Replay groups of a mastered slice, against forgetting, as a share of a taught slice's groups "
        "and on top of the round's budget (at 0.1 a default round replayed one group of a mastered slice, and the "
        "candidate lost every tool_use_chain item it had solved).",
    )
    focus: int | None = Field(
        default=None,
        ge=1,
        description="Unsolved slices given teacher data while the champion solves no slice yet with a tool call "
        "(easiest first; None: every one, as in every round once it solves some). From SmolLM2's base, 3 slices scored "
        "0.25 and 4 scored 0.17; from a round-1 champion, a focus of 3 lost to a uniform mix (README).",
    )
    teaches: dict[str, list[str]] = Field(
        default_factory=lambda: {task: list(targets) for task, targets in SUITE_TEACHERS.items()},
        description="lm-eval task -> the env categories (`env/category`) that train its skill: while the task is not "
        "mastered, its failure rate adds weight to their unlocked slices (`evaluation/steering.py`).",
    )
    benchmark_weight: float = Field(
        default=1.0,
        ge=0,
        description="Weight an lm-eval task failed outright adds to each slice that teaches it (an unsolved "
        "slice weighs 1), scaled by its failure rate.",
    )
    min_teacher_groups: int | None = Field(
        default=None,
        ge=1,
        description="Groups each taught unsolved slice gets at least: only as many (easiest first, at least one) "
        "as the budget left after the learnable slices can give this many (None: no floor). At 8 of the "
        "default's 32 groups, round 1 taught four slices and scored 0.17 where `focus` 3 scored 0.25.",
    )


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a success rate.

    >>> tuple(round(x, 3) for x in wilson(0, 10))
    (0.0, 0.278)
    """
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def build_curriculum(
    outcomes: list[dict[str, Any]],
    families: dict[str, tuple[str, ...]],
    config: CurriculumConfig | None = None,
    previous: dict[str, Any] | None = None,
    difficulty: str | None = None,
    carried: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Per env, every slice's class and evidence, and the slices unlocked.

    `outcomes`: `{source, category, difficulty, success}` rows (mining's flat samples);
    `families`: env -> its categories (none: the whole env is one slice, `*`); `previous`: the last
    round's curriculum (unlocks persist); `difficulty`: a profile that fixes one difficulty gets
    only that one, always unlocked; `carried`: the same rows of a kept-out candidate whose rollouts the
    next round carries (an unsolved slice that `previous` taught or carried and that it solved with a
    tool call records `carried`: wins/n).
    """
    config = config or CurriculumConfig()
    curriculum: dict[str, Any] = {}
    for env, categories in families.items():
        sources = {env, env_name(env)}  # Samples name a file or module:Class env by its class's name.
        if not categories:  # An env without task categories is one slice, `*`, with nothing to unlock.
            own = [row for row in outcomes if row["source"] in sources]
            counts = {(env, "*", "*"): _tally(own)}
            row = _classify(env, "*", "*", counts, config) | {"slice": "*"}
            curriculum[env] = {"slices": [row], "unlocked": ["*"], "newly_unlocked": []}
            continue
        levels = (difficulty,) if difficulty else DIFFICULTIES
        before = set((previous or {}).get(env, {}).get("unlocked", []))
        taught = {row["slice"] for row in (previous or {}).get(env, {}).get("slices", []) if row.get("groups") or
                  row.get("carried")}  # fmt: skip
        opened = before | {f"{c}/{levels[0]}" for c in categories}
        counts = _counts(env, [row for row in outcomes if row["source"] in sources], opened)
        rows, unlocked = [], set(opened)
        for category in categories:  # Easiest first: a slice mastered now unlocks the next one at once.
            for level, harder in zip(levels, (*levels[1:], None), strict=True):
                name = f"{category}/{level}"
                row = _classify(env, category, level, counts, config) | {"slice": name}
                if name not in unlocked:
                    row |= {"class": "locked", "evidence": "locked"}
                elif (
                    row["class"] == "unsolved"
                    and name in taught
                    and (solved := _carried(carried, sources, category, level))
                ):
                    row["carried"] = solved
                rows.append(row)
                if row["class"] == "mastered" and harder:
                    unlocked.add(f"{category}/{harder}")
        curriculum[env] = {
            "slices": rows,
            "unlocked": sorted(unlocked),
            "newly_unlocked": sorted(unlocked - opened),
        }
    return curriculum


def _carried(rows: list[dict[str, Any]] | None, sources: set[str], category: str, level: str) -> str | None:
    """`wins/n` of a kept-out candidate on a slice, when it solved one item there with a tool call."""
    own = [r for r in rows or [] if r["source"] in sources and (r["category"], r["difficulty"]) == (category, level)]
    wins, n, idle = _tally(own)
    return f"{wins}/{n}" if wins > idle else None


def _counts(env: str, rows: list[dict[str, Any]], opened: set[str]) -> dict[tuple[str, str, str], list[int]]:
    """[wins, n, wins without a tool call] per evidence level of `env`'s rows; the parent levels count
    only slices open before this round, so a locked harder slice (never trained) cannot drag an easier
    one's parent evidence."""
    grouped: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        own, *parents = _levels(env, row["category"], row["difficulty"])
        for key in [own] + (parents if f"{row['category']}/{row['difficulty']}" in opened else []):
            grouped[key].append(row)
    return {key: _tally(group) for key, group in grouped.items()}


def _tally(rows: list[dict[str, Any]]) -> list[int]:
    """[wins, n, wins without a tool call] (a row that does not say counts as having made one)."""
    wins = [row for row in rows if row["success"]]
    return [len(wins), len(rows), sum(not row.get("acted", True) for row in wins)]


def _levels(env: str, category: str, difficulty: str) -> list[tuple[str, str, str]]:
    """The evidence levels of a slice, most specific first."""
    return [(env, category, difficulty), (env, "*", difficulty), (env, "*", "*")]


def _classify(
    env: str, category: str, difficulty: str, counts: dict[tuple[str, str, str], list[int]], config: CurriculumConfig
) -> dict[str, Any]:
    """The class from the most specific decisive interval. A parent level decides only for a slice
    whose own outcomes point the same way; nothing decisive: unsolved until a success is seen,
    then learnable."""
    own_wins, own_n, idle = counts.get((env, category, difficulty), (0, 0, 0))
    for key in _levels(env, category, difficulty):
        wins, n, _ = counts.get(key, (0, 0, 0))
        if n == 0 or own_n == 0:
            continue
        low, high = wilson(wins, n, config.z)
        if high < config.low and own_wins / own_n < config.low:
            return _row("unsolved", own_wins, idle, own_n, (low, high), "/".join(key))
        if low > config.high and own_wins / own_n > config.high:
            return _row("mastered", own_wins, idle, own_n, (low, high), "/".join(key))
    interval = wilson(own_wins, own_n, config.z)
    if own_wins == 0:  # Nothing for rejection sampling to keep: demonstrations until it shows a success.
        return _row("unsolved", own_wins, idle, own_n, interval, "no success yet")
    return _row("learnable", own_wins, idle, own_n, interval, "undecided")


def _row(cls: SliceClass, wins: int, idle: int, n: int, ci: tuple[float, float], evidence: str) -> dict[str, Any]:
    low, high = ci
    return {
        "class": cls,
        "wins": wins,
        "wins_without_calls": idle,
        "n": n,
        "ci": [round(low, 4), round(high, 4)],
        "evidence": evidence,
    }


def plan_generation(
    curriculum: dict[str, Any], groups: int, config: CurriculumConfig | None = None, max_turns: int | None = None
) -> dict[str, Any]:
    """Split `groups` over the slices to teach by weight (unsolved 1, learnable 4p(1 - p)) and add each
    mastered slice's replay (`replay` times a taught slice's share) on top; per env and source (teacher /
    policy), the slice weights and group count generation runs with. Records `weight` and `groups` per
    slice, each unsolved slice's `teacher_turns` and turn budget `turns` (at least `max_turns`), and why a
    slice to teach `waits` (beyond the round's focus, or no group left in a budget smaller than the slices).

    Replay on top, not out of `groups`: taken out of the budget, replay grew with every slice mastered
    and starved the teaching (a default run's round 3 gave its unsolved slices 4 teacher groups each,
    round 1 gave 11), so the round's plan grows with what it keeps instead, by at most `groups` (a few
    taught slices beside many mastered ones would otherwise multiply the round's SFT). With nothing
    left to teach, `groups` all go to replay."""
    config = config or CurriculumConfig()
    weight = {"unsolved": 1.0, "mastered": config.replay, "locked": 0.0}
    per_env = [[(env, row) for row in spec["slices"]] for env, spec in curriculum.items()]
    # Interleaved across envs, so a budget smaller than the slices spreads its ties over every env.
    cells = [cell for rank in itertools.zip_longest(*per_env) for cell in rank if cell is not None]
    for _, row in cells:  # A learnable slice at even odds weighs like an unsolved one, one nearly solved little.
        own = round(4 * learnability(row, config), 4) if row["class"] == "learnable" else weight[row["class"]]
        row["weight"] = own + row.get("benchmark_weight", 0.0)  # What lm-eval weaknesses add (`steering.py`).
    _focus_teaching(cells, _teaching_limit(cells, groups, config), max_turns)
    taught = [0.0 if row["class"] == "mastered" else row["weight"] for _, row in cells]
    replayed = [row["weight"] if row["class"] == "mastered" else 0.0 for _, row in cells]
    replay_groups = min(round(sum(replayed) * groups / sum(taught)), groups) if any(taught) else groups
    shares = [
        a + b
        for a, b in zip(largest_remainder(taught, groups), largest_remainder(replayed, replay_groups), strict=True)
    ]
    plan: dict[str, Any] = defaultdict(dict)
    for (env, row), share in zip(cells, shares, strict=True):
        row["groups"] = share
        if not share and row["weight"] and row["class"] in ("unsolved", "learnable"):
            row["waits"] = f"no group left: this round's {groups} groups went to other slices"
        source = SOURCES[row["class"]]
        if share and source:
            part = plan[env].setdefault(source, {"groups": 0, "mix": {}})
            part["groups"] += share
            part["mix"][row["slice"]] = share
    for env, parts in plan.items():
        for part in parts.values():  # Slices the mix leaves out get weight 0 (TaskStream's default is 1).
            part["mix"] = {row["slice"]: part["mix"].get(row["slice"], 0) for row in curriculum[env]["slices"]}
    return dict(plan)


def _teaching_limit(cells: list[tuple[str, dict[str, Any]]], groups: int, config: CurriculumConfig) -> int | None:
    """How many unsolved slices this round teaches: `focus` while the champion solves no slice yet with a
    tool call (every one in reach once it does), and no more than leave `min_teacher_groups` each once
    the learnable slices have their share (by their weights); at least one."""
    solves_some = any(
        row["class"] in ("learnable", "mastered") and row["wins"] > row.get("wins_without_calls", 0) for _, row in cells
    )
    limit = None if solves_some else config.focus
    if config.min_teacher_groups:
        learnable = sum(row["weight"] for _, row in cells if row["class"] == "learnable")
        floor = max(1, math.floor(groups / config.min_teacher_groups - learnable))
        limit = min(limit or floor, floor)
    return limit


def _focus_teaching(cells: list[tuple[str, dict[str, Any]]], focus: int | None, max_turns: int | None) -> None:
    """Record each unsolved slice's teacher turns and turn budget (given the round's `max_turns`), zero the
    weight of the carried ones (the rollouts the round carries teach them), and of those past the `focus`
    easiest of the rest (easiest difficulty, then fewest teacher turns, ties taken from each env in turn)."""
    unsolved = [(env, row) for env, row in cells if row["class"] == "unsolved"]
    for env, row in unsolved if max_turns else []:
        row["teacher_turns"] = teacher_turns(env, row["slice"])
        row["turns"] = turn_budget(row["teacher_turns"] or 0, max_turns)
    teachable = ("unsolved", "learnable")
    others = any(row["weight"] for _, row in cells if row["class"] in teachable and not row.get("carried"))
    if others:  # With nothing else to teach, the carried slices are taught anew.
        for _, row in unsolved:
            if row.get("carried"):
                row["weight"], row["waits"] = 0.0, f"carried: the kept-out candidate solved {row['carried']}"
        unsolved = [(env, row) for env, row in unsolved if not row.get("carried")]
    seen: Counter[tuple[str, tuple[int, int]]] = Counter()
    ranked = []  # (ease, the env's how-many-th at that ease, row): equally easy slices alternate envs.
    for env, row in unsolved:
        ease = (_difficulty_rank(row["slice"]), row.get("teacher_turns") or 0)
        ranked.append((ease, seen[env, ease], row))
        seen[env, ease] += 1
    for *_, row in sorted(ranked, key=lambda entry: entry[:2])[focus or len(ranked) :]:
        row["weight"], row["waits"] = 0.0, f"beyond this round's focus of {focus} unsolved slices"


def _difficulty_rank(slice_name: str) -> int:
    level = slice_name.rsplit("/", 1)[-1]
    return DIFFICULTIES.index(level) if level in DIFFICULTIES else 0


def grpo_mix(curriculum: dict[str, Any], config: CurriculumConfig | None = None) -> dict[str, dict[str, float]]:
    """Per env, GRPO task weights on one scale across envs (GRPO draws an env's tasks in proportion to
    its weights' sum): learnability p(1 - p) of each learnable slice (p: the Wilson centre), so an env
    with nothing learnable gets no tasks. With nothing learnable anywhere, every unsolved slice alike
    (SFT has just been shown them, or their carried rows); with none of those either, every unlocked mastered
    one."""
    config = config or CurriculumConfig()
    cells = [(env, row) for env, spec in curriculum.items() for row in spec["slices"]]
    weights = [round(learnability(row, config), 4) for _, row in cells]
    for fallback in ("unsolved", "mastered"):  # Only the slices the plan teaches (a waiting one got no data).
        if not any(weights):
            weights = [
                float(row["class"] == fallback and (row.get("weight", 1.0) > 0 or bool(row.get("carried"))))
                for _, row in cells
            ]
    mix: dict[str, dict[str, float]] = {env: {} for env in curriculum}
    for (env, row), weight in zip(cells, weights, strict=True):
        mix[env][row["slice"]] = weight
    return mix


def learnability(row: dict[str, Any], config: CurriculumConfig) -> float:
    """p(1 - p) of a learnable slice (p: the Wilson centre of its success rate); 0 for any other class.
    What the champion's own rollouts can still teach there: rejection sampling and preference pairs
    need both outcomes, and a slice it nearly always solves gives back what it already does."""
    if row["class"] != "learnable":
        return 0.0
    p = sum(wilson(row["wins"], row["n"], config.z)) / 2
    return p * (1 - p)


def largest_remainder(weights: list[float], total: int) -> list[int]:
    """Integers proportional to `weights` summing to `total` (zero weights get zero).

    >>> largest_remainder([1, 1, 0.1], 10)
    [5, 5, 0]
    """
    mass = sum(weights)
    if mass <= 0:
        return [0] * len(weights)
    exact = [w / mass * total for w in weights]
    shares = [math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in order[: total - sum(shares)]:
        shares[i] += 1
    return shares
