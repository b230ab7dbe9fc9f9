"""LLMEngine: add requests, step, stream outputs (nano-vllm / vLLM v1 shape).

``step()`` = ``scheduler.schedule()`` -> ``runner.execute()`` ->
``scheduler.update_from_output()`` -> detokenize and check stop strings. Everything a
user can get wrong is rejected in ``add_request`` before any state changes, so a bad
request never disturbs the others; the request responsible for an unexpected model
error fails alone, found by bisection (``step_isolation.py``), and its batch mates go on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from kvstack.config.engine import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from kvstack.core.errors import ConfigError, InvalidRequestError
from kvstack.core.prompts import check_cache_salt
from kvstack.core.request import Request, RequestOutput, RequestStatus, SamplingParams
from kvstack.engine.hybrid import num_pages, plan_kv_groups, token_capacity
from kvstack.engine.output_processor import OutputProcessor, ParentState, record_logprobs
from kvstack.engine.segments import enable_segments, request_marks
from kvstack.engine.snapshot import engine_stats
from kvstack.engine.startup import fit_max_model_len, log_dtype
from kvstack.engine.stats import EngineStats, UsageTracker
from kvstack.engine.step_isolation import recover_step
from kvstack.kv.base import KVCacheStats, KVManager, KVRoutingInfo
from kvstack.kv.events import KVEventLog
from kvstack.kv.layouts import build_kv_manager
from kvstack.kv.paged_common import PagedCommon
from kvstack.kv.press.coordinator import PressCoordinator, PressDefaults
from kvstack.kv.storage import KVStorage
from kvstack.kv.tiers.connector import TierConnector, make_connector
from kvstack.model.arch.window import check_window_support
from kvstack.model.loader.fingerprint import model_fingerprint
from kvstack.model.loader.generation_config import load_generation_defaults
from kvstack.model.loader.registry import build_model, load_tokenizer, resolve_model_path
from kvstack.model.runner import LogitCapture, ModelRunner
from kvstack.model.structured import StructuredOutputManager
from kvstack.sched.scheduler import Scheduler
from kvstack.spec.drafter import build_drafter
from kvstack.spec.speculator import build_speculator

logger = logging.getLogger("kvstack.engine.llm_engine")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.config = config
        self.model = build_model(
            config.model, config.dtype, config.seed, config.quantization or "none"
        )
        self.model_config = self.model.config
        self.tokenizer = load_tokenizer(config.tokenizer or config.model, config.chat_template)
        # Sampling defaults of requests that leave a field unset (``--generation-config``).
        self.generation_defaults = load_generation_defaults(
            config.generation_config, resolve_model_path(config.model)
        )
        self.dtype = self.model.dtype

        mc = self.model_config
        max_len = config.scheduler.max_model_len or mc.max_position_embeddings
        if max_len > mc.max_position_embeddings:
            raise ConfigError(
                f"max_model_len {max_len} exceeds the model's context {mc.max_position_embeddings}"
            )
        self.max_model_len = max_len
        cc = config.cache
        max_seqs = config.scheduler.max_num_seqs
        self.kv_groups = plan_kv_groups(config, mc)  # sliding windows: the hybrid manager
        num_blocks = self._num_blocks()
        if cc.block_size > max_len:
            raise ConfigError(f"block_size {cc.block_size} exceeds max_model_len {max_len}")
        self.kv_storage = KVStorage(
            mc, num_blocks, cc.block_size, self.dtype, cc.kv_cache_dtype, max_seqs, self.kv_groups
        )
        codec = self.kv_storage.codec
        check_window_support(mc, cc.kv_press)  # a window-only model: one clear error
        self.kv_bytes_per_token = (
            KVStorage.bytes_per_block(mc, cc.block_size, self.dtype, cc.kv_cache_dtype)
            / cc.block_size
        )
        params = replace(
            cc.layout_params(num_blocks, max_len, mc.name), groups=self.kv_groups,
            max_chunk_tokens=config.scheduler.max_num_batched_tokens,
        )  # fmt: skip
        self.residency = params.residency  # vLLM's --kv-cache-metrics sampler, or None
        self.kv_manager: KVManager = build_kv_manager(cc.kv_layout, params)
        given = config.scheduler.max_model_len is not None
        fit = fit_max_model_len(self.kv_manager, max_len, given, self.kv_storage.nbytes)
        if fit < max_len:
            max_len = self.max_model_len = fit  # the model's context, lowered: a warning
            params = replace(params, max_model_len=fit)
            self.kv_manager = build_kv_manager(cc.kv_layout, params)
        if not codec.identity:  # KIVI frees the residual of a block that dies unfilled
            self.kv_manager.set_block_free_hook(codec.on_block_freed)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, max_len)
        self.connector: TierConnector | None = None
        if cc.kv_offload:
            assert isinstance(self.kv_manager, PagedCommon)  # CacheConfig checked the layout
            self.connector = make_connector(
                cc.kv_offload, model_fingerprint(self.model), self.kv_manager,
                self.kv_storage, config.dtype, cc.offload_key(),
            )  # fmt: skip
            self.scheduler.connector = self.connector
        self.usage_tracker = UsageTracker()
        # Presses: per-request press state and the hooks scheduler, runner and step call.
        self.press = PressCoordinator(
            PressDefaults(
                cc.kv_press,
                cc.kv_press_ratio,
                cc.kv_press_every,
                cc.kv_layout == "paged",
                windows=tuple(mc.layer_window(i) for i in range(mc.num_layers)),
            ),
            self.kv_manager,
            self.kv_storage,
            self.model.scale,
        )
        self.scheduler.press = self.press
        enable_segments(self)  # segment reuse, unless --segment-cache none
        so_backend = config.structured_outputs_backend
        self.structured = StructuredOutputManager(self.tokenizer, mc.vocab_size, so_backend)
        self.runner = ModelRunner(self.model, self.kv_storage, self.press, self.structured)
        self.speculator = build_speculator(
            config.speculative_config, config.scheduler.max_num_batched_tokens, max_len,
            token_capacity(num_blocks, self.kv_groups, cc.block_size), cc.kv_cache_dtype,
            codec.rolls_back, cc.kv_press_every,
        )  # fmt: skip
        stats = self.speculator.stats if self.speculator is not None else None
        self.runner.drafter = build_drafter(  # draft_model: its forwards (spec/drafter.py)
            self.model, config.speculative_config, config.dtype, config.seed, stats
        )
        self.outputs = OutputProcessor(self.tokenizer)
        self._next_id = 0
        self.num_steps = 0
        self._log_loaded(time.perf_counter() - t0)

    def _num_blocks(self) -> int:
        """Pool size: ``num_blocks``, or as many blocks as ``kv_cache_memory`` holds."""
        cc = self.config.cache
        if cc.num_blocks is not None:
            return num_pages(cc.num_blocks, self.kv_groups)
        memory = cc.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
        num_blocks = KVStorage.num_blocks_for_memory(
            self.model_config,
            cc.block_size,
            self.dtype,
            memory,
            cc.kv_cache_dtype,
            self.config.scheduler.max_num_seqs,
            self.kv_groups,
        )
        if num_blocks < 1:
            raise ConfigError(f"kv_cache_memory {memory} B holds not even one KV block")
        return num_blocks

    def _log_loaded(self, seconds: float) -> None:
        mc, cc, config = self.model_config, self.config.cache, self.config
        log_dtype(config.dtype, cc.kv_cache_dtype)  # the ISA that decided it; fp32 KV
        groups = self.kv_groups  # hybrid: blocks of every layer, held as pages of a few
        num_blocks = self.kv_manager.num_blocks // (groups.num_groups if groups else 1)
        plain = mc.kv_bytes_per_token(self.dtype.itemsize)
        logger.info(
            "loaded %s (%s, %d layers) in %.1fs; KV cache %s: %d blocks x %d tokens = %d tokens "
            "(%.0f B/token, %.2fx the tokens of %s), %.1f MiB; layout %s, prefix cache %s "
            "(eviction %s)",
            mc.name,
            config.dtype,
            mc.num_layers,
            seconds,
            cc.kv_cache_dtype,
            num_blocks,
            cc.block_size,
            num_blocks * cc.block_size,
            self.kv_bytes_per_token,
            plain / self.kv_bytes_per_token,
            config.dtype,
            self.kv_storage.nbytes / 2**20,
            cc.kv_layout,
            cc.prefix_cache if cc.kv_layout == "paged" else "none",
            cc.eviction_policy,
        )
        if groups is not None:
            logger.info(
                "hybrid KV manager: %s, %d pages; window layers free what their window left",
                groups.describe(), self.kv_manager.num_blocks,
            )  # fmt: skip

    # ------------------------------------------------------------------ requests
    def default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the generation config's defaults (vLLM's
        ``get_default_sampling_params``)."""
        return SamplingParams(**self.generation_defaults)

    def new_request_id(self) -> str:
        self._next_id += 1
        return f"req-{self._next_id}"

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int] | None,
        sampling_params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        cache_salt: str | None = None,
        segments: Sequence[Sequence[Any]] | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Raises ``InvalidRequestError``.

        ``cache_salt`` (vLLM's name) isolates prefix reuse: only requests with the same
        salt share cached KV; it must pass vLLM's ``validate_cache_salt``. ``segments``:
        ``[start, end)`` token ranges of the prompt reused wherever they sit.
        """
        check_cache_salt(cache_salt)
        sp = replace(sampling_params or self.default_sampling_params())
        rid = request_id if request_id is not None else self.new_request_id()
        if rid in self.outputs.parents:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        text: str | None = None
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                text = prompt
                prompt_token_ids = self.tokenizer.encode(prompt) if prompt else []
            elif isinstance(prompt, list):
                prompt_token_ids = prompt
            else:
                raise InvalidRequestError("a prompt (text or token ids) is required")
        ids = list(prompt_token_ids)
        if not ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        vocab = self.model_config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        sp.validate(vocab)
        if len(trimmed := sp.truncate_prompt(ids, self.max_model_len)) < len(ids):
            ids, text = trimmed, self.tokenizer.decode(trimmed, skip_special_tokens=False)
        sp.resolve_bad_words(lambda w: self.tokenizer.encode(w, add_special_tokens=False), vocab)
        if sp.max_tokens is None:  # the rest of the context, or the generation config's
            room = max(1, self.max_model_len - len(ids))
            sp.max_tokens = min(room, self.generation_defaults.get("max_tokens", room))
        self.scheduler.check_fits(len(ids), sp.max_tokens)

        press = self.press.resolve(sp)
        marks = request_marks(self, segments, ids, sp, press)
        if self.speculator is not None:
            self.speculator.check_request(sp)
        so = sp.structured_outputs
        grammar = None if so is None else self.structured.compile(so)
        eos = frozenset(self.tokenizer.eos_token_ids)
        children = []
        for i in range(sp.n):
            csp = replace(sp, n=1)
            if sp.n > 1 and sp.seed is not None:
                csp.seed = sp.seed + i
            cid = rid if sp.n == 1 else f"{rid}#{i}"
            children.append(
                Request(cid, ids, csp, eos_token_ids=eos, cache_salt=cache_salt, segments=marks)
            )
        for child in children:
            if child.request_id in self.scheduler.requests:
                raise InvalidRequestError(f"request id {child.request_id!r} is already in use")
        self.outputs.add(ParentState(rid, text, ids), children)
        for child in children:
            if child.sampling_params.prompt_logprobs is not None:
                child.prompt_logprobs = [None]
            if grammar is not None:
                self.structured.add(child.request_id, grammar)
            self.scheduler.add_request(child)
            self.press.on_request_added(child, press)
            if self.connector is not None:
                self.connector.on_request_added(child)
        return rid

    def abort_request(self, request_id: str | list[str]) -> None:
        """Abort requests (by the id given to ``add_request``); frees their KV at once."""
        ids = [request_id] if isinstance(request_id, str) else request_id
        children = [c for rid in ids for c in (self.outputs.children_of(rid) or [rid])]
        for cid in children:
            self.scheduler.finish_request(cid, RequestStatus.FINISHED_ABORTED)
        self.outputs.release_finished(children)
        self.structured.release(children)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    # ------------------------------------------------------------------ stepping
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Run one scheduling step; return outputs of requests that progressed.

        ``final_only`` (offline generation) returns only finished requests and skips
        detokenizing intermediate text where no stop string needs it.
        """
        out = self.scheduler.schedule()
        if out.is_empty:
            self.usage_tracker.pause()
            if self.connector is not None:  # only requests waiting on tier lookups
                self.connector.wait_for_loads(0.01)
            return []
        self.num_steps += 1
        kv = self.kv_manager
        waste = kv.waste_slots(self.scheduler.running) / (kv.num_blocks * kv.block_size)
        self.usage_tracker.record(kv.usage, waste)
        failed: list[RequestOutput] = []
        try:
            result = self.runner.execute(out)
        except Exception as exc:  # a bad request fails alone (step_isolation.py)
            logger.exception("model step failed; isolating its failing request")
            out, result, failed = recover_step(self, out, exc)
            if not out.scheduled:
                return failed
        if self.connector is not None:
            self.connector.after_step()  # write-through: queue this step's new blocks
        record_logprobs(self.scheduler.requests, result, self.tokenizer)
        now = time.monotonic()
        changed = self.scheduler.update_from_output(out, result.sampled, result.accepted)
        self.press.after_step((s.request for s in out.scheduled), result.press_queries)
        touched: set[str] = set()
        for req in changed:
            if req.first_token_time is None:
                req.first_token_time = now
            if (verdict := result.grammar_stops.get(req.request_id)) and not req.is_finished():
                self._grammar_stop(req, verdict)
            if self.outputs.on_new_token(req, stream=not final_only):
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            touched.add(req.request_id)
        self.structured.release(r.request_id for r in changed if r.is_finished())
        if self.speculator is not None:  # spec/: count the drafts, propose the next ones
            self.speculator.after_step(out.scheduled, result.accepted, changed)
        outputs = self.outputs.outputs_for(touched, final_only)
        self.outputs.release_finished(touched)
        return failed + outputs

    def _grammar_stop(self, req: Request, verdict: str) -> None:
        """Finish a request whose grammar is complete (stop) or rejected a token (error)."""
        status = RequestStatus.FINISHED_STOPPED
        if verdict != "done":
            logger.warning("%s: structured output failed: %s", req.request_id, verdict)
            req.error, status = f"structured output failed: {verdict}", RequestStatus.FINISHED_ERROR
        self.scheduler.finish_request(req.request_id, status)

    # ------------------------------------------------------------------ prefix cache
    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix and pin (running requests keep their blocks).

        Only the device cache: offload tiers keep their blocks (a device-cold, tier-warm
        state is what the offload benchmark measures).
        """
        self.kv_manager.reset_prefix_cache()
        logger.info("prefix cache reset")

    def pin_prefix(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """Pin an already cached prefix (see ``LLM.pin_prefix``); returns tokens pinned."""
        return self.kv_manager.pin_prefix(token_ids, cache_salt)

    def unpin_prefix(self, token_ids: list[int], cache_salt: str | None = None) -> bool:
        return self.kv_manager.unpin_prefix(token_ids, cache_salt)

    def pin_cached_prefix(self, token_ids: list[int], salt: str | None, share: float) -> int:
        return self.kv_manager.pin_cached_prefix(token_ids, salt, share)  # soft: released first

    @property
    def kv_events(self) -> KVEventLog:
        """Stream of BlockStored / BlockRemoved / AllBlocksCleared (``kv/events.py``)."""
        return self.kv_manager.events

    # ------------------------------------------------------------------ evaluation
    @contextmanager
    def capture_logits(self, request_id: str, start: int) -> Iterator[LogitCapture]:
        """Keep the full next-token log-distributions of request ``request_id``'s prompt
        positions ``>= start`` while the block runs (``LLM.score``; the request must ask
        for prompt logprobs). Add and run the request inside the ``with``."""
        capture = LogitCapture(start)
        self.runner.capture_logits[request_id] = capture
        try:
            yield capture
        finally:
            self.runner.capture_logits.pop(request_id, None)

    # ------------------------------------------------------------------ introspection
    def stats(self, kv: KVCacheStats | None = None) -> EngineStats:
        """Engine counters; ``kv`` is a KV snapshot the caller already took, if any."""
        return engine_stats(self, kv or self.kv_manager.stats())

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        self.press.check_integrity(self.scheduler.requests)
        self.structured.check_integrity(self.scheduler.requests)
        self.kv_storage.codec.check_integrity()
        if self.speculator is not None:
            self.speculator.stats.check_integrity()
        if self.connector is not None:
            self.connector.check_integrity()

    def shutdown(self) -> None:
        """Write queued offload stores (a restart then finds them) and stop the I/O thread."""
        if self.connector is not None:
            self.connector.close()

    @property
    def num_free_blocks(self) -> int:
        return self.kv_manager.num_free_blocks

    # ---- queries for the server (engine thread only)
    # ``serve.AsyncEngine`` calls these through ``AsyncEngine.run`` (between steps), so
    # the HTTP thread never reads the KV manager or the connector itself.
    def routing_info(self) -> KVRoutingInfo:
        """How this engine hashes prefixes: what a router needs to predict its block
        hashes. Fixed for the engine's life."""
        return self.kv_manager.routing_info()

    def check_pinnable(self, num_tokens: int) -> None:
        """``InvalidRequestError`` when no prefix of ``num_tokens`` tokens can be pinned."""
        self.kv_manager.check_pinnable(num_tokens)

    def num_pinned_blocks(self) -> int:
        return self.kv_manager.num_pinned_blocks

    def held_block_hashes(self) -> dict[str, list[bytes]]:
        """Every block hash each medium serves now: ``device`` (the prefix cache) and each
        offload tier that can list its blocks (Redis is shared and cannot)."""
        held = {"device": self.kv_manager.cached_hashes()}
        if self.connector is not None:
            held |= self.connector.held_hashes()
        return held

    def held_segment_keys(self) -> list[bytes]:
        """Keys of the ready segment entries in the device pool."""
        seg = getattr(self.kv_manager, "segments", None)
        return [k for k, e in seg.entries.items() if e.ready] if seg is not None else []

    def flush_offload(self, timeout_s: float) -> bool:
        """Wait until queued tier stores and loads are done (True at once without tiers);
        False on timeout. The exception here: it blocks, so call it off the engine thread
        (the I/O thread's queue is thread-safe)."""
        return self.connector is None or self.connector.flush(timeout_s)
