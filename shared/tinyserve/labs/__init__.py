"""Classroom labs: build student notebooks from solutions, check them, grade them.

The check functions that lab notebooks call (check_*) live in the checks*
modules and are re-exported here, so a lab writes `from tinyserve.labs import check_...`.
"""

from tinyserve.labs.checks import *  # noqa: F401,F403  labs 01-04
from tinyserve.labs.checks_policies import *  # noqa: F401,F403  lab 05
from tinyserve.labs.checks_routing import *  # noqa: F401,F403  lab 06
from tinyserve.labs.checks_capstone import *  # noqa: F401,F403  lab 07
