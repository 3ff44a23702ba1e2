"""tinyserve.book.claims (verdicts, strict mode, the registry) and the chapter checks of
``make claims``, including sabotage: with a property of the engine really gone, the
claim that rests on it must fail in strict mode."""

import json
import math
import random

import pytest

from tinyserve import engine as engine_module
from tinyserve.book import chapter_checks, claims, make_claims
from tinyserve.kv_cache import BlockManager
from tinyserve.scheduler import SchedulerConfig


@pytest.fixture
def reader(monkeypatch):
    """A reader's session: not strict, nothing forced."""
    monkeypatch.delenv(claims.STRICT_ENV, raising=False)
    monkeypatch.delenv(claims.FORCE_FALSE_ENV, raising=False)


@pytest.fixture
def strict(monkeypatch):
    """`make test`: strict, nothing forced."""
    monkeypatch.setenv(claims.STRICT_ENV, "strict")
    monkeypatch.delenv(claims.FORCE_FALSE_ENV, raising=False)


class Remeasure:
    """A measure(attempt) that returns the given values in turn and records each attempt asked for."""

    def __init__(self, *values):
        self.values, self.attempts = list(values), []

    def __call__(self, attempt):
        self.attempts.append(attempt)
        return self.values.pop(0)


# --------------------------------------------------------------------------- verdicts


def test_reader_mode_prints_a_verdict_and_never_raises(reader, capsys):
    held = claims.check("C02", "batching pays", 3.0, predicted=2.5, expect=claims.ratio_between(0.5, 2.0))
    again = Remeasure(5.0)
    gone = claims.check("C02", "batching pays", 0.9, predicted=2.5, expect=claims.ratio_between(0.5, 2.0),
                        measure=again, why_not="机器忙")
    out = capsys.readouterr().out
    assert held.holds and not gone.holds
    assert "✓ 本机成立 [C02]：batching pays（predicted 2.5, measured 3" in out
    assert "✗ 本机不成立 [C02]" in out and "机器忙" in out
    assert gone.attempts == 1 and again.attempts == []     # a reader gets one measurement
    assert claims.summary([held, gone]).splitlines()[-1] == "1 of 2 hold on this machine"


# Measured values; predicted 1.0, band 0.75-1.33. HOLD holds but not clearly (the clear band is
# its middle half on a log scale, 0.866-1.153), so two of three decides.
HOLD, FAIL = 0.8, 0.1


@pytest.mark.parametrize("outcomes, holds, reported", [
    ((HOLD, HOLD), True, 1),                             # decided after two attempts: the third is not run
    ((FAIL, FAIL), False, 1),
    ((HOLD, FAIL, HOLD), True, 1),
    ((FAIL, HOLD, HOLD), True, 2),
    ((HOLD, FAIL, FAIL), False, 2),                      # holding first does not save it
    ((FAIL, HOLD, FAIL), False, 1),
])
def test_strict_mode_decides_by_two_of_three_attempts(strict, outcomes, holds, reported):
    again = Remeasure(*[(m + i / 100, 1.0) for i, m in enumerate(outcomes[1:], 2)])  # attempt i measures m + i/100
    if holds:
        verdict = claims.check("C06", "fusion pays", outcomes[0], predicted=1.0,
                               expect=claims.ratio_between(0.75, 1.33), measure=again)
    else:
        with pytest.raises(claims.ClaimFailed, match="C06 does not hold"):
            claims.check("C06", "fusion pays", outcomes[0], predicted=1.0,
                         expect=claims.ratio_between(0.75, 1.33), measure=again)
        verdict = claims.RESULTS[-1]
    assert again.attempts == list(range(2, len(outcomes) + 1))
    assert verdict.holds is holds and verdict.reported == reported
    assert [a.holds for a in verdict.history] == [m == HOLD for m in outcomes]
    # The verdict reports the first attempt on the winning side; every attempt is in its line and JSON.
    assert verdict.measured == verdict.history[reported - 1].measured
    record = json.loads(json.dumps(verdict.as_dict()))
    assert [h["measured"] for h in record["history"]] == [a.measured for a in verdict.history]
    assert record["reported"] == reported and record["holds"] is holds
    assert "三次取二 " + "".join("✓" if m == HOLD else "✗" for m in outcomes) in verdict.line()
    assert not verdict.clear


def test_a_first_attempt_well_inside_the_band_decides_alone_in_strict_mode(strict, capsys):
    """1.0 against 0.75-1.33 is in the band's middle half: no second measurement."""
    again = Remeasure((0.1, 1.0))
    verdict = claims.check("C06", "fusion pays", 1.0, predicted=1.0, expect=claims.ratio_between(0.75, 1.33),
                           measure=again)
    assert verdict.holds and verdict.clear and verdict.attempts == 1 and again.attempts == []
    assert "一次即定" in capsys.readouterr().out and verdict.as_dict()["clear"] is True


def test_a_clear_first_attempt_never_saves_a_failure_nor_skips_it_in_a_readers_session(reader):
    again = Remeasure(1.0)
    failed = claims.check("C06", "fusion pays", 0.1, predicted=1.0, expect=claims.ratio_between(0.75, 1.33),
                          measure=again)
    assert not failed.holds and not failed.clear and again.attempts == []   # a reader measures once anyway
    assert not claims.check("C06", "fusion pays", 1.0, predicted=1.0, expect=claims.ratio_between(0.75, 1.33),
                            measure=again).clear                            # only strict mode decides early


@pytest.mark.parametrize("expect, clear, near", [
    (claims.at_least(1.2), [1.5, 10.0, 1e9], [1.2, 1.49]),
    (claims.at_most(0.1), [0.08, 0.0, -5.0], [0.1, 0.081]),
    (claims.between(0.7, 2.0), [0.875, 1.3, 1.6], [0.7, 0.87, 1.61, 2.0]),
    (claims.between(0.75, 1.33), [0.87, 1.0, 1.15], [0.75, 0.86, 1.16, 1.33]),  # narrow: its middle half
    (claims.between(0.7, 0.8), [0.73, 0.77], [0.7, 0.72, 0.78, 0.8]),
    (claims.at_least(0.0), [], [0.0, 5.0]),                                 # no factor moves a bound at 0
    (claims.ratio_between(1.5, math.inf), [1.875 * 2, 100.0], [1.5 * 2, 1.87 * 2]),
    (claims.equals(3), [], [3]),
    (claims.is_true(), [], [True]),
])
def test_the_clear_band_is_the_accepted_band_narrowed_by_clear_at_each_finite_bound(expect, clear, near):
    predicted = 2.0 if "predicted" in expect.text else None
    assert all(expect(m, predicted) and expect.clear(m, predicted) for m in clear), clear
    assert all(expect(m, predicted) and not expect.clear(m, predicted) for m in near), near
    assert not expect.clear(float("nan"), predicted) and not expect.clear(None, predicted)


def test_a_property_that_holds_half_the_time_fails_strict_mode_half_the_time(strict, capsys):
    """Sabotage: a 'claim' decided by a seeded coin (p = 0.5 on every attempt, no timing).

    Two of three passes with probability p^3 + 3 p^2 (1 - p) = 0.125 + 0.375 = 0.5; the old
    rule (retry until one attempt holds) passed 1 - (1 - p)^3 = 0.875. Over 2000 seeded runs
    the pass rate's standard deviation is sqrt(0.25 / 2000) = 0.011, so [0.45, 0.55] is more
    than 4 deviations wide on each side and 0.875 is 33 deviations away."""
    coin = random.Random(20261203)
    flip = lambda attempt=None: coin.random() < 0.5
    passed = 0
    for _ in range(2000):
        try:
            passed += claims.check("C06", "a coin", flip(), expect=claims.is_true(), measure=flip, quiet=True).holds
        except claims.ClaimFailed:
            pass
    assert 0.45 <= passed / 2000 <= 0.55
    del claims.RESULTS[-2000:]


def test_strict_mode_fails_with_every_attempt_in_the_message(strict, capsys):
    again = Remeasure(0.9)
    with pytest.raises(claims.ClaimFailed) as failed:
        claims.check("C10", "a flat floor", 1.0, predicted=2.0, expect=claims.ratio_between(0.75, 1.33),
                     measure=again, why_not="机器忙")
    message = str(failed.value)
    assert again.attempts == [2]
    assert message.startswith("C10 does not hold: a flat floor")
    assert "failed: measured 1 vs 2; failed: measured 0.9 vs 2" in message and "机器忙" in message
    assert "✗ 本机不成立 [C10]" in capsys.readouterr().out      # the reader's line is printed first


def test_a_claim_without_a_measure_is_one_attempt_in_strict_mode(strict):
    """Exact counts and functional properties are never retried: one result decides."""
    with pytest.raises(claims.ClaimFailed, match="C08 does not hold"):
        claims.check("C08", "steps", 96, predicted=95, expect=claims.equals())
    assert claims.RESULTS[-1].attempts == 1
    assert claims.check("C08", "steps", 95, predicted=95, expect=claims.equals()).attempts == 1


def test_simulated_and_auxiliary_checks_are_labelled_and_counted_apart(reader, capsys):
    sim = claims.check("C16", "head-of-line blocking", 3.0, expect=claims.at_least(2.0))
    aux = claims.check("A01", "a step takes milliseconds", 0.004, expect=claims.at_most(0.010))
    here = claims.check("C02", "batching pays", 0.1, predicted=1.0, expect=claims.ratio_between(0.5, 2.0))
    out = capsys.readouterr().out
    assert sim.simulated and "✓ 模拟成立 [C16]" in out
    assert aux.auxiliary and not aux.simulated and "✓ 本机成立 [A01]" in out
    # A timed check of a simulated claim's id is measured here, not on the simulator's clock.
    assert not claims.check("C16", "timed", 1.0, expect=claims.at_least(0.5), measure=Remeasure()).simulated
    lines = claims.summary([sim, aux, here]).splitlines()
    assert lines[-3:] == ["0 of 1 hold on this machine", "模拟（各机相同）：1 of 1 hold",
                          "辅助检查（不是本章的论断）：1 of 1 hold"]


def test_force_false_turns_a_claim_that_holds_into_a_failure(reader, monkeypatch, capsys):
    monkeypatch.setenv(claims.FORCE_FALSE_ENV, "C02, C06")
    never = Remeasure()
    verdict = claims.check("C02", "batching pays", 3.0, predicted=3.0, expect=claims.ratio_between(0.5, 2.0),
                           measure=never)
    assert not verdict.holds and verdict.forced and never.attempts == []
    assert "强制为假" in capsys.readouterr().out
    assert claims.check("C03", "other claims untouched", 1, expect=claims.equals(1)).holds
    monkeypatch.setenv(claims.STRICT_ENV, "strict")
    never = Remeasure(2.0, 2.0)
    with pytest.raises(claims.ClaimFailed, match="C06"):
        claims.check("C06", "fusion pays", 2.0, predicted=2.0, expect=claims.ratio_between(0.75, 1.33),
                     measure=never)
    assert never.attempts == []


@pytest.mark.parametrize("bad", [lambda m, p: True, "between(1, 2)", None])
def test_unknown_claims_and_bad_expectations_are_refused(reader, bad):
    with pytest.raises(ValueError, match="unknown claim 'C25'"):
        claims.check("C25", "not in the chapter", 1, expect=claims.equals(1))
    with pytest.raises(ValueError, match="expect"):
        claims.check("C01", "needs an Expect", 1, expect=bad)


def test_a_claim_the_book_only_states_cannot_print_a_verdict(reader, capsys):
    with pytest.raises(ValueError, match="claim_id: C20 is stated"):
        claims.check("C20", "our table's names exist", True, expect=claims.is_true())
    assert "C20" not in capsys.readouterr().out


def test_expectations_treat_missing_or_non_finite_numbers_as_failures():
    nan = float("nan")
    assert claims.between(1, 2)(1.5) and not claims.between(1, 2)(2.5) and not claims.between(1, 2)(nan)
    assert claims.at_least(2)(2) and not claims.at_least(2)(None) and claims.at_most(2)(1)
    ratio = claims.ratio_between(0.5, 2)
    assert ratio(2, 1) and not ratio(3, 1) and not ratio(1, 0) and not ratio(1, None) and not ratio(nan, 1)
    assert claims.equals()((1, [2]), (1, [2])) and not claims.equals(3)(4)
    assert claims.is_true()(True) and not claims.is_true()(1)


# --------------------------------------------------------------------------- the registry


def test_the_registry_holds_the_chapters_24_claims_in_order():
    assert [c.id for c in claims.CHAPTER] == [f"C{i:02d}" for i in range(1, 25)]
    assert all(c.how in claims.HOW_ZH and c.statement and c.notebooks for c in claims.CHAPTER)
    assert [c.id for c in claims.CHAPTER if c.how == "stated"] == ["C20"]
    table = claims.markdown_table(lambda nb: f"{nb}_x.ipynb").splitlines()
    assert len(table) == 2 + 24
    for row, c in zip(table[2:], claims.CHAPTER):
        assert row.startswith(f"| {c.id} | {c.statement}（「{c.section}」） |")
        assert all(f"[{nb}]({nb}_x.ipynb)" in row for nb in c.notebooks)


def test_auxiliary_ids_are_not_the_chapters():
    assert [a.id for a in claims.AUXILIARY] == [f"A{i:02d}" for i in range(1, len(claims.AUXILIARY) + 1)]
    assert not set(claims.AUX_BY_ID) & set(claims.BY_ID)
    assert all(f"| {a.id} |" not in claims.markdown_table() for a in claims.AUXILIARY)


def test_every_measurable_claim_has_a_check_that_says_what_it_measures():
    measurable = [c.id for c in claims.CHAPTER if c.how != "stated"]
    assert list(chapter_checks.CHECKS) == measurable
    for claim_id, check in chapter_checks.CHECKS.items():
        doc = (check.__doc__ or "").strip()
        assert doc and "\n" not in doc, claim_id


def test_make_claims_runs_the_chosen_claims_and_writes_json(reader, tmp_path, capsys):
    out = tmp_path / "claims.json"
    assert make_claims.main(["--only", "C01,C09,C20", "--json", str(out)]) == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    assert [c["id"] for c in report["claims"]] == ["C01", "C09", "C20"]
    assert report["claims"][2]["verdict"] is None and report["failed"] == []
    assert all(c["verdict"]["holds"] for c in report["claims"][:2])
    printed = capsys.readouterr().out
    assert "数据手册推算 2 of 2 hold; 书中陈述 1" in printed


def test_make_claims_strict_exits_1_when_a_claim_fails(reader, tmp_path, monkeypatch):
    monkeypatch.setenv(claims.FORCE_FALSE_ENV, "C09")
    monkeypatch.setenv(claims.STRICT_ENV, "off")          # main(--strict) sets it: undone after the test
    out = tmp_path / "claims.json"
    assert make_claims.main(["--only", "C01,C09", "--strict", "--json", str(out)]) == 1
    assert "C09 does not hold" in json.loads(out.read_text(encoding="utf-8"))["failed"][0]


# --------------------------------------------------------------------------- sabotage


def test_continuous_batching_holds_and_fails_when_it_is_static_batching(strict, monkeypatch):
    assert chapter_checks.deterministic.c08().holds

    def static_only(**kwargs):
        return SchedulerConfig(**{**kwargs, "batching": "static"})   # "continuous" asked, static run

    monkeypatch.setattr(engine_module, "SchedulerConfig", static_only)
    with pytest.raises(claims.ClaimFailed, match="C08 does not hold") as failed:
        chapter_checks.deterministic.c08()
    assert "measured (93, 93" in str(failed.value).replace("[", "(").replace("]", ")")


@pytest.fixture
def no_prefix_caching(monkeypatch):
    """Every block manager (engine and simulator) built with prefix caching off."""
    build = BlockManager.__init__

    def without_caching(self, num_blocks, block_size, enable_prefix_caching=False):
        build(self, num_blocks, block_size, False)

    monkeypatch.setattr(BlockManager, "__init__", without_caching)


def test_shared_block_refcounts_hold(strict):
    assert chapter_checks.deterministic.c14().holds


def test_shared_block_refcounts_fail_without_prefix_caching(strict, no_prefix_caching):
    with pytest.raises(claims.ClaimFailed, match="C14 does not hold"):
        chapter_checks.deterministic.c14()


def test_cache_aware_routing_holds(strict):
    assert chapter_checks.deterministic.c21().holds


def test_cache_aware_routing_fails_without_prefix_caching(strict, no_prefix_caching):
    with pytest.raises(claims.ClaimFailed, match="C21 does not hold"):
        chapter_checks.deterministic.c21()


def test_fusion_fails_when_the_fused_kernel_is_the_unfused_chain(strict, monkeypatch, capsys):
    """The speed-up of the 'fused' kernel is then ~1x against a predicted 2x: two attempts
    fail and decide it."""
    measured_checks = chapter_checks.measured
    monkeypatch.setattr(measured_checks, "_fused_chain", measured_checks._unfused_chain)
    with pytest.raises(claims.ClaimFailed, match="C06 does not hold") as failed:
        measured_checks.c06()
    measured = [a.measured for a in claims.RESULTS[-1].history]
    assert len(measured) == claims.NEEDED and all(0.7 < m < 1.4 for m in measured), failed.value


def test_per_attempt_runs_an_experiment_once_per_attempt_for_every_claim_on_it(strict):
    runs = iter([(0.1, 9.0), (0.6, 0.6)])              # attempt 2 fails both claims, attempt 3 holds both
    again = claims.per_attempt(lambda: next(runs))     # (0.6 holds in 0.5-2 but not clearly: 0.625-1.6)
    first = claims.check("C11", "share", 0.6, expect=claims.between(0.5, 2), measure=lambda a: again(a)[0])
    second = claims.check("C11", "gain", 0.6, expect=claims.between(0.5, 2), measure=lambda a: again(a)[1])
    assert [a.measured for a in first.history] == [0.6, 0.1, 0.6]
    assert [a.measured for a in second.history] == [0.6, 9.0, 0.6]     # the same runs, not new ones
