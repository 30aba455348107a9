"""Task family for `FunctionCallingEnv`: calls to generated APIs, judged by exact match.

Each task offers a few functions (OpenAI function schemas made up per task: a service, an action and
typed parameters — integer, number, boolean, string, enum, array, nested object; required and
optional) and a request in words. Categories, and what difficulty (easy / medium / hard) grows:
- `single`: one function, one call; its parameters: 1-2 plain ones; 3-4 with an enum, an array and
  an optional one; 5-6 with a nested object and two optional ones that the request sets or leaves out.
- `parallel`: several calls in one reply: 2 calls of one function with 1-2 parameters; 2-3 calls of
  one with 3 (an enum or an array among them); 3-4 calls over two functions of 3-4 parameters, one
  of them optional.
- `choose_or_refuse`: the one function that does what is asked, among 2 (other services), 3 (the
  same service, other actions) or 4 (near misses: the same service or the same action); a quarter
  of the tasks (a third when hard) ask for what none of them does, and the answer is no call.

The functions are shown in one of two listings, drawn per task: `schema`, the OpenAI schemas as the
tool-call parser renders tools for a system prompt, or `signatures`, one line a function
(`name(required: type, [optional: type]): description`), the compact form tool-calling benchmarks
(the shipped lm-eval suite's `flywheel_tool_call` among them) write tools in: a model taught one form
alone answered the other with the first call it had learnt (valid call 0.73, exact 0.00).

`answer.calls` is the ground truth (empty: no function fits). `verify` compares the agent's calls
with it exactly: the function name; the argument keys (every required one, no unknown one, an
optional one only when the request sets it; `null` for an optional one counts as left out, as the
tools read it); the values in their JSON types (5 is not "5" nor 5.0 for an integer, true is not
"true", enums case-sensitive, arrays in order, nested objects recursively). Parallel calls compare
as a multiset, in any order; every call of the episode counts, so a retry after a wrong call fails.
Agent output is read bounded (`verify.untrusted`): what no honest reply holds (more than 16 calls,
arguments nested past 32 levels or over 1 Mi characters, numbers past 1e15 or not finite,
duplicate keys in argument text; the loop's parsers keep the last of duplicate keys before this)
raises `Unjudgeable`, a failed task.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flywheel.environments.agent.policies import batch, call, final
from flywheel.environments.agent.tools import Tool
from flywheel.environments.tool_call_parsers import get_parser
from flywheel.environments.tool_context import ToolContext
from flywheel.environments.verify.untrusted import Unjudgeable, bounded_text, finite_number, load_json

CATEGORIES = ("single", "parallel", "choose_or_refuse")
MAX_CALLS = 16  # Four times the most a task asks for; past it the reply is not an answer.
RULES = (
    "Answer the request below with function calls: all the calls it needs, together in one reply, each "
    "with the arguments the request gives and no others (leave out optional arguments it does not "
    "mention), every value in its JSON type. If none of the functions can do what it asks, make no call "
    "and say so."
)
REFUSAL = "None of these functions can do that."
LISTINGS = ("schema", "signatures")  # How a task shows its functions (`user_prompt`).
_DONE = "Done."


@dataclass(frozen=True)
class _Param:
    """A parameter a generated function may take: its schema, a value drawn for it, the value in words."""

    name: str
    kind: str  # plain | enum | array | object
    schema: dict[str, Any]
    draw: Callable[[random.Random], Any]
    say: Callable[[Any], str]


def _listing(values: list[Any]) -> str:
    words = [f'"{v}"' if isinstance(v, str) else str(v) for v in values]
    return ", ".join(words[:-1]) + f" and {words[-1]}"


def _decimal(rng: random.Random, low: int, high: int) -> float:
    """A number with cents that are not .00: written as it is, it can only mean a JSON number."""
    cents = rng.randint(low * 100 + 1, high * 100 - 1)
    return cents / 100 if cents % 100 else (cents + rng.randint(1, 99)) / 100


def _integer(name: str, text: str, low: int, high: int, say: str, step: int = 1) -> _Param:
    return _Param(name, "plain", {"type": "integer", "description": text},
                  lambda rng: rng.randint(low // step, high // step) * step, say.format)  # fmt: skip


def _number(name: str, text: str, low: int, high: int, say: str) -> _Param:
    return _Param(name, "plain", {"type": "number", "description": text}, lambda rng: _decimal(rng, low, high),
                  say.format)  # fmt: skip


def _flag(name: str, text: str, yes: str, no: str) -> _Param:
    return _Param(name, "plain", {"type": "boolean", "description": text}, lambda rng: rng.random() < 0.5,
                  lambda v: yes if v else no)  # fmt: skip


def _text(name: str, text: str, pool: tuple[str, ...], say: str) -> _Param:
    return _Param(name, "plain", {"type": "string", "description": text}, lambda rng: rng.choice(pool), say.format)


def _enum(name: str, text: str, options: tuple[str, ...], say: str) -> _Param:
    return _Param(name, "enum", {"type": "string", "enum": list(options), "description": text},
                  lambda rng: rng.choice(options), say.format)  # fmt: skip


def _array(name: str, text: str, items: dict[str, Any], pool: tuple[Any, ...], say: str) -> _Param:
    return _Param(name, "array", {"type": "array", "items": items, "description": text},
                  lambda rng: rng.sample(pool, rng.randint(2, 3)), lambda v: say.format(_listing(v)))  # fmt: skip


def _object(name: str, text: str, properties: dict[str, Any], draw: Callable[[random.Random], Any],
            say: Callable[[Any], str]) -> _Param:  # fmt: skip
    schema = {"type": "object", "description": text, "properties": properties, "required": list(properties)}
    return _Param(name, "object", schema, draw, say)


def _date(rng: random.Random) -> str:
    return f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _clock(rng: random.Random) -> str:
    return f"{rng.randint(6, 21):02d}:{rng.choice(('00', '15', '30', '45'))}"


def _phone(rng: random.Random) -> str:
    return f"+{rng.randint(30, 99)} {rng.randint(100, 999)} {rng.randint(100, 999)} {rng.randint(100, 999)}"


def _hours(rng: random.Random) -> dict[str, int]:
    start = rng.randint(6, 15)
    return {"start_hour": start, "end_hour": rng.randint(start + 2, 22)}


_CITIES = ("Lisbon", "Osaka", "Nairobi", "Quito", "Oslo", "Hanoi", "Tbilisi", "Perth", "Lyon", "Cusco", "Accra")
_PEOPLE = ("Ana Ferreira", "Kenji Mori", "Lena Vogel", "Omar Haddad", "Priya Nair", "Tomas Novak", "Zoe Martin")
_NOTES = ("ring twice", "leave it at the door", "call on arrival", "bring spare keys", "ask for Sam")
_AMENITIES = ("pool", "gym", "parking", "breakfast", "wifi")
_EXTRAS = ("blanket", "snacks", "charger", "map", "umbrella")
_LABELS = ("quiet", "sunny", "family", "outdoor", "budget", "group", "late", "early")

_PLAIN = (
    _integer("guests", "Number of guests.", 2, 12, "for {} guests"),
    _integer("nights", "Number of nights.", 2, 14, "for {} nights"),
    _integer("duration_minutes", "Length in minutes.", 10, 120, "lasting {} minutes", step=5),
    _integer("priority", "Priority, from 1 (lowest) to 5.", 1, 5, "at priority {}"),
    _integer("seat_row", "Seat row number.", 1, 40, "in row {}"),
    _integer("reference_number", "Booking reference number.", 10000, 99999, "with reference number {}"),
    _integer("max_results", "Most results to return.", 3, 50, "showing at most {} results"),
    _number("budget_usd", "Budget in US dollars.", 20, 2000, "with a budget of {} dollars"),
    _number("weight_kg", "Weight in kilograms.", 1, 80, "weighing {} kg"),
    _number("distance_km", "Distance in kilometres.", 1, 300, "over {} km"),
    _number("tip_percent", "Tip as a percentage.", 5, 25, "with a {} percent tip"),
    _flag("free_cancellation", "Whether it can be cancelled free of charge.",
          "with free cancellation", "without free cancellation"),
    _flag("wheelchair_access", "Whether wheelchair access is needed.",
          "with wheelchair access", "without wheelchair access"),
    _flag("express", "Whether to use express handling.", "with express handling", "without express handling"),
    _flag("insurance", "Whether to add insurance.", "with insurance", "without insurance"),
    _text("city", "City name.", _CITIES, "in {}"),
    _text("guest_name", "Full name of the guest.", _PEOPLE, 'under the name "{}"'),
    _Param("date", "plain", {"type": "string", "description": "Date as YYYY-MM-DD."}, _date, "on {}".format),
    _Param("start_time", "plain", {"type": "string", "description": "Start time as HH:MM, 24-hour clock."},
           _clock, "starting at {}".format),
    _text("note", "A note for the staff.", _NOTES, 'with the note "{}"'),
)  # fmt: skip
_ENUMS = (
    _enum("seat_class", "Travel class.", ("economy", "premium", "business"), "in {} class"),
    _enum("notify_by", "How to send updates.", ("email", "sms", "phone"), "with updates by {}"),
    _enum("size", "Size.", ("small", "medium", "large"), "in size {}"),
    _enum("seat", "Seat position.", ("window", "aisle", "middle"), "with a {} seat"),
    _enum("pace", "Pace.", ("relaxed", "moderate", "intense"), "at a {} pace"),
    _enum("payment", "Payment method.", ("card", "cash", "voucher"), "paid by {}"),
)
_ARRAYS = (
    _array("tags", "Labels, in order.", {"type": "string"}, _LABELS, "tagged {}, in that order"),
    _array("ages", "Ages of the travellers, in order.", {"type": "integer"}, tuple(range(1, 90)),
           "with travellers aged {}, in that order"),
    _array("extras", "Extras to add, in order.", {"type": "string", "enum": list(_EXTRAS)}, _EXTRAS,
           "with the extras {}, in that order"),
    _array("stop_numbers", "Stops, in order.", {"type": "integer"}, tuple(range(1, 60)),
           "stopping at stops {}, in that order"),
)  # fmt: skip
_AMENITY_LIST = {"type": "array", "items": {"type": "string", "enum": list(_AMENITIES)}}
_OBJECTS = (
    _object("contact", "Who to contact.", {"name": {"type": "string"}, "phone": {"type": "string"}},
            lambda rng: {"name": rng.choice(_PEOPLE), "phone": _phone(rng)},
            lambda v: f'with "{v["name"]}" as the contact, phone "{v["phone"]}"'),
    _object("time_window", "Hours it may take place in, 24-hour clock.",
            {"start_hour": {"type": "integer"}, "end_hour": {"type": "integer"}}, _hours,
            lambda v: f"between {v['start_hour']}:00 and {v['end_hour']}:00"),
    _object("dimensions", "Size in centimetres.", {"length_cm": {"type": "number"}, "width_cm": {"type": "number"}},
            lambda rng: {"length_cm": _decimal(rng, 10, 200), "width_cm": _decimal(rng, 10, 200)},
            lambda v: f"measuring {v['length_cm']} cm by {v['width_cm']} cm"),
    _object("pickup", "Where to pick it up.", {"dock": {"type": "integer"}, "gate": {"type": "string"}},
            lambda rng: {"dock": rng.randint(1, 30), "gate": f"{rng.choice('ABCDEF')}{rng.randint(1, 9)}"},
            lambda v: f'picked up at dock {v["dock"]}, gate "{v["gate"]}"'),
    _object("filters", "Search filters.", {"min_stars": {"type": "integer"}, "amenities": _AMENITY_LIST},
            lambda rng: {"min_stars": rng.randint(1, 5), "amenities": rng.sample(_AMENITIES, rng.randint(2, 3))},
            lambda v: f"with at least {v['min_stars']} stars and the amenities {_listing(v['amenities'])}, "
            "in that order"),
)  # fmt: skip
_POOLS = {"plain": _PLAIN, "enum": _ENUMS, "array": _ARRAYS, "object": _OBJECTS}

_SERVICES = (
    "ferry ticket", "hotel room", "museum tour", "bike rental", "library loan", "clinic visit", "concert seat",
    "cargo shipment", "bakery order", "yoga class", "telescope session", "kayak trip", "wine tasting",
    "piano lesson", "parking permit", "laundry pickup", "pet grooming", "boat charter", "cooking class",
    "train pass",
)  # fmt: skip
# action -> (the function's description, the request's words); {a} is the article, {s} the service.
_ACTIONS = {
    "reserve": ("Reserve a {s}.", "Reserve {a} {s}"),
    "cancel": ("Cancel a {s}.", "Cancel {a} {s}"),
    "reschedule": ("Move a {s} to a new time.", "Move {a} {s}"),
    "quote": ("Estimate the cost of a {s}.", "Estimate the cost of {a} {s}"),
    "register": ("Register a new {s}.", "Register {a} {s}"),
    "track": ("Look up the status of a {s}.", "Look up the status of {a} {s}"),
    "rate": ("Leave a rating for a {s}.", "Rate {a} {s}"),
    "renew": ("Extend a {s}.", "Extend {a} {s}"),
}


@dataclass(frozen=True)
class _Function:
    action: str
    service: str
    params: tuple[_Param, ...]
    optional: frozenset[str]

    @property
    def name(self) -> str:
        return f"{self.action}_{self.service.replace(' ', '_')}"

    def spec(self) -> dict[str, Any]:
        """The OpenAI function schema the model is shown."""
        properties = {p.name: p.schema for p in self.params}
        required = [p.name for p in self.params if p.name not in self.optional]
        return {
            "name": self.name,
            "description": _ACTIONS[self.action][0].format(s=self.service),
            "parameters": {"type": "object", "properties": properties, "required": required},
        }

    def arguments(self, rng: random.Random) -> dict[str, Any]:
        """Values for one call: every required parameter, each optional one half of the time."""
        return {p.name: p.draw(rng) for p in self.params if p.name not in self.optional or rng.random() < 0.5}

    def request(self, arguments: dict[str, Any], rng: random.Random) -> str:
        """The call in words, its arguments in a random order (never the schema's)."""
        words = [p.say(arguments[p.name]) for p in self.params if p.name in arguments]
        rng.shuffle(words)
        article = "an" if self.service[0] in "aeiou" else "a"
        return f"{_ACTIONS[self.action][1].format(a=article, s=self.service)}: {'; '.join(words)}."


def _function(rng: random.Random, action: str, service: str, count: int, special: tuple[str, ...],
              optional: int) -> _Function:  # fmt: skip
    """A function of `action` on `service` with `count` parameters: one of each kind in `special`, the rest
    plain; `optional` of them optional (never a nested object: its parts are required, and so is it)."""
    params: list[_Param] = []
    for kind in [*special, *["plain"] * (count - len(special))]:
        params.append(rng.choice([p for p in _POOLS[kind] if p.name not in {q.name for q in params}]))
    rng.shuffle(params)
    candidates = [p.name for p in params if p.kind != "object"]
    return _Function(action, service, tuple(params), frozenset(rng.sample(candidates, min(optional, len(candidates)))))


def make_task(rng: random.Random, category: str, difficulty: str, split: str = "train") -> dict[str, Any]:
    """A task of the slice from the `split` part of the task space (`split_of`): drawn again until it is."""
    builder = {"single": _single, "parallel": _parallel, "choose_or_refuse": _choose_or_refuse}[category]
    while True:
        functions, calls, request = builder(rng, difficulty)
        specs = [f.spec() for f in functions]
        if split_of(specs, request) == split:
            break
    listing = rng.choice(LISTINGS)  # Drawn after the task: a seed makes the same task in either listing.
    return {
        "prompt": user_prompt(specs, request, listing=listing),
        "request": request,
        "functions": specs,
        "listing": listing,
        "answer": {"calls": calls},
        "oracle": [*_one_reply(calls), final(_DONE if calls else REFUSAL)],
    }


def _one_reply(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The oracle's calls as one reply: a call, a `batch` of them, or nothing (no function fits)."""
    actions = [call(c["name"], **c["arguments"]) for c in calls]
    return [batch(*actions)] if len(actions) > 1 else actions


def split_of(functions: list[dict[str, Any]], request: str) -> str:
    """`held_out` for a quarter of all (API, request) pairs, by their hash, `train` for the rest: the held-out
    tasks (`FunctionCallingEnv.setup`) and the training ones never share one, whatever the seeds, and each
    part is an unbiased sample of every slice. An easy slice holds only thousands of distinct tasks, so
    seeds alone would let a held-out task come up in training."""
    digest = hashlib.sha256(json.dumps([functions, request], sort_keys=True).encode()).digest()
    return "held_out" if digest[0] < 64 else "train"


def _single(rng: random.Random, difficulty: str) -> tuple[list[_Function], list[dict[str, Any]], str]:
    action, service = rng.choice(list(_ACTIONS)), rng.choice(_SERVICES)
    if difficulty == "easy":
        function = _function(rng, action, service, rng.randint(1, 2), (), optional=0)
    elif difficulty == "medium":
        function = _function(rng, action, service, rng.randint(3, 4), ("enum", "array"), optional=1)
    else:
        function = _function(rng, action, service, rng.randint(5, 6), ("object", "enum", "array"), optional=2)
    arguments = function.arguments(rng)
    return [function], [{"name": function.name, "arguments": arguments}], function.request(arguments, rng)


def _parallel(rng: random.Random, difficulty: str) -> tuple[list[_Function], list[dict[str, Any]], str]:
    actions, services = rng.sample(list(_ACTIONS), 2), rng.sample(_SERVICES, 2)
    if difficulty == "easy":
        functions = [_function(rng, actions[0], services[0], rng.randint(1, 2), (), optional=0)]
        count = 2
    elif difficulty == "medium":
        functions = [_function(rng, actions[0], services[0], 3, (rng.choice(("enum", "array")),), optional=0)]
        count = rng.randint(2, 3)
    else:
        functions = [
            _function(rng, actions[i], services[i], rng.randint(3, 4), (rng.choice(("enum", "array")),), optional=1)
            for i in range(2)
        ]
        count = rng.randint(3, 4)
    chosen = [functions[i % len(functions)] for i in range(count)]
    rng.shuffle(chosen)
    calls: list[dict[str, Any]] = []
    while len(calls) < count:  # Distinct calls: each one the request asks for is one call to make.
        function = chosen[len(calls)]
        drawn = {"name": function.name, "arguments": function.arguments(rng)}
        if drawn not in calls:
            calls.append(drawn)
    by_name = {f.name: f for f in functions}
    sentences = [by_name[c["name"]].request(c["arguments"], rng) for c in calls]
    request = " ".join([sentences[0], *(f"Also {s[0].lower()}{s[1:]}" for s in sentences[1:])])
    return functions, calls, request


def _choose_or_refuse(rng: random.Random, difficulty: str) -> tuple[list[_Function], list[dict[str, Any]], str]:
    offered = {"easy": 2, "medium": 3, "hard": 4}[difficulty]
    refuse = rng.random() < (1 / 3 if difficulty == "hard" else 1 / 4)
    a, s = rng.sample(list(_ACTIONS), 4), rng.sample(_SERVICES, 4)
    # The target first, then the others: other services (easy); the same service, other actions (medium);
    # near misses, the target's service with other actions and its action on other services (hard).
    pairs = {
        "easy": [(a[0], s[0]), (a[1], s[1]), (a[2], s[2])],
        "medium": [(a[0], s[0]), (a[1], s[0]), (a[2], s[0]), (a[3], s[0])],
        "hard": [(a[0], s[0]), (a[1], s[0]), (a[0], s[1]), (a[2], s[0]), (a[0], s[2])],
    }[difficulty]
    functions = []
    for action, service in pairs:
        if difficulty == "easy":
            functions.append(_function(rng, action, service, rng.randint(1, 2), (), optional=0))
        elif difficulty == "medium":
            functions.append(_function(rng, action, service, rng.randint(2, 3), ("enum",), optional=0))
        else:
            special = ("object", "enum") if rng.random() < 0.5 else ("array",)
            functions.append(_function(rng, action, service, rng.randint(3, 5), special, optional=1))
    target, others = functions[0], functions[1:]
    shown = others if refuse else [target, *others[: offered - 1]]  # Refused: the target is left out.
    rng.shuffle(shown)
    arguments = target.arguments(rng)
    calls = [] if refuse else [{"name": target.name, "arguments": arguments}]
    return shown, calls, target.request(arguments, rng)


def user_prompt(functions: list[dict[str, Any]], request: str, parser: str = "hermes", listing: str = "schema") -> str:
    """The user message: the functions (as `parser` renders tools for a system prompt, or as `signatures`),
    how to write a call the way the parser reads it, the rules, and the request."""
    tool_call = get_parser(parser)
    if listing == "signatures":
        lines = "\n".join(signature(f) for f in functions)
        example = tool_call.tool_call_text("tool_name", {"argument": "value"})
        tools = (
            f"Functions you can call, one a line (arguments in square brackets are optional):\n{lines}\n\n"
            f"For each function call, reply exactly like this:\n{example}"
        )
    else:
        tools = tool_call.render_tools_prompt([{"type": "function", "function": f} for f in functions])
    return f"{tools}\n\n{RULES}\n\nRequest: {request}"


def signature(function: dict[str, Any]) -> str:
    """One function as a line: `- name(required: type, [optional: type]): description`.

    >>> signature({"name": "rate_kayak_trip", "description": "Leave a rating for a kayak trip.", "parameters": {
    ...     "properties": {"seat": {"type": "string", "enum": ["window", "aisle"]}, "ages": {"type": "array",
    ...     "items": {"type": "integer"}}}, "required": ["seat"]}})
    '- rate_kayak_trip(seat: "window" | "aisle", [ages: array of integers]): Leave a rating for a kayak trip.'
    """
    parameters = function["parameters"]
    required = set(parameters.get("required", []))
    arguments = [
        f"{name}: {_type_words(schema)}" if name in required else f"[{name}: {_type_words(schema)}]"
        for name, schema in parameters.get("properties", {}).items()
    ]
    return f"- {function['name']}({', '.join(arguments)}): {function.get('description', '')}".rstrip(": ")


def _type_words(schema: dict[str, Any]) -> str:
    """A parameter's JSON type in words: `integer`, `"a" | "b"`, `array of strings`, `object {x: number}`."""
    if "enum" in schema:
        return " | ".join(json.dumps(value) for value in schema["enum"])
    if schema.get("type") == "array":
        items = schema.get("items", {})
        return f"array of ({_type_words(items)})" if "enum" in items else f"array of {_type_words(items)}s"
    if schema.get("type") == "object":
        fields = ", ".join(f"{name}: {_type_words(sub)}" for name, sub in schema.get("properties", {}).items())
        return f"object {{{fields}}}"
    return str(schema.get("type", "value"))


def function_tools(item: dict[str, Any]) -> list[Tool]:
    """The task's functions as tools the agent loop runs: each checks its arguments against the schema (a
    mistyped call is a tool error the model sees) and answers `{"status": "ok"}`. The verifier judges the
    calls in the conversation, never what the tools were given."""
    return [Tool(f["name"], f["description"], f["parameters"], _accepted) for f in item.get("functions") or []]


def _accepted(ctx: ToolContext, **arguments: Any) -> str:
    return json.dumps({"status": "ok"})


# -- the verifier --------------------------------------------------------------------------------


def verify(item: dict[str, Any], messages: Any, unparsed: list[str] | tuple[str, ...] = ()) -> bool:
    """Whether the agent's calls in `messages` (OpenAI format) are exactly `answer.calls`; `unparsed`: its
    tool calls the loop could not parse (one is a wrong answer). Raises `Unjudgeable` (a ValueError) for
    output no honest reply holds; anything else about the reply is a plain False.

    >>> item = make_task(random.Random(0), "single", "easy")
    >>> c = item["answer"]["calls"][0]
    >>> reply = {"role": "assistant", "content": "", "tool_calls": [
    ...     {"function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}]}
    >>> verify(item, [reply]), verify(item, [reply, reply]), verify(item, [{"role": "assistant", "content": "No."}])
    (True, False, False)
    """
    if unparsed:
        return False
    calls, expected = _agent_calls(messages), item["answer"]["calls"]
    if not expected:  # No function fits: no call, and words that say so.
        return not calls and bool(_final_text(messages).strip())
    if len(calls) != len(expected):
        return False
    schemas = {f["name"]: f["parameters"] for f in item["functions"]}
    left = list(expected)
    for name, arguments in calls:  # Exact matching: a call that fits two expected ones fits them alike.
        index = next(
            (i for i, e in enumerate(left) if e["name"] == name and _same_object(arguments, e["arguments"], schemas[name])),
            None,
        )  # fmt: skip
        if index is None:
            return False
        left.pop(index)
    return True


def _agent_calls(messages: Any) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of every tool call the assistant made, read bounded."""
    if not isinstance(messages, list):
        raise Unjudgeable("the conversation is not a list of messages")
    calls: list[tuple[str, dict[str, Any]]] = []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") != "assistant":
            continue
        entries = message.get("tool_calls") or []
        if not isinstance(entries, list):
            raise Unjudgeable("tool_calls is not a list")
        if len(calls) + len(entries) > MAX_CALLS:
            raise Unjudgeable(f"more than {MAX_CALLS} tool calls")
        for entry in entries:
            function = entry.get("function") if isinstance(entry, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            if not isinstance(name, str) or not name:
                raise Unjudgeable("a tool call without a function name")
            calls.append((bounded_text(name, 256), _arguments(function.get("arguments"))))
    return calls


def _arguments(raw: Any) -> dict[str, Any]:
    """A call's arguments, from their JSON text (the OpenAI format) or a dict: plain JSON, bounded."""
    if raw is None:
        return {}
    if isinstance(raw, dict):
        try:
            raw = json.dumps(raw, allow_nan=False)
        except (ValueError, TypeError, RecursionError) as err:
            raise Unjudgeable(f"arguments that are not plain JSON ({type(err).__name__})") from None
    if not isinstance(raw, str):
        raise Unjudgeable(f"arguments of type {type(raw).__name__}")
    if not raw.strip():
        return {}
    try:
        value = load_json(raw)
        json.loads(raw, object_pairs_hook=_unique_keys)  # Bounded by now; only duplicate keys left to find.
    except Unjudgeable:
        raise
    except ValueError as err:
        raise Unjudgeable(f"arguments that are not JSON: {str(err)[:80]}") from None
    if not isinstance(value, dict):
        raise Unjudgeable("arguments that are not a JSON object")
    _check_numbers(value)
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    if len({key for key, _ in pairs}) != len(pairs):
        raise Unjudgeable("duplicate keys in the arguments")
    return dict(pairs)


def _check_numbers(value: Any) -> None:
    """Every number finite and at most 1e15 in size (`load_json` has bounded the nesting)."""
    if isinstance(value, dict):
        for item in value.values():
            _check_numbers(item)
    elif isinstance(value, list):
        for item in value:
            _check_numbers(item)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        finite_number(value)


def _final_text(messages: list[Any]) -> str:
    """The content of the assistant's last message (bounded), or ''."""
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "assistant":
            content = message.get("content")
            return bounded_text(content) if isinstance(content, str) else ""
    return ""


def _same_object(actual: dict[str, Any], expected: dict[str, Any], schema: dict[str, Any]) -> bool:
    """The same keys (an optional one sent as null counts as left out) with the same typed values."""
    required = schema.get("required", [])
    given = {key: value for key, value in actual.items() if value is not None or key in required}
    return given.keys() == expected.keys() and all(
        _same_value(given[key], expected[key], schema["properties"][key]) for key in expected
    )


def _same_value(actual: Any, expected: Any, schema: dict[str, Any]) -> bool:
    kind = schema["type"]
    if kind == "object":
        return isinstance(actual, dict) and _same_object(actual, expected, schema)
    if kind == "array":
        return (
            isinstance(actual, list)
            and len(actual) == len(expected)
            and all(_same_value(a, e, schema["items"]) for a, e in zip(actual, expected, strict=True))
        )
    if kind == "number":  # An integer is a JSON number; the tasks' numbers all have cents, so none equals one.
        return type(actual) in (int, float) and actual == expected
    python = {"integer": int, "boolean": bool, "string": str}[kind]
    return type(actual) is python and actual == expected
