"""Lab 07 (capstone): the goodput check passes a tuning that follows the order, fails
the mystery baseline and half-done tunings with the next layer to fix, rejects
configs outside the budget, and `make grade` shows the goodput score."""

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from tinyserve.labs import capstone_problem, check_capstone, run_capstone
from tinyserve.labs.grade import CheckResult, format_table, grade_notebook
from tinyserve.labs.lab07 import BASELINE, TARGET_GOODPUT

# Written out again here (not imported from the solution notebook).
REFERENCE = {"max_num_seqs": 128, "enable_prefix_caching": True, "enable_chunked_prefill": True,
             "max_num_batched_tokens": 512}


def test_reference_tuning_passes_and_prints_the_score_table(capsys):
    summary = check_capstone(REFERENCE)
    out = capsys.readouterr().out
    assert summary["goodput"] >= TARGET_GOODPUT
    assert summary["slo_attainment"] > 0.95
    lines = out.splitlines()
    assert lines[1].startswith("baseline (mystery)") and lines[2].startswith("your config")
    assert lines[3].split() == ["target", f"{TARGET_GOODPUT:.2f}"]
    score = next(line for line in lines if line.startswith("score:"))
    assert score.endswith("PASS") and f"{summary['goodput']:.2f} req/s" in score


def test_target_is_reachable_with_slack_and_far_above_the_baseline():
    problem = capstone_problem()
    reference = run_capstone(REFERENCE, problem)["goodput"]
    baseline = run_capstone(problem.baseline, problem)["goodput"]
    assert baseline < 0.1 * TARGET_GOODPUT
    assert TARGET_GOODPUT <= 0.95 * reference


@pytest.mark.parametrize("config, stage, hint", [
    ({}, "queueing", "max_num_seqs"),                                       # today's config
    ({"max_num_seqs": 128}, "overload", "enable_prefix_caching"),           # batch fixed only
    ({"max_num_seqs": 128, "enable_prefix_caching": True, "enable_chunked_prefill": True},
     "decode", "max_num_batched_tokens"),                                   # budget still 4096
])
def test_each_half_done_tuning_fails_with_the_next_layer(config, stage, hint, capsys):
    with pytest.raises(AssertionError) as e:
        check_capstone(config)
    message = str(e.value)
    assert f"「{stage}」" in message and f"'{stage}'" in message
    assert hint in message
    assert "target 17.00" in message or f"{TARGET_GOODPUT:.2f}" in message
    assert capsys.readouterr().out.splitlines()[-1].endswith("FAIL")


def test_quantization_is_refused_by_the_budget():
    with pytest.raises(AssertionError, match="INT8 is not signed off"):
        check_capstone(REFERENCE | {"dtype": "int8"})


@pytest.mark.parametrize("config, match", [
    ({"num_replicas": 2}, "the budget is one GPU"),
    ({"max_num_seq": 64}, r"unknown knobs \['max_num_seq'\]"),
    ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1"),
    ({"max_num_batched_tokens": 512.0}, "max_num_batched_tokens must be an integer >= 1"),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching must be True or False"),
    ([("max_num_seqs", 64)], "config must be a dict"),
    ({"max_num_batched_tokens": 1024}, "Without chunking the token budget must hold the longest request"),
])
def test_bad_configs_get_an_actionable_hint(config, match):
    with pytest.raises(AssertionError, match=match):
        run_capstone(config)


def test_problem_is_reproducible_and_missing_knobs_keep_todays_values():
    a, b = capstone_problem(0), capstone_problem(0)
    assert a.specs == b.specs and a.baseline == BASELINE
    assert capstone_problem(1).specs != a.specs
    assert 0.5 < a.prefix_share < 1
    assert run_capstone({}, a) == run_capstone(dict(BASELINE), a)
    with pytest.raises(ValueError, match="seed must be an int"):
        capstone_problem("0")


def test_score_table_lists_each_checks_score_line():
    results = [CheckResult(3, "check_capstone", True, "", "goodput 19.12 req/s (target 17.00) PASS"),
               CheckResult(5, "check_other", False, "AssertionError: no")]
    table = format_table(results)
    assert "   3  check_capstone  score: goodput 19.12 req/s (target 17.00) PASS" in table.splitlines()
    assert table.endswith("score: 1/2")


def test_grade_shows_the_goodput_score(tmp_path):
    nb = new_notebook(cells=[
        new_code_cell("from tinyserve.labs import check_capstone"),
        new_code_cell(f"check_capstone({REFERENCE!r})"),
        new_code_cell("check_capstone({})"),
    ])
    path = tmp_path / "student.ipynb"
    nbformat.write(nb, path)
    passed, failed = grade_notebook(path)
    assert passed.passed and passed.detail.endswith("PASS") and "goodput" in passed.detail
    assert not failed.passed and failed.detail.endswith("FAIL") and failed.error.startswith("AssertionError")
    assert "score: goodput" in format_table([passed, failed])
