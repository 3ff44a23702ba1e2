"""Every figure the notebooks show, as plain functions of measured data.

Each function takes data (lists, dicts, step stats) and an optional matplotlib
``ax``, draws, and returns the axes, so notebooks, widgets and labs share them.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

# ---- notebook 01: batching, scheduling, queues ------------------------------------

# ---- notebook 03: continuous batching ------------------------------------------------
