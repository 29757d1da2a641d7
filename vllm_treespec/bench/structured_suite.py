"""A structured-output suite: each turn a chat prompt with its own constraint.

Agentic and API traffic is mostly constrained: ``response_format`` with a JSON
schema or JSON mode, tool calls, regex and choice outputs, grammars. Each turn
here carries one such constraint as vLLM's OpenAI server takes it (0.32.0:
``response_format``, ``tools`` + ``tool_choice``, and the ``structured_outputs``
extra-body field for regex, choice and grammar; the old ``guided_*`` fields are
gone), and a checker that says whether the answer is valid under it. The kinds
come in a fixed cycle of ``len(SLOTS)`` turns, so any ``SLOTS``-long run of
turns holds one of each (the tool slot alternates a named function and
``"required"``); within a kind, the short texts are built from small word lists
so that no two turns share a prompt (a shared prompt would be a prefix-cache
hit for some methods and not others).

served_ab's ``--suite structured_output`` sends these turns and adds, per method,
the validity counts per kind, how many answers equal the first method's (plain's)
and, where the server exposes a counter of grammar-forced accepted tokens, their
share of the accepted tokens.
"""

from __future__ import annotations

import json
import re
from collections import Counter

import jsonschema

from vllm_treespec.bench.pangu240 import Turn

SUITE = "structured_output"

NAMES = ("Alice Martin", "Bruno Costa", "Chen Wei", "Dana Okafor", "Emil Novak",
         "Fatima Zahra", "Goran Petrov", "Hana Sato", "Ivan Horvat", "Julia Weber", "Kofi Mensah")
CITIES = ("Lisbon", "Osaka", "Denver", "Nairobi", "Krakow", "Lyon", "Austin",
          "Bergen", "Porto", "Seoul", "Quito", "Leeds", "Turin")
JOBS = ("nurse", "welder", "architect", "teacher", "pilot", "baker", "chemist")
ITEMS = (("KB-101", "keyboard", 49.5), ("MS-220", "mouse", 19.0), ("HD-310", "headset", 89.0),
         ("CB-040", "cable", 7.25), ("MN-270", "monitor", 199.0))
TIERS = ("bronze", "silver", "gold")
SHIPPING = ("standard", "express", "overnight")
DEPARTMENTS = ("sales", "research", "support", "finance", "legal")
REVIEWS = ("The battery lasts two days and the screen is sharp.",
           "It broke after a week and support never answered.",
           "It does what the box says, nothing more.",
           "Best pair of boots I have owned, worth every cent.",
           "The soup was cold and the waiter was rude.",
           "Delivery took four days as promised.")
SENTIMENTS = ["positive", "negative", "neutral"]


def _obj(props: dict, required: list | None = None) -> dict:
    """A closed object: every property required, nothing else allowed."""
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required,
            "additionalProperties": False}


S = {"type": "string"}
SCHEMA_SMALL = _obj({"city": S, "year": {"type": "integer"}})
SCHEMA_PERSON = _obj({"name": S, "age": {"type": "integer"}, "occupation": S, "city": S,
                      "email": S, "employed": {"type": "boolean"}})
SCHEMA_ORDER = _obj({  # 15 leaf fields, nested objects, an array and three enums
    "order_id": S,
    "customer": _obj({"name": S, "email": S, "tier": {"enum": list(TIERS)}}),
    "items": {"type": "array", "minItems": 1, "maxItems": 3,
              "items": _obj({"sku": S, "quantity": {"type": "integer"},
                             "unit_price": {"type": "number"}})},
    "shipping": _obj({"method": {"enum": list(SHIPPING)},
                      "address": _obj({"street": S, "city": S, "country": S})}),
    "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
    "paid": {"type": "boolean"}, "total": {"type": "number"}})

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": _obj({"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}})}},
    {"type": "function", "function": {
        "name": "book_flight", "description": "Book a one-way flight.",
        "parameters": _obj({"origin": S, "destination": S, "date": S,
                            "passengers": {"type": "integer"}})}},
]
TOOL_PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

PHONE_REGEX = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
# A small SELECT dialect (xgrammar's EBNF): bounded identifiers and literals, so an
# answer ends within a few dozen tokens whatever the model prefers.
SQL_GRAMMAR = r"""
root ::= "SELECT " columns " FROM " table where? order? ";"
columns ::= "*" | column (", " column){0,3}
column ::= name | agg "(" ("*" | name) ")"
agg ::= "COUNT" | "AVG" | "MAX" | "MIN" | "SUM"
name ::= "id" | "name" | "age" | "salary" | "department" | "city" | "hired"
table ::= "employees" | "departments" | "offices"
where ::= " WHERE " cond ((" AND " | " OR ") cond){0,2}
cond ::= name " " op " " value
op ::= "=" | "!=" | "<" | ">" | "<=" | ">="
value ::= [0-9]{1,7} | "'" [a-zA-Z ]{1,24} "'"
order ::= " ORDER BY " name (" ASC" | " DESC")?
"""


def _pick(seq, i: int, stride: int = 1):
    return seq[(i * stride) % len(seq)]


def _small(i: int) -> tuple[str, dict]:
    city, year = _pick(CITIES, i), 1990 + (i * 7) % 35
    return (f"Extract the city and the year from this sentence as JSON.\n\n"
            f"Sentence: The annual robotics fair moved to {city} in {year}.",
            {"response_format": {"type": "json_schema", "json_schema": {
                "name": "city_year", "schema": SCHEMA_SMALL}}})


def _person(i: int) -> tuple[str, dict]:
    name, age, job, city = _pick(NAMES, i), 24 + (i * 5) % 40, _pick(JOBS, i, 3), \
        _pick(CITIES, i, 5)
    email = name.lower().replace(" ", ".") + "@example.org"
    status = "works full time" if i % 2 == 0 else "is between jobs"
    return (f"Extract a person record from this text as JSON.\n\nText: {name}, {age}, is a "
            f"{job} living in {city}. {name.split()[0]} {status} and can be reached at "
            f"{email}.",
            {"response_format": {"type": "json_schema", "json_schema": {
                "name": "person", "schema": SCHEMA_PERSON}}})


def _order(i: int) -> tuple[str, dict]:
    (sku1, what1, p1), (sku2, what2, p2) = _pick(ITEMS, i), _pick(ITEMS, i + 2)
    q1, q2 = 1 + i % 3, 1 + (i * 2) % 4
    name, city = _pick(NAMES, i, 3), _pick(CITIES, i, 7)
    text = (f"Order A-{1000 + 37 * i} was placed by {name} ({name.split()[0].lower()}"
            f"@shop.test), a {_pick(TIERS, i)} member: {q1} x {what1} ({sku1}) at "
            f"${p1:.2f} each and {q2} x {what2} ({sku2}) at ${p2:.2f} each. Ship "
            f"{_pick(SHIPPING, i)} to {10 + i} Harbour Road, {city}, "
            f"{'Portugal' if i % 2 else 'Canada'}. Total ${q1 * p1 + q2 * p2:.2f}, paid, "
            "and the parcel has shipped.")
    return (f"Extract the order as a JSON record.\n\n{text}",
            {"response_format": {"type": "json_schema", "json_schema": {
                "name": "order", "schema": SCHEMA_ORDER}}})


def _json_object(i: int) -> tuple[str, dict]:
    return (f"Give a JSON object with the keys \"title\", \"author\" and \"year\" for a "
            f"book called \"The {_pick(CITIES, i, 2)} Letters\", written by "
            f"{_pick(NAMES, i, 5)} in {1950 + (i * 3) % 70}.",
            {"response_format": {"type": "json_object"}})


def _tool(i: int) -> tuple[str, dict]:
    if i % 2 == 0:
        unit = "fahrenheit" if i % 4 else "celsius"
        return (f"What is the weather like in {_pick(CITIES, i, 3)} right now, in {unit}?",
                {"tools": TOOLS, "tool_choice": {"type": "function",
                                                 "function": {"name": "get_weather"}}})
    return (f"Book a flight from {_pick(CITIES, i)} to {_pick(CITIES, i + 4)} on "
            f"2025-0{1 + i % 9}-1{i % 10} for {1 + i % 4} passengers.",
            {"tools": TOOLS, "tool_choice": "required"})


def _regex(i: int) -> tuple[str, dict]:
    area, mid, end = 200 + (i * 37) % 700, 100 + (i * 53) % 900, 1000 + (i * 611) % 9000
    return (f"What is {_pick(NAMES, i, 2)}'s phone number? Answer with the number only.\n\n"
            f"Note: for deliveries call {_pick(NAMES, i, 2).split()[0]} on {area}.{mid}.{end} "
            "between nine and five.",
            {"structured_outputs": {"regex": PHONE_REGEX}})


def _choice(i: int) -> tuple[str, dict]:
    return (f"Classify the sentiment of this review as positive, negative or neutral.\n\n"
            f"Review ({_pick(NAMES, i, 3).split()[0]}, {_pick(CITIES, i)}): "
            f"{_pick(REVIEWS, i)}",
            {"structured_outputs": {"choice": SENTIMENTS}})


def _sql(i: int) -> tuple[str, dict]:
    dept, pay = _pick(DEPARTMENTS, i), 30000 + (i * 2500) % 60000
    return (f"Write one SQL query on the table employees(id, name, age, salary, department, "
            f"city, hired): the names of the employees in {dept} who earn more than {pay}, "
            "highest salary first.",
            {"structured_outputs": {"grammar": SQL_GRAMMAR}})


# (kind, builder), in the order the turns cycle through them.
SLOTS = (("json_small", _small), ("json_person", _person), ("json_order", _order),
         ("json_object", _json_object), ("tool", _tool), ("regex", _regex),
         ("choice", _choice), ("sql", _sql))


def kind_of(fields: dict) -> str:
    """The kind a turn's request fields name (the tool slot's two variants apart)."""
    if "tools" in fields:
        return "tool_required" if fields["tool_choice"] == "required" else "tool_named"
    if "response_format" in fields:
        rf = fields["response_format"]
        return "json_object" if rf["type"] == "json_object" else \
            "json_" + {"city_year": "small"}.get(rf["json_schema"]["name"],
                                                 rf["json_schema"]["name"])
    so = next(iter(fields["structured_outputs"]))  # regex, choice, grammar
    return "sql" if so == "grammar" else so


def build(n: int) -> tuple[list[Turn], dict[str, dict]]:
    """``n`` turns and, per turn id, the request fields that carry its constraint."""
    turns, fields = [], {}
    for j in range(n):
        slot, i = j % len(SLOTS), j // len(SLOTS)
        prompt, extra = SLOTS[slot][1](i)
        tid = f"{SUITE}/{kind_of(extra)}/{i}"
        turns.append(Turn(tid, SUITE, [{"role": "user", "content": prompt}]))
        fields[tid] = extra
    return turns, fields


# ---- validity -----------------------------------------------------------------------

def _json_valid(text: str, schema: dict | None) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if schema is None:  # JSON mode: any object
        return isinstance(value, dict)
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def _calls(text: str, tool_calls: list | None) -> list[tuple[str | None, str]] | None:
    """(name, arguments JSON) of each call: from streamed ``tool_calls`` where the
    server has a tool parser, else from the text the grammar forced (vLLM streams a
    named call's arguments, or "required"'s ``[{"name", "parameters"}]`` list, as
    plain content when no ``--tool-call-parser`` is set)."""
    if tool_calls:
        return [(c.get("name"), c.get("arguments") or "") for c in tool_calls]
    return None if not text else [(None, text)]


def tool_valid(fields: dict, text: str, tool_calls: list | None) -> bool:
    calls = _calls(text, tool_calls)
    if not calls:
        return False
    choice = fields["tool_choice"]
    if isinstance(choice, dict):  # named: the arguments of that one function
        want = choice["function"]["name"]
        return len(calls) == 1 and calls[0][0] in (None, want) and \
            _json_valid(calls[0][1], TOOL_PARAMS[want])
    if calls[0][0] is None:  # "required" as content: a list of {"name", "parameters"}
        try:
            listed = json.loads(calls[0][1])
        except ValueError:
            return False
        if not isinstance(listed, list) or not listed or \
                not all(isinstance(c, dict) for c in listed):
            return False
        calls = [(c.get("name"), json.dumps(c.get("parameters"))) for c in listed]
    return all(name in TOOL_PARAMS and _json_valid(args, TOOL_PARAMS[name])
               for name, args in calls)


def sql_valid(text: str) -> bool:
    """Light: the grammar's start keyword, its closing ';', balanced parentheses."""
    depth = 0
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0 and text.startswith("SELECT ") and text.endswith(";")


def valid(fields: dict, text: str, tool_calls: list | None = None) -> bool:
    """Whether an answer satisfies the constraint its request carried."""
    if "tools" in fields:
        return tool_valid(fields, text, tool_calls)
    if "response_format" in fields:
        rf = fields["response_format"]
        return _json_valid(text, None if rf["type"] == "json_object"
                           else rf["json_schema"]["schema"])
    so = fields["structured_outputs"]
    if "regex" in so:
        return re.fullmatch(so["regex"], text) is not None
    if "choice" in so:
        return text in so["choice"]
    return sql_valid(text)


def status(fields: dict, result) -> str:
    """valid, truncated (cut by max_tokens before the constraint closed) or invalid."""
    if valid(fields, result.text, getattr(result, "tool_calls", None)):
        return "valid"
    return "truncated" if getattr(result, "finish_reason", None) == "length" else "invalid"


def answer(result) -> tuple:
    """What identity compares: the text and any streamed tool calls."""
    return result.text, json.dumps(getattr(result, "tool_calls", None))


# ---- summary ------------------------------------------------------------------------

def _delta(before: dict, after: dict, keep) -> float:
    return sum(v - before.get(k, 0.0) for k, v in after.items() if keep(k))


def forced_share(before: dict, after: dict) -> float | None:
    """Grammar-forced accepted tokens over all accepted draft tokens between two
    /metrics scrapes (the tree server's ``vllm_treespec:accepted_tokens_total``
    with ``source="grammar"``), or None where the server exposes no such series."""
    def forced(k):
        return k.startswith("vllm_treespec:accepted_tokens_total") and 'source="grammar"' in k
    if not any(forced(k) for k in after):
        return None
    n_forced = _delta(before, after, forced)
    tree = _delta(before, after, lambda k: k.startswith("vllm_treespec:accepted_tokens_total"))
    accepted = tree or _delta(
        before, after, lambda k: k.startswith("vllm:spec_decode_num_accepted_tokens_total"))
    return n_forced / accepted if accepted > 0 else None


def summarize(fields: dict[str, dict], results: list, first: list,
              before: dict, after: dict) -> dict:
    """Per kind: turns, valid / truncated / invalid, identical to the first method's."""
    by_kind: dict[str, Counter] = {}
    rows = []
    for r, f in zip(results, first):
        kind = kind_of(fields[r.turn_id])
        st, same = status(fields[r.turn_id], r), answer(r) == answer(f)
        c = by_kind.setdefault(kind, Counter())
        c.update({"turns": 1, st: 1, "identical": int(same)})
        rows.append({"turn": r.turn_id, "kind": kind, "status": st, "identical": same,
                     "finish_reason": getattr(r, "finish_reason", None), "text": r.text,
                     "tool_calls": getattr(r, "tool_calls", None)})
    keys = ("turns", "valid", "truncated", "invalid", "identical")
    kinds = {k: {key: c[key] for key in keys} for k, c in sorted(by_kind.items())}
    total = {key: sum(c[key] for c in kinds.values()) for key in keys}
    return {"by_kind": kinds, "total": total, "forced_share": forced_share(before, after),
            "answers": rows}


def table(summary: dict, first: str) -> str:
    """One row per method: validity and identity per kind, and the forced share."""
    methods = {label: m["structured"] for label, m in summary["methods"].items()
               if "structured" in m}
    if not methods:
        return ""
    kinds = sorted({k for s in methods.values() for k in s["by_kind"]})
    lines = [f"| method | {' | '.join(kinds)} | all: valid / truncated / invalid "
             f"| same as `{first}` | forced share |",
             "|---|" + "---|" * (len(kinds) + 3)]
    for label, s in methods.items():
        cells = [f"{s['by_kind'][k]['valid']}/{s['by_kind'][k]['turns']}"
                 if k in s["by_kind"] else "–" for k in kinds]
        t, share = s["total"], s["forced_share"]
        lines.append(f"| {label} | {' | '.join(cells)} | {t['valid']} / {t['truncated']} / "
                     f"{t['invalid']} | {t['identical']}/{t['turns']} | "
                     f"{'n/a' if share is None else f'{share:.3f}'} |")
    return "\n".join(lines)
