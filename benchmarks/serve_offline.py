"""The offline side of ``serve.py``'s HTTP-overhead check: ``LLM.generate`` on the
shared-prefix prompts in a child process (``serve.py --worker-offline``), and the server /
offline output tok/s ratio with the greedy texts compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_common import REPO_ROOT, log, measure, write_json
from serve_report import find_run
from serve_servers import LOG_DIR, MAX_MODEL_LEN, MAX_NUM_SEQS

SERVE_SCRIPT = Path(__file__).resolve().with_name("serve.py")


def offline_worker(request_path: Path, out_path: Path) -> None:
    """In its own process: time ``LLM.generate`` on the request's prompts (see the docstring)."""
    from kvstack import LLM, SamplingParams

    req = json.loads(request_path.read_text())
    t0 = time.perf_counter()
    llm = LLM(max_num_seqs=req["max_num_seqs"], max_model_len=req["max_model_len"])
    load_s = time.perf_counter() - t0

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        llm.reset_prefix_cache()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    prompts = req["prompt_ids"]
    result = measure(
        generate, prompts, req["max_tokens"], runs=1, single_new_tokens=0,
        sample_prompts=len(prompts),
    )  # fmt: skip
    result["load_s"] = round(load_s, 2)
    write_json(result, out_path)


def run_offline(reqs: Sequence[Any], timeout_s: float = 1200.0) -> dict[str, Any]:
    """The offline measurement in a child process; ``{"error": ...}`` if it failed."""
    log_path = LOG_DIR / "serve-offline.log"
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvstack-serve-offline-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    req_path, out_path = tmp / "request.json", tmp / "result.json"
    req_path.write_text(json.dumps({
        "prompt_ids": [r.prompt_token_ids for r in reqs], "max_tokens": reqs[0].max_tokens,
        "max_num_seqs": MAX_NUM_SEQS, "max_model_len": MAX_MODEL_LEN,
    }))  # fmt: skip
    cmd = [sys.executable, str(SERVE_SCRIPT), "--worker-offline", str(req_path)]
    cmd += ["--worker-out", str(out_path)]
    log(f"[offline] LLM.generate on {len(reqs)} prompts (log {log_path})")
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as logf:
        try:
            rc: int | str = subprocess.run(
                cmd, stdout=logf, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=REPO_ROOT,
                check=False,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0 or not out_path.exists():
        tail = log_path.read_text(errors="replace").splitlines()[-10:]
        log(f"[offline] FAILED ({rc}): " + " | ".join(tail))
        return {"error": f"exit {rc}", "log_tail": tail}
    result = json.loads(out_path.read_text())
    for p in (req_path, out_path):
        p.unlink()
    tmp.rmdir()
    log(f"[offline] {result['output_tok_s']} output tok/s")
    return result


def overhead(doc: dict[str, Any], tok: Any = None) -> dict[str, Any] | None:
    """Server (kvstack, shared-prefix, rate inf) vs offline output tok/s."""
    off = doc.get("offline") or {}
    if "output_tok_s" not in off:
        return None
    case = off["num_prompts"], off["max_new_tokens"]
    run = find_run(doc, "kvstack", "shared-prefix", "inf", *case)
    if run is None:
        return None
    out = {
        "num_prompts": case[0],
        "max_tokens": case[1],
        "offline_output_tok_s": off["output_tok_s"],
        "server_output_tok_s": round(run["output_throughput"], 2),
        "ratio": round(run["output_throughput"] / off["output_tok_s"], 3),
        "required": 0.8,
    }
    out["pass"] = out["ratio"] >= out["required"]
    texts = run.get("generated_texts")
    if tok is not None and texts and len(off.get("sample_output_ids", [])) == len(texts):
        offline = [tok.decode(ids) for ids in off["sample_output_ids"]]
        by_id = dict(zip(run["request_ids"], texts, strict=True))
        order = [r.request_id for r in doc["_requests"]["shared-prefix"]]
        out["same_text_as_offline"] = sum(
            by_id.get(i) == t for i, t in zip(order, offline, strict=True)
        )
        out["compared"] = len(offline)
    return out
