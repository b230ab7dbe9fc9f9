"""What the engine states and checks once at start: the dtype and the ISA that decided it,
and whether the KV pool holds one sequence of ``max_model_len`` tokens.

The dtype line: ``--dtype auto`` was resolved by the config (``config/choices.py``'s
``to_dtype`` asks ``model/kernels/isa.py``'s ``auto_dtype``), so the engine sees a concrete
dtype; ``dtype_note`` says which, what ``auto`` picks on this CPU and why, and what the KV
cache holds with it (``--kv-cache-dtype auto`` is the model dtype: float32 K/V take 4 bytes
a value, so the same ``--kv-cache-memory`` holds half the tokens of bf16). On a CPU with
AVX2 but no bf16 instructions ``auto`` is bf16 storage with float32 compute (the table in
``isa.py`` says why); bfloat16 asked for where ``auto`` picks float32 (no AVX2) is allowed,
with one warning (``isa.emulated_bf16_warning``).

The pool check follows vLLM's ``check_enough_kv_cache_memory`` (``vllm/v1/core/
kv_cache_utils.py``): a ``--max-model-len`` the pool cannot hold for one sequence is one
``ConfigError`` at start, naming the largest length that fits. When ``max_model_len`` was
not given (the model's context), the engine lowers it to that length with a warning
instead, so that a small ``--kv-cache-memory`` / ``--num-blocks`` still serves (every
request that fits the pool is served; a longer one is refused with the context-length
error). Invariant after ``fit_max_model_len``: a sequence of ``max_model_len`` tokens fits
the empty pool.
"""

from __future__ import annotations

import logging

from kvstack.core.errors import ConfigError
from kvstack.kv.base import KVManager
from kvstack.model.kernels.isa import DtypeChoice, auto_dtype, emulated_bf16_warning

logger = logging.getLogger("kvstack.engine.startup")


def dtype_note(dtype: str, kv_cache_dtype: str, choice: DtypeChoice) -> tuple[int, str]:
    """The start-up line about ``dtype`` (concrete) and its logging level: WARNING for
    bfloat16 where ``auto`` would not pick it (a CPU without AVX2), else INFO."""
    kv = ""
    if kv_cache_dtype == "auto":
        kv = f"; KV cache {dtype} (--kv-cache-dtype auto = the model dtype)"
        if dtype == "float32":
            kv += (
                ": 4 bytes a value, half the tokens of bf16 in the same --kv-cache-memory "
                "(--kv-cache-dtype bf16 keeps them in bf16)"
            )
    if dtype == "bfloat16" and choice.dtype != "bfloat16":  # no kernel widens bf16 here
        return logging.WARNING, emulated_bf16_warning(choice) + kv
    if dtype == choice.dtype:
        return logging.INFO, f"dtype {dtype} (--dtype auto's choice: {choice.reason()}){kv}"
    why = f"--dtype auto would pick {choice.dtype}: {choice.reason()}"
    return logging.INFO, f"dtype {dtype} as asked ({why}){kv}"


def log_dtype(dtype: str, kv_cache_dtype: str) -> None:
    """Log ``dtype_note`` for this CPU (once per engine)."""
    level, text = dtype_note(dtype, kv_cache_dtype, auto_dtype())
    logger.log(level, "%s", text)


def pool_max_len(kv: KVManager, limit: int) -> int:
    """The longest sequence, at most ``limit`` tokens, the empty pool of ``kv`` holds
    (``num_blocks_for`` grows with the length: binary search)."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if kv.num_blocks_for(mid) <= kv.num_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo


def fit_max_model_len(kv: KVManager, max_len: int, given: bool, nbytes: int) -> int:
    """``max_len`` if one sequence of it fits the pool of ``kv`` (``nbytes`` of KV); else
    ``ConfigError`` when it was ``given`` (``--max-model-len``), or the longest length that
    fits, with a warning."""
    if kv.num_blocks_for(max_len) <= kv.num_blocks:
        return max_len
    fit = pool_max_len(kv, max_len)
    pool = f"{kv.num_blocks} {kv.block_unit} of {kv.block_size} tokens, {nbytes / 2**20:.1f} MiB"
    need = f"{kv.num_blocks_for(max_len)} {kv.block_unit}"
    if given:
        raise ConfigError(
            f"the model's max seq len ({max_len}) is larger than the maximum number of tokens "
            f"that can be stored in the KV cache ({fit}: {pool}; one sequence of {max_len} "
            f"needs {need}). Try increasing --kv-cache-memory / --num-blocks (vLLM's "
            "gpu_memory_utilization) or decreasing --max-model-len"
        )
    logger.warning(
        "the model's context (%d tokens, %s) is larger than the KV pool holds for one "
        "sequence (%s): max_model_len lowered to %d; raise --kv-cache-memory / --num-blocks "
        "to serve the whole context, or set --max-model-len",
        max_len, need, pool, fit,
    )  # fmt: skip
    return fit
