"""Lab 06 checks: they pass a correct cache-aware routing decision and reject typical mistakes.

The reference is written out again here (not imported from the checks or the
router), so the checks are tested against an independent implementation.
"""

import matplotlib
import pytest

matplotlib.use("Agg")

from tinyserve.labs import (FunctionPolicy, check_choose_replica,  # noqa: E402
                            check_is_imbalanced, check_routing_in_simulator)
from tinyserve.routing import PrefixTree  # noqa: E402


def is_imbalanced(outstanding, abs_threshold, rel_threshold):
    hi, lo = max(outstanding), min(outstanding)
    return hi - lo > abs_threshold and hi > rel_threshold * lo


def make_choose(imbalanced=is_imbalanced, record="chosen", ties="least_loaded",
                use_ratio=True, use_guard=True, use_match=True, ratio_strict=False):
    """The reference decision, with one knob per typical mistake."""
    def least(outstanding, candidates):
        return min(candidates, key=lambda i: (outstanding[i], i))

    def choose(key, outstanding, trees, balance_abs_threshold=8, balance_rel_threshold=1.5,
               min_match_ratio=0.1):
        n = len(outstanding)
        replica = None
        guard = use_guard and imbalanced(outstanding, balance_abs_threshold, balance_rel_threshold)
        if use_match and not guard:
            matches = [t.match(key) for t in trees]
            best = max(matches)
            need = min_match_ratio * len(key) if use_ratio else 0
            ok = best > need if ratio_strict else best >= need
            if best > 0 and ok:
                tied = [i for i in range(n) if matches[i] == best]
                replica = tied[-1] if ties == "last" else least(outstanding, tied)
        if replica is None:
            replica = max(range(n), key=lambda i: (-outstanding[i], i)) if ties == "last" \
                else least(outstanding, range(n))
        if record == "chosen":
            trees[replica].insert(key)
        elif record == "all":
            for t in trees:
                t.insert(key)
        return replica
    return choose


def test_the_reference_passes_every_check(capsys):
    check_is_imbalanced(is_imbalanced)
    check_choose_replica(make_choose())
    rows = check_routing_in_simulator(make_choose(), plot=False)
    rr, yours = rows[0], rows[-1]
    assert yours["hit_rate"] > rr["hit_rate"] + 0.15 and yours["mean_ttft"] < rr["mean_ttft"]
    assert "✓" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, hint", [
    (lambda o, a, r: max(o) - min(o) > a or max(o) > r * min(o), "and, not or"),
    (lambda o, a, r: max(o) - min(o) >= a and max(o) >= r * min(o), "strict >"),
    (lambda o, a, r: max(o) - min(o) > 8 and max(o) > 1.5 * min(o), "abs_threshold"),
    (lambda o, a, r: int(max(o) - min(o) > a and max(o) > r * min(o)), "True or False"),
])
def test_wrong_load_guards_fail_with_a_hint(wrong, hint):
    with pytest.raises(AssertionError, match=hint):
        check_is_imbalanced(wrong)


def test_a_guard_that_mutates_its_input_fails():
    def sorts(o, a, r):
        o.sort()
        return is_imbalanced(o, a, r)
    with pytest.raises(AssertionError, match="changed the outstanding list"):
        check_is_imbalanced(sorts)


@pytest.mark.parametrize("kwargs, hint", [
    (dict(use_match=False), "longest match|match decides|replica 0"),
    (dict(use_guard=False), "imbalanced"),
    (dict(record="none"), "does not hold the key"),
    (dict(record="all"), "was not chosen but its tree changed"),
    (dict(ties="last"), "smallest index|smaller index|less loaded"),
    (dict(use_ratio=False), "short|min_match_ratio"),
    (dict(ratio_strict=True), r"equal counts \(>=\)"),
    (dict(imbalanced=lambda o, a, r: max(o) - min(o) > 8 and max(o) > 1.5 * min(o)),
     "thresholds|balance_abs_threshold"),
])
def test_wrong_decisions_fail_with_a_hint(kwargs, hint):
    with pytest.raises(AssertionError, match=hint):
        check_choose_replica(make_choose(**kwargs))


def test_a_decision_returning_a_non_index_fails():
    def returns_tree(key, outstanding, trees, **kw):
        return trees[0]
    with pytest.raises(AssertionError, match="replica index"):
        check_choose_replica(returns_tree)


def test_routing_without_recording_keys_fails_in_the_simulator():
    # Never recording keys: every tree stays empty, so it degenerates to least-outstanding.
    with pytest.raises(AssertionError, match="not clearly higher"):
        check_routing_in_simulator(make_choose(record="none"), plot=False)


def test_function_policy_rejects_a_bad_index():
    policy = FunctionPolicy(lambda key, outstanding, trees: 5, 3)
    with pytest.raises(ValueError, match=r"not a replica index in 0\.\.2"):
        policy.choose((1, 2), [0, 0, 0])
    good = FunctionPolicy(make_choose(), 2)
    assert good.choose((1, 2, 3), [0, 0]) == 0 and isinstance(good.trees[0], PrefixTree)
    assert good.trees[0].match((1, 2, 3)) == 3
