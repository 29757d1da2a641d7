"""The request-mix property test's generator and checks (``bench.request_mix``),
each check shown to fail on the answer it exists to catch; and the requests a
tree engine refuses by name (``vllm_glue.request_checks``)."""

from __future__ import annotations

import random
from types import SimpleNamespace

from vllm_treespec.bench.request_mix import check_request, random_mix
from vllm_treespec.bench.request_mix_run import gathered, mixes


def _chat(**body):
    return {"api": "chat", "stream": False,
            "body": {"model": "smollm2", "messages": [], "max_tokens": 4, **body}}


def _answer(text="Paris.", n=1, logprobs=None, tokens=2):
    choice = {"index": 0, "message": {"content": text}, "finish_reason": "length"}
    if logprobs is not None:
        choice["logprobs"] = {"content": [{"token": "x", "top_logprobs": [{}] * logprobs}] * tokens}
    return {"status": 200, "json": {"choices": [dict(choice, index=i) for i in range(n)],
                                    "usage": {"completion_tokens": tokens}}}


def test_mixes_are_seeded_and_cover_every_field():
    """Mix i depends on (seed, i) alone (a resumed run sends the same mixes), and
    a few hundred mixes use every field the generator knows."""
    first = list(mixes(0, 3))
    assert first == list(mixes(0, 3)) and first != list(mixes(1, 3))
    seen = {k for _, mix in mixes(0, 300) for r in mix for k in r["body"]}
    wanted = {"n", "temperature", "top_p", "top_k", "seed", "presence_penalty",
              "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs",
              "prompt_logprobs", "logprob_token_ids", "echo", "stop", "stop_token_ids",
              "include_stop_str_in_output", "min_tokens", "max_tokens", "ignore_eos",
              "bad_words", "allowed_token_ids", "response_format", "structured_outputs",
              "tools", "tool_choice", "cache_salt", "stream_options", "priority", "min_p",
              "logit_bias", "thinking_token_budget"}
    assert wanted <= seen, wanted - seen
    sizes = {len(random_mix(random.Random(i), 2 + i % 15)) for i in range(30)}
    assert sizes == set(range(2, 17))


def test_checks_pass_plain_answers_and_catch_each_failure():
    greedy = _chat(temperature=0.0)
    assert check_request(greedy, _answer(), _answer()) == []
    assert check_request(greedy, _answer(), _answer("Lyon."))       # greedy text differs
    assert check_request(greedy, _answer(), {"status": 500, "error": "boom"})
    assert check_request(greedy, _answer(), {"status": None, "error": "reset"})
    assert check_request(greedy, _answer(), {"status": 400, "error": "no"})
    assert check_request(_chat(n=2), _answer(n=2), _answer(n=1))     # a choice lost
    asked = _chat(temperature=1.0, logprobs=True, top_logprobs=2)
    assert check_request(asked, _answer(logprobs=2), _answer("Other.", logprobs=2)) == []
    assert check_request(asked, _answer(logprobs=2), _answer(logprobs=None))  # dropped
    assert check_request(asked, _answer(logprobs=2), _answer(logprobs=0))     # counts
    no_usage = _answer()
    del no_usage["json"]["usage"]
    assert check_request(greedy, _answer(), no_usage)


def test_what_plain_vllm_gets_wrong_itself_is_not_held_against_the_tree():
    """A request plain vLLM fails (5xx) is not judged on the tree server, as
    long as it answers; logprobs=0 asks for logprobs; beside a specific-token
    request, top-logprob lists may be short (vLLM's whole-batch layout), never long."""
    failed = {"status": 500, "error": "grammar rejected tokens"}
    assert check_request(_chat(), failed, {"status": 500, "error": "same"}) == []
    assert check_request(_chat(), failed, _answer()) == []
    assert check_request(_chat(), failed, {"status": None, "error": "reset"})
    comp = {"api": "completions", "stream": False, "body": {"logprobs": 0, "max_tokens": 4}}
    answer = {"status": 200, "json": {"choices": [{"index": 0, "text": "ab"}],
                                      "usage": {"completion_tokens": 2}}}
    assert check_request(comp, answer, answer) == ["logprobs missing"]
    asked = _chat(temperature=1.0, logprobs=True, top_logprobs=5)
    assert check_request(asked, _answer(logprobs=5), _answer(logprobs=1))
    assert check_request(asked, _answer(logprobs=5), _answer(logprobs=1), True) == []
    assert check_request(asked, _answer(logprobs=5), _answer(logprobs=7), True)


def test_a_field_only_speculation_refuses_may_be_refused_by_name():
    """Plain serves min-p; a speculative server may answer 400 if it names it."""
    req = _chat(temperature=1.0, min_p=0.1)
    named = {"status": 400, "error": "min_p and logit_bias are not supported"}
    assert check_request(req, _answer(), named) == []
    assert check_request(req, _answer(), {"status": 400, "error": "bad request"})
    assert check_request(_chat(temperature=1.0), _answer(), named)  # not asked: a failure


def test_a_stream_is_gathered_into_one_answer_with_its_error_code():
    events = ['data: {"choices": [{"index": 0, "delta": {"content": "Pa"}}]}',
              'data: {"choices": [{"index": 0, "delta": {"content": "ris"}, '
              '"finish_reason": "stop"}]}',
              'data: {"choices": [], "usage": {"completion_tokens": 2}}', "data: [DONE]"]
    got = gathered(events)
    assert got["json"]["choices"][0]["message"]["content"] == "Paris"
    assert got["json"]["usage"] == {"completion_tokens": 2}
    refused = gathered(['data: {"error": {"message": "x", "code": 400}}', "data: [DONE]"])
    assert refused["status"] == 400
    assert gathered(events[:2])["status"] == 500  # cut off before [DONE]


def test_a_thinking_budget_is_refused_by_name():
    from vllm_treespec.vllm_glue.request_checks import refusal

    assert refusal(SimpleNamespace(thinking_token_budget=None, extra_args=None)) is None
    name, value, message = refusal(SimpleNamespace(thinking_token_budget=4))
    assert name == "thinking_token_budget" and "4" in message and "eagle3_tree" in message
    assert value == 4
    assert refusal(SimpleNamespace(extra_args={"thinking_token_budget": 0}))[:2] == (name, 0)
