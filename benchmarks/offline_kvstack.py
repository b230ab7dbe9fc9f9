"""kvstack's side of ``offline_throughput.py``: its offline ``LLM.generate`` timed like the
peers are (run in the kvstack worker process, ``--worker-request``), and whether this
interpreter can run it at all.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

from bench_common import measure_scheduled


def run_kvstack(
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    dtype: str,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    *,
    runs: int = 3,
    single_new_tokens: int = 256,
    time_budget_s: float | None = None,
    prefix_caching: bool = False,
    model: str = "default",
) -> dict[str, Any]:
    """Time kvstack's offline ``LLM.generate`` on ``prompt_ids`` like the peers are timed.

    ``prefix_caching`` selects the hash-chain prefix cache (else none); the cache is
    emptied before every generate call, so each timed run starts cold, as vllm's does.
    """
    import kvstack
    from kvstack import LLM, SamplingParams  # type: ignore[attr-defined]

    t0 = time.perf_counter()
    llm = LLM(
        model=model,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        prefix_cache="hash" if prefix_caching else "none",
    )
    load_s = time.perf_counter() - t0

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        llm.reset_prefix_cache()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    result = measure_scheduled(
        "kvstack",
        generate,
        prompt_ids,
        max_new_tokens,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        runs=runs,
        single_new_tokens=single_new_tokens,
        time_budget_s=time_budget_s,
    )
    import torch

    result.update(
        peer="kvstack",
        versions={
            "kvstack": getattr(kvstack, "__version__", "?"),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        config={
            "dtype": dtype,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "prefix_caching": prefix_caching,
        },
        load_s=round(load_s, 2),
    )
    return result


def kvstack_available() -> str | None:
    """Return None when kvstack's offline API can be imported, else the reason it cannot."""
    if importlib.util.find_spec("kvstack") is None:
        return "package kvstack is not installed in this interpreter"
    try:
        import kvstack
    except Exception as exc:  # report any import failure, the run goes on without kvstack
        return f"import kvstack failed: {exc!r}"
    missing = [n for n in ("LLM", "SamplingParams") if not hasattr(kvstack, n)]
    return f"kvstack lacks {', '.join(missing)}" if missing else None
