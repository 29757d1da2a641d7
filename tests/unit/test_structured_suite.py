"""The structured-output suite's requests are ones vLLM takes, and its checkers
tell a valid answer from an invalid one (no engine, no server)."""

from __future__ import annotations

import json
import types

import pytest

from vllm_treespec.bench import structured_suite as ss

pytest.importorskip("vllm")
xgr = pytest.importorskip("xgrammar")

N = 2 * len(ss.SLOTS) + 2  # every slot twice: both tool variants


@pytest.fixture(scope="module")
def suite():
    return ss.build(N)


def _request(turn, fields):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest.model_validate(
        {"model": "bench", "messages": turn.messages, "max_tokens": 64, "stream": True,
         **json.loads(json.dumps(fields))})  # as the client sends it: plain JSON


def test_turns_unique_and_every_kind_present(suite):
    turns, fields = suite
    assert len(turns) == N and set(fields) == {t.turn_id for t in turns}
    assert len({t.messages[0]["content"] for t in turns}) == N  # no shared prompt
    assert {ss.kind_of(f) for f in fields.values()} == {
        "json_small", "json_person", "json_order", "json_object", "tool_named",
        "tool_required", "regex", "choice", "sql"}
    first = {ss.kind_of(fields[t.turn_id]) for t in turns[:len(ss.SLOTS)]}
    assert len(first) == len(ss.SLOTS)  # any SLOTS-long run: one turn per slot


def test_request_bodies_parse_and_compile(suite):
    """vLLM's own request model takes each body, and its grammar compiles in xgrammar
    (the serving layer's tool schema for tool calls, vLLM's own check otherwise)."""
    from vllm.tool_parsers.utils import get_json_schema_from_tools
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    turns, fields = suite
    for t in turns:
        f = fields[t.turn_id]
        req = _request(t, f)
        if "tools" in f:
            schema = get_json_schema_from_tools(req.tool_choice, req.tools)
            assert schema is not None
            xgr.Grammar.from_json_schema(json.dumps(schema))
            continue
        so = req.extract_structured_outputs()
        assert so is not None, t.turn_id
        sp = req.to_sampling_params(64, {})
        validate_xgrammar_grammar(sp)
        if so.grammar is not None:
            xgr.Grammar.from_ebnf(so.grammar)


def _result(text, tool_calls=None, finish="stop"):
    return types.SimpleNamespace(text=text, tool_calls=tool_calls, finish_reason=finish)


def _fields(kind):
    turns, fields = ss.build(N)
    return next(fields[t.turn_id] for t in turns if ss.kind_of(fields[t.turn_id]) == kind)


ORDER = {"order_id": "A-1", "customer": {"name": "A", "email": "a@b", "tier": "gold"},
         "items": [{"sku": "KB-101", "quantity": 2, "unit_price": 49.5}],
         "shipping": {"method": "express",
                      "address": {"street": "1 Road", "city": "Lyon", "country": "France"}},
         "status": "shipped", "paid": True, "total": 99.0}
PERSON = {"name": "A", "age": 3, "occupation": "x", "city": "y", "email": "z",
          "employed": True}
WEATHER = {"city": "Lyon", "unit": "celsius"}
FLIGHT = {"origin": "Lyon", "destination": "Oslo", "date": "2025-01-10", "passengers": 2}

# kind: (valid answer, invalid answer); tool answers are (text, streamed calls)
CASES = {
    "json_small": ('{"city": "Lyon", "year": 2001}', '{"city": "Lyon", "year": "2001"}'),
    "json_person": (json.dumps(PERSON), json.dumps({**PERSON, "extra": 1})),
    "json_order": (json.dumps(ORDER), json.dumps({**ORDER, "status": "lost"})),
    "json_object": ('{"title": "T"}', '["title"]'),
    "regex": ("(212) 555-0142", "212-555-0142"),
    "choice": ("neutral", "mixed"),
    "sql": ("SELECT name FROM employees WHERE salary > 5 ORDER BY salary DESC;",
            "SELECT COUNT(* FROM employees;"),
    "tool_named": ((json.dumps(WEATHER), None),
                   ("", [{"name": "get_weather", "arguments": '{"city": "Lyon"}'}])),
    "tool_required": (
        ("", [{"name": "book_flight", "arguments": json.dumps(FLIGHT)}]),
        (json.dumps([{"name": "get_weather", "parameters": FLIGHT}]), None)),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_checker_accepts_valid_rejects_invalid(kind):
    f = _fields(kind)
    good, bad = CASES[kind]
    good, bad = (good if isinstance(good, tuple) else (good, None),
                 bad if isinstance(bad, tuple) else (bad, None))
    assert ss.valid(f, *good)
    assert not ss.valid(f, *bad)


def test_tool_checkers_take_both_stream_forms():
    named, required = _fields("tool_named"), _fields("tool_required")
    assert ss.valid(named, "", [{"name": "get_weather", "arguments": json.dumps(WEATHER)}])
    assert not ss.valid(named, "", [{"name": "book_flight", "arguments": json.dumps(WEATHER)}])
    as_text = json.dumps([{"name": "book_flight", "parameters": FLIGHT}])
    assert ss.valid(required, as_text)
    assert not ss.valid(required, "[]") and not ss.valid(required, "")


def test_status_truncated_apart_from_invalid():
    f = _fields("json_person")
    cut = json.dumps(PERSON)[:20]
    assert ss.status(f, _result(json.dumps(PERSON))) == "valid"
    assert ss.status(f, _result(cut, finish="length")) == "truncated"
    assert ss.status(f, _result(cut)) == "invalid"


def test_forced_share_reads_a_forced_counter_only_when_present():
    before = {"vllm_treespec:accepted_tokens_total{source=\"drafter\"}": 10.0}
    after = {"vllm_treespec:accepted_tokens_total{source=\"drafter\"}": 50.0}
    assert ss.forced_share(before, after) is None
    after['vllm_treespec:accepted_tokens_total{engine="0",source="grammar"}'] = 10.0
    after['vllm_treespec:accepted_tokens_created{engine="0",source="grammar"}'] = 1e9
    assert ss.forced_share(before, after) == pytest.approx(10 / 50)


def test_summary_counts_kinds_identity_and_status():
    turns, fields = ss.build(len(ss.SLOTS))
    first = [types.SimpleNamespace(turn_id=t.turn_id, text="x", tool_calls=None,
                                   finish_reason="stop") for t in turns]
    other = [types.SimpleNamespace(**{**vars(r), "text": "y" if i == 0 else "x"})
             for i, r in enumerate(first)]
    s = ss.summarize(fields, other, first, {}, {})
    assert s["total"]["turns"] == len(ss.SLOTS) and s["total"]["identical"] == len(ss.SLOTS) - 1
    assert s["total"]["invalid"] == len(ss.SLOTS)  # "x" satisfies none of them
    assert s["forced_share"] is None
    table = ss.table({"methods": {"none": {"structured": s}}}, "none")
    assert "n/a" in table and "json_order" in table
