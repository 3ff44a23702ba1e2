"""Every notebook's run time is stated in four places, and they must agree.

The notebook's own title cell ("**运行时间**：……约 N 秒"), the chapter map of
notebook 00, and the two tables of the README (Chinese, then English). A
notebook's time changes when its experiments change; this test makes a stale
copy fail instead of leaving a reader with three different numbers. Labs are
stated in the README (twice) and in notebook 00's map.
"""

import re
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = ROOT / "chapters" / "ch05_engine_and_scheduling"
OVERVIEW = CHAPTER / "00_overview.ipynb"

# "约 9 秒", "约 2 分钟", "~9 s", "~2 min"; a range ("约 10–20 秒") states no single time.
FIGURE = re.compile(r"(?:约\s*(\d+(?:\.\d+)?)\s*(秒|分钟))|(?:~(\d+(?:\.\d+)?)\s*(s|min)\b)")


def seconds(text: str) -> float | None:
    """The first run time stated in ``text`` (in seconds), or None if there is none."""
    found = FIGURE.findall(text)
    if not found:
        return None
    zh, zh_unit, en, en_unit = found[0]
    value, unit = (float(zh), zh_unit) if zh else (float(en), en_unit)
    return value * 60 if unit in ("分钟", "min") else value


def table_times(markdown: str, name_pattern: str) -> dict[str, float | None]:
    """{name: seconds} from the last cell of the first table row that names each notebook or lab."""
    times = {}
    for line in markdown.splitlines():
        if not line.startswith("|"):
            continue
        match = re.search(name_pattern, line)
        if match and match.group(1) not in times:
            times[match.group(1)] = seconds(line.rstrip(" |").rsplit("|", 1)[-1])
    return times


def title_time(path: Path) -> float | None:
    """The run time in the notebook's opening cells (the line that says 运行时间)."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells[:3]:
        for line in cell.source.splitlines():
            if "运行时间" in line:
                return seconds(line)
    return None


def test_run_times_agree_everywhere():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    zh, en = readme.split("## English", 1) if "## English" in readme else (readme, "")
    overview = "\n".join(c.source for c in nbformat.read(OVERVIEW, as_version=4).cells
                         if c.cell_type == "markdown")
    notebook = r"(?<![\w/])(\d\d)_\w+\.ipynb"        # 03_continuous_batching.ipynb, not lab03_...
    lab = r"(lab\d\d)_\w+\.ipynb"
    sources = {"README (中文)": (zh, notebook, lab), "README (English)": (en, notebook, lab),
               "00 map": (overview, notebook, lab)}
    problems = []
    notebooks = sorted(CHAPTER.glob("[0-9][0-9]_*.ipynb"))
    stated = {p.name[:2]: title_time(p) for p in notebooks}
    for key, value in stated.items():
        if value is None:
            problems.append(f"notebook {key}: its title states no single run time ('约 N 秒', not a range)")
    labs = {}
    for where, (text, nb_pat, lab_pat) in sources.items():
        for key, value in table_times(text, nb_pat).items():
            if key in stated and value != stated[key]:
                problems.append(f"notebook {key}: {where} says {value} s, its title {stated[key]} s")
        for key, value in table_times(text, lab_pat).items():
            labs.setdefault(key, {})[where] = value
    for key, values in sorted(labs.items()):
        if len(set(values.values())) != 1 or None in values.values():
            problems.append(f"{key}: run times differ: {values}")
    assert not problems, "\n".join(problems)
