"""vLLM's front-end flags that change what ``kvstack serve`` does, under vLLM's names.

``FrontendOptions`` is a part of ``ServerOptions`` (its options are flattened into
``kvstack serve``'s flags), declared as vLLM 0.33's ``FrontendArgs`` documents them
(``vllm/entrypoints/common/cli_args.py``), with vLLM's defaults: the uvicorn log
level and access log, TLS, request logging, the docs pages, the response role,
``token_id:N`` logprob tokens, the logprobs cap, request-level chat templates, CORS's
methods/headers/credentials and ``system_fingerprint``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import kvstack
from kvstack.core.errors import ConfigError
from kvstack.core.options import check_choices, option

FRONTEND = "vLLM front end"
UVICORN_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
FINGERPRINT_MODES = ("full", "hash", "custom", "none")


def _json_list(value: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """vLLM's ``'["GET", "POST"]'`` (or an already parsed list) as a tuple (idempotent)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"expected a JSON list of strings, got {value!r}: {e}") from None
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"expected a JSON list of strings, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class FrontendOptions:
    """vLLM's front-end options kvstack implements; ``max_logprobs`` >= 0."""

    uvicorn_log_level: str = option(
        "info", "uvicorn's log level (vLLM's flag)", group=FRONTEND,
        choices=lambda: UVICORN_LEVELS,
    )  # fmt: skip
    disable_uvicorn_access_log: bool = option(
        False, "no uvicorn access log line per request (vLLM's flag)", group=FRONTEND
    )
    enable_log_requests: bool = option(
        False,
        "log one line per request received (id, endpoint, prompt count, sampling "
        "parameters; never the prompt text), as vLLM's flag",
        group=FRONTEND,
    )
    disable_fastapi_docs: bool = option(
        False, "serve no /openapi.json, /docs or /redoc (vLLM's flag)", group=FRONTEND
    )
    response_role: str = option(
        "assistant",
        "the role of chat answers when add_generation_prompt is true (vLLM's flag)",
        group=FRONTEND,
    )
    return_tokens_as_token_ids: bool = option(
        False,
        "logprobs name tokens 'token_id:N' instead of their text, so tokens that are "
        "not valid UTF-8 alone stay identifiable (vLLM's flag; a request may ask with "
        "return_tokens_as_token_ids)",
        group=FRONTEND,
    )
    max_logprobs: int = option(
        20,
        "the most logprobs / top_logprobs / prompt_logprobs a request may ask for "
        "(vLLM's flag and default); more is 400",
        group=FRONTEND,
    )
    trust_request_chat_template: bool = option(
        False,
        "let a request's chat_template replace the model's (vLLM's flag); without it a "
        "request naming one gets 400",
        group=FRONTEND,
    )
    default_chat_template_kwargs: str | None = option(
        None,
        "chat template keywords every request gets unless it sets them itself, a JSON "
        """object (vLLM's flag), e.g. '{"enable_thinking": false}'""",
        group=FRONTEND, metavar="JSON",
    )  # fmt: skip
    ssl_keyfile: str | None = option(None, "TLS key file (vLLM's flag)", group=FRONTEND)
    ssl_certfile: str | None = option(None, "TLS certificate file (vLLM's flag)", group=FRONTEND)
    ssl_ca_certs: str | None = option(None, "CA certificates file (vLLM's flag)", group=FRONTEND)
    ssl_cert_reqs: int = option(
        0, "client certificates: 0 none, 1 optional, 2 required (ssl.CERT_*)", group=FRONTEND
    )
    ssl_ciphers: str | None = option(None, "TLS 1.2 cipher suites (vLLM's flag)", group=FRONTEND)
    allow_credentials: bool = option(
        False, "CORS: allow credentials (with --allowed-origins)", group=FRONTEND
    )
    allowed_methods: tuple[str, ...] = option(
        ("*",), "CORS methods, a JSON list (with --allowed-origins)", group=FRONTEND,
        metavar="JSON_LIST", convert=_json_list,
    )  # fmt: skip
    allowed_headers: tuple[str, ...] = option(
        ("*",), "CORS headers, a JSON list (with --allowed-origins)", group=FRONTEND,
        metavar="JSON_LIST", convert=_json_list,
    )  # fmt: skip
    fingerprint_mode: str = option(
        "full",
        "system_fingerprint on responses: full / hash ('kvstack-VERSION-HASH8', HASH8 of "
        "the model and engine options), custom (--fingerprint-value) or none (null)",
        group=FRONTEND, choices=lambda: FINGERPRINT_MODES,
    )  # fmt: skip
    fingerprint_value: str | None = option(
        None, "system_fingerprint with --fingerprint-mode custom", group=FRONTEND
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_methods", _json_list(self.allowed_methods))
        object.__setattr__(self, "allowed_headers", _json_list(self.allowed_headers))
        if self.max_logprobs < 0:
            raise ConfigError(f"--max-logprobs must be >= 0, got {self.max_logprobs}")
        if not self.response_role:
            raise ConfigError("--response-role must not be empty")
        if (self.fingerprint_mode == "custom") != (self.fingerprint_value is not None):
            raise ConfigError("--fingerprint-value goes with --fingerprint-mode custom")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ConfigError("--ssl-keyfile and --ssl-certfile go together")
        self.template_defaults()  # one clear line at start-up for bad JSON
        check_choices(self)

    def template_defaults(self) -> dict[str, Any]:
        """``--default-chat-template-kwargs`` as a dict (empty when not given)."""
        if self.default_chat_template_kwargs is None:
            return {}
        try:
            value = json.loads(self.default_chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--default-chat-template-kwargs is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError("--default-chat-template-kwargs must be a JSON object")
        from kvstack.model.tokenizer.tokenizer import RESERVED_TEMPLATE_KWARGS

        clash = sorted(RESERVED_TEMPLATE_KWARGS & set(value))
        if clash:
            raise ConfigError(f"--default-chat-template-kwargs may not set {clash}")
        return value

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """uvicorn.Config's log and TLS keywords for these options."""
        return {
            "log_level": self.uvicorn_log_level,
            "access_log": not self.disable_uvicorn_access_log,
            "ssl_keyfile": self.ssl_keyfile,
            "ssl_certfile": self.ssl_certfile,
            "ssl_ca_certs": self.ssl_ca_certs,
            "ssl_cert_reqs": self.ssl_cert_reqs,
            **({"ssl_ciphers": self.ssl_ciphers} if self.ssl_ciphers else {}),
        }

    def fingerprint(self, identity: str) -> str | None:
        """``system_fingerprint``: kvstack's version and an 8-hex hash of ``identity``
        (the model and engine options), as vLLM's ``vllm-VERSION-HASH8``."""
        if self.fingerprint_mode == "none":
            return None
        if self.fingerprint_mode == "custom":
            return self.fingerprint_value
        digest = hashlib.sha256(identity.encode("utf-8")).hexdigest()[:8]
        return f"kvstack-{kvstack.__version__}-{digest}"
