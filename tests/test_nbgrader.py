"""Every lab round-trips through the real nbgrader, in a temporary course folder.

``python -m tinyserve.labs nbgrader COURSE`` writes the course; then nbgrader
itself releases each lab (``generate_assignment``) and grades two submissions
(``autograde``): the solution, which must get full marks, and our untouched
``labs/`` notebook, which must get zero on every check cell and fail nowhere
else. nbgrader's release must hold exactly the code of our ``labs/``.

One generate and one autograde run cover all labs (each lab's notebook runs
once per submission); about 1-2 minutes on 2 cores.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from tinyserve.labs.build import CHECK_TAG, solution_notebooks
from tinyserve.labs.course import assignment_name, write_course

nbgrader_api = pytest.importorskip("nbgrader.api", reason="nbgrader is a test dependency: pip install -e '.[dev]'")

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = solution_notebooks(ROOT / "solutions")
STUDENTS = {"solution": "source", "untouched": "labs"}  # student id -> where the submission comes from


def nbgrader(course, *args):
    """Run the nbgrader command line in the course folder; fail with its output."""
    # nbgrader runs the `alembic` script of this environment to create its gradebook.
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "shared"), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    course = tmp_path_factory.mktemp("course")
    write_course(course, ROOT / "solutions")
    nbgrader(course, "generate_assignment", "*", "--force")
    for src in SOLUTIONS:
        name = assignment_name(src)
        for student, origin in STUDENTS.items():
            dst = course / "submitted" / student / name / src.name
            dst.parent.mkdir(parents=True)
            from_ = course / "source" / name / src.name if origin == "source" else ROOT / "labs" / src.name
            shutil.copy(from_, dst)
    nbgrader(course, "autograde", "*", "--force")
    return course


def grades(course, solution, student):
    """{grade_id: (score, max_score)} that nbgrader's gradebook holds for one submission."""
    name = assignment_name(solution)
    with nbgrader_api.Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        sub = gb.find_submission_notebook(solution.stem, name, student)
        return {g.name: (g.score, g.max_score) for g in sub.grades}


def check_cells(nb):
    return [c for c in nb.cells if CHECK_TAG in c.metadata.get("tags", [])]


per_lab = pytest.mark.parametrize("solution", [pytest.param(p, id=p.stem) for p in SOLUTIONS])


@per_lab
def test_release_is_our_lab(course, solution):
    release = nbformat.read(course / "release" / assignment_name(solution) / solution.name, as_version=4)
    ours = nbformat.read(ROOT / "labs" / solution.name, as_version=4)
    assert [c.source for c in release.cells] == [c.source for c in ours.cells]
    assert [c.metadata.get("nbgrader", {}).get("grade_id") for c in release.cells] == \
        [c.metadata.get("nbgrader", {}).get("grade_id") for c in ours.cells]


@per_lab
def test_solution_gets_full_marks(course, solution):
    got = grades(course, solution, "solution")
    lab = nbformat.read(ROOT / "labs" / solution.name, as_version=4)
    assert sorted(got) == sorted(c.metadata.nbgrader.grade_id for c in check_cells(lab))
    assert all(score == top > 0 for score, top in got.values()), got


@per_lab
def test_untouched_lab_scores_zero_and_fails_only_in_check_cells(course, solution):
    got = grades(course, solution, "untouched")
    assert got and all(score == 0 for score, _ in got.values()), got
    graded = nbformat.read(course / "autograded" / "untouched" / assignment_name(solution) / solution.name,
                           as_version=4)
    outside = [f"cell {i}: {o.ename}" for i, c in enumerate(graded.cells) if c.cell_type == "code"
               and CHECK_TAG not in c.metadata.get("tags", [])
               for o in c.outputs if o.output_type == "error"]
    assert not outside, f"errors outside check cells: {outside}"
