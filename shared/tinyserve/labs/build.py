"""Build student labs from solution notebooks, and check that labs/ is current.

solutions/labNN_*.ipynb is the only source. In its code cells, the student's
part sits between two marker lines (nbgrader's convention):

    ### BEGIN SOLUTION
    ...reference code...
    ### END SOLUTION

The lab gets one `raise NotImplementedError(...)` line instead, at the
marker's indentation, so the surrounding function still parses and fails
only when a check calls it.

Both the lab and the nbgrader source (`nbgrader_source`, written into a course
folder by `python -m tinyserve.labs nbgrader COURSE`) carry nbgrader's cell
metadata, derived here from the markers and the check calls, so that
`nbgrader generate_assignment` releases what `build_lab` writes and
`nbgrader autograde` scores the same check cells as `make grade`: a cell with
markers is an autograded answer, a cell calling `check_*` is a locked test
worth CHECK_POINTS.
"""

import copy
import re
from pathlib import Path

import nbformat

from tinyserve.book.notebooks import dumps, strip, write

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
STUB = 'raise NotImplementedError("在这里写你的代码 / write your code here")'
CHECK_TAG = "check"
SOLUTION_ONLY_TAG = "solution-only"
NBGRADER_SCHEMA = 3  # nbgrader 0.9's cell metadata version
CHECK_POINTS = 1

# A call of a check function, e.g. `check_step(fn)` or `labs.check_step(fn)`;
# `def check_x(` is a definition and `request.check_stop(` a method, not checks.
CHECK_CALL = re.compile(r"(?:(?<![\w.])|(?<=labs\.))(?<!def )(check_\w+)\s*\(")


def is_marker(line, marker):
    # Match on the words, so "# BEGIN SOLUTION" is treated as a marker too
    # rather than silently leaking the code after it.
    return marker.lstrip("# ") in line


def replace_solutions(source, where):
    """Replace each marked region of a cell's source by the stub line."""
    out = []
    inside = False
    for line in source.split("\n"):
        if is_marker(line, BEGIN):
            if inside:
                raise ValueError(f"{where}: nested '{BEGIN}'")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out.append(indent + STUB)
        elif is_marker(line, END):
            if not inside:
                raise ValueError(f"{where}: '{END}' without '{BEGIN}'")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{where}: '{BEGIN}' without '{END}'")
    return "\n".join(out)


def check_name(source):
    """Name of the first check function the source calls, or None."""
    m = CHECK_CALL.search(source)
    return m.group(1) if m else None


def is_check_cell(cell):
    return cell.cell_type == "code" and (
        CHECK_TAG in cell.metadata.get("tags", []) or check_name(cell.source) is not None
    )


def has_markers(nb):
    return any(c.cell_type == "code" and is_marker(c.source, BEGIN) for c in nb.cells)


# The first name a solution cell defines (`def retire(`, `class StreamDetokenizer(`).
DEFINED_NAME = re.compile(r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)", re.MULTILINE)


def nbgrader_cell(grade_id, *, solution):
    """nbgrader's metadata: an autograded answer (solution) or a locked, scored test."""
    meta = {"grade": not solution, "grade_id": grade_id, "locked": not solution,
            "schema_version": NBGRADER_SCHEMA, "solution": solution, "task": False}
    if not solution:
        meta["points"] = CHECK_POINTS
    return meta


def cell_role(cell):
    """("answer", base id) for a cell with markers, ("check", base id) for a check cell, or None."""
    if cell.cell_type != "code":
        return None
    if is_marker(cell.source, BEGIN):
        m = DEFINED_NAME.search(cell.source)
        return "answer", m.group(1) if m else "answer"
    if is_check_cell(cell):
        return "check", check_name(cell.source) or "check"
    return None


def nbgrader_source(src_nb, name=None):
    """The solution notebook as an nbgrader source: teacher-only cells dropped, every
    answer and check cell carrying nbgrader metadata (unique, stable grade ids), the
    check cells tagged. Raises ValueError on unbalanced markers."""
    src_nb, name = _read(src_nb, name)
    nb = copy.deepcopy(src_nb)  # the caller's notebook stays untouched
    cells, used = [], set()
    for index, cell in enumerate(nb.cells):
        tags = cell.metadata.get("tags", [])
        if SOLUTION_ONLY_TAG in tags:
            continue
        if cell.cell_type == "code":
            replace_solutions(cell.source, f"{name}: cell {index}")  # validates the markers
        cell.metadata.pop("nbgrader", None)
        role = cell_role(cell)
        if role is not None:
            kind, base = role
            grade_id = base if base not in used else f"{base}_cell{index}"
            used.add(grade_id)
            cell.metadata["nbgrader"] = nbgrader_cell(grade_id, solution=kind == "answer")
            if kind == "check" and CHECK_TAG not in tags:
                cell.metadata["tags"] = tags + [CHECK_TAG]
        cells.append(cell)
    nb.cells = cells
    return nb


def build_lab(src_nb, name=None):
    """Return the student version of a solution notebook (a path or a NotebookNode)."""
    src_nb, name = _read(src_nb, name)
    nb = nbgrader_source(src_nb, name)
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            cell.source = replace_solutions(cell.source, f"{name}: cell {index}")
            cell.outputs = []
            cell.execution_count = None
    return strip(nb)


def _read(src_nb, name):
    if not isinstance(src_nb, nbformat.NotebookNode):
        return nbformat.read(src_nb, as_version=4), name or Path(src_nb).name
    return src_nb, name or "<notebook>"


def solution_notebooks(solutions):
    return sorted(Path(solutions).glob("lab*.ipynb"))


def build_all(solutions="solutions", labs="labs"):
    """Write labs/<name> for every solutions/lab*.ipynb; return the paths written.

    Labs whose solution is gone are removed: labs/ is generated, never edited.
    """
    labs = Path(labs)
    labs.mkdir(parents=True, exist_ok=True)
    sources = solution_notebooks(solutions)
    written = []
    for src in sources:
        dst = labs / src.name
        write(build_lab(src), dst)
        written.append(dst)
    names = {s.name for s in sources}
    for orphan in sorted(labs.glob("lab*.ipynb")):
        if orphan.name not in names:
            orphan.unlink()
            print(f"removed {orphan} (no solution for it)")
    return written


def check_all(solutions="solutions", labs="labs"):
    """Return a list of problems (empty when labs/ is current and leak-free)."""
    problems = []
    sources = solution_notebooks(solutions)
    for src in sources:
        nb = nbformat.read(src, as_version=4)
        if not has_markers(nb):
            problems.append(f"{src}: no '{BEGIN}' markers: the lab would give the answer away")
        dst = Path(labs) / src.name
        if not dst.exists():
            problems.append(f"{dst}: missing")
        elif dst.read_text(encoding="utf-8") != dumps(build_lab(nb, src.name)):
            problems.append(f"{dst}: stale (differs from a fresh build of {src})")
    names = {s.name for s in sources}
    for lab in sorted(Path(labs).glob("lab*.ipynb")):
        text = lab.read_text(encoding="utf-8")
        if "BEGIN SOLUTION" in text or "END SOLUTION" in text:
            problems.append(f"{lab}: contains solution markers (a solution leaked)")
        if lab.name not in names:
            problems.append(f"{lab}: no matching {Path(solutions) / lab.name}")
    return problems
