"""``python -m tinyserve ...``: the same as the ``tinyserve`` command."""

from tinyserve.cli import main

main()
