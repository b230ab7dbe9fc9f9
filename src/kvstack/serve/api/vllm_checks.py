"""vLLM's request checks that depend on the server's flags, with vLLM 0.33's messages.

Each raises ``InvalidRequestError`` (a 400 naming ``param``) before the request is
tokenized: ``stream_options`` without ``stream`` (vLLM's ``validate_stream_options``),
more logprobs than ``--max-logprobs`` (vLLM's ``SamplingParams._validate_logprobs``
wording), a request-level ``chat_template`` without ``--trust-request-chat-template``
(vLLM's online renderer), and ``use_beam_search``, which kvstack does not implement.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from kvstack.core.errors import InvalidRequestError
from kvstack.core.request import SamplingParams
from kvstack.serve.api.protocol import ChatCompletionRequest, CompletionRequest
from kvstack.serve.frontend_options import FrontendOptions

logger = logging.getLogger("kvstack.serve")
UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


def check_request(req: CompletionRequest | ChatCompletionRequest, opts: FrontendOptions) -> None:
    """400 for what vLLM refuses given these options (see the module docstring)."""
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    if req.use_beam_search:
        raise InvalidRequestError(
            "beam search (use_beam_search) is not supported by kvstack yet",
            param="use_beam_search",
        )
    if isinstance(req, ChatCompletionRequest):
        sample = req.top_logprobs if req.logprobs else None
        if req.chat_template is not None and not opts.trust_request_chat_template:
            raise InvalidRequestError(UNTRUSTED_TEMPLATE, param="chat_template")
    else:
        sample = req.logprobs
    cap = opts.max_logprobs
    if sample is not None and sample > cap:
        raise InvalidRequestError(
            f"Requested sample logprobs of {sample}, which is greater than max allowed: {cap}",
            param="logprobs",
        )
    if req.prompt_logprobs is not None and req.prompt_logprobs > cap:
        raise InvalidRequestError(
            f"Requested prompt logprobs of {req.prompt_logprobs}, which is greater than max "
            f"allowed: {cap}",
            param="prompt_logprobs",
        )


def tokens_as_ids(req: CompletionRequest | ChatCompletionRequest, opts: FrontendOptions) -> bool:
    """Whether logprob tokens are named ``token_id:N`` (the request's choice, else the flag)."""
    asked = req.return_tokens_as_token_ids
    return opts.return_tokens_as_token_ids if asked is None else asked


def fit_context(sp: SamplingParams, num_prompt: int, max_model_len: int) -> SamplingParams:
    """``sp`` checked for a prompt of ``num_prompt`` tokens, as vLLM's ``_validate_input``:
    a prompt that leaves no room is a 400 with vLLM's "This model's maximum context length
    is ..." (param ``input_tokens``), and a ``max_tokens`` past the room left is vLLM's
    "'max_tokens' or 'max_completion_tokens' is too large" 400 (param ``max_tokens``)."""
    room = max_model_len - num_prompt
    if room <= 0:
        why = (
            "which exceeds this limit even without any output tokens"
            if room < 0
            else "which leaves no room for any output token"
        )
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {num_prompt} input tokens, {why}. Please reduce the length of "
            "the input prompt.",
            param="input_tokens",
        )
    if sp.max_tokens is not None and sp.max_tokens > room:
        raise InvalidRequestError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {sp.max_tokens}. This "
            f"model's maximum context length is {max_model_len} tokens and your request has "
            f"{num_prompt} input tokens ({sp.max_tokens} > {max_model_len} - {num_prompt}).",
            param="max_tokens",
        )
    return sp


def model_card(name: str, root: str, max_model_len: int) -> dict[str, Any]:
    """One ``/v1/models`` entry in vLLM's ``ModelCard`` shape, ``owned_by`` "vllm" and one
    ``model_permission`` included, so clients that read vLLM's fields find them."""
    now = int(time.time())
    permission = {
        "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": now,
        "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
        "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
        "organization": "*", "group": None, "is_blocking": False,
    }  # fmt: skip
    return {
        "id": name, "object": "model", "created": now, "owned_by": "vllm", "root": root,
        "parent": None, "max_model_len": max_model_len, "permission": [permission],
    }  # fmt: skip


def log_request(
    rid: str, req: CompletionRequest | ChatCompletionRequest, prompt_lengths: list[int]
) -> None:
    """``--enable-log-requests``: one line per request, sizes and sampling, never text."""
    fields = ("n", "max_tokens", "temperature", "top_p", "top_k", "seed", "stream")
    params = {f: getattr(req, f) for f in fields if getattr(req, f, None) is not None}
    logger.info("Received request %s: prompt tokens %s, params %s", rid, prompt_lengths, params)
