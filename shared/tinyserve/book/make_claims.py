"""``make claims``: every claim of the chapter checked on this machine, one table and
``claims.json``.

    python -m tinyserve.book.make_claims [--only C02,C06] [--strict] [--json PATH]
    python -m tinyserve.book.make_claims --guide solutions/INSTRUCTOR.md

It runs the checks of ``tinyserve.book.chapter_checks`` in chapter order; a claim the
book only states gets a line of its own and no verdict. The table counts the claims
measured here apart from those on the simulator's clock and the datasheet arithmetic.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from tinyserve.book import chapter_checks, claims
from tinyserve.book.claims import CHAPTER, ChapterClaim, Verdict


def run_chapter(only: set[str] | None = None) -> list[tuple[ChapterClaim, Verdict | None]]:
    """Every chapter claim (or those in ``only``) with its verdict; None for a stated one."""
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
        except claims.ClaimFailed:      # strict mode: the verdict is recorded, go on to the next claim
            rows.append((c, claims.RESULTS[-1]))
    return rows


def _kind(c: ChapterClaim, v: Verdict | None) -> str:
    """How this run decided the claim: measured here, simulated, computed, or stated."""
    if v is None:
        return "stated"
    return "simulated" if v.simulated else ("computed" if c.how == "computed" else "measured")


def chapter_table(rows) -> str:
    lines = ["", "本章 24 个论断在这台机器上的结论", f"{'claim':<5} {'':<2} {'how':<10} statement"]
    for c, v in rows:
        mark = "—" if v is None else ("✓" if v.holds else "✗")
        lines.append(f"{c.id:<5} {mark:<2} {_kind(c, v):<10} {c.statement}")
    counts = []
    for kind, zh in (("measured", "本机实测"), ("simulated", "模拟（各机相同）"), ("computed", "数据手册推算")):
        vs = [v for c, v in rows if _kind(c, v) == kind]
        if vs:
            counts.append(f"{zh} {sum(v.holds for v in vs)} of {len(vs)} hold")
    stated = sum(v is None for _, v in rows)
    lines.append("; ".join(counts + ([f"书中陈述 {stated}"] if stated else [])))
    return "\n".join(lines)


def main(argv=None) -> int:
    from tinyserve.measure import this_machine

    parser = argparse.ArgumentParser(prog="python -m tinyserve.book.make_claims",
                                     description="Check every claim of the chapter on this machine.")
    parser.add_argument("--json", metavar="PATH", default="claims.json",
                        help="where to write the verdicts with the machine and versions (default claims.json)")
    parser.add_argument("--only", default="", help="comma-separated claim ids, e.g. C02,C06")
    parser.add_argument("--guide", metavar="PATH",
                        help="rewrite the claims table of the instructor guide at PATH from the registry, then stop")
    parser.add_argument("--strict", action="store_true",
                        help="decide each timed claim by two of three attempts (or by one well inside "
                             "its band); exit 1 if any claim fails")
    args = parser.parse_args(argv)
    if args.guide:
        guide = Path(args.guide)
        guide.write_text(claims.with_table(guide.read_text(encoding="utf-8"), claims.guide_table(guide)),
                         encoding="utf-8")
        print(f"wrote the claims table into {guide}")
        return 0
    only = {s.strip() for s in args.only.split(",") if s.strip()} or None
    for claim_id in only or ():
        claims.chapter_claim(claim_id)
    if args.strict:
        os.environ[claims.STRICT_ENV] = "strict"
    machine = this_machine()
    print(machine)
    started = time.perf_counter()
    rows = run_chapter(only)
    failed = [f"{v.claim_id} does not hold: {v.what} (measured "
              + ", ".join(str(a.measured) for a in v.history) + f"; accepted: {v.expect})"
              for _, v in rows if v is not None and not v.holds]
    seconds = time.perf_counter() - started
    print(chapter_table(rows))
    print(f"checked in {seconds:.0f} s")
    report = {"machine": machine.as_dict(), "python": platform.python_version(), "seconds": seconds,
              "rule": (f"strict: {claims.NEEDED} of {claims.ATTEMPTS} attempts, or attempt 1 alone "
                       "well inside the band (claims.CLEAR)") if args.strict else "one attempt",
              "claims": [{"id": c.id, "section": c.section, "statement": c.statement, "how": c.how,
                          "kind": _kind(c, v), "verdict": None if v is None else v.as_dict()} for c, v in rows],
              "failed": failed}
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(report, f, ensure_ascii=False, indent=1)
    print(f"wrote {args.json}")
    return 1 if args.strict and failed else 0


if __name__ == "__main__":
    # Run through the imported module, so that the checks and this entry point share one
    # ClaimFailed class and one RESULTS list (not this file's __main__ copy).
    from tinyserve.book.make_claims import main as imported_main

    raise SystemExit(imported_main())
