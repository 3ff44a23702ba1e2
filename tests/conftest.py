"""Session-wide test setup."""

import os

# First of all: on a machine without a GPU, tinyserve.kernels sets TRITON_INTERPRET=1
# before Triton is imported. transformers imports Triton too, and a Triton imported
# first would ignore the variable (every kernel test would then fail on a CPU).
import tinyserve.kernels  # noqa: F401


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (``make test``): one worker per core that other programs leave free; with
    one free core, no workers at all (one process, as without xdist). A worker keeps to its
    own core, and one that a busy program shares would time that program too: beside a
    spinning process on 2 cores, 05's and 01's timed claims failed that way."""
    if not hasattr(os, "sched_setaffinity"):
        return 0                  # workers could not keep to cores of their own (macOS, Windows)
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None               # the reader's own number: xdist reads it
    from tinyserve.host import free_cores
    free = free_cores(sample=1.0)
    return free if free > 1 else 0


def pytest_configure(config):
    """Under pytest-xdist (``make test`` runs one worker per core), each worker keeps to
    cores of its own, and so do the notebook kernels and servers it starts (they inherit
    the affinity). Workers that shared cores would time each other: a torch op split over
    threads waits for its slowest thread, and ``host.free_cores`` could count a core as
    free just before the other worker takes it back."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    mine = cpus[int(worker.removeprefix("gw")) % len(cpus)::workers] or cpus
    os.sched_setaffinity(0, mine)
    import torch
    torch.set_num_threads(len(mine))


# The files that take longest in `make test` (each a minute or more of one worker on a 2-core
# AMD EPYC), first: pytest-xdist hands out files in collection order, and a long file handed
# out last keeps one worker busy while the other has nothing left to do.
LONGEST_FIRST = ("06_scheduling_policies.ipynb", "test_nbgrader.py", "test_kernels_aot.py",
                 "test_fidelity.py", "test_cost_model.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))     # stable: the rest keep their order
