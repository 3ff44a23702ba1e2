"""Execute notebooks in place and keep them clean for git.

    python -m tinyserve.book.notebooks execute PATH...   (notebooks or folders)
    python -m tinyserve.book.notebooks runtimes --write  (run times in the docs from the record)
    python -m tinyserve.book.notebooks tags PATH...      (# NBVAL_* comments -> cell tags)

Chapters are committed with their outputs, so a reader sees the figures
without running anything. Executing rewrites each notebook with fresh outputs
and drops what only adds noise to diffs: widget state and per-cell timings.

nbval reads its per-cell options from a comment line (``# NBVAL_CHECK_OUTPUT``)
or from a cell tag (``nbval-check-output``); the tag keeps test plumbing out of
the code a reader sees, and ``tags`` turns the one into the other.

``execute`` records each notebook's wall time and the machine (``tinyserve.book.runtimes``)
and rewrites every run time the docs state from that record.
"""

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from tinyserve.book import runtimes

KERNEL_NAME = "python3"
CELL_TIMEOUT = 600  # seconds; notebooks aim for under a minute in total
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
KERNEL_QUIET = ["--IPKernelApp.log_level=ERROR"]
KERNELSPEC = {"name": KERNEL_NAME, "display_name": "Python 3 (ipykernel)", "language": "python"}


# nbval's comment markers and the cell tags it reads instead (nbval.plugin.metadata_tags).
NBVAL_TAGS = {marker: marker.lower().replace("_", "-") for marker in
              ("NBVAL_CHECK_OUTPUT", "NBVAL_IGNORE_OUTPUT", "NBVAL_SKIP", "NBVAL_RAISES_EXCEPTION")}


def markers_to_tags(nb):
    """Move every ``# NBVAL_*`` comment line of nb's code cells into a cell tag; return how many."""
    moved = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        kept, tags = [], list(cell.metadata.get("tags", []))
        for line in cell.source.split("\n"):
            tag = NBVAL_TAGS.get(line.strip().lstrip("#").strip()) if line.strip().startswith("#") else None
            if tag is None:
                kept.append(line)
                continue
            moved += 1
            if tag not in tags:
                tags.append(tag)
        if len(kept) != len(cell.source.split("\n")):
            cell.source = "\n".join(kept)
            cell.metadata["tags"] = tags
    return moved


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


def run(nb, cwd, allow_errors=False, timeout=CELL_TIMEOUT, **options):
    """Execute nb (in place) with the python3 kernel, cwd = the notebook's folder.

    ``options`` go to nbclient's NotebookClient (interrupt_on_timeout, hooks...).
    """
    client = NotebookClient(
        nb,
        kernel_name=KERNEL_NAME,
        timeout=timeout,
        allow_errors=allow_errors,
        record_timing=False,
        resources={"metadata": {"path": str(cwd)}},
        # The kernel's start-up warnings (plain-TCP transport) are not the reader's to act on.
        extra_arguments=KERNEL_QUIET,
        **options,
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
    rt = sub.add_parser("runtimes", help="the run times in the README and the notebooks, from the record")
    mode = rt.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite them from the record")
    mode.add_argument("--check", action="store_true", help="exit 1 if any differs from the record")
    tg = sub.add_parser("tags", help="turn # NBVAL_* comment lines into nbval's cell tags, in place")
    tg.add_argument("paths", nargs="+", metavar="PATH", help="notebook or folder")
    args = parser.parse_args(argv)

    if args.command == "tags":
        for path in find_notebooks(args.paths):
            nb = nbformat.read(path, as_version=4)
            moved = markers_to_tags(nb)
            if moved:
                write(nb, path)
                print(f"{moved:3d} marker(s) -> tags  {path}")
        return 0

    if args.command == "runtimes":
        if args.check:
            problems = runtimes.stale()
            for where in problems:
                print(f"stale run time: {where} (python -m tinyserve.book.notebooks runtimes --write)")
            return 1 if problems else 0
        for where in runtimes.write(write):
            print(f"rewrote the run times in {where}")
        return 0

    from tinyserve.measure import this_machine

    failed, timed = [], {}
    for path in find_notebooks(args.paths):
        try:
            seconds = execute_notebook(path)
        except Exception as e:  # report and go on: one broken notebook should not hide the others
            last_line = (str(e).strip().splitlines() or [""])[-1]
            print(f" FAILED    {path}: {type(e).__name__}: {last_line}")
            failed.append(path)
            continue
        print(f"{seconds:7.1f} s  {path}")
        timed[path.stem] = round(seconds, 1)
    if timed:
        runtimes.record(timed, this_machine().as_dict())
        for where in runtimes.write(write):
            print(f"rewrote the run times in {where}")
    if failed:
        print(f"{len(failed)} notebook(s) failed and were left unchanged", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
