"""An nbgrader course folder made from solutions/, for teachers grading on JupyterHub.

    python -m tinyserve.labs nbgrader COURSE [--solutions solutions]

writes ``COURSE/nbgrader_config.py`` and ``COURSE/source/<lab>/<lab>.ipynb`` (the
solution as ``build.nbgrader_source`` makes it: nbgrader's cell metadata, the
teacher-only cells dropped). Then, in COURSE, the usual nbgrader steps work:
``nbgrader generate_assignment lab01_continuous_batching`` releases exactly the
code of ``labs/lab01_continuous_batching.ipynb`` (the config sets our stub line),
and ``nbgrader autograde`` runs every cell under ``grade.CELL_TIMEOUT`` seconds.
"""

from pathlib import Path

from tinyserve.book.notebooks import KERNEL_QUIET, write
from tinyserve.labs.build import STUB, nbgrader_source, solution_notebooks
from tinyserve.labs.grade import CELL_TIMEOUT

CONFIG = f'''\
# Written by `python -m tinyserve.labs nbgrader` for the tinyserve labs.
c = get_config()  # noqa: F821 (nbgrader provides it)
# Release the same stub line as `make labs`, so labs/ and nbgrader's release agree.
c.ClearSolutions.code_stub = {{"python": {STUB!r}}}
# A student's endless loop fails its cell instead of holding up autograde.
c.Execute.timeout = {CELL_TIMEOUT}
# nbgrader's default (no history file) and no kernel start-up warnings a grader cannot act on.
c.Execute.extra_arguments = {["--HistoryManager.hist_file=:memory:", *KERNEL_QUIET]!r}
'''


def assignment_name(solution: Path) -> str:
    """nbgrader's assignment id for a solution notebook: its file name without .ipynb."""
    return solution.stem


def write_course(course, solutions="solutions"):
    """Write the config and one source assignment per solution; return the notebooks written."""
    course = Path(course)
    sources = solution_notebooks(solutions)
    if not sources:
        raise FileNotFoundError(f"no lab*.ipynb in {solutions}")
    course.mkdir(parents=True, exist_ok=True)
    (course / "nbgrader_config.py").write_text(CONFIG, encoding="utf-8")
    written = []
    for src in sources:
        dst = course / "source" / assignment_name(src) / src.name
        dst.parent.mkdir(parents=True, exist_ok=True)
        write(nbgrader_source(src), dst)
        written.append(dst)
    return written
