"""Grade a student's lab: run it, then score its check cells.

A check cell passes when it ran without raising. Errors are allowed while
running, so one failing exercise does not hide the score of the others.
A check that measures something (lab 07's goodput) prints a line starting
with ``score:``; the table shows the last such line of each check cell.

Every cell runs under a time limit (CELL_TIMEOUT seconds, ``--timeout``): a
student's endless loop is interrupted, its cell fails with a hint, and the
grading goes on, so a whole notebook takes at most cells x limit.
"""

from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbclient.exceptions import DeadKernelError

from tinyserve.labs.build import check_name, is_check_cell
from tinyserve.book.notebooks import run


@dataclass
class CheckResult:
    index: int  # cell index in the notebook
    name: str  # the check function called, or the cell's first line
    passed: bool
    error: str  # "" when passed
    detail: str = ""  # the cell's last printed "score: ..." line, if any


SCORE_PREFIX = "score:"
# Seconds per cell: the slowest solution cell takes a few seconds on a 2-core CPU.
CELL_TIMEOUT = 60
TIMED_OUT = "CellTimeoutError"  # the error a cell gets when its time is up


def timeout_hint(seconds):
    return (f"超时：{seconds} 秒内没有结束，可能有一个永远不结束的循环 / "
            f"timed out after {seconds} s: is there a loop that never ends?")


def short_error(cell, limit=300):
    """'Type: message' of the cell's error output on one line, or ''. Every line of the
    message is kept (our hints have a Chinese and an English line), joined by ' / '."""
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            lines = [l.strip() for l in str(out.get("evalue", "")).splitlines() if l.strip()]
            text = f"{out.get('ename', 'Error')}: {' / '.join(lines)}".rstrip(": ")
            return text if len(text) <= limit else text[: limit - 1] + "…"
    return ""


def score_line(cell):
    """The last line of the cell's printed output that starts with 'score:', or ''."""
    found = ""
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream" and out.get("name") == "stdout":
            for line in str(out.get("text", "")).splitlines():
                if line.startswith(SCORE_PREFIX):
                    found = line[len(SCORE_PREFIX):].strip()
    return found


def grade_notebook(path, timeout=CELL_TIMEOUT):
    """Execute the notebook at path and return one CheckResult per check cell."""
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    died, timed_out = "", set()

    def note_timeout(cell, cell_index, execute_reply):
        if execute_reply and execute_reply["content"].get("ename") == TIMED_OUT:
            timed_out.add(cell_index)

    try:
        # A cell over its time is interrupted (the kernel stays up for the next one).
        run(nb, path.parent, allow_errors=True, timeout=timeout, interrupt_on_timeout=True,
            error_on_timeout={"ename": TIMED_OUT, "evalue": timeout_hint(timeout), "traceback": []},
            on_cell_executed=note_timeout)
    except DeadKernelError as e:
        died = f"not run: kernel died ({e})"

    results = []
    for index, cell in enumerate(nb.cells):
        if not is_check_cell(cell):
            continue
        first_line = next((s for s in cell.source.splitlines() if s.strip()), "")
        name = check_name(cell.source) or first_line.strip()
        error = timeout_hint(timeout) if index in timed_out else short_error(cell)
        if not error and cell.get("execution_count") is None:
            error = died or "not run"
        results.append(CheckResult(index, name, not error, error, score_line(cell)))
    return results


def format_table(results):
    """The score table as text, ending with the total."""
    if not results:
        return "no check cells found\nscore: 0/0"
    width = max(len("check"), *(len(r.name) for r in results))
    lines = [f"{'cell':>4}  {'check':<{width}}  result  error"]
    for r in results:
        lines.append(f"{r.index:>4}  {r.name:<{width}}  {'PASS' if r.passed else 'FAIL':<6}  {r.error}")
    lines += [f"{r.index:>4}  {r.name:<{width}}  score: {r.detail}" for r in results if r.detail]
    passed = sum(r.passed for r in results)
    lines.append(f"score: {passed}/{len(results)}")
    return "\n".join(lines)
