"""The chapter's claim table is generated from one registry (``book.claims.CHAPTER``):
the instructor guide holds exactly the generated table, and notebook 00 displays it
from the registry instead of keeping a copy of its own."""

import inspect
from pathlib import Path

import nbformat

from tinyserve.book import chapter_checks, claims

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "solutions" / "INSTRUCTOR.md"
OVERVIEW = ROOT / "chapters" / "ch05_engine_and_scheduling" / "00_overview.ipynb"


def test_the_instructor_guide_holds_the_registry_table():
    text = GUIDE.read_text(encoding="utf-8")
    block = text.split(claims.GUIDE_BEGIN, 1)[1].split(claims.GUIDE_END, 1)[0].strip()
    assert block == claims.guide_table(GUIDE), (
        "the guide's claims table is stale: run python -m tinyserve.book.make_claims --guide solutions/INSTRUCTOR.md")


def test_a_measured_claim_whose_check_runs_on_the_simulator_says_where_it_is_measured():
    """The table says 本机实测 for a claim the registry marks measured; where `make claims`
    checks it on the simulator's clock instead, the note must say which notebook measures it
    here and what is simulated (C04, C18), or the table claims more than was measured."""
    for c in claims.CHAPTER:
        check = chapter_checks.CHECKS.get(c.id)
        if c.how == "measured" and check is not None and "simulated=True" in inspect.getsource(check):
            assert "本机实测" in c.note and "模拟器" in c.note, c.id


def test_every_link_of_the_generated_table_names_a_notebook():
    table = claims.guide_table(GUIDE)
    for c in claims.CHAPTER:
        for nb in c.notebooks:
            assert any(p.name.startswith(f"{nb}_") for p in OVERVIEW.parent.glob("*.ipynb")), nb
    for target in (part.split(")")[0] for part in table.split("](")[1:]):
        assert (GUIDE.parent / target).resolve().exists(), target


def test_notebook_00_shows_the_table_from_the_registry():
    nb = nbformat.read(OVERVIEW, as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code" and "claims.markdown_table" in c.source]
    assert len(cells) == 1
    shown = "".join(o.get("data", {}).get("text/markdown", "") for o in cells[0].outputs)
    assert all(f"| {c.id} |" in shown for c in claims.CHAPTER), "re-execute notebook 00 (make execute)"


def test_a_claim_forced_false_prints_its_verdict_and_the_notebook_goes_on(monkeypatch):
    # A reader's session (not strict) with A01 forced false: notebook 00 prints the ✗ line,
    # raises nowhere and reaches its last code cell.
    from tinyserve.book.notebooks import run

    monkeypatch.delenv(claims.STRICT_ENV, raising=False)
    monkeypatch.setenv(claims.FORCE_FALSE_ENV, "A01")       # the kernel inherits this process's environment
    nb = nbformat.read(OVERVIEW, as_version=4)
    run(nb, OVERVIEW.parent, allow_errors=True)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for c in code for o in c.outputs if o.output_type == "stream")
    assert "✗ 本机不成立 [A01]" in text and "强制为假" in text
    assert code[-1].outputs, "the last code cell did not run"
