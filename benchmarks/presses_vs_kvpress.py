"""kvstack's presses against NVIDIA kvpress itself: the positions each (layer, KV head) keeps.

Runs every press that both implement (StreamingLLM, SnapKV, Knorm, PyramidKV) on the same
token ids of the default model (SmolLM2-135M-Instruct) in float32, at each ratio: kvstack
in this process (the project's ``.venv``), kvpress in its own venv (it pins its own
transformers), both from the same weights (kvstack the GGUF, kvpress its dequantized HF
copy, ``.bench-venvs/smollm2-hf``)::

    bash benchmarks/setup_peers.sh kvpress model        # once: the venv and the HF folder
    .venv/bin/python benchmarks/presses_vs_kvpress.py   # ~2 min on 2 cores
    .venv/bin/python benchmarks/presses_vs_kvpress.py --write-readme

It reports, per press, ratio and prompt length: the Jaccard index of the kept positions
(mean and minimum over the 30 x 3 (layer, KV head) pairs, and pooled: all intersections
over all unions), the share of (layer, head) pairs whose sets are identical, the per-layer
budgets of both (PyramidKV's schedule), and the greedy tokens each decodes after the press
(32, EOS ignored; kvpress as its pipeline decodes: the compressed cache, positions counting
on from the prompt's length). An unpressed run checks that both models agree first.

kvpress's kept positions are read without changing kvpress: its ``compress`` is wrapped,
and the rows of the compressed keys are found among the uncompressed ones (a gather copies
them bit for bit). kvstack's are the indices its ``Press.select`` returns. H2O and
DefensiveKV are not compared: kvpress has no DefensiveKV, and its ``ObservedAttentionPress``
(every query's attention, normalized by how many queries see a token, no recent half) is
not kvstack's H2O (the last 256 queries, half the budget for the most recent tokens).

The kvpress side is this file too, started with the kvpress venv's interpreter::

    .bench-venvs/kvpress/bin/python benchmarks/presses_vs_kvpress.py kvpress \
        --request r.json --out o.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_common import (
    HF_MODEL_DIR,
    REPO_ROOT,
    RESULTS_DIR,
    log,
    render_docs,
    venv_python,
    write_json,
)

PRESSES = ("streaming_llm", "snapkv", "knorm", "pyramidkv")
KVPRESS_CLASSES = {  # kvstack name -> kvpress class
    "streaming_llm": "StreamingLLMPress",
    "snapkv": "SnapKVPress",
    "knorm": "KnormPress",
    "pyramidkv": "PyramidKVPress",
}
DEFAULT_LENGTHS = (662, 1500)
DEFAULT_RATIOS = (0.5, 0.8)
GREEDY_TOKENS = 32
RESULT = RESULTS_DIR / "presses_vs_kvpress.json"
MIN_JACCARD = 0.999  # agreement with kvpress for StreamingLLM, SnapKV and Knorm

Kept = list[list[list[int]]]  # per layer, per KV head, sorted kept positions


# ---------------------------------------------------------------------------- kvpress side


def run_kvpress(
    hf_model: str, prompts: list[list[int]], runs: list[list[Any]], greedy_tokens: int
) -> dict[str, Any]:
    """kvpress on every (prompt index, press or None, ratio) of ``runs``: kept positions
    per layer and head, and the greedy tokens decoded from the compressed cache."""
    import kvpress
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    transformers.utils.logging.disable_progress_bar()  # the weight-loading bar, per tensor
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(hf_model, dtype=torch.float32).eval()
    out = []
    for p_idx, name, ratio in runs:
        ids = prompts[p_idx]
        t0 = time.perf_counter()
        kept: dict[int, list[list[int]]] = {}
        press = None
        if name is not None:
            press = getattr(kvpress, KVPRESS_CLASSES[name])(compression_ratio=ratio)
            inner = press.compress

            def compress(module: Any, hidden_states: Any, keys: Any, values: Any, *a: Any,
                         _inner: Any = inner, _kept: Any = kept) -> Any:  # fmt: skip
                k2, v2 = _inner(module, hidden_states, keys, values, *a)
                _kept[module.layer_idx] = _positions(keys[0], k2[0])
                return k2, v2

            press.compress = compress  # the instance's hook calls self.compress
        cache = DynamicCache()
        x = torch.tensor([ids])
        with torch.inference_mode():
            if press is not None:
                with press(model):
                    logits = model(input_ids=x, past_key_values=cache, logits_to_keep=1).logits
            else:
                logits = model(input_ids=x, past_key_values=cache, logits_to_keep=1).logits
            tokens = [int(logits[0, -1].argmax())]
            n = len(ids)
            for i in range(greedy_tokens - 1):  # kvpress's pipeline: positions go on from n
                step = model(
                    input_ids=torch.tensor([[tokens[-1]]]),
                    past_key_values=cache,
                    position_ids=torch.tensor([[n + i]]),
                )
                tokens.append(int(step.logits[0, -1].argmax()))
        out.append(
            {
                "prompt": p_idx,
                "press": name,
                "ratio": ratio,
                "kept": [kept[i] for i in sorted(kept)] if name is not None else None,
                "tokens": tokens,
                "wall_s": round(time.perf_counter() - t0, 2),
            }
        )
        log(f"  kvpress {name}@{ratio} on {len(ids)} tokens: {out[-1]['wall_s']} s")
    return {
        "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else _version("kvpress"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "runs": out,
    }


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def _positions(keys: Any, kept_keys: Any) -> list[list[int]]:
    """Per head, the sorted positions of ``kept_keys`` rows ``[kvh, m, d]`` among ``keys``
    ``[kvh, n, d]`` (exact: kvpress gathers the rows it keeps)."""
    heads = []
    for h in range(keys.shape[0]):
        where = {row.numpy().tobytes(): j for j, row in enumerate(keys[h])}
        assert len(where) == keys.shape[1], "two positions share one key row"
        heads.append(sorted(where[row.numpy().tobytes()] for row in kept_keys[h]))
    return heads


# ---------------------------------------------------------------------------- kvstack side


def run_kvstack(prompts: list[list[int]], runs: list[list[Any]], greedy_tokens: int) -> list[Any]:
    """kvstack on every run: the indices its ``Press.select`` returns, and greedy tokens."""
    from kvstack import LLM, SamplingParams
    from kvstack.kv.press import PRESSES as KVSTACK_PRESSES

    llm = LLM("default", dtype="float32", prefix_cache="none", seed=0)
    out = []
    for p_idx, name, ratio in runs:
        t0 = time.perf_counter()
        records: list[Kept] = []
        cls = KVSTACK_PRESSES.get(name) if name is not None else None
        had_own = cls is not None and "select" in cls.__dict__
        if cls is not None:
            inner = cls.select

            def select(self: Any, inp: Any, _inner: Any = inner, _rec: Any = records) -> Any:
                chosen = _inner(self, inp)
                _rec.append([idx.tolist() for idx in chosen])
                return chosen

            cls.select = select  # type: ignore[method-assign]
        try:
            sp = SamplingParams(temperature=0.0, max_tokens=greedy_tokens, ignore_eos=True)
            if name is not None:
                sp = SamplingParams(
                    temperature=0.0,
                    max_tokens=greedy_tokens,
                    ignore_eos=True,
                    kv_press=name,
                    kv_press_ratio=ratio,
                )
            res = llm.generate(prompt_token_ids=[prompts[p_idx]], sampling_params=sp)
        finally:
            if cls is not None:
                if had_own:
                    cls.select = inner  # type: ignore[method-assign]
                else:
                    del cls.select
        assert name is None or len(records) == 1, f"{name}: {len(records)} presses"
        out.append(
            {
                "prompt": p_idx,
                "press": name,
                "ratio": ratio,
                "kept": records[0] if records else None,
                "tokens": list(res[0].outputs[0].token_ids),
                "wall_s": round(time.perf_counter() - t0, 2),
            }
        )
        log(f"  kvstack {name}@{ratio} on {len(prompts[p_idx])} tokens: {out[-1]['wall_s']} s")
    return out


# ---------------------------------------------------------------------------- comparison


def compare(a: Kept, b: Kept) -> dict[str, Any]:
    """Jaccard of kept positions per (layer, head) of kvstack (``a``) and kvpress (``b``)."""
    scores, inter, union, same = [], 0, 0, 0
    for la, lb in zip(a, b, strict=True):
        for ha, hb in zip(la, lb, strict=True):
            sa, sb = set(ha), set(hb)
            i, u = len(sa & sb), len(sa | sb)
            scores.append(i / u if u else 1.0)
            inter, union, same = inter + i, union + u, same + (sa == sb)
    return {
        "jaccard_mean": sum(scores) / len(scores),
        "jaccard_min": min(scores),
        "jaccard_pooled": inter / union if union else 1.0,
        "heads_identical": same,
        "heads": len(scores),
        "budgets_kvstack": [len(layer[0]) for layer in a],
        "budgets_kvpress": [len(layer[0]) for layer in b],
    }


def tokens_agree(a: list[int], b: list[int]) -> dict[str, int]:
    prefix = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        prefix += 1
    return {"equal": sum(x == y for x, y in zip(a, b, strict=False)), "prefix": prefix}


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    dirty = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "commit": commit + ("+dirty" if dirty else ""),
        "date": time.strftime("%Y-%m-%d"),
    }


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        "#### Presses against kvpress: kept positions on the default model",
        "",
        "| press | ratio | prompt | Jaccard mean (min) | pooled | identical (layer, head) "
        "| budgets equal | greedy tokens equal (prefix) |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in report["results"]:
        c = r["compare"]
        budgets = "yes" if c["budgets_kvstack"] == c["budgets_kvpress"] else "**no**"
        if r["press"] == "pyramidkv":
            b = c["budgets_kvstack"]
            budgets += f" ({b[0]} → {b[-1]})" if b[0] != b[-1] else f" ({b[0]}, uniform)"
        g = r["greedy"]
        lines.append(
            f"| `{r['press']}` | {r['ratio']:g} | {r['prompt_tokens']} "
            f"| {c['jaccard_mean']:.4f} ({c['jaccard_min']:.3f}) | {c['jaccard_pooled']:.4f} "
            f"| {c['heads_identical']}/{c['heads']} | {budgets} "
            f"| {g['equal']}/{report['greedy_tokens']} ({g['prefix']}) |"
        )
    base = report["unpressed"]
    lines += [
        "",
        f"_{m['date']}, commit {m['commit']}, {m['cpu']}, {m['cores']} cores: "
        f"SmolLM2-135M-Instruct in float32, kvstack (the Q4_1 GGUF) against kvpress "
        f"{report['peer']['kvpress']} (transformers {report['peer']['transformers']}, "
        f"torch {report['peer']['torch']}; the GGUF dequantized into an HF folder), prompts "
        f"cut from the Python Language Reference's prose (`--corpus real`). Unpressed, "
        f"the two agree on "
        + ", ".join(f"{b['equal']}/{report['greedy_tokens']}" for b in base)
        + " greedy tokens. `python benchmarks/presses_vs_kvpress.py`, "
        f"{report['wall_s']:.0f} s; JSON: `benchmarks/results/{RESULT.name}`._",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd")
    peer = sub.add_parser("kvpress", help="(inside the kvpress venv) run kvpress on a request")
    peer.add_argument("--request", required=True)
    peer.add_argument("--out", required=True)
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)))
    parser.add_argument("--ratios", default=",".join(map(str, DEFAULT_RATIOS)))
    parser.add_argument("--presses", default=",".join(PRESSES))
    parser.add_argument("--hf-model", default=str(HF_MODEL_DIR), help="the HF copy kvpress loads")
    parser.add_argument("--venv", default=str(venv_python("kvpress")), help="kvpress's python")
    parser.add_argument("--out", default=str(RESULT))
    parser.add_argument("--write-readme", action="store_true")
    args = parser.parse_args(argv)

    if args.cmd == "kvpress":
        req = json.loads(Path(args.request).read_text())
        write_json(run_kvpress(**req), args.out)
        return 0

    from kvstack.model.loader.registry import load_tokenizer
    from kvstack.tools.eval.corpus import real_corpus

    t0 = time.perf_counter()
    lengths = [int(x) for x in args.lengths.split(",")]
    ratios = [float(x) for x in args.ratios.split(",")]
    presses = [p for p in args.presses.split(",") if p]
    for p in presses:
        if p not in KVPRESS_CLASSES:
            parser.error(f"no kvpress counterpart for {p!r}; choose from {', '.join(PRESSES)}")
    if not Path(args.venv).is_file():
        parser.error(f"{args.venv} missing: run `bash benchmarks/setup_peers.sh kvpress`")
    if not (Path(args.hf_model) / "config.json").is_file():
        parser.error(f"{args.hf_model} missing: run `bash benchmarks/setup_peers.sh model`")
    tok = load_tokenizer("default")
    prompts = [t.token_ids for t in real_corpus(tok, lengths, 1, seed=0)]
    runs: list[list[Any]] = [[i, None, 0.0] for i in range(len(prompts))]
    runs += [[i, p, r] for i in range(len(prompts)) for p in presses for r in ratios]

    with tempfile.TemporaryDirectory(prefix="kvpress-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps({"hf_model": args.hf_model, "prompts": prompts,
                                   "runs": runs, "greedy_tokens": GREEDY_TOKENS}))  # fmt: skip
        log(f"kvpress ({args.venv}) on {len(runs)} runs")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        subprocess.run(
            [args.venv, __file__, "kvpress", "--request", str(req), "--out", str(res)],
            check=True, env=env,
        )  # fmt: skip
        theirs = json.loads(res.read_text())
    log(f"kvstack on {len(runs)} runs")
    ours = run_kvstack(prompts, runs, GREEDY_TOKENS)

    results, unpressed = [], []
    for a, b in zip(ours, theirs["runs"], strict=True):
        assert (a["prompt"], a["press"], a["ratio"]) == (b["prompt"], b["press"], b["ratio"])
        greedy = tokens_agree(a["tokens"], b["tokens"])
        if a["press"] is None:
            unpressed.append({"prompt_tokens": len(prompts[a["prompt"]]), **greedy})
            continue
        results.append(
            {
                "press": a["press"],
                "ratio": a["ratio"],
                "prompt_tokens": len(prompts[a["prompt"]]),
                "compare": compare(a["kept"], b["kept"]),
                "greedy": greedy,
                "tokens_kvstack": a["tokens"],
                "tokens_kvpress": b["tokens"],
            }
        )
    report = {
        "tool": "benchmarks/presses_vs_kvpress.py",
        "model": "SmolLM2-135M-Instruct (kvstack: Q4_1 GGUF; kvpress: its HF copy), float32",
        "corpus": "real_corpus (the Python Language Reference's prose), seed 0",
        "greedy_tokens": GREEDY_TOKENS,
        "machine": machine(),
        "peer": {k: theirs[k] for k in ("kvpress", "transformers", "torch", "python")},
        "unpressed": unpressed,
        "results": results,
        "not_compared": {
            "h2o": "kvpress's ObservedAttentionPress scores every query's attention "
            "normalized by how many queries see a token and keeps no recent half",
            "defensivekv": "kvpress has no DefensiveKV",
        },
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    write_json(report, args.out)
    table = markdown(report)
    print(table)
    if args.write_readme:
        render_docs()
    bad = [
        r for r in results
        if r["press"] != "pyramidkv" and r["compare"]["jaccard_pooled"] < MIN_JACCARD
    ]  # fmt: skip
    bad += [
        r for r in results
        if r["compare"]["budgets_kvstack"] != r["compare"]["budgets_kvpress"]
    ]  # fmt: skip
    for r in bad:
        log(f"BELOW THE BAR: {r['press']}@{r['ratio']:g} on {r['prompt_tokens']} tokens")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
