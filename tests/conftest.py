"""Session-wide test setup."""

# First of all: on a machine without a GPU, tinyserve.kernels sets TRITON_INTERPRET=1
# before Triton is imported. transformers imports Triton too, and a Triton imported
# first would ignore the variable (every kernel test would then fail on a CPU).
import tinyserve.kernels  # noqa: F401
