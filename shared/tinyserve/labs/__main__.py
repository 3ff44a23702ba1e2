"""Command line for the lab tooling.

    python -m tinyserve.labs build [--solutions solutions --labs labs]
    python -m tinyserve.labs check [--solutions solutions --labs labs]
    python -m tinyserve.labs grade [--timeout SECONDS] NB...
    python -m tinyserve.labs nbgrader COURSE [--solutions solutions]
"""

import argparse
import sys

from tinyserve.labs.build import build_all, check_all
from tinyserve.labs.course import write_course
from tinyserve.labs.grade import CELL_TIMEOUT, format_table, grade_notebook


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tinyserve.labs")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in [
        ("build", "write labs/ from solutions/"),
        ("check", "fail if labs/ is stale or leaks a solution"),
    ]:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--solutions", default="solutions", help="folder of solution notebooks")
        p.add_argument("--labs", default="labs", help="folder of generated student notebooks")
    g = sub.add_parser("grade", help="run a student's notebook and print a score table")
    g.add_argument("notebooks", nargs="+", metavar="NB")
    g.add_argument("--timeout", type=int, default=CELL_TIMEOUT,
                   help=f"seconds a cell may run before it fails (default {CELL_TIMEOUT})")
    n = sub.add_parser("nbgrader", help="write an nbgrader course folder (config + source/) from solutions/")
    n.add_argument("course", metavar="COURSE", help="course folder to write (created if missing)")
    n.add_argument("--solutions", default="solutions", help="folder of solution notebooks")
    args = parser.parse_args(argv)

    if args.command == "build":
        for path in build_all(args.solutions, args.labs):
            print(f"wrote {path}")
        return 0

    if args.command == "check":
        problems = check_all(args.solutions, args.labs)
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print("labs/ is not up to date: run `make labs` (python -m tinyserve.labs build)", file=sys.stderr)
            return 1
        print(f"{args.labs}/ is up to date and leaks no solution")
        return 0

    if args.command == "nbgrader":
        written = write_course(args.course, args.solutions)
        for path in written:
            print(f"wrote {path}")
        print(f"next: cd {args.course} && nbgrader generate_assignment {written[0].parent.name} (one per lab)")
        return 0

    if args.timeout <= 0:
        parser.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    failed = 0
    for nb in args.notebooks:
        print(f"== {nb}")
        results = grade_notebook(nb, timeout=args.timeout)
        print(format_table(results))
        failed += sum(not r.passed for r in results) + (not results)
    # The table is the result; the exit status lets a script tell full marks (0) from not (1).
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
