"""The names a server answers to when ``--served-model-name`` is not given, as vLLM's.

vLLM serves a model under the string given on the command line (``vllm serve ORG/NAME``
answers to ``ORG/NAME``), so a client sending that string is served. kvstack does the
same and keeps the file's stem (a ``.gguf``'s ``SmolLM2-135M-Instruct.Q4_1``, a folder's
name, a cached Hugging Face id's ``NAME``) as an alias, which older kvstack clients
send. kvstack's own shortcuts (``default``, ``gemma3-270m``, ``qwen2.5-coder-0.5b``, ...)
name no file a client would know, so they serve the stem alone, as before (the 0.5B
answers to ``qwen2.5-coder-0.5b-instruct-q4_k_m``, the official GGUF's name).
"""

from __future__ import annotations

from pathlib import Path


def default_served_names(model: str) -> tuple[str, ...]:
    """(name in responses and metrics, aliases...) for ``model`` as given."""
    from kvstack.model.loader.part_wheels import part_wheel_model
    from kvstack.model.loader.registry import DEFAULT_ALIASES, GEMMA3_ALIASES, resolve_model_path

    path = Path(resolve_model_path(model))
    stem = path.stem if path.is_file() else path.name
    if not Path(model).expanduser().exists() and "/" in model:  # a cached HF id
        stem = model.rstrip("/").rsplit("/", 1)[1]
    if model.strip().lower() in DEFAULT_ALIASES | GEMMA3_ALIASES or part_wheel_model(model):
        return (stem,)
    return tuple(dict.fromkeys((model, stem)))
