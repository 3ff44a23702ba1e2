"""``make claims``: a fast check of every claim of the chapter on the machine at hand.

``CHECKS`` maps a claim id (C01..C24 but C20, which the book only states) to a function
that predicts, measures and returns the ``claims.check`` verdict, in chapter order
(``tinyserve.book.make_claims`` runs them). Two kinds, one module each:

* ``measured``: timed on this CPU; strict mode decides each by two of three attempts
  (or by one well inside its band);
* ``deterministic``: datasheet arithmetic, the simulator's clock, or exact counts of a
  real engine run: the same on every machine, never measured again.
"""

from __future__ import annotations

from typing import Callable

from tinyserve.book import claims
from tinyserve.book.chapter_checks.deterministic import (c01, c04, c05, c08, c09, c12, c13, c14, c16, c17,
                                                         c18, c19, c21, c22, c23, c24)
from tinyserve.book.chapter_checks.measured import c02, c03, c06, c07, c10, c11, c15

CHECKS: dict[str, Callable[[], claims.Verdict]] = {
    "C01": c01, "C02": c02, "C03": c03, "C04": c04, "C05": c05, "C06": c06, "C07": c07, "C08": c08,
    "C09": c09, "C10": c10, "C11": c11, "C12": c12, "C13": c13, "C14": c14, "C15": c15, "C16": c16,
    "C17": c17, "C18": c18, "C19": c19, "C21": c21, "C22": c22, "C23": c23, "C24": c24,
}
