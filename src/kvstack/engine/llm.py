"""``LLM``: offline batch generation with vLLM's API (``generate``, ``chat``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvstack.config.engine import EngineConfig
from kvstack.config.vllm_args import describe as describe_vllm_keywords
from kvstack.config.vllm_args import translate
from kvstack.core.errors import InvalidRequestError
from kvstack.core.options import build
from kvstack.core.prompts import PromptInput, parse_prompts
from kvstack.core.request import RequestOutput, SamplingParams
from kvstack.engine.llm_engine import LLMEngine
from kvstack.engine.stats import EngineStats
from kvstack.model.tokenizer.chat_template import load_chat_template
from kvstack.model.tokenizer.tokenizer import Tokenizer


class LLM:
    """Offline engine: ``LLM(model="default").generate(prompts, SamplingParams(...))``.

    ``LLM(model, **options)`` takes exactly the engine options ``EngineConfig`` declares
    (the ``kvstack`` CLI flags, with underscores), flat: ``LLM("default", dtype="float32",
    num_blocks=256, kv_press="snapkv", kv_press_ratio=0.5)``; an unknown name raises
    ``TypeError``. vLLM's common keywords are accepted as well (``kvstack.config.vllm_args``):
    mapped where they mean something here (``enable_prefix_caching=False``,
    ``gpu_memory_utilization=0.5``), accepted where they already hold
    (``enforce_eager=True``), refused with a ``ConfigError`` naming them otherwise.
    ``LLM.from_config(config)`` takes a ready ``EngineConfig``.
    Call ``shutdown()`` when done with offload tiers so queued stores are written.
    """

    def __init__(self, model: str = "default", **options: Any) -> None:
        values = translate({"model": model, **options})
        self._start(build(EngineConfig, values, "LLM()"))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An ``LLM`` on an already built (and so already validated) configuration."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.config = config
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Any = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[list[int]] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        check_integrity: bool = False,
        on_step: Callable[[], None] | None = None,
        segments: Sequence[Sequence[Sequence[Any]] | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions; outputs come back in the order of the prompts.

        ``prompts`` as vLLM takes them (``kvstack.core.prompts``): a string, a ``TextPrompt``
        or ``TokensPrompt`` dict (``{"prompt_token_ids": ids}``), or a list of these;
        ``prompt_token_ids=`` (older vLLM's keyword) is kept. ``use_tqdm`` shows a
        progress bar by default, as vLLM does (a callable: the ``tqdm`` class to use).
        All prompts are validated before any runs: one bad prompt raises
        ``InvalidRequestError`` and nothing is queued. ``segments`` (kvstack's segment reuse):
        per prompt, ``[start, end)`` token ranges whose KV is reused wherever they sit
        (tool schemas, documents in any order; ``--segment-cache``), or None.
        """
        if lora_request is not None:
            raise InvalidRequestError("lora_request: kvstack does not serve LoRA adapters")
        if prompt_token_ids is not None:
            items = [PromptInput(None, list(p)) for p in prompt_token_ids]
        elif prompts is not None:
            items = parse_prompts(prompts)
        else:
            raise InvalidRequestError("generate() needs prompts or prompt_token_ids")
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(items):
                raise InvalidRequestError("one SamplingParams per prompt, or a single one")
            params = list(sampling_params)
        else:
            params = [sampling_params or self.get_default_sampling_params()] * len(items)
        marks = list(segments) if segments is not None else [None] * len(items)
        if len(marks) != len(items):
            raise InvalidRequestError("segments: one list of token ranges (or None) per prompt")

        ids: list[str] = []
        try:
            for item, sp, spans in zip(items, params, marks, strict=True):
                rid = self.engine.new_request_id()
                self.engine.add_request(
                    rid, item.text, sp, prompt_token_ids=item.token_ids,
                    cache_salt=item.cache_salt, segments=spans,
                )  # fmt: skip
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm, check_integrity, on_step)

    # ------------------------------------------------------------------ prefix cache
    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix and pin (e.g. before a timed benchmark run)."""
        self.engine.reset_prefix_cache()

    def pin_prefix(self, prefix: str | list[int], cache_salt: str | None = None) -> int:
        """Compute ``prefix`` (text or token ids) if needed and pin its full blocks.

        A pinned prefix (a system prompt, a tool schema) is never evicted until
        ``unpin_prefix``. Returns the number of tokens pinned (block-aligned). Raises
        ``InvalidRequestError`` if it is shorter than a block, longer than the pin limit
        (``max_pinned_fraction`` of the pool) or no prefix cache is enabled.
        """
        ids = self._prefix_ids(prefix)
        self.engine.check_pinnable(len(ids))
        rid = self.engine.new_request_id()
        self.engine.add_request(
            rid, None, SamplingParams(max_tokens=1), prompt_token_ids=ids, cache_salt=cache_salt
        )
        self._run([rid], False, False, None)
        return self.engine.pin_prefix(ids, cache_salt)

    def unpin_prefix(self, prefix: str | list[int], cache_salt: str | None = None) -> bool:
        """Release a pin; returns False when that prefix was not pinned."""
        return self.engine.unpin_prefix(self._prefix_ids(prefix), cache_salt)

    def _prefix_ids(self, prefix: str | list[int]) -> list[int]:
        if isinstance(prefix, str):
            return self.tokenizer.encode(prefix, add_special_tokens=False)
        return list(prefix)

    def score(
        self,
        prompt_token_ids: list[int],
        start: int = 1,
        press_after: int | None = None,
        segments: Sequence[Sequence[Any]] | None = None,
    ) -> torch.Tensor:
        """Teacher-forced next-token log-distributions of a text (``kvstack eval``).

        Row ``i`` is the model's log-softmax distribution for token ``start + i`` given
        every token before it, read through this engine's KV cache (codec included):
        ``[len(prompt_token_ids) - start, vocab]``, float16. The prompt runs in chunks of
        ``max_num_batched_tokens``, so later chunks attend to earlier ones' cached KV.
        With a press (``kv_press``), ``press_after`` tokens are computed, pressed, and the
        rest is read through the pressed cache (default: ``start``). ``segments``: token
        ranges before ``start`` reused as segments (``generate``'s), so the rows score what
        their copies change.
        """
        if not 1 <= start < len(prompt_token_ids):
            raise InvalidRequestError(f"start must be in [1, {len(prompt_token_ids)}), got {start}")
        rid = self.engine.new_request_id()
        with self.engine.capture_logits(rid, start) as capture:
            after = start if press_after is None else press_after
            sp = SamplingParams(max_tokens=1, prompt_logprobs=0, kv_press_after=after)
            self.engine.add_request(
                rid, None, sp, prompt_token_ids=list(prompt_token_ids), segments=segments
            )
            self._run([rid], False, False, None)
        return capture.logprobs()

    def shutdown(self) -> None:
        """Write queued offload-tier stores and stop the I/O thread (no-op without tiers)."""
        self.engine.shutdown()

    def get_stats(self) -> EngineStats:
        """Engine counters: prefix hits, evictions, preemptions, KV usage and waste."""
        return self.engine.stats()

    def get_tokenizer(self) -> Tokenizer:
        """The engine's tokenizer, as vLLM's ``LLM.get_tokenizer()``: ``encode``,
        ``decode`` and ``apply_chat_template`` as transformers' tokenizers have them."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` samples with when given no ``SamplingParams``: vLLM's defaults
        overridden by the model's generation config (option ``generation_config``)."""
        return self.engine.default_sampling_params()

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[RequestOutput]:
        """Apply the chat template to one or several conversations and generate.

        Rendered as the server renders a chat (``kvstack.model.tokenizer.chat_template``):
        ``developer`` messages as ``system``, text parts joined with newlines.
        ``chat_template`` (a file or the Jinja text) replaces the engine's for this call;
        ``continue_final_message`` continues a final assistant message (with
        ``add_generation_prompt=False``).
        """
        convs: list[Any] = (
            [messages] if messages and isinstance(messages[0], dict) else list(messages)
        )
        template = load_chat_template(chat_template) if chat_template is not None else None
        token_ids = []
        for conv in convs:
            ids = self.tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, tokenize=True,
                continue_final_message=continue_final_message, chat_template=template,
                **(chat_template_kwargs or {}),
            )  # fmt: skip
            assert isinstance(ids, list)
            token_ids.append(ids)
        return self.generate(
            sampling_params=sampling_params, prompt_token_ids=token_ids, use_tqdm=use_tqdm
        )

    def _run(
        self,
        ids: list[str],
        use_tqdm: bool | Callable[..., Any],
        check_integrity: bool,
        on_step: Callable[[], None] | None,
    ) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar_cls = use_tqdm if callable(use_tqdm) else tqdm
            bar = bar_cls(total=len(ids), desc="Processed prompts", unit="req")
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step(final_only=True):
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if check_integrity:
                    self.engine.check_integrity()
                if on_step is not None:
                    on_step()
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids if i in results]


LLM.__doc__ = f"""{LLM.__doc__}
    Options (declared in ``kvstack.config.engine``; defaults as in the CLI):

{EngineConfig.describe("    ")}

    vLLM keywords (``kvstack.config.vllm_args``):

{describe_vllm_keywords("    ")}
    """
