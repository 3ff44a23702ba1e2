"""The chapter's claims, each checked on the machine at hand.

A notebook sentence that states a measured relation sits under a ``check``:

    claims.check("C02", "一批共享一次权重读取：每条请求的成本随批变小",
                 measured=speedup, predicted=predicted, expect=claims.ratio_between(0.5, 2.0),
                 measure=lambda attempt: remeasure(repeats=5 * attempt),
                 why_not="机器忙，或 L3 大到装下了整个模型")

prints one verdict line for the reader, ``✓ 本机成立：...`` or ``✗ 本机不成立：...``
with the numbers and what to try, and returns a ``Verdict``. In a reader's session
a check never raises, so "Run All" always reaches the end of the notebook.

Strict mode (``TINYSERVE_CLAIMS=strict``, set by ``make test``) is for CI: a
failing claim is measured again with ``measure(attempt)`` (attempt = 1, 2, ...,
asked to use more repetitions each time) and fails with ``ClaimFailed`` only when
every attempt fails, so one unlucky run on a busy machine is not a failure, and a
property that is really gone is.

``TINYSERVE_CLAIMS_FORCE_FALSE=C02,C06`` turns those claims' verdicts to ✗ without
measuring anything differently: it shows what a reader sees when a claim does not
hold (and, in strict mode, that the claim fails).

``CHAPTER`` is the registry of the chapter's 24 claims in chapter order: the
section, a one-line paraphrase, the notebook that proves it and how. Notebook 00's
table and the instructor guide are generated from it (``markdown_table``), and
``python -m tinyserve.book.claims`` (``make claims``) runs a fast measurement of
every one (``tinyserve.book.chapter_checks``) and prints the chapter's verdict
table for this machine.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

STRICT_ENV = "TINYSERVE_CLAIMS"
FORCE_FALSE_ENV = "TINYSERVE_CLAIMS_FORCE_FALSE"
RETRIES = 2          # strict mode: measurements after the first before a claim fails


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
    ChapterClaim("C01", "本章开头", "同一张卡、同一个模型，服务的吞吐可以差出几个数量级，差距来自软件而不是硬件",
                 ("01", "04"), "computed",
                 "屋顶线上 A100 + 7B 从每次一条到批开到交叉点相差约 150 倍；逐条且不用 KV 缓存再差一个量级，"
                 "三个数量级要连同不复用 KV 的实现一起算（`make claims` 按屋顶线算出至少两个数量级；"
                 "01 和 04 只量出其中批处理的那一段）"),
    ChapterClaim("C02", "先垫三块砖：批处理、调度、队列", "解码每步都要读一遍权重，一批请求共享这次读取，每条请求的成本随批变小",
                 ("01",), "measured"),
    ChapterClaim("C03", "先垫三块砖：批处理、调度、队列", "调度决定批里放谁：吞吐和延迟常常此消彼长",
                 ("01", "06"), "measured"),
    ChapterClaim("C04", "先垫三块砖：批处理、调度、队列", "到达率超过处理能力后，队列按 (λ−μ)t 增长，只有加机器或限流才能收住",
                 ("01", "06", "08"), "measured"),
    ChapterClaim("C05", "软件栈的四层", "推理软件分四层，下面两层（引擎与 kernel）决定一次调用实际做了几步、几次前向",
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
                 ("05", "08"), "measured"),
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

BY_ID = {c.id: c for c in CHAPTER}


def chapter_claim(claim_id: str) -> ChapterClaim:
    try:
        return BY_ID[claim_id]
    except KeyError:
        raise ValueError(f"claim_id: unknown claim {claim_id!r}; the chapter's are "
                         f"{CHAPTER[0].id}..{CHAPTER[-1].id}") from None


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
    """An accepted relation: ``test(measured, predicted) -> bool`` and how to say it."""

    test: Callable[[Any, Any], bool]
    text: str

    def __call__(self, measured, predicted=None) -> bool:
        try:
            return bool(self.test(measured, predicted))
        except (TypeError, ValueError, ZeroDivisionError):
            return False


def _finite(x) -> bool:
    """A finite number, numpy scalars included (not a tuple, a string or None)."""
    try:
        return not isinstance(x, (str, bytes)) and math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def between(lo: float, hi: float) -> Expect:
    return Expect(lambda m, p: _finite(m) and lo <= m <= hi, f"in [{lo:g}, {hi:g}]")


def at_least(lo: float) -> Expect:
    return Expect(lambda m, p: _finite(m) and m >= lo, f">= {lo:g}")


def at_most(hi: float) -> Expect:
    return Expect(lambda m, p: _finite(m) and m <= hi, f"<= {hi:g}")


def ratio_between(lo: float, hi: float) -> Expect:
    """measured / predicted within [lo, hi]."""
    return Expect(lambda m, p: _finite(m) and _finite(p) and p != 0 and lo <= m / p <= hi,
                  f"measured/predicted in [{lo:g}, {hi:g}]")


def equals(expected=None) -> Expect:
    """measured == expected (or == predicted when expected is None)."""
    return Expect(lambda m, p: m == (p if expected is None else expected),
                  "equal to the prediction" if expected is None else f"== {expected!r}")


def is_true() -> Expect:
    return Expect(lambda m, p: m is True or (isinstance(m, bool) and m), "true")


# --------------------------------------------------------------------------- verdicts


class ClaimFailed(AssertionError):
    """A claim that failed every measurement in strict mode."""


@dataclass
class Verdict:
    claim_id: str
    what: str
    holds: bool
    measured: Any
    predicted: Any
    expect: str
    attempts: int = 1
    why_not: str = ""
    forced: bool = False
    history: list = field(default_factory=list)

    def line(self) -> str:
        numbers = _numbers(self.measured, self.predicted, self.expect)
        retried = f"，测了 {self.attempts} 次" if self.attempts > 1 else ""
        if self.holds:
            return f"✓ 本机成立 [{self.claim_id}]：{self.what}（{numbers}{retried}）"
        reason = "（强制为假：TINYSERVE_CLAIMS_FORCE_FALSE）" if self.forced else ""
        hint = f"\n    可能的原因与可以试的：{self.why_not}" if self.why_not else ""
        return f"✗ 本机不成立 [{self.claim_id}]：{self.what}（{numbers}{retried}）{reason}{hint}"

    def _ipython_display_(self):
        """Shown as the last line of a cell: nothing more, ``check`` printed the verdict."""

    def as_dict(self) -> dict:
        return {"claim": self.claim_id, "what": self.what, "holds": self.holds,
                "measured": _jsonable(self.measured), "predicted": _jsonable(self.predicted),
                "expect": self.expect, "attempts": self.attempts, "forced": self.forced}


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
          retries: int = RETRIES, quiet: bool = False) -> Verdict:
    """Check one claim; print its verdict; in strict mode raise ``ClaimFailed`` only
    after ``retries`` more measurements all failed.

    ``measure(attempt)`` measures again (attempt = 1, 2, ...; use more repetitions
    for larger attempts) and returns the new measured value, or a pair
    ``(measured, predicted)`` when the prediction is re-measured too.
    """
    chapter_claim(claim_id)
    if not isinstance(expect, Expect):
        raise ValueError("expect: use claims.between / at_least / at_most / ratio_between / equals / is_true")
    force = claim_id in forced_false()
    holds = (not force) and expect(measured, predicted)
    history = [(measured, predicted)]
    attempts = 1
    if not holds and not force and strict() and measure is not None:
        for attempt in range(1, retries + 1):
            again = measure(attempt)
            measured, predicted = again if isinstance(again, tuple) and len(again) == 2 else (again, predicted)
            history.append((measured, predicted))
            attempts += 1
            if expect(measured, predicted):
                holds = True
                break
    verdict = Verdict(claim_id, what, holds, measured, predicted, expect.text, attempts,
                      why_not, force, history)
    RESULTS.append(verdict)
    if not quiet:
        print(verdict.line())
    if not holds and strict():
        tried = "; ".join(f"measured {_fmt(m)}" + (f" vs {_fmt(p)}" if p is not None else "")
                          for m, p in history)
        raise ClaimFailed(f"{claim_id} does not hold: {what} ({tried}; accepted: {expect.text})"
                          + (f". Likely reason: {why_not}" if why_not else ""))
    return verdict


def summary(results: list[Verdict] | None = None) -> str:
    """The 本机验证 table of ``results`` (default: every check in this process)."""
    results = RESULTS if results is None else results
    lines = ["本机验证（这台机器上本篇的论断）", f"{'claim':<5} {'verdict':<4} {'measured':>14} {'predicted':>14}  what"]
    for v in results:
        lines.append(f"{v.claim_id:<5} {'✓' if v.holds else '✗':<4} {_fmt(v.measured)[:14]:>14} "
                     f"{_fmt(v.predicted)[:14] if v.predicted is not None else '-':>14}  {v.what}")
    held = sum(v.holds for v in results)
    lines.append(f"{held} of {len(results)} hold on this machine")
    return "\n".join(lines)


# --------------------------------------------------------------------------- make claims


def run_chapter(only: set[str] | None = None) -> list[tuple[ChapterClaim, Verdict | None]]:
    """A fast measurement of every chapter claim on this machine (``chapter_checks``);
    a claim the book only states gets ``None``."""
    from tinyserve.book import chapter_checks

    rows = []
    for c in CHAPTER:
        if only and c.id not in only:
            continue
        if c.how == "stated":
            print(f"— 书中陈述 [{c.id}]：{c.statement}（本机无法测量：{c.note}）")
            rows.append((c, None))
            continue
        try:
            rows.append((c, chapter_checks.CHECKS[c.id]()))
        except ClaimFailed:             # strict mode: the verdict is recorded, go on to the next claim
            rows.append((c, RESULTS[-1]))
    return rows


def chapter_table(rows) -> str:
    lines = ["", "本章 24 个论断在这台机器上的结论", f"{'claim':<5} {'':<2} {'how':<10} statement"]
    for c, v in rows:
        mark = "—" if v is None else ("✓" if v.holds else "✗")
        lines.append(f"{c.id:<5} {mark:<2} {c.how:<10} {c.statement}")
    verdicts = [v for _, v in rows if v is not None]
    lines.append(f"{sum(v.holds for v in verdicts)} of {len(verdicts)} measurable claims hold here; "
                 f"{len(rows) - len(verdicts)} stated only")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    import json
    import platform
    import time

    from tinyserve.measure import this_machine

    parser = argparse.ArgumentParser(prog="python -m tinyserve.book.claims",
                                     description="Check every claim of the chapter on this machine.")
    parser.add_argument("--json", metavar="PATH", default="claims.json",
                        help="where to write the verdicts with the machine and versions (default claims.json)")
    parser.add_argument("--only", default="", help="comma-separated claim ids, e.g. C02,C06")
    parser.add_argument("--guide", metavar="PATH",
                        help="rewrite the claims table of the instructor guide at PATH from the registry, then stop")
    parser.add_argument("--strict", action="store_true",
                        help="re-measure a failing claim, then exit 1 if any still fails")
    args = parser.parse_args(argv)
    if args.guide:
        from pathlib import Path

        guide = Path(args.guide)
        guide.write_text(with_table(guide.read_text(encoding="utf-8"), guide_table(guide)), encoding="utf-8")
        print(f"wrote the claims table into {guide}")
        return 0
    only = {s.strip() for s in args.only.split(",") if s.strip()} or None
    for claim_id in only or ():
        chapter_claim(claim_id)
    if args.strict:
        os.environ[STRICT_ENV] = "strict"
    machine = this_machine()
    print(machine)
    started = time.perf_counter()
    rows = run_chapter(only)
    failed = [f"{v.claim_id} does not hold: {v.what} (measured {_fmt(v.measured)}; accepted: {v.expect})"
              for _, v in rows if v is not None and not v.holds]
    seconds = time.perf_counter() - started
    print(chapter_table(rows))
    print(f"checked in {seconds:.0f} s")
    report = {"machine": machine.as_dict(), "python": platform.python_version(), "seconds": seconds,
              "claims": [{"id": c.id, "section": c.section, "statement": c.statement, "how": c.how,
                          "verdict": None if v is None else v.as_dict()} for c, v in rows],
              "failed": failed}
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(report, f, ensure_ascii=False, indent=1)
    print(f"wrote {args.json}")
    return 1 if args.strict and failed else 0


if __name__ == "__main__":
    # Run through the imported module, so that chapter_checks and this entry point share
    # one ClaimFailed class and one RESULTS list (not this file's __main__ copy).
    from tinyserve.book.claims import main as imported_main

    raise SystemExit(imported_main())
