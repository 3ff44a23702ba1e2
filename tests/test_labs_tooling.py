"""Lab tooling: building labs from solutions, staleness checks, grading, strip.

The first half works on small notebooks made in tmp_path; the second half
checks the real solutions/ and labs/ of the repository.
"""

from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from tinyserve.labs.build import CHECK_POINTS, NBGRADER_SCHEMA, STUB, build_all, build_lab, check_all, nbgrader_source
from tinyserve.labs.grade import format_table, grade_notebook, timeout_hint
from tinyserve.book.notebooks import NBVAL_TAGS, WIDGET_VIEW, dumps, markers_to_tags, strip

ROOT = Path(__file__).resolve().parents[1]

SOLUTION_CELL = """\
def step(x):
    y = 1
    ### BEGIN SOLUTION
    z = x + y
    return z
    ### END SOLUTION

def other():
    for i in range(3):
        ### BEGIN SOLUTION
        print(i)
        ### END SOLUTION
    return 0"""

EXPECTED_LAB_CELL = f"""\
def step(x):
    y = 1
    {STUB}

def other():
    for i in range(3):
        {STUB}
    return 0"""


def make_solution():
    nb = new_notebook()
    nb.cells = [
        new_markdown_cell("# Lab 01\nWrite `step`."),
        new_code_cell(
            SOLUTION_CELL,
            execution_count=3,
            outputs=[new_output("stream", name="stdout", text="0\n1\n2\n")],
        ),
        new_code_cell("### BEGIN SOLUTION\nanswer = 42\n### END SOLUTION"),
        new_code_cell("from tinyserve.labs import check_step\ncheck_step(step)", execution_count=4),
        new_code_cell("def check_helper(x):\n    return x", metadata={"tags": ["keep"]}),
        new_code_cell("print(answer)", metadata={"tags": ["solution-only"]}),
    ]
    return nb


def save(nb, path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(nb), encoding="utf-8")
    return path


# ---- build_lab on a synthetic notebook -------------------------------------


def test_stub_replaces_each_solution_at_the_marker_indentation():
    lab = build_lab(make_solution(), "lab01_x.ipynb")
    assert lab.cells[1].source == EXPECTED_LAB_CELL
    assert lab.cells[2].source == STUB
    text = dumps(lab)
    assert "SOLUTION" not in text
    assert "x + y" not in text and "answer = 42" not in text


def test_build_clears_outputs_and_leaves_the_source_untouched():
    src = make_solution()
    lab = build_lab(src, "lab01_x.ipynb")
    for cell in lab.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
    assert src.cells[1].outputs and src.cells[1].source == SOLUTION_CELL


def test_check_cells_are_tagged_and_solution_only_cells_dropped():
    lab = build_lab(make_solution(), "lab01_x.ipynb")
    tags = [c.metadata.get("tags", []) for c in lab.cells]
    assert len(lab.cells) == 5  # the solution-only cell is gone
    assert "print(answer)" not in [c.source for c in lab.cells]
    assert tags[3] == ["check"]
    assert tags[4] == ["keep"]  # defining check_helper is not calling a check
    assert all("check" not in t for t in tags[:3])


def test_answer_and_check_cells_carry_nbgrader_metadata():
    lab = build_lab(make_solution(), "lab01_x.ipynb")
    meta = [c.metadata.get("nbgrader") for c in lab.cells]
    answer = {"grade": False, "locked": False, "schema_version": NBGRADER_SCHEMA, "solution": True, "task": False}
    assert meta[1] == {**answer, "grade_id": "step"}      # named after the first function it defines
    assert meta[2] == {**answer, "grade_id": "answer"}    # defines nothing
    assert meta[3] == {"grade": True, "grade_id": "check_step", "locked": True, "points": CHECK_POINTS,
                       "schema_version": NBGRADER_SCHEMA, "solution": False, "task": False}
    assert meta[0] is None and meta[4] is None           # prose, and a definition that is not a check call
    assert nbgrader_source(make_solution()).cells[1].metadata.nbgrader == meta[1]


def test_grade_ids_stay_unique_when_a_check_repeats():
    nb = make_solution()
    nb.cells.append(new_code_cell("check_step(step)"))
    ids = [c.metadata.nbgrader.grade_id for c in nbgrader_source(nb).cells if "nbgrader" in c.metadata]
    assert ids == ["step", "answer", "check_step", "check_step_cell6"]


def test_nbgrader_source_keeps_the_solution_but_drops_teacher_only_cells():
    src = nbgrader_source(make_solution(), "lab01_x.ipynb")
    assert src.cells[1].source == SOLUTION_CELL and src.cells[1].outputs
    assert "print(answer)" not in [c.source for c in src.cells]


@pytest.mark.parametrize(
    "source, problem",
    [
        ("x = 1\n### BEGIN SOLUTION\nx = 2", "without"),
        ("x = 1\n### END SOLUTION", "without"),
        ("### BEGIN SOLUTION\n### BEGIN SOLUTION\nx = 2\n### END SOLUTION\n### END SOLUTION", "nested"),
    ],
)
def test_unbalanced_or_nested_markers_name_notebook_and_cell(source, problem):
    nb = new_notebook(cells=[new_markdown_cell("intro"), new_code_cell(source)])
    with pytest.raises(ValueError, match=rf"lab07_bad\.ipynb: cell 1: .*{problem}"):
        build_lab(nb, "lab07_bad.ipynb")


def test_build_is_byte_identical_on_rebuild(tmp_path):
    save(make_solution(), tmp_path / "solutions" / "lab01_x.ipynb")
    first = build_all(tmp_path / "solutions", tmp_path / "labs_a")
    second = build_all(tmp_path / "solutions", tmp_path / "labs_b")
    a, b = first[0].read_bytes(), second[0].read_bytes()
    assert a == b and a.endswith(b"\n")
    build_all(tmp_path / "solutions", tmp_path / "labs_a")
    assert first[0].read_bytes() == a


def test_check_all_finds_stale_leaking_orphan_and_markerless(tmp_path):
    sols, labs = tmp_path / "solutions", tmp_path / "labs"
    save(make_solution(), sols / "lab01_x.ipynb")
    build_all(sols, labs)
    assert check_all(sols, labs) == []

    lab = labs / "lab01_x.ipynb"
    lab.write_text(lab.read_text(encoding="utf-8").replace("NotImplementedError", "ValueError"), encoding="utf-8")
    assert any("stale" in p for p in check_all(sols, labs))

    save(make_solution(), labs / "lab02_leak.ipynb")  # a solution copied by hand
    problems = check_all(sols, labs)
    assert any("lab02_leak" in p and "leaked" in p for p in problems)
    assert any("lab02_leak" in p and "no matching" in p for p in problems)

    save(new_notebook(cells=[new_code_cell("x = 1")]), sols / "lab03_open.ipynb")
    assert any("lab03_open" in p and "no '### BEGIN SOLUTION'" in p for p in check_all(sols, labs))


def test_build_all_removes_labs_without_solution(tmp_path):
    save(make_solution(), tmp_path / "solutions" / "lab01_x.ipynb")
    save(new_notebook(), tmp_path / "labs" / "lab09_gone.ipynb")
    build_all(tmp_path / "solutions", tmp_path / "labs")
    assert sorted(p.name for p in (tmp_path / "labs").iterdir()) == ["lab01_x.ipynb"]


# ---- notebooks.strip --------------------------------------------------------


def test_strip_removes_widget_state_and_timings_but_keeps_fallbacks():
    widget = {"model_id": "abc", "version_major": 2, "version_minor": 0}
    cell = new_code_cell(
        "slider",
        execution_count=1,
        metadata={"execution": {"iopub.status.busy": "2025-01-01"}, "ExecuteTime": {"end_time": "x"}, "tags": ["t"]},
        outputs=[
            new_output("display_data", data={WIDGET_VIEW: widget, "text/plain": "IntSlider(value=3)"}),
            new_output("display_data", data={WIDGET_VIEW: widget}),
            new_output("execute_result", data={"text/plain": "3"}, execution_count=1),
        ],
    )
    nb = new_notebook(cells=[cell], metadata={"widgets": {"state": {}}, "kernelspec": {"name": "venv-py", "display_name": "x"}})
    strip(nb)
    assert "widgets" not in nb.metadata
    assert nb.metadata.kernelspec.name == "python3"
    cell = nb.cells[0]
    assert dict(cell.metadata) == {"tags": ["t"]}
    assert [o.data for o in cell.outputs] == [{"text/plain": "IntSlider(value=3)"}, {"text/plain": "3"}]
    assert cell.execution_count == 1
    nbformat.validate(nb)


# ---- grading (starts a kernel) ---------------------------------------------


def test_grade_scores_check_cells_only(tmp_path):
    nb = new_notebook(
        cells=[
            new_code_cell("def check_ok():\n    pass\n\ndef check_bad():\n    raise AssertionError('hint: return a list')"),
            new_code_cell("check_ok()"),
            new_code_cell("1 / 0"),  # a student's error outside checks is not scored
            new_code_cell("check_bad()"),
            new_code_cell("x = 1\ncheck_ok()"),
        ]
    )
    results = grade_notebook(save(nb, tmp_path / "student.ipynb"))
    assert [(r.index, r.name, r.passed) for r in results] == [
        (1, "check_ok", True),
        (3, "check_bad", False),
        (4, "check_ok", True),
    ]
    assert results[1].error == "AssertionError: hint: return a list"
    assert format_table(results).endswith("score: 2/3")


def test_grade_keeps_both_lines_of_a_hint_and_exits_1_below_full_marks(tmp_path, capsys):
    from tinyserve.labs.__main__ import main
    nb = new_notebook(cells=[
        new_code_cell("def check_bad():\n    raise AssertionError('提示：返回列表\\nhint: return a list')"),
        new_code_cell("check_bad()"),
    ])
    path = save(nb, tmp_path / "student.ipynb")
    assert grade_notebook(path)[0].error == "AssertionError: 提示：返回列表 / hint: return a list"
    assert main(["grade", str(path)]) == 1
    assert "score: 0/1" in capsys.readouterr().out
    full = save(new_notebook(cells=[new_code_cell("def check_ok():\n    pass"), new_code_cell("check_ok()")]),
                tmp_path / "full.ipynb")
    assert main(["grade", str(full)]) == 0


def test_grade_interrupts_an_endless_loop_and_goes_on(tmp_path):
    nb = new_notebook(
        cells=[
            new_code_cell("def check_ok():\n    pass\n\ndef check_loop():\n    while True:\n        pass"),
            new_code_cell("check_loop()"),
            new_code_cell("check_ok()"),
        ]
    )
    results = grade_notebook(save(nb, tmp_path / "student.ipynb"), timeout=2)
    assert [(r.name, r.passed, r.error) for r in results] == [
        ("check_loop", False, timeout_hint(2)),
        ("check_ok", True, ""),
    ]
    assert "timed out after 2 s" in format_table(results)


def test_grade_rejects_a_non_positive_timeout(tmp_path):
    with pytest.raises(ValueError, match="timeout must be > 0 seconds, got 0"):
        grade_notebook(tmp_path / "missing.ipynb", timeout=0)


# ---- nbval's cell tags ------------------------------------------------------


def test_markers_become_the_tags_nbval_reads():
    from nbval.plugin import comment_markers, metadata_tags
    for marker, tag in NBVAL_TAGS.items():
        assert metadata_tags[tag] == comment_markers[marker]  # nbval treats both alike
    nb = new_notebook(cells=[
        new_code_cell("# NBVAL_CHECK_OUTPUT\nprint(1)", metadata={"tags": ["keep"]}),
        new_code_cell("x = 1  # NBVAL_SKIP is not a marker here\n#   NBVAL_SKIP  \ny = 2"),
        new_code_cell("print(2)"),
        new_markdown_cell("# NBVAL_SKIP"),
    ])
    assert markers_to_tags(nb) == 2
    assert [(c.source, c.metadata.get("tags")) for c in nb.cells[:3]] == [
        ("print(1)", ["keep", "nbval-check-output"]),
        ("x = 1  # NBVAL_SKIP is not a marker here\ny = 2", ["nbval-skip"]),
        ("print(2)", None),
    ]
    assert nb.cells[3].source == "# NBVAL_SKIP"  # prose is left alone
    assert markers_to_tags(nb) == 0


# ---- the repository's real labs ---------------------------------------------

SOLUTIONS = sorted((ROOT / "solutions").glob("lab*.ipynb"))
per_solution = pytest.mark.parametrize(
    "solution",
    [pytest.param(p, id=p.name) for p in SOLUTIONS]
    or [pytest.param(None, marks=pytest.mark.skip(reason="no solutions/lab*.ipynb in the repository yet"))],
)


def lab_of(solution):
    return ROOT / "labs" / solution.name


@per_solution
def test_lab_is_current(solution):
    lab = lab_of(solution)
    assert lab.exists(), f"{lab} is missing: run `make labs`"
    assert lab.read_text(encoding="utf-8") == dumps(build_lab(solution)), f"{lab} is stale: run `make labs`"


@per_solution
def test_lab_leaks_no_solution(solution):
    src = nbformat.read(solution, as_version=4)
    regions = sum(
        c.source.count("BEGIN SOLUTION")
        for c in src.cells
        if c.cell_type == "code" and "solution-only" not in c.metadata.get("tags", [])
    )
    assert regions > 0, f"{solution} has no '### BEGIN SOLUTION' region: nothing is left for students"
    text = lab_of(solution).read_text(encoding="utf-8")
    assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text
    lab = nbformat.reads(text, as_version=4)
    assert sum(c.source.count(STUB) for c in lab.cells) == regions


def test_every_lab_has_a_solution():
    orphans = [p.name for p in (ROOT / "labs").glob("lab*.ipynb") if not (ROOT / "solutions" / p.name).exists()]
    assert not orphans, f"labs without a source in solutions/: {orphans}"
