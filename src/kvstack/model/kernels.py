"""Optional C++ kernels, compiled on first use with ``torch.utils.cpp_extension``.

``paged_decode_attention`` reads K/V in place through block tables (``csrc/``). The
build takes ~30-60 s once per machine and is cached under ``~/.cache/kvstack``
(or ``$KVSTACK_KERNEL_DIR``). If the compiler is missing or the build fails, kvstack
logs a warning and falls back to the pure-PyTorch path in ``model/attention.py``;
``KVSTACK_NO_KERNELS=1`` forces the fallback (used by tests that compare both paths).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from types import ModuleType

logger = logging.getLogger("kvstack.kernels")

_CSRC = Path(__file__).parent / "csrc"
_lock = threading.Lock()
_module: ModuleType | None = None
_failed = False


def kernels_disabled() -> bool:
    return os.environ.get("KVSTACK_NO_KERNELS", "") not in ("", "0")


def build_dir() -> Path:
    base = os.environ.get("KVSTACK_KERNEL_DIR") or str(Path.home() / ".cache" / "kvstack")
    path = Path(base) / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_kernels() -> ModuleType | None:
    """The compiled extension module, or None when unavailable (never raises)."""
    global _module, _failed
    if kernels_disabled():
        return None
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is not None or _failed:
            return _module
        try:
            from torch.utils.cpp_extension import load

            logger.info("building kvstack C++ kernels (first use on this machine)...")
            _module = load(
                name="kvstack_kernels",
                sources=[str(_CSRC / "paged_attention.cpp")],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir()),
                verbose=False,
            )
        except Exception as exc:  # compiler missing, headers missing, ...
            _failed = True
            logger.warning("C++ kernels unavailable (%s); using the PyTorch fallback", exc)
    return _module
