"""Classroom labs: build student notebooks from solutions, check them, grade them.

The check functions that lab notebooks call (check_*) live in one module per lab
(lab01 ... lab07, sharing the hints of ``tinyserve.labs.hints``) and are
re-exported here, so a lab writes `from tinyserve.labs import check_...`.
"""

from tinyserve.labs.lab01 import *  # noqa: F401,F403  continuous batching
from tinyserve.labs.lab02 import *  # noqa: F401,F403  fused add + RMSNorm
from tinyserve.labs.lab03 import *  # noqa: F401,F403  the batch-size crossover
from tinyserve.labs.lab03_machine import *  # noqa: F401,F403  lab 03 on the student's machine
from tinyserve.labs.lab04 import *  # noqa: F401,F403  stream detokenizer
from tinyserve.labs.lab05 import *  # noqa: F401,F403  priority with aging
from tinyserve.labs.lab06 import *  # noqa: F401,F403  cache-aware routing
from tinyserve.labs.lab07 import *  # noqa: F401,F403  capstone
