"""Execute notebooks in place and keep them clean for git.

    python -m tinyserve.book.notebooks execute PATH...   (notebooks or folders)

Chapters are committed with their outputs, so a reader sees the figures
without running anything. Executing rewrites each notebook with fresh outputs
and drops what only adds noise to diffs: widget state and per-cell timings.
"""

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

KERNEL_NAME = "python3"
CELL_TIMEOUT = 600  # seconds; notebooks aim for under a minute in total
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
KERNELSPEC = {"name": KERNEL_NAME, "display_name": "Python 3 (ipykernel)", "language": "python"}


def strip(nb):
    """Remove widget state and timing metadata; set the standard kernelspec.

    Widget views are useless without the saved state, and each output that
    holds one also carries a text/plain or image fallback, which is kept.
    """
    nb.metadata.pop("widgets", None)
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        cell.metadata.pop("ExecuteTime", None)
        if cell.cell_type != "code":
            continue
        kept = []
        for out in cell.outputs:
            data = out.get("data")
            if data is not None and WIDGET_VIEW in data:
                del data[WIDGET_VIEW]
                if not data:  # a bare widget view: nothing left to show
                    continue
            kept.append(out)
        cell.outputs = kept
    return nb


def dumps(nb):
    """A notebook's text, the same every time (nbformat's indent 1, trailing newline)."""
    text = nbformat.writes(nb)
    return text if text.endswith("\n") else text + "\n"


def write(nb, path):
    Path(path).write_text(dumps(nb), encoding="utf-8")


def run(nb, cwd, allow_errors=False, interrupt_on_timeout=False):
    """Execute nb (in place) with the python3 kernel, cwd = the notebook's folder."""
    client = NotebookClient(
        nb,
        kernel_name=KERNEL_NAME,
        timeout=CELL_TIMEOUT,
        allow_errors=allow_errors,
        interrupt_on_timeout=interrupt_on_timeout,
        record_timing=False,
        resources={"metadata": {"path": str(cwd)}},
    )
    return client.execute()


def execute_notebook(path):
    """Execute the notebook at path, rewrite it with outputs; return wall seconds."""
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    run(nb, path.parent)
    seconds = time.perf_counter() - start
    write(strip(nb), path)
    return seconds


def find_notebooks(paths):
    """Expand folders into their notebooks (sorted, checkpoints skipped)."""
    found = []
    for p in map(Path, paths):
        if p.is_dir():
            found += sorted(q for q in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in q.parts)
        elif p.suffix == ".ipynb" and p.exists():
            found.append(p)
        else:
            raise FileNotFoundError(f"not a notebook or folder: {p}")
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tinyserve.book.notebooks")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("execute", help="run notebooks in place, keep outputs")
    ex.add_argument("paths", nargs="+", metavar="PATH", help="notebook or folder")
    args = parser.parse_args(argv)

    failed = []
    for path in find_notebooks(args.paths):
        try:
            seconds = execute_notebook(path)
        except Exception as e:  # report and go on: one broken notebook should not hide the others
            last_line = (str(e).strip().splitlines() or [""])[-1]
            print(f" FAILED    {path}: {type(e).__name__}: {last_line}")
            failed.append(path)
            continue
        print(f"{seconds:7.1f} s  {path}")
    if failed:
        print(f"{len(failed)} notebook(s) failed and were left unchanged", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
