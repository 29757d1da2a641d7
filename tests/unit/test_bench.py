"""The benchmark's dataset and arithmetic: pangu240 turns, /metrics parsing,
per-turn speedups, acceptance, per-depth rates and the stage breakdown."""

import json
import os

import pytest

from vllm_treespec.bench import driver, pangu240, report
from vllm_treespec.bench.server import metric_sum, parse_prometheus

PROM = """\
# HELP vllm_treespec:trees_total Verified draft trees
# TYPE vllm_treespec:trees_total counter
vllm_treespec:trees_total{engine="0",model_name="m"} 10.0
vllm_treespec:draft_nodes_total{engine="0",model_name="m"} 160.0
vllm_treespec:emitted_tokens_total{engine="0",model_name="m"} 35.0
vllm_treespec:accepted_at_depth_total{depth="1",engine="0",model_name="m"} 8.0
vllm_treespec:accepted_at_depth_total{depth="2",engine="0",model_name="m"} 5.0
vllm_treespec:stage_seconds_total{engine="0",model_name="m",stage="draft"} 0.2
vllm_treespec:stage_seconds_total{engine="0",model_name="m",stage="prepare"} 0.01
vllm_treespec:stage_seconds_total{engine="0",model_name="m",stage="verify_forward"} 0.76
vllm_treespec:stage_seconds_total{engine="0",model_name="m",stage="accept"} 0.02
vllm_treespec:stage_seconds_total{engine="0",model_name="m",stage="commit"} 0.01
vllm:num_requests_running{engine="0",model_name="m"} 2.0 1700000000000
"""


def test_first_turns_skip_turns_that_need_an_answer_and_keep_the_order():
    first = pangu240.first_turns(12)
    assert len(first) == 12 and all(t.depends_on is None for t in first)
    every_first = [t for t in pangu240.build_turns() if t.depends_on is None]
    assert [t.turn_id for t in first] == [t.turn_id for t in every_first[:12]]


def test_creative_turns_are_writing_and_roleplay_first_turns():
    turns = pangu240.mtbench_first_turns(("writing", "roleplay"), 50)
    assert len(turns) == 20  # MT-Bench: ten questions a category
    categories = {q["question_id"]: q["category"] for q in pangu240.mtbench_questions()}
    assert {categories[int(t.turn_id.split("/")[1])] for t in turns} == {"writing", "roleplay"}
    assert all(len(t.messages) == 1 and t.depends_on is None for t in turns)


def test_pangu240_has_240_interleaved_turns_and_second_turns_use_first_answers():
    turns = pangu240.build_turns()
    assert len(turns) == 240
    assert [t.source for t in turns[:3]] == ["humaneval", "mtbench", "mtbench"]
    assert sum(t.source == "humaneval" for t in turns) == 80
    assert sum(t.depends_on is not None for t in turns) == 80
    limited = pangu240.build_turns(limit=6)
    asked = []
    answer = lambda t: asked.append(t.turn_id) or f"A:{t.turn_id}"  # noqa: E731
    done = pangu240.materialize(limited, answer, known={limited[4].turn_id: "known"})
    assert all(t.depends_on is None for t in done)
    assert done[2].messages[1] == {"role": "assistant", "content": f"A:{limited[1].turn_id}"}
    assert done[5].messages[1]["content"] == "known"
    assert asked == [limited[1].turn_id]  # each first answer generated once
    orphan = pangu240.materialize(limited[2:3], answer)  # its first turn was cut by --limit
    assert asked[-1] == limited[1].turn_id and orphan[0].messages[0] == limited[1].messages[0]
    assert "```python" in done[0].messages[0]["content"]


def test_prometheus_parsing_sums_over_labels():
    m = parse_prometheus(PROM)
    assert m['vllm:num_requests_running{engine="0",model_name="m"}'] == 2.0  # timestamp ignored
    assert metric_sum(m, "vllm_treespec:trees_total") == 10.0
    assert metric_sum(m, "vllm_treespec:stage_seconds_total") == pytest.approx(1.0)
    assert metric_sum(m, "vllm_treespec:trees") == 0.0  # a prefix of a name is not the name


def test_per_depth_and_stage_breakdown_between_scrapes():
    after = parse_prometheus(PROM)
    before = {k: v / 2 for k, v in after.items()}  # half of everything happened in the window
    rates, size = report.per_depth(before, after)
    assert rates == pytest.approx([0.8, 0.5]) and size == pytest.approx(16.0)
    st = report.stage_breakdown(before, after, output_tokens=50)
    assert st["seconds"]["verify_forward"] == pytest.approx(0.38)
    assert sum(st["share"].values()) == pytest.approx(1.0)
    assert st["overhead_share"] == pytest.approx(0.04)
    assert st["ms_per_output_token"]["draft"] == pytest.approx(2.0)
    assert report.stage_breakdown(after, after, 50) is None  # nothing ran: no breakdown


def test_acceptance_length_counts_the_bonus_token():
    tree = {"drafts": 0, "accepted": 0, "trees": 10, "emitted": 35}
    assert driver.accept_len_between(dict.fromkeys(tree, 0), tree) == 3.5
    chain = {"drafts": 10, "accepted": 12, "trees": 0, "emitted": 0}
    assert driver.accept_len_between(dict.fromkeys(chain, 0), chain) == pytest.approx(2.2)
    assert driver.accept_len_between(chain, chain) is None


def test_speedups_are_per_turn_ratios_and_the_markdown_lists_stages():
    def res(turn, tokens, secs, accept=None):
        return driver.TurnResult(turn, "x", tokens, secs, 0.1, "", accept)

    none = [res("a", 100, 10.0), res("b", 100, 2.0)]
    tree = [res("a", 100, 5.0, 3.0), res("b", 100, 2.0, 1.0)]
    by_turn = {r.turn_id: r for r in none}
    after = parse_prometheus(PROM)
    s = report.method_summary(tree, by_turn, ({}, after))
    assert s["speedup_mean"] == pytest.approx(1.5)      # mean of 2.0 and 1.0
    assert s["speedup_of_means"] == pytest.approx(35.0 / 30.0)
    assert s["accept_len_mean"] == pytest.approx(2.0)
    assert s["stages"]["overhead_share"] == pytest.approx(0.04)
    md = report.markdown({"suite": "pangu240", "turns": 2, "max_tokens": 100, "temperature": 0.0,
                          "command": "cmd", "methods": {"eagle3_tree": {"c1": s}}})
    assert "verify_forward" in md and "4.0%" in md


def test_resume_files_keep_finished_turns_and_all_sittings_counters(tmp_path):
    """``--resume``: turns are appended as they finish (a line cut off by an
    interruption is skipped), and the /metrics counters of several sittings (each
    server starting from zero) add up to one window."""
    from vllm_treespec.bench import add_window, append_turn, read_turns, read_window

    turns, window = tmp_path / "turns-x.jsonl", tmp_path / "window-x.json"
    for i in range(2):
        append_turn(turns, driver.TurnResult(f"t{i}", "humaneval", 10 + i, 1.0, 0.1, "x", 1.5))
    with open(turns, "a") as f:
        f.write('{"turn_id": "t2", "sour')  # killed mid-write
    got = read_turns(turns)
    assert [r.turn_id for r in got] == ["t0", "t1"] and got[1].tok_s == 11.0
    append_turn(turns, driver.TurnResult("t2", "mtbench", 5, 1.0, 0.1, "y"))  # next sitting
    assert [r.turn_id for r in read_turns(turns)] == ["t0", "t1", "t2"]
    # Sitting 1: counters 5 -> 8 -> 12; sitting 2 (a new server): 0 -> 4.
    start1 = {"c": 5.0, "g": float("nan")}
    add_window(window, "s1", start1, {"c": 8.0})
    add_window(window, "s1", start1, {"c": 12.0})
    add_window(window, "s2", {"c": 0.0}, {"c": 4.0})
    before, after = read_window(window)
    assert after["c"] - before.get("c", 0.0) == 11.0
    assert read_window(tmp_path / "missing.json") is None


def test_resume_continues_with_the_runs_own_settings(tmp_path, capsys):
    """A resumed run takes its settings from run.json; one given that differs is
    refused (found the hard way: ``--resume DIR`` alone once continued a 20-turn,
    256-token run as the full 240-turn, 1024-token protocol in the same files)."""
    from vllm_treespec.bench import RUN_KEYS, build_parser, given_on_command_line, resumed_args

    parser = build_parser()

    def resume(*argv):
        argv = ["--resume", str(tmp_path), *argv]
        args = parser.parse_args(argv)
        resumed_args(parser, args, tmp_path, given_on_command_line(argv))
        return args

    stored = {k: parser.get_default(k) for k in RUN_KEYS} | {
        "limit": 20, "max_tokens": 256, "methods": "none,eagle3:k=2", "model": "M",
        "drafter": "D"}
    (tmp_path / "run.json").write_text(json.dumps(stored))
    args = resume()
    assert (args.limit, args.max_tokens, args.methods, args.model) == (20, 256,
                                                                      "none,eagle3:k=2", "M")
    resume("--max-tokens", "256")  # the run's own value
    with pytest.raises(SystemExit):
        resume("--limit", "240")
    assert "--limit 240 differs from the run's 20" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # given, and equal to the default: still not the run's
        resume("--max-tokens", "1024")
    assert "--max-tokens 1024 differs from the run's 256" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        resumed_args(parser, parser.parse_args(["--resume", str(tmp_path / "x")]), tmp_path / "x",
                     set())


def test_every_server_starts_a_round_in_turn():
    from vllm_treespec.bench.served_ab import rotated

    labels = ["none", "eagle3:k=3", "eagle3_tree"]
    orders = [rotated(labels, i) for i in range(6)]
    assert all(sorted(o) == sorted(labels) for o in orders)
    assert [o[0] for o in orders[:3]] == labels  # each first once in three rounds
    assert orders[3] == orders[0] and orders[1] == ["eagle3:k=3", "eagle3_tree", "none"]


def test_a_method_can_be_served_from_another_checkout(tmp_path):
    from vllm_treespec.bench import split_methods
    from vllm_treespec.bench.served_ab import server_env, split_code_dir

    (tmp_path / "vllm_treespec").mkdir()
    (tmp_path / "vllm_treespec" / "__init__.py").write_text("")
    methods = split_methods(f"none,eagle3_tree:depth=4,top_k=2@{tmp_path},eagle3_tree")
    assert methods == ["none", f"eagle3_tree:depth=4,top_k=2@{tmp_path}", "eagle3_tree"]
    assert split_code_dir(methods[1]) == ("eagle3_tree:depth=4,top_k=2", str(tmp_path))
    assert split_code_dir("eagle3_tree") == ("eagle3_tree", None)
    env = server_env({"A": "1"}, str(tmp_path))
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path) and env["A"] == "1"
    assert server_env({"A": "1"}, None) == {"A": "1"}
    with pytest.raises(SystemExit, match="no checkout"):
        split_code_dir(f"eagle3_tree@{tmp_path / 'missing'}")
