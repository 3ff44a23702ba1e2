"""Every run time the docs state is generated from one record (``book/runtimes.py``).

``make execute`` records each notebook's wall time and the machine in
``data/notebook_runtimes.json`` and rewrites the README's two tables, notebook 00's map
and each chapter notebook's title from it. These tests fail when a doc was edited by
hand (or a notebook was added) and the generated text no longer matches.
"""

import json

import nbformat
import pytest

from tinyserve.book import runtimes

NOTEBOOKS = sorted(p.stem for p in runtimes.CHAPTER.glob("[0-9][0-9]_*.ipynb"))
LABS = sorted(p.stem for p in (runtimes.ROOT / "solutions").glob("lab[0-9][0-9]_*.ipynb"))


def test_the_record_times_every_notebook_and_lab_on_one_machine():
    data = runtimes.load()
    assert sorted(data["notebooks"]) == sorted(NOTEBOOKS + LABS)
    assert all(seconds > 0 for seconds in data["notebooks"].values())
    assert {"cpu", "cores", "l3_bytes", "gpu", "torch"} <= set(data["machine"])


def test_the_docs_state_the_recorded_run_times():
    assert runtimes.stale() == [], "run: python -m tinyserve.book.notebooks runtimes --write"


def test_every_notebook_has_a_run_time_in_every_table_and_title():
    """The generator rewrites what it finds; a table row or title it cannot find would stay
    stale unnoticed, so each must be there."""
    readme = runtimes.README.read_text(encoding="utf-8")
    zh, en = readme.split("## English", 1)
    overview = "\n".join(c.source for c in nbformat.read(runtimes.OVERVIEW, as_version=4).cells
                         if c.cell_type == "markdown")
    for where, text in (("README (中文)", zh), ("README (English)", en), ("00 map", overview)):
        rows = {}
        for line in text.splitlines():
            found = runtimes.NOTEBOOK.search(line) if line.startswith("|") else None
            if found:
                rows.setdefault(found.group(1), line)          # its row in the map: the first
        for stem in NOTEBOOKS + LABS:
            assert stem in rows and runtimes.FIGURE.search(rows[stem].rsplit("|", 2)[-2]), (where, stem)
    for stem in NOTEBOOKS:
        nb = nbformat.read(runtimes.CHAPTER / f"{stem}.ipynb", as_version=4)
        assert any("运行时间" in line and runtimes.FIGURE.search(line)
                   for c in nb.cells[:3] for line in c.source.splitlines()), stem
    assert readme.count(runtimes.MACHINE_BEGIN) == 2       # the machine under each language's tables


@pytest.mark.parametrize("seconds, zh, en", [(8.6, "约 9 秒", "~9 s"), (47, "约 45 秒", "~45 s"),
                                             (76, "约 75 秒", "~75 s"), (150.0, "约 2 分钟", "~2 min"),
                                             (200, "约 3 分钟", "~3 min")])
def test_run_times_are_rounded_as_a_reader_reads_them(seconds, zh, en):
    assert (runtimes.zh(seconds), runtimes.en(seconds)) == (zh, en)


def test_a_new_time_rewrites_only_the_last_cell_of_its_row(tmp_path):
    data = runtimes.load()
    data["notebooks"]["03_continuous_batching"] = 33.0
    text = ("| 03 | `03_continuous_batching.ipynb` | 约 5 秒 of prose stays | 约 3 分钟 |\n"
            "| lab01 | `labs/lab01_continuous_batching.ipynb` | 03 | 约 9 秒（答案版） |\n"
            "## English\n| 03 | `03_continuous_batching.ipynb` | ~5 s stays | ~3 min |")
    new = runtimes.readme_text(text, data)
    assert new.splitlines()[0] == "| 03 | `03_continuous_batching.ipynb` | 约 5 秒 of prose stays | 约 35 秒 |"
    assert new.splitlines()[1] == (f"| lab01 | `labs/lab01_continuous_batching.ipynb` | 03 | "
                                   f"{runtimes.zh(data['notebooks']['lab01_continuous_batching'])}（答案版） |")
    assert new.splitlines()[-1] == "| 03 | `03_continuous_batching.ipynb` | ~5 s stays | ~35 s |"


def test_recording_a_run_keeps_the_other_times_and_names_the_machine(tmp_path):
    path = tmp_path / "runtimes.json"
    machine = {"cpu": "AMD EPYC", "cores": 2, "l3_bytes": 2**25, "gpu": None, "torch": "x"}
    runtimes.record({"00_overview": 9.0, "01_batching_scheduling_queues": 100.0}, machine, path)
    data = runtimes.record({"00_overview": 11.0}, machine, path)
    assert data["notebooks"] == {"00_overview": 11.0, "01_batching_scheduling_queues": 100.0}
    other = runtimes.record({"00_overview": 7.0}, {**machine, "cpu": "Intel(R) Xeon(R)"}, path)
    assert other["notebooks"] == {"00_overview": 7.0}         # never two machines in one table
    assert json.loads(path.read_text(encoding="utf-8"))["machine"]["cpu"] == "Intel(R) Xeon(R)"
