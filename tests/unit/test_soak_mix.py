"""The soak's request mix and its verdict on one result (no server needed)."""

from collections import Counter

from vllm_treespec.bench.soak_mix import COMPLETIONS, SoakResult, build_mix

POOL = list(range(100, 4000))
TEXTS = ["Write a haiku.", "Explain recursion.", "def add(a, b):"]


def test_mix_is_seeded_and_covers_every_kind():
    a = build_mix(600, 7, "m", TEXTS, POOL, 1024)
    b = build_mix(600, 7, "m", TEXTS, POOL, 1024)
    assert [(r.kind, r.body) for r in a] == [(r.kind, r.body) for r in b]
    assert [r.body for r in build_mix(600, 8, "m", TEXTS, POOL, 1024)] != [r.body for r in a]
    kinds = Counter(r.kind.split(":")[0] for r in a)
    assert set(kinds) == {"chat", "completion", "fallback", "abort", "invalid"}
    assert len({r.kind for r in a if r.kind.startswith("invalid")}) == 5
    assert len({r.kind for r in a if r.kind.startswith("fallback")}) == 4
    assert any(r.stream for r in a) and any(not r.stream for r in a if r.expect == "ok")
    bodies = [r.body for r in a if isinstance(r.body, dict)]
    assert any(b.get("n") == 4 for b in bodies) and any("stop" in b for b in bodies)
    assert any("logprobs" in b for b in bodies) and any(b.get("max_tokens") == 1 for b in bodies)
    assert max(b["max_tokens"] for b in bodies if b.get("max_tokens", 0) > 0) > 128


def test_valid_token_prompts_fit_the_model_and_the_long_invalid_one_does_not():
    for r in build_mix(600, 3, "m", TEXTS, POOL, 1024):
        if r.path != COMPLETIONS or not isinstance(r.body["prompt"], list):
            continue
        total = len(r.body["prompt"]) + r.body["max_tokens"]
        if r.expect == "4xx":
            assert len(r.body["prompt"]) > 1024
        else:
            assert total <= 1024 and len(r.body["prompt"]) >= 1


def test_verdicts():
    ok = SoakResult(0, "chat", "ok", status=200, texts=["hi"], completion_tokens=1)
    assert ok.violation == ""
    assert "no tokens" in SoakResult(0, "chat", "ok", status=200).violation
    assert "HTTP 500" in SoakResult(0, "chat", "ok", status=500).violation
    assert "failed" in SoakResult(0, "chat", "ok", status=None, error="reset").violation
    bad_input = SoakResult(1, "invalid:x", "4xx", status=400, error='{"message": "max_tokens"}')
    assert bad_input.violation == ""
    assert "not a 4xx" in SoakResult(1, "invalid:x", "4xx", status=200).violation
    assert "without an error message" in SoakResult(1, "invalid:x", "4xx", status=422,
                                                    error="{}").violation
    assert SoakResult(2, "abort", "abort", status=200, aborted=True).violation == ""
    assert "HTTP 503" in SoakResult(2, "abort", "abort", status=503).violation


def test_min_p_and_logit_bias_are_expected_refused_with_speculation():
    mix = build_mix(600, 7, "m", TEXTS, POOL, 1024)
    refused = [r for r in mix if r.kind in ("fallback:min_p", "fallback:logit_bias")]
    assert refused and all(r.expect_on(False) == "ok" and r.expect_on(True) == "4xx"
                           for r in refused)
    others = [r for r in mix if r not in refused]
    assert all(r.expect_on(True) == r.expect for r in others)


def test_a_short_mix_still_holds_every_kind():
    # The CI soak sends 32 requests: it must still abort and send bad input.
    for seed in range(20):
        for n in (5, 8, 32):
            kinds = Counter(r.kind.split(":")[0] for r in build_mix(n, seed, "m", TEXTS, POOL, 1024))
            assert set(kinds) == {"chat", "completion", "fallback", "abort", "invalid"}, (seed, n)


def test_the_plain_servers_copy_of_the_mix_has_no_seeds_and_nothing_else_changes():
    mix = build_mix(600, 7, "m", TEXTS, POOL, 1024)
    seeded = [r for r in mix if isinstance(r.body, dict) and "seed" in r.body]
    assert seeded  # the mix does send seeds (to the tree servers)
    plain = [r.unseeded() for r in mix]
    assert not any(isinstance(r.body, dict) and "seed" in r.body for r in plain)
    for a, b in zip(mix, plain):
        if a in seeded:
            assert {k: v for k, v in a.body.items() if k != "seed"} == b.body
            assert (a.kind, a.path, a.stream, a.expect) == (b.kind, b.path, b.stream, b.expect)
        else:
            assert a is b
    assert all("seed" in r.body for r in seeded)  # the tree servers' mix is untouched


def _run(name, rss_warm, *rss_passes, preemptions=3.0):
    from vllm_treespec.bench.soak_report import ServerRun

    metrics = {"vllm:num_preemptions_total": preemptions}
    # rss_end (after the quiet subset) is reported, not judged
    by_process = [{"VLLM::Worker": rss} for rss in (rss_warm, *rss_passes)]
    return ServerRun(name, [], [], [[] for _ in rss_passes], [1.0] * len(rss_passes), by_process,
                     rss_end=10 * rss_passes[-1], healthy_end=True, metrics=metrics, burst=[],
                     burst_preemptions=0, dumps=0, injected_dumps=0)


def _memory_violations(plain_growth, tree_growth):
    from vllm_treespec.bench.soak_report import check

    runs = {"plain": _run("plain", 1000, *(int(1000 * g) for g in plain_growth)),
            "adaptive": _run("adaptive", 1000, *(int(1000 * g) for g in tree_growth))}
    return [v for v in check(runs, [])[1] if "resident memory" in v]


def test_memory_is_judged_against_plain_vllms_own_growth():
    assert _memory_violations((1.15, 1.2), (1.18,)) == []   # plain vLLM grows as much
    assert _memory_violations((1.0, 1.0), (1.09,)) == []    # within 10 %
    assert _memory_violations((1.0, 1.0), (1.12,))
    assert _memory_violations((1.15, 1.2), (1.30,))
    assert _memory_violations((1.5, 1.6), (1.0,)) == []     # plain itself is not judged


def test_a_second_pass_tells_a_leak_from_a_larger_working_set():
    """Both servers' growth is judged after every pass both ran: a tree server that
    steps up once and then grows like plain passes, one that keeps growing faster
    than plain fails at the pass where it outgrows plain's growth + 10 %."""
    plain = (1.10, 1.15)
    assert _memory_violations(plain, (1.18, 1.23)) == []            # working set: +8 then flat
    leak = _memory_violations(plain, (1.18, 1.28))                  # +8, then +5 more a pass
    assert len(leak) == 1 and "load pass 2" in leak[0] and "1.25x" in leak[0]
    from vllm_treespec.bench.soak_report import check

    runs = {"plain": _run("plain", 1000, 1100, 1150),
            "adaptive": _run("adaptive", 1000, 1180, 1280)}
    summary, _ = check(runs, [])
    assert summary["adaptive"]["violations"] == 1 and summary["plain"]["violations"] == 0
    assert _memory_violations(plain, (1.22, 1.24))[0].count("load pass 1") == 1


def test_markdown_shows_the_growth_after_each_pass():
    import argparse

    from vllm_treespec.bench.soak_report import check, markdown

    runs = {"plain": _run("plain", 1000, 1100, 1150), "fixed": _run("fixed", 1000, 1180, 1230)}
    summary, violations = check(runs, [])
    for s in summary.values():
        s["load"] = [{"tok_s": 1.0, "ttft_ms": {"p50": 1, "p99": 2},
                      "tpot_ms": {"p50": 1, "p99": 2}}]
    args = argparse.Namespace(requests=1, concurrency=1, kv_tokens=1, seed=0)
    md = markdown(summary, violations, args)
    assert "| 1.18 / 1.23 (<= 1.2 / 1.25) |" in md and "| 1.1 / 1.15 |" in md


def test_preemption_burst_cannot_fit_the_cache():
    """The burst's arithmetic: every request's prompt fits at once, and even all
    but one of them, grown by their answers, need more blocks than the cache has."""
    from vllm_treespec.bench.soak_mix import preemption_burst

    for blocks, seqs in ((12, 16), (64, 64), (64, 16), (100, 16), (9, 16)):
        burst = preemption_burst("m", POOL, blocks, seqs, 128, 1024)
        usable = blocks - 1  # vLLM's null block holds no KV
        assert len(burst) == min(usable, seqs)
        prompts = [r.body["prompt"] for r in burst]
        held = [-(-(len(p) + 32) // 128) for p in prompts]  # a tree's lookahead of 32
        grown = [-(-(len(p) + r.body["max_tokens"]) // 128) for p, r in zip(prompts, burst)]
        assert sum(held) <= usable < sum(sorted(grown)[1:])
        assert len({p[0] for p in prompts}) == len(prompts)  # no shared cached block
        assert all(r.body["ignore_eos"] and r.body["temperature"] == 0 for r in burst)
    assert preemption_burst("m", POOL, 4096, 16, 128, 1024) == []  # too large to force


def test_soak_counts_a_lost_burst_request():
    from vllm_treespec.bench.soak_mix import SoakResult

    lost = SoakResult(-1, "preempt", "ok", status=500, error="engine died")
    assert lost.violation.startswith("HTTP 500")


def test_valid_requests_take_the_tenants_in_turn():
    from vllm_treespec.bench import soak_mix

    mix = build_mix(600, 7, "m", TEXTS, POOL, 1024)
    valid = [r for r in mix if isinstance(r.body, dict) and r.expect != "4xx"]
    salts = Counter(r.body.get("cache_salt") for r in valid)
    assert set(salts) == set(soak_mix.TENANTS) and min(salts.values()) > 100
    for r in valid:
        assert r.body.get("cache_salt") == soak_mix.TENANTS[r.index % len(soak_mix.TENANTS)]
