"""The flag table of ``docs/serving/vllm_compat.md``, generated from what ``kvstack serve`` does.

``flag_table()`` walks ``vllm_serve_flags()`` and says, per vLLM flag, what kvstack does
with it: *same* (kvstack's own option of that name, notes in ``OWN_NOTES`` where it
differs), or the ``vllm_flag_policies`` policy (*ignored*, *neutral*, *mapped*,
*refused*) with its reason. ``python -m kvstack.cli.vllm_compat_table`` rewrites the
table in the doc; a test checks the doc holds exactly this table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvstack.cli.vllm_flags import DEST_PREFIX, VLLM_VERSION, policy_of, vllm_serve_flags

START, END = "<!-- vllm-flags:start -->", "<!-- vllm-flags:end -->"
WHAT = {
    "ignored": "accepted, ignored (one start-up line)",
    "neutral": "accepted at kvstack's value; others refused",
    "mapped": "same, as kvstack's option",
    "refused": "refused at start-up (one error line)",
}
# kvstack's own options that behave differently from vLLM's flag of the same name.
OWN_NOTES = {
    "--host": "differs: default 127.0.0.1 (vLLM: all interfaces); --host 0.0.0.0 gives vLLM's",
    "--allowed-origins": 'differs: default no CORS (vLLM: ["*"]); \'["*"]\' gives vLLM\'s',
    "--api-key": "same for /v1/*; kvstack also keys /invocations, /tokenize, /load (SECURITY.md)",
    "--dtype": "differs: auto (the default) is bfloat16 on every CPU with AVX2 (native "
    "with AVX512-BF16 or AMX, else bf16 storage with float32 compute), float32 without AVX2 "
    "(a fixed table per ISA, `kvstack doctor` shows it); half/float16 run as bfloat16 (CPU "
    "kernels), float32 as is",
    "--gpu-memory-utilization": "same as vLLM's CPU backend: a share of total RAM for "
    "weights, runtime and KV; capped at 80 % of the RAM available after the weights",
    "--max-logprobs": "same, at most 20 (vLLM: -1 for the whole vocabulary)",
    "--model": "same: a path, kvstack's 'default', or an ORG/NAME id already in the local "
    "Hugging Face cache (never downloaded)",
    "--served-model-name": "same: default the model as given, the file's name kept as an alias",
    "--tensor-parallel-size": "accepted at 1; more is refused (one process)",
    "--pipeline-parallel-size": "accepted at 1; more is refused (one process)",
    "--data-parallel-size": "accepted at 1; replicas are kvstack router / --ray",
    "--quantization": "differs: kvstack's none/int8/int4/gguf",
    "--kv-cache-dtype": "differs: kvstack's codecs (fp8 = e4m3, int8, int4...)",
    "--revision": "accepted unset only: kvstack loads local files",
    "--tokenizer-revision": "accepted unset only: kvstack loads local files",
    "--download-dir": "accepted unset only: kvstack never downloads",
    "--hf-token": "accepted unset only: kvstack never downloads",
    "--cpu-offload-gb": "accepted at 0: weights stay in RAM (KV offload: --kv-offload)",
    "--tokenizer-mode": "accepted at auto only",
    "--speculative-config": "differs: kvstack's draft / ngram methods (kvstack.spec)",
    "--compilation-config": "accepted, ignored: no CUDA graphs / torch.compile",
    "--enforce-eager": "accepted, ignored: kvstack always runs eagerly",
    "--trust-remote-code": "accepted, ignored: kvstack never runs checkpoint code",
    "--disable-custom-all-reduce": "accepted, ignored: one process",
    "--disable-log-stats": "accepted, ignored",
    "--fingerprint-mode": "same shape: kvstack-VERSION-HASH8 (vLLM: vllm-VERSION-HASH8)",
    "--tool-call-parser": "same names where kvstack has the parser (hermes, llama3_json, "
    "mistral, pythonic); default hermes",
}


def _serve_parser() -> argparse.ArgumentParser:
    from kvstack.cli import build_parser

    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def flag_table() -> str:
    """The Markdown table: one row per vLLM flag (its spellings), what kvstack does."""
    known = _serve_parser()._option_string_actions
    rows = ["| vLLM flag | kvstack | why / notes |", "| --- | --- | --- |"]
    for flag in vllm_serve_flags():
        names = " ".join(f"`{s}`" for s in flag.strings)
        action = known.get(flag.strings[0])
        if flag.dest == "config":
            rows.append(f"| {names} | same | vLLM's YAML keys (`uvicorn-log-level: info`) |")
        elif action is not None and not action.dest.startswith(DEST_PREFIX):
            note = OWN_NOTES.get(flag.strings[0], "kvstack's own option of that name")
            kind, _, why = note.partition(": ")
            if not note.startswith(("differs", "accepted", "same")):
                kind, why = "same", note
            rows.append(f"| {names} | {kind} | {why} |")
        else:
            policy = policy_of(flag.dest)
            assert policy is not None, flag.dest
            extra = f" (accepted: {', '.join(policy.accept)})" if policy.accept else ""
            rows.append(f"| {names} | {WHAT[policy.kind]} | {policy.reason}{extra} |")
    return "\n".join(rows) + "\n"


def write_doc(path: Path) -> None:
    """Replace the table between the markers of ``path`` with ``flag_table()``."""
    text = path.read_text(encoding="utf-8")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{START}\n{flag_table()}{END}{tail}", encoding="utf-8")


if __name__ == "__main__":  # python -m kvstack.cli.vllm_compat_table docs/serving/vllm_compat.md
    write_doc(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/serving/vllm_compat.md"))
    print(f"vLLM {VLLM_VERSION}: {len(vllm_serve_flags())} flags written")
