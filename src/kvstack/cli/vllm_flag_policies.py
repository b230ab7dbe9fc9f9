"""What each ``vllm serve`` flag kvstack does not declare itself means here (``vllm_flags``).

A policy is ``ignored`` only where the flag's absence changes no answer (GPU kernels,
CUDA graphs, NCCL, several machines, multimodal limits on a text model, vLLM's logging
internals); ``neutral`` where kvstack already behaves as one of the values; ``mapped``
where it is kvstack's option under another name; ``refused`` where kvstack lacks the
feature and accepting the flag would silently change answers. ``FAMILIES`` give one
policy to a family of dests (a regular expression over vLLM's dest names); ``POLICIES``
name single dests and win over the families.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstack.core.errors import ConfigError

KINDS = ("ignored", "neutral", "mapped", "refused")


@dataclass(frozen=True)
class Policy:
    """``kind`` (one of ``KINDS``) and the reason stated at start-up and in the docs.

    ``accept``: the values (lower-case text) a ``neutral`` flag may take; ``maps_to``
    and ``convert``: the kvstack option a ``mapped`` flag sets and how its text becomes
    that option's value. A switch given as "off" (``--no-x``) is accepted by any policy.
    """

    kind: str
    reason: str
    accept: tuple[str, ...] = ()
    maps_to: str | None = None
    convert: Callable[[str], Any] = str

    def judge(self, flag: str, value: Any) -> str:
        """The start-up note for ``flag`` given ``value``; ``ConfigError`` if refused."""
        if value is False:
            return f"vLLM flag {flag} off: kvstack does not have it on either ({self.reason})"
        if self.kind == "refused" or (
            self.kind == "neutral" and self.accept and _text(value) not in self.accept
        ):
            shown = "" if value is True else f" {_text(value)}"
            only = f" (kvstack accepts only: {', '.join(self.accept)})" if self.accept else ""
            raise ConfigError(f"{flag}{shown}: not supported by kvstack: {self.reason}{only}")
        if self.kind == "mapped":
            return f"vLLM flag {flag} -> kvstack --{str(self.maps_to).replace('_', '-')}"
        return f"vLLM flag {flag} accepted, no effect: {self.reason}"


def _text(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(str(v) for v in value).lower()
    return str(value).lower()


def human_int(text: str) -> int:
    """vLLM's ``human_readable_int``: ``25.6k`` = 25,600 (lower case: powers of 1000),
    ``64M`` = 64 * 2**20 (upper case: powers of 1024), plain digits as they are."""
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
    units |= {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    text = str(text).strip()
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise ConfigError(f"expected a whole number such as 64M or 25.6k, got {text!r}") from None


def ignored(reason: str) -> Policy:
    return Policy("ignored", reason)


def neutral(reason: str, *accept: str) -> Policy:
    return Policy("neutral", reason, accept=accept)


def refused(reason: str) -> Policy:
    return Policy("refused", reason)


def mapped(to: str, convert: Callable[[str], Any] = str) -> Policy:
    return Policy("mapped", f"kvstack's --{to.replace('_', '-')}", maps_to=to, convert=convert)


GPU = "GPU-only (kernels, CUDA graphs, device memory); kvstack runs on CPU"
MULTI = (
    "several processes or machines (parallelism, NCCL, Ray); kvstack runs one engine "
    "process (replicas: kvstack router)"
)
MOE = "mixture-of-experts placement across GPUs; kvstack runs dense models on one CPU"
MAMBA = "Mamba/SSM state; kvstack's models keep no SSM state"
MM = "multimodal inputs; kvstack serves text-only models, where vLLM ignores it too"
LOAD = "vLLM's weight-loader tuning; kvstack reads .gguf / safetensors itself"
OBS = "vLLM's tracing / profiling internals; kvstack's own metrics are at /metrics"
SCHED = (
    "vLLM scheduler tuning; kvstack's scheduler takes --max-num-seqs and "
    "--max-num-batched-tokens (the order of outputs, not their text, depends on it)"
)
LORA_SIZES = "sizes LoRA slots; kvstack loads no adapters (--lora-modules is refused)"
COHERE = "vLLM's Cohere / Anthropic endpoints only; kvstack does not serve them"
TEXT = "kvstack does not implement it yet"

FAMILIES: tuple[tuple[str, Policy], ...] = (
    (r"(max_)?cudagraph_.*|cuda_graph_.*|.*_cudagraph|cudagraph_metrics", ignored(GPU)),
    (r".*_backend|.*nvtx.*|enable_flashinfer_autotune|monokernel|ir_op_priority", ignored(GPU)),
    (r"enable_cumem_allocator|enable_nccl_comm_suspend|sleep_.*|enable_sleep_mode", ignored(GPU)),
    (r"data_parallel_.*|dp_.*|dcp_.*|cp_kv_.*|master_.*|nnodes|node_rank", ignored(MULTI)),
    (r"distributed_.*|cpu_distributed_.*|numa_bind.*|device_ids|enable_scale_out", ignored(MULTI)),
    (r"ray_.*|worker_cls|worker_extension_cls|.*fault_tolerance.*|grpc_port", ignored(MULTI)),
    (r"enable_hc_sp|enable_batch_sharded_sampling|disable_nccl_for_dp_.*", ignored(MULTI)),
    (r"max_parallel_loading_workers|weight_transfer_config", ignored(MULTI)),
    (r"enable_shm_tensor_arena", ignored(MULTI)),
    (r".*expert.*|.*eplb.*|all2all_.*|.*dbo.*|ubatch_size|.*elastic_ep.*", ignored(MOE)),
    (r".*_ep_.*|num_redundant_experts|enable_return_routed_experts", ignored(MOE)),
    (r".*mamba.*|.*replayssm.*|prefix_match_unit|swa_bounded_replay", ignored(MAMBA)),
    (r"mm_.*|.*_mm_.*|limit_mm_per_prompt|media_io_kwargs|video_pruning_.*", ignored(MM)),
    (r"trust_request_mm_kwargs|allowed_local_media_path|allowed_media_domains", ignored(MM)),
    (r"language_model_only|enable_tower_connector_lora|default_mm_loras|ec_.*", ignored(MM)),
    (r"safetensors_.*|model_loader_extra_config|ignore_patterns|use_tqdm_on_load", ignored(LOAD)),
    (r"pt_load_map_location|quantization_config|allow_deprecated_quantization", ignored(LOAD)),
    (r"offload_.*|cpu_offload_params", ignored("weights offload; kvstack keeps weights in RAM")),
    (r"max_loras|max_lora_.*|lora_dtype|max_cpu_loras|fully_sharded_loras", ignored(LORA_SIZES)),
    (r"lora_target_modules|specialize_active_lora|.*moe.*lora.*", ignored(LORA_SIZES)),
    (r"otlp_.*|collect_detailed_traces|profiler_config|jit_monitor_.*", ignored(OBS)),
    (r"enable_mfu_metrics|enable_logging_iteration_details|watchdog_config", ignored(OBS)),
    (r"aggregate_engine_logging|per_request_spec_decode_metrics|enable_trace_replay", ignored(OBS)),
    (r"show_hidden_metrics_for_version|custom_histogram_buckets", ignored(OBS)),
    (r"cohere_.*|anthropic_.*", ignored(COHERE)),
    (r"max_num_scheduled_tokens|max_num_active_seqs|max_num_queued_tokens", ignored(SCHED)),
    (r"long_prefill_.*|scheduler_reserve_full_isl|watermark", ignored(SCHED)),
    (r"prefill_schedule_interval", ignored(SCHED)),
    (r"async_scheduling|disable_chunked_mm_input|dp_sync_interval", ignored(SCHED)),
)  # fmt: skip

POLICIES: dict[str, Policy] = {
    # The front end.
    "headless": refused("kvstack serve always runs its API server (no engine-only mode)"),
    "api_server_count": neutral("kvstack runs one API server process", "1"),
    "grpc": refused("kvstack serves HTTP only"),
    "lora_modules": refused(
        "LoRA adapters are not implemented; a request naming one gets 404, so the flag "
        "is refused rather than serving the base model under the adapter's name"
    ),
    "chat_template_content_format": neutral(
        "kvstack passes string content as a string and text parts joined ('auto')", "auto"
    ),
    "reasoning_effort_map": refused(
        "kvstack's reasoning parsers are built in (--reasoning-parser deepseek_r1 or qwen3) "
        "and take no effort map"
    ),
    "reasoning_parser_plugin": refused(
        "kvstack loads no parser plugins; --reasoning-parser deepseek_r1 or qwen3 are built in"
    ),
    "reasoning_config": refused(
        "kvstack's reasoning parsers are built in (--reasoning-parser deepseek_r1 or qwen3) "
        "and take no config"
    ),
    "exclude_tools_when_tool_choice_none": refused(TEXT),
    "tool_parser_plugin": refused("kvstack imports no code named on the command line"),
    "tool_strict_level": refused(TEXT),
    "tool_server": refused("built-in tool servers (browser, python) are not implemented"),
    "enable_prompt_tokens_details": ignored(
        "kvstack always reports usage.prompt_tokens_details.cached_tokens"
    ),
    "max_log_len": ignored("kvstack's request log lines carry sizes, never prompt text"),
    "enable_per_request_metrics": refused(TEXT + " (per-request timings are at /metrics)"),
    "enable_server_load_tracking": ignored("kvstack always tracks /load's server_load"),
    "enable_force_include_usage": refused(TEXT + " (ask with stream_options.include_usage)"),
    "sse_keep_alive_interval": ignored("kvstack streams send no keep-alive comments"),
    "enable_tokenizer_info_endpoint": refused("/tokenizer_info is not served"),
    "enable_log_outputs": ignored("--enable-log-requests' lines carry sizes, not text"),
    "enable_log_deltas": ignored("--enable-log-requests' lines carry sizes, not text"),
    "log_error_stack": ignored("kvstack always logs the stack of a 500"),
    "tokens_only": refused("kvstack serves the whole OpenAI API, not tokens in/out only"),
    "uds": refused(TEXT + " (serve on --host/--port)"),
    "disable_access_log_for_endpoints": ignored("kvstack's access log is uvicorn's, unfiltered"),
    "enable_ssl_refresh": ignored("certificates are read once at start-up; restart to renew"),
    "middleware": refused("kvstack imports no code named on the command line"),
    "enable_request_id_headers": ignored("kvstack's responses carry their id in the body"),
    "h11_max_incomplete_event_size": ignored("kvstack bounds headers by --header-timeout"),
    "h11_max_header_count": ignored("kvstack bounds headers by --header-timeout"),
    "enable_offline_docs": ignored("kvstack's /docs and /redoc always use local assets"),
    "enable_flash_late_interaction": ignored(GPU),
    # The model.
    "runner": neutral("kvstack runs generative models", "auto", "generate"),
    "convert": neutral("kvstack runs generative models as they are", "auto", "none"),
    "hf_config_path": refused("kvstack reads config.json from the model folder"),
    "trust_remote_code": ignored("kvstack never runs code from a checkpoint"),
    "enforce_eager": ignored("kvstack always runs eagerly (no CUDA graphs)"),
    "disable_custom_all_reduce": ignored(MULTI),
    "code_revision": ignored("kvstack never runs code from a checkpoint"),
    "return_sampling_mask": refused(TEXT),
    "logprobs_mode": neutral("kvstack returns the processed model's raw logprobs", "raw_logprobs"),
    "use_fp64_gumbel": ignored("kvstack samples with torch.multinomial, not Gumbel noise"),
    "disable_sliding_window": refused("window models run with their window, as trained"),
    "disable_cascade_attn": ignored(GPU),
    "skip_tokenizer_init": refused("kvstack needs the tokenizer (text in, text out)"),
    "enable_prompt_embeds": refused("prompt embeddings are not supported"),
    "config_format": neutral(
        "kvstack reads Hugging Face config.json or GGUF metadata", "auto", "hf"
    ),
    "hf_overrides": neutral("kvstack applies no config overrides", "{}"),
    "model_class_overrides": neutral("kvstack applies no model class overrides", "{}"),
    "pooler_config": refused("pooling models are not served"),
    "override_generation_config": refused(TEXT + " (set sampling per request)"),
    "model_impl": neutral("kvstack runs its own model code", "auto"),
    "logits_processors": refused("kvstack imports no code named on the command line"),
    "io_processor_plugin": refused("kvstack imports no code named on the command line"),
    "renderer_num_workers": ignored("kvstack renders prompts in two worker threads"),
    "load_format": neutral(
        "kvstack reads the model's own weights; 'dummy' (random weights) would change answers",
        *("auto", "safetensors", "gguf", "fastsafetensors"),
    ),
    "decode_context_parallel_size": neutral(MULTI, "1"),
    "prefill_context_parallel_size": neutral(MULTI, "1"),
    "kv_cache_memory_bytes": mapped("kv_cache_memory", human_int),
    "num_gpu_blocks_override": mapped("num_blocks", human_int),
    "prefix_cache_retention_interval": ignored("kvstack's eviction policy is --eviction-policy"),
    "kv_cache_dtype_skip_layers": refused(TEXT),
    "kv_sharing_fast_prefill": ignored(GPU),
    "kv_offloading_size": ignored("KV offload to host RAM is kvstack's --kv-offload host:SIZE"),
    "kv_offloading_backend": ignored("KV offload is kvstack's --kv-offload"),
    "enable_lora": ignored(
        "no adapter is loaded, so a request naming one gets 404 as in vLLM "
        "(--lora-modules is refused)"
    ),
    "logging_config": ignored("kvstack logs with its own format (-v for more)"),
    "log_config_file": ignored("kvstack logs with its own format (-v for more)"),
    "log_level": ignored("kvstack logs at INFO when serving (-v for more)"),
    "max_num_queued_reqs": mapped("max_waiting", human_int),
    "scheduling_policy": neutral("kvstack schedules first come, first served", "fcfs"),
    "scheduler_cls": refused("kvstack imports no code named on the command line"),
    "stream_interval": ignored("kvstack streams every token as it is made"),
    "spec_method": refused("give kvstack's --speculative-config JSON"),
    "spec_model": refused("give kvstack's --speculative-config JSON"),
    "spec_tokens": refused("give kvstack's --speculative-config JSON"),
    "watermark_config": refused(TEXT + " (it changes the sampled tokens)"),
    "diffusion_config": refused("diffusion models are not served"),
    "kv_transfer_config": ignored(
        "vLLM's KV connectors between GPU nodes; kvstack's prefill/decode split is "
        "--role with --kv-offload, and a decode node without it recomputes the same KV"
    ),
    "engram_config": refused(TEXT),
    "kernel_config": ignored(GPU),
    "attention_config": ignored(GPU),
    "additional_config": ignored("vLLM platform plugins' options"),
    "structured_outputs_config": ignored(
        "kvstack's grammar engine is its own (kvstack.core.structured_outputs)"
    ),
    "aux_output_config": refused(TEXT),
    "optimization_level": ignored(GPU),
    "performance_mode": ignored(GPU),
    "fail_on_environ_validation": ignored("kvstack reads only the VLLM_* variables it names"),
    "shutdown_timeout": mapped("shutdown_grace", float),
}
