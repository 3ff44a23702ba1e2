"""How long each notebook runs, recorded by ``make execute`` and written into the docs.

``make execute`` times every notebook it runs and keeps the seconds, with the machine
that ran them, in ``data/notebook_runtimes.json``. Every place that tells a reader how
long a notebook takes is generated from that one record, so none can drift:

* the title cell of each chapter notebook (the line with 运行时间);
* the chapter map of notebook 00 (its two tables, notebooks and labs);
* the README's two tables (Chinese and English) and the sentence under each that names
  the machine.

    python -m tinyserve.book.notebooks runtimes --write   # rewrite the docs from the record
    python -m tinyserve.book.notebooks runtimes --check   # exit 1 if a doc differs from it

A table row is found by the notebook's file name in it (``03_continuous_batching.ipynb``,
``lab01_...``); only its last cell's time is rewritten, the rest of the row is prose.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat

RECORD = Path(__file__).resolve().parent.parent / "data" / "notebook_runtimes.json"
ROOT = RECORD.parents[3]
CHAPTER = ROOT / "chapters" / "ch05_engine_and_scheduling"
README = ROOT / "README.md"
OVERVIEW = CHAPTER / "00_overview.ipynb"

# "约 9 秒", "约 2 分钟", "~9 s", "~2 min": the first one in a text is its run time.
FIGURE = re.compile(r"约\s*\d+(?:\.\d+)?\s*(?:秒|分钟)|~\d+(?:\.\d+)?\s*(?:s|min)\b")
NOTEBOOK = re.compile(r"(?<!\w)(\d\d_\w+|lab\d\d_\w+)\.ipynb")
MACHINE_BEGIN, MACHINE_END = "<!-- runtimes:machine -->", "<!-- /runtimes:machine -->"


def load(path: Path = RECORD) -> dict:
    """The record: {"machine": {...}, "notebooks": {stem: seconds}}."""
    return json.loads(path.read_text(encoding="utf-8"))


def record(seconds: dict[str, float], machine: dict, path: Path = RECORD) -> dict:
    """Merge ``seconds`` ({notebook stem: wall seconds}) into the record, with the machine
    that ran them now, and write it. A partial run (one notebook) keeps the others' times."""
    old = load(path) if path.exists() else {"notebooks": {}}
    if old.get("machine", {}).get("cpu") not in (None, machine.get("cpu")):
        old["notebooks"] = {}           # times from another machine would mix two machines in one table
    data = {"machine": machine, "notebooks": dict(sorted({**old["notebooks"], **seconds}.items()))}
    path.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    return data


def _rounded(seconds: float) -> tuple[int, bool]:
    """(value, in minutes): whole seconds below 20 s, fives below 90 s, whole minutes above."""
    if seconds < 20:
        return max(1, round(seconds)), False
    if seconds < 90:
        return 5 * round(seconds / 5), False
    return round(seconds / 60), True


def zh(seconds: float) -> str:
    value, minutes = _rounded(seconds)
    return f"约 {value} {'分钟' if minutes else '秒'}"


def en(seconds: float) -> str:
    value, minutes = _rounded(seconds)
    return f"~{value} {'min' if minutes else 's'}"


def machine_zh(machine: dict) -> str:
    l3 = f"，{machine['l3_bytes'] / 2**20:.0f} MiB L3" if machine.get("l3_bytes") else ""
    gpu = f"，GPU {machine['gpu']}" if machine.get("gpu") else ""
    return f"{machine['cpu']}，{machine['cores']} 核{l3}{gpu}，torch {machine['torch']}"


def machine_en(machine: dict) -> str:
    l3 = f", {machine['l3_bytes'] / 2**20:.0f} MiB L3" if machine.get("l3_bytes") else ""
    gpu = f", GPU {machine['gpu']}" if machine.get("gpu") else ""
    return f"{machine['cpu']}, {machine['cores']} cores{l3}{gpu}, torch {machine['torch']}"


def _rows(text: str, times: dict, say) -> str:
    """The first table row that names each recorded notebook (its row in the map; later tables
    only link to it), its last cell's time rewritten."""
    out, seen = [], set()
    for line in text.split("\n"):
        found = NOTEBOOK.search(line) if line.startswith("|") else None
        if found and found.group(1) in times and found.group(1) not in seen:
            seen.add(found.group(1))
            head, last = line.rstrip(" |").rsplit("|", 1)
            if FIGURE.search(last):
                line = head + "|" + FIGURE.sub(say(times[found.group(1)]), last, count=1) + " |"
        out.append(line)
    return "\n".join(out)


def _machine_block(text: str, sentence: str) -> str:
    if MACHINE_BEGIN not in text:
        return text
    head, rest = text.split(MACHINE_BEGIN, 1)
    return head + MACHINE_BEGIN + sentence + MACHINE_END + rest.split(MACHINE_END, 1)[1]


def readme_text(text: str, data: dict) -> str:
    """The README with both languages' tables and machine sentences from the record."""
    times, machine = data["notebooks"], data["machine"]
    zh_part, sep, en_part = text.partition("## English")
    zh_part = _machine_block(_rows(zh_part, times, zh),
                             f"运行时间是 `make execute` 在 {machine_zh(machine)} 上一次执行全部笔记本时记下的"
                             f"（含进程启动；记录在 `shared/tinyserve/data/notebook_runtimes.json`）")
    en_part = _machine_block(_rows(en_part, times, en),
                             f"Runtimes were recorded by one `make execute` of every notebook on {machine_en(machine)} "
                             f"(process start-up included; the record is `shared/tinyserve/data/notebook_runtimes.json`)")
    return zh_part + sep + en_part


def title_text(source: str, seconds: float) -> str:
    """A title cell's source with the time on its 运行时间 line from the record."""
    lines = source.split("\n")
    for i, line in enumerate(lines):
        if "运行时间" in line and FIGURE.search(line):
            lines[i] = FIGURE.sub(zh(seconds), line, count=1)
            break
    return "\n".join(lines)


def notebook_sources(data: dict) -> dict[Path, list[tuple[int, str]]]:
    """{notebook: [(cell index, generated source)]} for every markdown cell that states a run time:
    each chapter notebook's title (the first three cells) and notebook 00's map."""
    times, out = data["notebooks"], {}
    for path in sorted(CHAPTER.glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "markdown":
                continue
            new = cell.source
            if i < 3 and path.stem in times:
                new = title_text(new, times[path.stem])
            if path == OVERVIEW:
                new = _rows(new, times, zh)
            if new != cell.source:
                out.setdefault(path, []).append((i, new))
    return out


def stale(data: dict | None = None) -> list[str]:
    """Where a doc's run time differs from the record (empty when every copy is generated)."""
    data = data or load()
    problems = []
    if README.read_text(encoding="utf-8") != readme_text(README.read_text(encoding="utf-8"), data):
        problems.append("README.md")
    problems += [f"{path.name} cell {i}" for path, cells in notebook_sources(data).items() for i, _ in cells]
    return problems


def write(write_notebook, data: dict | None = None) -> list[str]:
    """Rewrite every doc's run times from the record, notebooks through ``write_notebook(nb,
    path)`` (the executor's, so the file format is the executor's); return what changed."""
    data = data or load()
    changed = []
    text = README.read_text(encoding="utf-8")
    if readme_text(text, data) != text:
        README.write_text(readme_text(text, data), encoding="utf-8")
        changed.append("README.md")
    for path, cells in notebook_sources(data).items():
        nb = nbformat.read(path, as_version=4)
        for i, source in cells:
            nb.cells[i].source = source
        write_notebook(nb, path)
        changed.append(path.name)
    return changed
