"""The chapter's claims, each checked on the machine at hand.

A notebook sentence that states a measured relation sits under a ``check``:

    claims.check("C02", "一批共享一次权重读取：每条请求的成本随批变小",
                 measured=speedup, predicted=predicted, expect=claims.ratio_between(0.5, 2.0),
                 measure=lambda attempt: remeasure(seed=attempt),
                 why_not="机器忙，或 L3 大到装下了整个模型")

prints one verdict line for the reader, ``✓ 本机成立：...`` or ``✗ 本机不成立：...``
with the numbers and what to try, and returns a ``Verdict``. In a reader's session
a check is one measurement and never raises, so "Run All" always reaches the end
of the notebook.

Strict mode (``TINYSERVE_CLAIMS=strict``, set by ``make test``) is for CI and decides
a timed claim by **two of three**, a rule fixed before anything is measured: the
value given is attempt 1, ``measure(2)`` and ``measure(3)`` are attempts 2 and 3,
and the claim holds when two attempts hold. Measuring stops as soon as the outcome
is decided (two held, or two failed). One more rule, fixed in advance too: an
attempt 1 that lands well inside the accepted band, a factor ``CLEAR`` (1.25) inside
each of its finite bounds, or in the middle half (log scale) of a band too narrow for
that (``Expect.clear``; a band with a bound at 0 or below has none), decides alone.
Re-measuring pays near a bound, where a busy moment can flip an attempt, more than
deep inside the band: a claim that holds clearly costs one measurement, one near its
bound two or three. A property that holds with probability p on one attempt, and
clearly with probability q, passes with probability
q + (p - q)(1 - (1 - p)^2) + (1 - p)p^2; with q = 0 that is two of three,
p^3 + 3p^2(1 - p): 0.5 for p = 0.5 (retrying until one attempt held passed 0.875),
0.97 for p = 0.9. Exact relations (``equals``, ``is_true``, a custom ``Expect``)
have no clear region: they always take two of three. ``measure(attempt)`` must
measure as much as attempt 1 did and independently of it (``attempt`` may seed it;
it must not grow the repetitions, nor aggregate over earlier attempts, nor change
state that later cells read: return values, and read the attempt the verdict reports
from ``Verdict.reported``). Every attempt is in the verdict line, in
``Verdict.history`` and in ``as_dict`` (``claims.json``).
A check without ``measure`` (an exact count, a functional property such as "no
request failed", arithmetic, the simulator) is one attempt in every mode: such a
property is never retried.

``TINYSERVE_CLAIMS_FORCE_FALSE=C02,C06`` turns those claims' verdicts to ✗ without
measuring anything differently: it shows what a reader sees when a claim does not
hold (and, in strict mode, that the claim fails).

``CHAPTER`` is the registry of the chapter's 24 claims in chapter order: the
section, a one-line paraphrase, the notebook that proves it and how. ``AUXILIARY``
holds the checks a notebook makes that are not the chapter's claims (A01, ...):
they print verdicts but stay out of the chapter's tables. A claim the registry
marks "stated" cannot be checked (it never prints ✓); a check of a "simulated"
claim without ``measure`` says 模拟 in its line, and is not counted as measured on
this machine. Notebook 00's table and the instructor guide are generated from the
registry (``markdown_table``); ``python -m tinyserve.book.make_claims``
(``make claims``) runs a fast check of every claim and prints the table for this
machine.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

STRICT_ENV = "TINYSERVE_CLAIMS"
FORCE_FALSE_ENV = "TINYSERVE_CLAIMS_FORCE_FALSE"
ATTEMPTS, NEEDED = 3, 2     # strict mode: a timed claim holds when NEEDED of ATTEMPTS attempts hold
CLEAR = 1.25                # ... or attempt 1 alone, this factor inside each bound (_narrowed)


# --------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class ChapterClaim:
    """One claim of the chapter: where it stands, what it says, where we test it.

    ``how``: "measured" (predicted, then measured on this machine), "simulated"
    (the same scheduler on the simulator's clock, the same result everywhere),
    "computed" (arithmetic from datasheet figures) or "stated" (the book says it;
    nothing here can measure it, ``note`` says why).
    """

    id: str
    section: str
    statement: str
    notebooks: tuple[str, ...]
    how: str
    note: str = ""


CHAPTER: tuple[ChapterClaim, ...] = (
    ChapterClaim("C01", "本章开头", "同一张卡、同一个模型，服务的吞吐可以差出三个数量级，差距来自软件而不是硬件",
                 ("01", "04"), "computed",
                 "屋顶线上 A100 + 7B 从每次一条到批开到交叉点相差约 150 倍；逐条且不用 KV 缓存再慢约 5 倍，"
                 "合起来接近三个数量级（`make claims` 按屋顶线算出）；01 第 1.6 节在本机量出“逐条且不用 KV 缓存”"
                 "对“KV 缓存 + 批处理”的差距（至少一个数量级），并用同一模型算出要多长的输出才到三个数量级"),
    ChapterClaim("C02", "先垫三块砖：批处理、调度、队列", "解码每步都要读一遍权重，一批请求共享这次读取，每条请求的成本随批变小",
                 ("01",), "measured"),
    ChapterClaim("C03", "先垫三块砖：批处理、调度、队列", "调度决定批里放谁：吞吐和延迟常常此消彼长",
                 ("01", "06"), "measured"),
    ChapterClaim("C04", "先垫三块砖：批处理、调度、队列", "到达率超过处理能力后，队列按 (λ−μ)t 增长，只有加机器或限流才能收住",
                 ("01", "06", "08"), "measured",
                 "01 用真实引擎在本机实测；06、08 和 `make claims` 用模拟器（各机相同）"),
    ChapterClaim("C05", "软件栈的四层", "推理软件从下往上分四层：CUDA、深度学习框架、推理引擎、编排层；一次调用在引擎层走几步、在框架层做几次前向，都数得出来",
                 ("07",), "measured"),
    ChapterClaim("C06", "kernel 与融合：少读写一次很值", "中间结果写回再读出浪费带宽：融合的加速比可以由少搬的字节数预测",
                 ("02",), "measured"),
    ChapterClaim("C07", "kernel 与融合：少读写一次很值", "带宽受限的阶段，收益来自少搬数据而不是算得更快（FlashAttention 不把分数矩阵写回内存）",
                 ("02",), "measured"),
    ChapterClaim("C08", "引擎在做什么", "连续批处理按步换人：写完的请求立刻离开，等着的请求立刻补上，块马上被复用",
                 ("03",), "measured"),
    ChapterClaim("C09", "批多大才划算", "A100 上 7B FP16：一步读权重约 6.9 ms，每条请求的计算约 45 µs，交叉点约 153",
                 ("04",), "computed"),
    ChapterClaim("C10", "批多大才划算", "交叉点以内加请求几乎不加时间，越过以后延迟随批线性上涨，所以引擎给批设上限",
                 ("01", "04"), "measured"),
    ChapterClaim("C11", "一次请求在引擎里的旅程", "分词在 CPU 上单线程进行，高并发时可能成为瓶颈",
                 ("05",), "measured"),
    ChapterClaim("C12", "一次请求在引擎里的旅程", "长提示词被切块、与解码同批；预填充完成时产出首字，之后进入解码循环",
                 ("00", "05"), "measured"),
    ChapterClaim("C13", "一次请求在引擎里的旅程", "流式反分词绝不发出半个字符",
                 ("05",), "measured"),
    ChapterClaim("C14", "一次请求在引擎里的旅程", "请求结束时块的引用计数减一，共享的块要等最后一个使用者离开才释放",
                 ("05",), "measured"),
    ChapterClaim("C15", "一次请求在引擎里的旅程", "任何一站卡住，用户看到的都是“慢”，所以先给每一站计时",
                 ("05", "07"), "measured"),
    ChapterClaim("C16", "调度：先来后到不够用", "先来先服务会造成队头阻塞：短请求被排在前面的长请求堵住",
                 ("06",), "simulated"),
    ChapterClaim("C17", "调度：先来后到不够用", "每种改法都有代价：分桶降低填充率，优先级会饿死请求，老化给饥饿设上界",
                 ("06",), "simulated"),
    ChapterClaim("C18", "调度：先来后到不够用", "分块预填充让解码的节奏不被长提示词打断，首字延迟也不至于失控",
                 ("05", "08"), "measured",
                 "05 用真实引擎在本机实测；08 和 `make claims` 用模拟器（各机相同）"),
    ChapterClaim("C19", "调度：先来后到不够用", "输入短输出长的负载适合解码优先，输入长输出短的适合预填充优先",
                 ("06",), "simulated",
                 "前一半成立；后一半在模拟器里不成立：解码优先加分块预填充的有效吞吐更高（06 的“本书说/这里测到”）"),
    ChapterClaim("C20", "三个引擎的取舍", "vLLM、SGLang、TensorRT-LLM 各有所长，功能正在趋同",
                 ("07",), "stated",
                 "要在同一张 GPU 上装好三个引擎并跑同一负载才能比较；本项目只对照它们的参数名和指标定义"),
    ChapterClaim("C21", "编排层：引擎之上还有一层", "缓存感知路由把同前缀的请求送到同一副本，省掉重复的预填充，降低首字延迟",
                 ("07",), "simulated"),
    ChapterClaim("C22", "编排层：引擎之上还有一层", "预填充与解码分离，两个池子可以各自扩缩",
                 ("07",), "simulated"),
    ChapterClaim("C23", "一次调参的判断顺序", "调优有顺序：先按症状定位慢在哪一段，再看批大小，再看缓存命中",
                 ("08",), "simulated"),
    ChapterClaim("C24", "一次调参的判断顺序", "模型层面的改动放在最后：系统卡在排队时，量化也救不了",
                 ("08",), "simulated"),
)


@dataclass(frozen=True)
class AuxiliaryCheck:
    """A check a notebook makes that is not one of the chapter's claims: a guard on its
    own set-up or on a number its prose uses. It prints a verdict like a claim, and stays
    out of the chapter's tables and counts."""

    id: str
    notebook: str
    statement: str


AUXILIARY: tuple[AuxiliaryCheck, ...] = (
    AuxiliaryCheck("A01", "00", "tiny-zh 在一个 CPU 线程上每一步只要几毫秒"),
    AuxiliaryCheck("A02", "01", "打开 enforce_eager=False 不会让解码变慢"),
    AuxiliaryCheck("A03", "04", "RTX 4090 上 7B fp16 的 KV 缓存分给交叉点那么多条请求，每条只剩一百多个 token"),
    AuxiliaryCheck("A04", "05", "三项步长模型（a + b·n + c·m）比直线更贴近标定的步长"),
    AuxiliaryCheck("A05", "05", "空闲的引擎上排队时间不到 1 毫秒"),
    AuxiliaryCheck("A06", "07", "对照表里 tinyserve 这一栏的参数和指标都真实存在"),
    AuxiliaryCheck("A07", "06", "只在一种长度形状上校准的模拟器，预测这台 CPU 上真 vLLM 其余形状的吞吐、TPOT 和 TTFT"),
)

BY_ID = {c.id: c for c in CHAPTER}
AUX_BY_ID = {c.id: c for c in AUXILIARY}


def chapter_claim(claim_id: str) -> ChapterClaim:
    try:
        return BY_ID[claim_id]
    except KeyError:
        raise ValueError(f"claim_id: unknown claim {claim_id!r}; the chapter's are "
                         f"{CHAPTER[0].id}..{CHAPTER[-1].id}") from None


def _checkable(claim_id: str) -> ChapterClaim | AuxiliaryCheck:
    """The registry entry a ``check`` may carry: a chapter claim that is not only stated,
    or an auxiliary check."""
    if claim_id in AUX_BY_ID:
        return AUX_BY_ID[claim_id]
    if claim_id not in BY_ID:
        raise ValueError(f"claim_id: unknown claim {claim_id!r}; the chapter's are "
                         f"{CHAPTER[0].id}..{CHAPTER[-1].id}, auxiliary checks "
                         f"{AUXILIARY[0].id}..{AUXILIARY[-1].id}")
    claim = BY_ID[claim_id]
    if claim.how == "stated":
        raise ValueError(f"claim_id: {claim_id} is stated by the book and cannot be checked here "
                         f"({claim.note}); give a check of our own an auxiliary id")
    return claim


HOW_ZH = {"measured": "本机实测", "simulated": "模拟器（各机相同）", "computed": "数据手册推算",
          "stated": "书中陈述，本机无法测量"}


GUIDE_BEGIN, GUIDE_END = "<!-- claims:begin -->", "<!-- claims:end -->"


def with_table(text: str, table: str) -> str:
    """``text`` with the block between the claims markers replaced by ``table``."""
    if GUIDE_BEGIN not in text or GUIDE_END not in text:
        raise ValueError(f"no {GUIDE_BEGIN} ... {GUIDE_END} block to fill")
    head, rest = text.split(GUIDE_BEGIN, 1)
    return head + GUIDE_BEGIN + "\n" + table + "\n" + GUIDE_END + rest.split(GUIDE_END, 1)[1]


def markdown_table(link: Callable[[str], str] | None = None) -> str:
    """The registry as a Markdown table (notebook 00, the instructor guide).

    ``link(notebook)`` returns the relative path of a notebook "NN" (a link is
    made of it), or None for plain numbers."""
    rows = ["| 编号 | 本书说（章节） | 在哪里验证 | 怎样验证 |", "| --- | --- | --- | --- |"]
    for c in CHAPTER:
        where = " ".join(f"[{nb}]({link(nb)})" if link and link(nb) else nb for nb in c.notebooks)
        how = HOW_ZH[c.how] + (f"：{c.note}" if c.note else "")
        rows.append(f"| {c.id} | {c.statement}（「{c.section}」） | {where} | {how} |")
    return "\n".join(rows)


def guide_table(guide_path) -> str:
    """The registry table with links from ``guide_path`` to the notebooks beside it."""
    from pathlib import Path

    chapter = Path(guide_path).resolve().parent.parent / "chapters" / "ch05_engine_and_scheduling"
    names = {p.name[:2]: p.name for p in chapter.glob("[0-9][0-9]_*.ipynb")}
    return markdown_table(lambda nb: f"../chapters/ch05_engine_and_scheduling/{names[nb]}" if nb in names else None)


# --------------------------------------------------------------------------- expectations


@dataclass(frozen=True)
class Expect:
    """An accepted relation: ``test(measured, predicted) -> bool`` and how to say it.

    ``inner`` is the same relation on the band's clear region (``_narrowed``; None: it
    has none); ``clear`` asks it."""

    test: Callable[[Any, Any], bool]
    text: str
    inner: Callable[[Any, Any], bool] | None = None

    def __call__(self, measured, predicted=None) -> bool:
        return _safely(self.test, measured, predicted)

    def clear(self, measured, predicted=None) -> bool:
        """Well inside the band: in its clear region (``_narrowed``)."""
        return self.inner is not None and _safely(self.inner, measured, predicted)


def _safely(test, measured, predicted) -> bool:
    try:
        return bool(test(measured, predicted))
    except (TypeError, ValueError, ZeroDivisionError):
        return False


def _narrowed(lo: float, hi: float) -> tuple[float, float] | None:
    """[lo, hi] narrowed at each finite bound by ``CLEAR``, or, for a band narrower than
    that allows, to its middle half on a log scale (an infinite bound stays); None when a
    finite bound is 0 or below (no factor moves it)."""
    if any(math.isfinite(b) and b <= 0 for b in (lo, hi)) or not lo < hi:
        return None
    factor = min(CLEAR, (hi / lo) ** 0.25) if math.isfinite(lo) and math.isfinite(hi) else CLEAR
    return (lo * factor if math.isfinite(lo) else lo), (hi / factor if math.isfinite(hi) else hi)


def _band(lo: float, hi: float, text: str, of=lambda m, p: m) -> Expect:
    """``lo <= of(measured, predicted) <= hi``, with its narrowed band as ``inner``."""
    def within(a, b):
        return lambda m, p: _finite(m) and _finite(of(m, p)) and a <= of(m, p) <= b
    narrow = _narrowed(lo, hi)
    return Expect(within(lo, hi), text, within(*narrow) if narrow else None)


def _finite(x) -> bool:
    """A finite number, numpy scalars included (not a tuple, a string or None)."""
    try:
        return not isinstance(x, (str, bytes)) and math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def between(lo: float, hi: float) -> Expect:
    return _band(lo, hi, f"in [{lo:g}, {hi:g}]")


def at_least(lo: float) -> Expect:
    return _band(lo, math.inf, f">= {lo:g}")


def at_most(hi: float) -> Expect:
    return _band(-math.inf, hi, f"<= {hi:g}")


def ratio_between(lo: float, hi: float) -> Expect:
    """measured / predicted within [lo, hi]."""
    return _band(lo, hi, f"measured/predicted in [{lo:g}, {hi:g}]",
                 lambda m, p: m / p if _finite(p) and p != 0 else math.nan)


def equals(expected=None) -> Expect:
    """measured == expected (or == predicted when expected is None)."""
    return Expect(lambda m, p: m == (p if expected is None else expected),
                  "equal to the prediction" if expected is None else f"== {expected!r}")


def is_true() -> Expect:
    return Expect(lambda m, p: m is True or (isinstance(m, bool) and m), "true")


# --------------------------------------------------------------------------- verdicts


class ClaimFailed(AssertionError):
    """A claim that failed in strict mode (for a timed claim: two of its three attempts)."""


class Attempt(NamedTuple):
    """One measurement of a claim and whether it held."""
    measured: Any
    predicted: Any
    holds: bool


@dataclass
class Verdict:
    """A claim's outcome. ``measured`` and ``predicted`` are those of attempt ``reported``
    (1-based): the first attempt on the side that won; ``history`` holds every attempt."""

    claim_id: str
    what: str
    holds: bool
    measured: Any
    predicted: Any
    expect: str
    why_not: str = ""
    forced: bool = False
    history: list[Attempt] = field(default_factory=list)
    reported: int = 1
    simulated: bool = False
    clear: bool = False          # strict mode: attempt 1 was well inside the band and decided alone

    @property
    def attempts(self) -> int:
        return len(self.history)

    @property
    def auxiliary(self) -> bool:
        return self.claim_id in AUX_BY_ID

    def line(self) -> str:
        numbers = _numbers(self.measured, self.predicted, self.expect)
        if self.attempts > 1:
            marks = "".join("✓" if a.holds else "✗" for a in self.history)
            numbers += (f"；三次取二 {marks}：measured "
                        + " / ".join(_fmt(a.measured) for a in self.history))
        elif self.clear:
            numbers += f"；远在范围之内（离每个界至少 {CLEAR:g} 倍，窄的范围取中间一半），一次即定"
        where = "模拟" if self.simulated else "本机"
        if self.holds:
            return f"✓ {where}成立 [{self.claim_id}]：{self.what}（{numbers}）"
        reason = "（强制为假：TINYSERVE_CLAIMS_FORCE_FALSE）" if self.forced else ""
        hint = f"\n    可能的原因与可以试的：{self.why_not}" if self.why_not else ""
        return f"✗ {where}不成立 [{self.claim_id}]：{self.what}（{numbers}）{reason}{hint}"

    def _ipython_display_(self):
        """Shown as the last line of a cell: nothing more, ``check`` printed the verdict."""

    def as_dict(self) -> dict:
        return {"claim": self.claim_id, "what": self.what, "holds": self.holds,
                "measured": _jsonable(self.measured), "predicted": _jsonable(self.predicted),
                "expect": self.expect, "forced": self.forced, "simulated": self.simulated,
                "auxiliary": self.auxiliary, "reported": self.reported, "clear": self.clear,
                "history": [{"measured": _jsonable(a.measured), "predicted": _jsonable(a.predicted),
                             "holds": a.holds} for a in self.history]}


def _fmt(x) -> str:
    if isinstance(x, bool) or x is None:
        return str(x)
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1e4 else f"{x:.4g}"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in x) + "]"
    return str(x)


def _numbers(measured, predicted, expect: str) -> str:
    parts = []
    if predicted is not None:
        parts.append(f"predicted {_fmt(predicted)}")
    parts.append(f"measured {_fmt(measured)}")
    parts.append(f"accepted: {expect}")
    return ", ".join(parts)


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


def strict() -> bool:
    return os.environ.get(STRICT_ENV, "").strip().lower() == "strict"


def forced_false() -> set[str]:
    return {s.strip() for s in os.environ.get(FORCE_FALSE_ENV, "").split(",") if s.strip()}


# Every verdict checked in this process, in order (the notebook's 本机验证 table).
RESULTS: list[Verdict] = []


def check(claim_id: str, what: str, measured, *, expect: Expect, predicted=None,
          measure: Callable[[int], Any] | None = None, why_not: str = "",
          simulated: bool | None = None, quiet: bool = False) -> Verdict:
    """Check one claim and print its verdict; in strict mode raise ``ClaimFailed`` if it fails.

    ``measured`` (and ``predicted``) is attempt 1. ``measure(attempt)``, for a timed claim
    only, measures again (attempt = 2, 3) as much as attempt 1 did and returns the new
    measured value, or a pair ``(measured, predicted)`` when the prediction is re-measured
    too; strict mode then decides by two of three (the module doc). ``simulated``: the
    numbers come from the simulator's clock, the same on every machine (default: the
    registry says "simulated" and there is no ``measure``).
    """
    _checkable(claim_id)
    if not isinstance(expect, Expect):
        raise ValueError("expect: use claims.between / at_least / at_most / ratio_between / equals / is_true")
    if simulated is None:
        simulated = measure is None and claim_id in BY_ID and BY_ID[claim_id].how == "simulated"
    force = claim_id in forced_false()
    history = [Attempt(measured, predicted, not force and expect(measured, predicted))]
    clear = strict() and measure is not None and history[0].holds and expect.clear(measured, predicted)
    if strict() and measure is not None and not force and not clear:
        while NEEDED > sum(a.holds for a in history) and NEEDED > sum(not a.holds for a in history):
            again = measure(len(history) + 1)
            m, p = again if isinstance(again, tuple) and len(again) == 2 else (again, predicted)
            history.append(Attempt(m, p, expect(m, p)))
    holds = sum(a.holds for a in history) >= min(NEEDED, len(history))
    reported = min(i for i, a in enumerate(history, 1) if a.holds == holds)
    chosen = history[reported - 1]
    verdict = Verdict(claim_id, what, holds, chosen.measured, chosen.predicted, expect.text,
                      why_not, force, history, reported, simulated, clear)
    RESULTS.append(verdict)
    if not quiet:
        print(verdict.line())
    if not holds and strict():
        tried = "; ".join(f"{'held' if a.holds else 'failed'}: measured {_fmt(a.measured)}"
                          + (f" vs {_fmt(a.predicted)}" if a.predicted is not None else "") for a in history)
        raise ClaimFailed(f"{claim_id} does not hold: {what} ({tried}; accepted: {expect.text})"
                          + (f". Likely reason: {why_not}" if why_not else ""))
    return verdict


def per_attempt(measure_once: Callable[[], Any]) -> Callable[[int], Any]:
    """One run of an experiment per attempt, shared by the claims that read it.

    ``again = per_attempt(rerun)`` gives ``again(attempt)``: the first claim that asks for
    attempt 2 (or 3) runs ``rerun()``, every later claim reads that same run. Several claims
    on one experiment then cost one re-run per attempt, and their attempt k is one
    experiment. ``rerun`` measures afresh, as much as the first run did, and returns what
    it measured instead of changing the notebook's state."""
    runs: dict[int, Any] = {}

    def again(attempt: int):
        if attempt not in runs:
            runs[attempt] = measure_once()
        return runs[attempt]

    return again


def summary(results: list[Verdict] | None = None) -> str:
    """The 本机验证 table of ``results`` (default: every check in this process): the chapter's
    claims measured here are counted apart from those on the simulator's clock and from the
    auxiliary checks."""
    results = RESULTS if results is None else results
    lines = ["本机验证（这台机器上本篇的论断）", f"{'claim':<5} {'verdict':<4} {'measured':>14} {'predicted':>14}  what"]
    for v in results:
        lines.append(f"{v.claim_id:<5} {'✓' if v.holds else '✗':<4} {_fmt(v.measured)[:14]:>14} "
                     f"{_fmt(v.predicted)[:14] if v.predicted is not None else '-':>14}  {v.what}")
    groups = (("模拟（各机相同）", [v for v in results if v.simulated and not v.auxiliary]),
              ("辅助检查（不是本章的论断）", [v for v in results if v.auxiliary]))
    here = [v for v in results if not v.simulated and not v.auxiliary]
    lines.append(f"{sum(v.holds for v in here)} of {len(here)} hold on this machine")
    lines += [f"{name}：{sum(v.holds for v in vs)} of {len(vs)} hold" for name, vs in groups if vs]
    return "\n".join(lines)
