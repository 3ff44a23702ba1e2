"""``python -m tinyserve.book.site build|check``; see the package docstring."""

import argparse
import sys

from tinyserve.book.site.build import LAB_URL, main_build
from tinyserve.book.site.check import main_check


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tinyserve.book.site",
                                     description="Build the companion's website, or check a built one.")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the site into BUILD_DIR/html (warnings are errors)")
    b.add_argument("--build-dir", default="_build", help="where src/, doctrees/ and html/ go (default _build)")
    b.add_argument("--teacher", action="store_true", help="include the lab answers and the instructor guide")
    b.add_argument("--pages", nargs="+", metavar="PAGE",
                   help="only these pages besides the README (repository-relative paths)")
    b.add_argument("--lab-url", default=LAB_URL,
                   help=f"where 在 JupyterLab 中打开 points, a notebook's path appended (default {LAB_URL})")
    c = sub.add_parser("check", help="check the links, images and search index of a built site")
    c.add_argument("html", nargs="?", default="_build/html")
    args = parser.parse_args(argv)
    return main_build(args) if args.command == "build" else main_check(args)


if __name__ == "__main__":
    sys.exit(main())
