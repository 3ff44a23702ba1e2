"""Our C kernels for CPUs (``bf16_gemm.c``, ``cpu_attention.c``, ``cpu_rmsnorm.c``), compiled
at first use.

Each C file is compiled with the system's C compiler (``$CC``, else ``cc``) for this
CPU (``-march=native``) and kept in ``~/.cache/tinyserve/kernels``
(``$TINYSERVE_CACHE``), keyed by its source, the shared header, the compiler's flags
and the CPU's, so a later start loads it in milliseconds. Where no compiler builds it
(none installed; a compiler without OpenMP, as Apple's clang), ``load`` returns None
and callers keep torch's path. ``TINYSERVE_<NAME>=0`` (``TINYSERVE_BF16_GEMM=0``,
``TINYSERVE_CPU_ATTENTION=0``) turns one off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

from tinyserve.host import cache_root, cpu_flags, cpu_name

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
HEADER = HERE / "simd.h"                # helpers every kernel includes
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", f"-I{HERE}"]
LIBS = ["-lm"]


def build(source: Path, target: Path, compiler: str) -> None:
    """Compile ``source`` to the shared library ``target`` (written whole, then renamed:
    processes building at once never load a half-written file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, str(source), "-o", str(built), *LIBS], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(built, target)


def load(name: str) -> ctypes.CDLL | None:
    """``tinyserve/<name>.c`` compiled for this machine (built on first use) and loaded;
    None where it cannot be built (logged) or ``TINYSERVE_<NAME>=0``."""
    if os.environ.get(f"TINYSERVE_{name.upper()}") == "0":
        return None
    source = HERE / f"{name}.c"
    compiler = os.environ.get("CC", "cc")
    # -march=native code runs only where every extension it was built for exists: the key
    # holds the CPU's flags, so a home directory shared by different machines stays safe.
    # FLAGS name this directory: a copy of the package elsewhere builds its own.
    key = hashlib.sha256("\0".join([source.read_text(), HEADER.read_text(), compiler, *FLAGS,
                                    *LIBS, platform.machine(), cpu_name(), cpu_flags()])
                         .encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"{name}-{key}.so"
    try:
        if not target.exists():
            build(source, target, compiler)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        log.info("%s.c not built (%s): torch's path is used instead", name, detail)
        return None
