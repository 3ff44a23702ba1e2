"""Lab 05 checks: they pass a correct priority-with-aging policy and reject typical mistakes.

The reference is written out again here (not imported from the scheduler), so the
checks are tested against an independent implementation.
"""

import matplotlib
import pytest

matplotlib.use("Agg")

from tinyserve.labs import (check_aging_argument, check_bounded_starvation,  # noqa: E402
                            check_equal_priorities_is_fcfs, check_priority_choice)
from tinyserve.policies import Policy  # noqa: E402


class Aging(Policy):
    name = "lab05-reference"

    def __init__(self, aging=1.0):
        if aging < 0:
            raise ValueError(f"aging must be >= 0, got {aging!r}")
        self.aging = aging

    def key(self, request, now):
        return request.priority - self.aging * (now - request.arrival_time)

    def choose(self, waiting, now, running):
        best = 0
        for i in range(1, len(waiting)):
            if self.key(waiting[i], now) < self.key(waiting[best], now):
                best = i
        return best


class SignFlipped(Aging):
    def key(self, request, now):
        return request.priority + self.aging * (now - request.arrival_time)


class UsesArrival(Aging):
    def key(self, request, now):
        return request.priority - self.aging * request.arrival_time


class HigherFirst(Aging):
    def key(self, request, now):
        return -(request.priority - self.aging * (now - request.arrival_time))


class IgnoresAging(Aging):
    def key(self, request, now):
        return request.priority


class TiesLast(Aging):
    def choose(self, waiting, now, running):
        best = 0
        for i in range(1, len(waiting)):
            if self.key(waiting[i], now) <= self.key(waiting[best], now):
                best = i
        return best


class ReturnsRequest(Aging):
    def choose(self, waiting, now, running):
        return waiting[super().choose(waiting, now, running)]


class NoValidation(Aging):
    def __init__(self, aging=1.0):
        self.aging = aging


class VagueError(Aging):
    def __init__(self, aging=1.0):
        if aging < 0:
            raise ValueError("bad value")
        self.aging = aging


class IgnoresPriority(Aging):
    """FCFS in disguise: passes the equal-priority check, fails the starvation one."""
    def key(self, request, now):
        return -(now - request.arrival_time)


class NotAPolicy:
    def __init__(self, aging=1.0):
        self.aging = aging

    def choose(self, waiting, now, running):
        return 0


def test_reference_passes_every_check(capsys):
    check_aging_argument(Aging)
    check_priority_choice(Aging)
    check_equal_priorities_is_fcfs(Aging)
    rows0, rows = check_bounded_starvation(Aging, plot=False)
    assert capsys.readouterr().out.count("✓") == 4
    # aging = 0 starves them far beyond what aging = 1 lets them wait
    assert max(w for _, w, _ in rows0) > 1.5 * max(w for _, w, _ in rows)
    assert all(w <= b for _, w, b in rows)


@pytest.mark.parametrize("cls, hint", [
    (SignFlipped, r"aging has the wrong sign"),
    (UsesArrival, r"wrong sign.*used the arrival time itself"),
    (HigherFirst, r"a lower value goes first"),
    (IgnoresAging, r"you ignored aging"),
    (TiesLast, r"equal effective priority go in arrival order: pick the first"),
    (ReturnsRequest, r"return its \*index\* in waiting"),
    (NotAPolicy, r"must subclass tinyserve.policies.Policy"),
])
def test_check_priority_choice_rejects(cls, hint):
    with pytest.raises(AssertionError, match=hint):
        check_priority_choice(cls)


@pytest.mark.parametrize("cls, hint", [
    (NoValidation, r"aging=-1 was accepted"),
    (VagueError, r"does not name the field"),
])
def test_check_aging_argument_rejects(cls, hint):
    with pytest.raises(AssertionError, match=hint):
        check_aging_argument(cls)


@pytest.mark.parametrize("cls, hint", [
    (TiesLast, r"aging=0\] every priority is 0, so scheduling must equal FCFS.*only the tie rule"),
    (SignFlipped, r"aging=1\] every priority is 0, so scheduling must equal FCFS"),
])
def test_check_equal_priorities_is_fcfs_rejects(cls, hint):
    with pytest.raises(AssertionError, match=hint):
        check_equal_priorities_is_fcfs(cls)


@pytest.mark.parametrize("cls, hint", [
    (IgnoresPriority, r"with aging=0, a priority-5 request .* while \d+ priority-0 requests were queued"),
    (SignFlipped, r"more than its bound|while \d+ priority-0 requests were queued"),
])
def test_check_bounded_starvation_rejects(cls, hint):
    with pytest.raises(AssertionError, match=hint):
        check_bounded_starvation(cls, plot=False)


def test_the_hint_is_bilingual_and_names_the_queue():
    with pytest.raises(AssertionError) as info:
        check_priority_choice(SignFlipped)
    msg = str(info.value)
    assert "老化的方向反了" in msg and "wrong sign" in msg
    assert "effective=" in msg and "You chose #" in msg


def test_untouched_stubs_raise_not_implemented():
    class Stub(Policy):
        def __init__(self, aging=1.0):
            raise NotImplementedError("write your code here")

    class StubChoose(Aging):
        def choose(self, waiting, now, running):
            raise NotImplementedError("write your code here")

    for check, cls in ((check_aging_argument, Stub), (check_priority_choice, Stub),
                       (check_priority_choice, StubChoose), (check_equal_priorities_is_fcfs, StubChoose),
                       (check_bounded_starvation, StubChoose)):
        with pytest.raises(NotImplementedError):
            check(cls)
