"""Numbers in prose come from outputs: every quantity a markdown cell quotes must be found.

A markdown cell of a chapter notebook or a lab solution may quote three kinds of number
(issue 37 §1): a constant of the book or the chapter, arithmetic on such constants, or
what the notebook's own code prints. A printed number is best not copied at all (the prose
says "上面打印的…"), because the next execution on another machine prints another one.

This test extracts every number that carries a unit (ms, µs, 秒, GB/s, GiB, tok/s,
GFLOP/s, %, 倍, ×, ...) from each markdown cell and looks for it, in that order:

1. in ``BOOK``: the chapter's constants and a few hardware datasheet figures, each with its
   source, and ``ARITHMETIC``: results of arithmetic on them, each with its formula;
2. in the notebook's own code (for a lab, also its check modules in tinyserve/labs), where a
   number is written with its unit ("25 ms" in a string or comment) or is bare (a load
   factor, an SLO in seconds);
3. in the notebook's committed outputs, with or without a unit.

The book's named quantities (脊点, 交叉点, 拐点) are checked even without a unit and even in
words ("十几" is 11-19): against the chapter's 153 or a printed line that names them.

A number matches when the found value, in the prose's unit, rounds to what the prose wrote
(so "约 2.4 秒" matches a printed "ready in 2.43 s", but "约 10 秒" does not). A number
found nowhere fails the test, naming the notebook, the cell index (from 0) and the number.

Run times on a title's "运行时间" line and in notebook 00's map are checked against the
README by tests/test_runtimes.py and are left to it; a lab's "预计用时" is a planning estimate.
"""

import math
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted([*ROOT.glob("chapters/**/*.ipynb"), *ROOT.glob("solutions/*.ipynb")])

# unit -> (dimension, factor to the dimension's base unit)
UNITS = {
    "ns": ("time", 1e-9), "µs": ("time", 1e-6), "μs": ("time", 1e-6), "us": ("time", 1e-6),
    "微秒": ("time", 1e-6), "ms": ("time", 1e-3), "毫秒": ("time", 1e-3), "s": ("time", 1.0),
    "秒": ("time", 1.0), "min": ("time", 60.0), "分钟": ("time", 60.0),
    "KiB": ("bytes", 2**10), "MiB": ("bytes", 2**20), "GiB": ("bytes", 2**30),
    "KB": ("bytes", 1e3), "MB": ("bytes", 1e6), "GB": ("bytes", 1e9),
    "MB/s": ("bandwidth", 1e6), "GB/s": ("bandwidth", 1e9), "GiB/s": ("bandwidth", 2**30),
    "TB/s": ("bandwidth", 1e12), "Gb/s": ("bandwidth", 1e9 / 8),
    "GFLOP/s": ("flops", 1e9), "TFLOP/s": ("flops", 1e12), "TFLOPS": ("flops", 1e12),
    "tokens/s": ("token rate", 1.0), "token/s": ("token rate", 1.0), "tok/s": ("token rate", 1.0),
    "req/s": ("request rate", 1.0),
    "%": ("ratio", 0.01), "倍": ("ratio", 1.0), "×": ("ratio", 1.0), "x": ("ratio", 1.0),
}
_UNIT = "|".join(sorted((re.escape(u) for u in UNITS), key=len, reverse=True))
_NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?"
# A number, an optional range end ("0.7–2 倍"), a unit. Not "1/3" (the 3), not "x86",
# not "32 × 2048" (a product: the × is an operator there, not a unit).
QUANTITY = re.compile(rf"(?<![\w./]){_NUMBER}(?:\s*[–~-]\s*{_NUMBER})?\s?(?:{_UNIT})"
                      rf"(?![A-Za-z0-9/])")
PRODUCT = re.compile(r"\s*[\d$\\(]")  # what follows the × of "32 × 2048"
BARE = re.compile(rf"(?<![\w.]){_NUMBER}(?:[eE]-?\d+)?(?![\w.])")
TIME_WORDS = re.compile(r"(?i)time|ttft|tpot|itl|latency|e2e|slo|_s\b|seconds|secs|every|duration|interval")
BYTE_WORDS = re.compile(r"(?i)_(?:gib|mib|kib|gb|mb|bytes)\b")  # weight_gib=0.5
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)


def quantities(text):
    """(number as written, unit) for every quantity with a unit in ``text``."""
    for m in QUANTITY.finditer(text):
        unit = next(u for u in sorted(UNITS, key=len, reverse=True) if m.group(0).rstrip().endswith(u))
        if unit in ("×", "x") and PRODUCT.match(text, m.end()):
            continue
        for number in re.findall(_NUMBER, m.group(0)[: -len(unit)]):
            yield number, unit


# The chapter's constants and datasheet figures the notebooks quote: (value, unit, source).
BOOK = [
    (6.9, "ms", "chapter: an A100 reads a 7B FP16 model's 14 GB of weights in 6.9 ms"),
    (45, "µs", "chapter: one request's compute per decode step on an A100 (7B, FP16)"),
    (14, "GB", "chapter: 7B parameters x 2 bytes (FP16)"),
    (2039, "GB/s", "chapter: A100 80GB SXM memory bandwidth"),
    (312, "TFLOP/s", "chapter: A100 dense FP16 tensor-core peak"),
    # Datasheets, as tinyserve.hardware cites them beside each preset.
    (19.5, "TFLOP/s", "NVIDIA A100 datasheet: FP32 (non-tensor) peak"),
    (67, "TFLOP/s", "NVIDIA H100 SXM datasheet: FP32 peak"),
    (80, "GiB", "NVIDIA A100 80GB: its memory, '80GB' in the datasheet (tinyserve.hardware)"),
    (40, "GB", "NVIDIA A100 40GB: the product's name (tinyserve.hardware.A100_SXM_40GB)"),
    (81920, "MiB", "nvidia-smi's size of an A100 80GB (tinyserve.hardware, the comment on sizes)"),
    (24, "GiB", "NVIDIA RTX 4090: 24 GB of GDDR6X (tinyserve.hardware.RTX_4090)"),
    (24564, "MiB", "nvidia-smi's size of an RTX 4090 (tinyserve.hardware, the comment on sizes)"),
    (300, "GB/s", "NVIDIA L4 datasheet: memory bandwidth (tinyserve.hardware.L4)"),
    (512, "KiB", "KV cache per token of Llama-2-7B in FP16: 2 x 32 layers x 4096 x 2 bytes"),
    (25, "Gb/s", "a common Ethernet link speed"),
    # The machines this project has run on (each notebook's first output names its machine).
    (32, "MiB", "the AMD EPYC (Zen 5) VM's L3"),
    (480, "MiB", "the Intel Xeon VM's L3, as notebook 03's first output printed it"),
]
# Arithmetic on the constants above: (value, unit, formula).
ARITHMETIC = [
    (6.87, "ms", "14 GB / 2039 GB/s (the 6.9 ms unrounded)"),
    (44.9, "µs", "2 x 7e9 FLOP / 312 TFLOP/s (the 45 µs unrounded)"),
    (46.67, "ms", "14 GB / 300 GB/s: an L4 reads the 7B FP16 weights"),
    (13.89, "ms", "14 GB / 1008 GB/s: an RTX 4090 reads the 7B FP16 weights"),
    (72, "tok/s", "1 / 13.89 ms: one user's ceiling on an RTX 4090"),
    (84.7, "µs", "2 x 7e9 FLOP / 165.2 TFLOP/s: one request's compute on an RTX 4090"),
    (0.21, "ms", "8 requests x 101 tokens x 512 KiB / 2039 GB/s: their KV read on an A100"),
    (7.07, "ms", "6.87 ms + 0.21 ms: notebook 06's predicted step"),
    (0.36, "ms", "8 x 14 GFLOP / 312 TFLOP/s"),
    (400, "MB", "cpu-bench: about 1e8 parameters x 4 bytes (fp32)"),
    (128, "倍", "a K or V row holds head_dim = 128 numbers where a score is one"),
    (7, "MiB", "8 heads x 480 x 480 scores x 4 bytes (fp32) = 7.03 MiB"),
    (8, "KiB", "a row of 4096 fp16 numbers: 4096 x 2 bytes"),
    (128, "MiB", "32 layers x 1024 x 1024 fp32 numbers x 4 bytes"),
    (256, "GiB", "16 requests x 32768 tokens x 512 KiB of Llama-2-7B KV cache"),
    (67, "ms", "1500 tokens x 44.9 µs: a 1500-token prefill's compute on an A100 (7B FP16)"),
    (0.37, "s", "8192 tokens x 44.9 µs: a full 8192-token prefill step's compute on an A100 (7B FP16)"),
    (80, "秒", "2000 requests / 25 per second: notebook 06's overload workload arrives for 80 s"),
]


# The book's named dimensionless quantities: the prose word, the word the code prints, and the
# chapter's value (an A100 with a 7B FP16 model: 312 TFLOP/s / 2039 GB/s = 153 FLOP/byte, and
# with 2 bytes per parameter and 2 FLOPs per parameter the crossover batch is the same 153).
NAMED = {"脊点": ("ridge", 153), "交叉点": ("crossover", 153), "拐点": ("knee", None)}
# "脊点只有十几", "交叉点约 153", "交叉点…在二十几": a copula, then digits or a vague numeral.
NAMED_VALUE = re.compile(r"(脊点|交叉点|拐点)[^。；\n]{0,12}?(?:是|在|只有|约|大约|≈|=|为)\s*"
                         rf"({_NUMBER}|[一二三四五六七八九]?十几|几十|几百|一两百)(?![\d.]|\s*倍)")
VAGUE = {"几十": (20, 99), "几百": (200, 999), "一两百": (100, 200)}


def _interval(written):
    """The values a number written in the prose stands for: digits round, numerals span."""
    if written in VAGUE:
        return VAGUE[written]
    if written.endswith("十几"):
        tens = "一二三四五六七八九".find(written[0]) + 1 if len(written) == 3 else 1
        return (10 * tens + 1, 10 * tens + 9)
    decimals = len(written.split(".")[1]) if "." in written else 0
    value = float(written.replace(",", ""))
    return (value - 0.5 * 10**-decimals, value + 0.5 * 10**-decimals)


def _scale(unit):
    return UNITS[unit][1]


def _rounds_to(found, written):
    """True if ``found`` (in the prose's unit) rounds to the ``written`` number."""
    decimals = len(written.split(".")[1]) if "." in written else 0
    return math.isclose(round(found, decimals), float(written.replace(",", "")), abs_tol=1e-9)


class Haystack:
    """Where a notebook's prose may take its numbers from: its code and its outputs.

    A number printed with its unit counts for that unit's dimension. A bare number counts
    for a dimension only if its context names one: the same paragraph of output (a table's
    header carries the unit of its rows) or the same line of code. A ratio is often printed
    bare ("predicted 4.76, measured 6.63"), so a bare number always counts as a ratio. A bare
    integer (a batch size, a count, an index) never stands for a measurement.
    """

    def __init__(self, nb, modules=()):
        self.found = []  # (value in the base unit or bare, dimension, is_bare)
        self.named = {}  # "crossover" -> every number on a line that names it
        for module in modules:
            for line in module.read_text(encoding="utf-8").splitlines():
                self._add(line)
        for cell in nb.cells:
            if cell.cell_type != "code":
                continue
            for block in [*cell.source.splitlines(), *re.split(r"\n\s*\n", _output_text(cell))]:
                self._add(block)

    def _add(self, text):
        for line in text.splitlines():
            for english, _ in NAMED.values():
                if english in line.lower():
                    self.named.setdefault(english, []).extend(float(n.replace(",", "")) for n in BARE.findall(line))
        dims = {"ratio"} | {UNITS[u][0] for _, u in quantities(text)}
        if TIME_WORDS.search(text):
            dims.add("time")
        if BYTE_WORDS.search(text):
            dims.add("bytes")
        for number, unit in quantities(text):
            self.found.append((float(number.replace(",", "")) * _scale(unit), UNITS[unit][0], False))
        for number in BARE.findall(QUANTITY.sub(" ", text)):
            if "." not in number and "e" not in number.lower():
                continue  # a bare integer is a count or an index far more often than a measurement
            self.found.extend((float(number.replace(",", "")), dim, True) for dim in dims)

    def has_named(self, english, written):
        low, high = _interval(written)
        return any(low <= v <= high for v in self.named.get(english, []))

    def has(self, number, unit):
        dim, scale = UNITS[unit]
        # A bare number is in the prose's unit ("ms" column) or in the base unit (seconds, a fraction).
        return any(d == dim and (_rounds_to(v / scale, number) or (bare and _rounds_to(v, number)))
                   for v, d, bare in self.found)


def _output_text(cell):
    parts = []
    for out in cell.get("outputs", []):
        if "text" in out:
            parts.append(out["text"])
        for kind in ("text/plain", "text/markdown"):
            if kind in out.get("data", {}):
                parts.append(out["data"][kind])
    return "\n".join(parts)


def _in_book(number, unit):
    dim, scale = UNITS[unit]
    return any(UNITS[u][0] == dim and _rounds_to(v * _scale(u) / scale, number) for v, u, _ in BOOK + ARITHMETIC)


def _checked_prose(source, is_overview):
    """The markdown a reader reads as prose: no code, and no run times (tests/test_runtimes.py)."""
    lines = []
    for line in CODE.sub("", source).splitlines():
        if "预计用时" in line:
            continue  # a student's working time, an estimate for planning, not a measurement
        if "运行时间" in line:
            line = re.sub(r"约\s*\d+(?:\.\d+)?\s*(?:秒|分钟)", "", line, count=1)
        if is_overview and line.startswith("|") and re.search(r"\.ipynb\)", line):
            line = line.rstrip(" |").rsplit("|", 1)[0]
        lines.append(line)
    return "\n".join(lines)


def lab_modules(path):
    """A lab's checks live in the package (tinyserve/labs/lab03.py, lab03_machine.py): its code too."""
    match = re.match(r"lab(\d\d)_", path.name)
    return sorted((ROOT / "shared" / "tinyserve" / "labs").glob(f"lab{match.group(1)}*.py")) if match else []


def unfound(nb, is_overview=False, modules=()):
    """'cell i: number unit' for every quantity in the prose found nowhere."""
    haystack = Haystack(nb, modules)
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        prose = _checked_prose(cell.source, is_overview)
        for number, unit in quantities(prose):
            if not (_in_book(number, unit) or haystack.has(number, unit)):
                problems.append(f"cell {i}: {number} {unit}")
        for m in NAMED_VALUE.finditer(prose):
            english, book = NAMED[m.group(1)]
            low, high = _interval(m.group(2))
            if not ((book is not None and low <= book <= high) or haystack.has_named(english, m.group(2))):
                problems.append(f"cell {i}: {m.group(1)} {m.group(2)}")
    return problems


def _notebook(markdown, code="", output=""):
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell(code)
    if output:
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=output)]
    nb.cells = [nbformat.v4.new_markdown_cell(markdown), cell]
    return nb


def test_a_number_copied_from_an_older_run_is_caught():
    nb = _notebook("这里测到约 3 GFLOP/s，启动约 10 秒。", output="GEMM ... = 436.2 GFLOP/s\nready in 2.4 s")
    assert unfound(nb) == ["cell 0: 3 GFLOP/s", "cell 0: 10 秒"]


def test_a_named_quantity_in_words_is_caught():
    nb = _notebook("脊点只有十几；交叉点再乘 2，在二十几。A100 的交叉点约 153。",
                   output="ridge point F/BW = 4.6 FLOP/byte -> predicted crossover = 9.1")
    assert unfound(nb) == ["cell 0: 脊点 十几", "cell 0: 交叉点 二十几"]
    assert unfound(_notebook("脊点约 4.6，交叉点是几十。", output="ridge 4.62\ncrossover 23.1")) == []


def test_printed_numbers_match_at_the_precision_the_prose_wrote():
    nb = _notebook("启动约 2.4 秒，单步 25 ms，命中率 30%，加速 4.5 倍，B=1 到 B=8 是 1.23×。",
                   output="ready in 2.43 s\nstep 0.0251\nhit 0.296\nspeed-up 4.45x\nratio 1.23")
    assert unfound(nb) == []


def test_constants_products_and_run_times_are_not_quoted_numbers():
    nb = _notebook("**运行时间**：约 2 分钟。读权重 6.9 ms，每条 45 µs，2039 GB/s；32 × 2048 个 token。")
    assert unfound(nb) == []


def test_a_number_in_code_counts_only_with_its_unit_or_bare():
    assert unfound(_notebook("SLO 是 0.5 秒。", code="slo = 0.5")) == []
    assert unfound(_notebook("SLO 是 0.7 秒。", code="slo = 0.5  # seconds")) == ["cell 0: 0.7 秒"]


@pytest.mark.parametrize("path", [pytest.param(p, id=str(p.relative_to(ROOT))) for p in NOTEBOOKS])
def test_every_number_in_the_prose_is_printed_by_the_notebook_or_is_a_constant(path):
    problems = unfound(nbformat.read(path, as_version=4), is_overview=path.name.startswith("00_"),
                       modules=lab_modules(path))
    assert not problems, (f"{path.relative_to(ROOT)}: numbers in markdown found in no output, code or "
                          "BOOK/ARITHMETIC constant (point at the printed line instead):\n" + "\n".join(problems))


# "goodput 0.90 req/s, SLO met 8%, p99 TTFT 9.195 s, p99 TPOT 141.5 ms": one run of lab 07's capstone.
CAPSTONE_RUN = re.compile(r"goodput ([\d.]+) req/s, SLO met \d+%, p99 TTFT ([\d.]+) s, p99 TPOT ([\d.]+) ms")
# "| 批：`max_num_seqs` 8 → 128 | 0.90 | 9.20 s | 141.5 ms |": a row of the guide's reference path.
GUIDE_ROW = re.compile(r"^\|[^|]+\| ([\d.]+) \| ([\d.]+) s \| ([\d.]+) ms \|$", re.MULTILINE)


def test_the_guides_lab07_path_is_what_the_solution_printed():
    """The instructor guide's Lab 07 table, row by row: the baseline, then each step of the reference path."""
    nb = nbformat.read(ROOT / "solutions" / "lab07_capstone_tuning.ipynb", as_version=4)
    printed = []
    for cell in nb.cells:
        for run in CAPSTONE_RUN.findall(_output_text(cell) if cell.cell_type == "code" else ""):
            if not printed or printed[-1] != run:   # the baseline is shown twice
                printed.append(run)
    guide = (ROOT / "solutions" / "INSTRUCTOR.md").read_text(encoding="utf-8").split("### Lab 07", 1)[1]
    rows = GUIDE_ROW.findall(guide)
    assert len(rows) == len(printed) == 5, (rows, printed)
    for row, run in zip(rows, printed):
        assert all(_rounds_to(float(p), r) for r, p in zip(row, run)), f"guide {row} vs solution {run}"
