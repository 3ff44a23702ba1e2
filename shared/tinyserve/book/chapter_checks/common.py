"""What the chapter's checks share: the reasons they print and the way they measure."""

from __future__ import annotations

import functools
from typing import Callable

from tinyserve import hardware as hwm
from tinyserve import host
from tinyserve.book import claims

A100, LLAMA_7B = hwm.A100_SXM_80GB, hwm.LLAMA_7B
INF = float("inf")
BUSY = "机器忙（关掉其它程序再跑一次），或这台机器的矩阵库、缓存和预测用的模型不符"
SIM = "模拟器的结果各机相同：若不成立，是调度器、模拟器或成本模型的代码变了"
EXACT = "确定性的计数：若不成立，是引擎的代码变了（调度、块管理或流式输出）"


def say(line: str) -> None:
    print("  " + line)


def all_of(text: str, test: Callable) -> claims.Expect:
    """An accepted relation over several numbers at once: ``test(measured, predicted)``."""
    return claims.Expect(test, text)


def each_within(lo: float, hi: float) -> claims.Expect:
    return all_of(f"each measured/predicted in [{lo:g}, {hi:g}]",
                  lambda m, p: all(lo <= a / b <= hi for a, b in zip(m, p)))


def timed(claim_id: str, what: str, remeasure: Callable, expect: claims.Expect, why: str = BUSY):
    """A timing-based claim: ``remeasure(attempt) -> (measured, predicted)`` is attempt 1;
    strict mode asks for attempts 2 and 3 of the same size (two of three decide)."""
    measured, predicted = remeasure(1)
    return claims.check(claim_id, what, measured, predicted=predicted, expect=expect,
                        measure=remeasure, why_not=why)


def one_thread(check: Callable) -> Callable:
    """Run a measured check, set-up included, on one torch thread (see the module doc)."""
    @functools.wraps(check)
    def run():
        with host.fixed_threads(1):
            return check()
    return run
