"""The Llama forward on the paged cache vs transformers on a tiny random model, and the
C++ decode kernel vs the PyTorch fallback."""

from __future__ import annotations

import pytest
import torch

from kvstack.config.engine import ModelConfig
from kvstack.kv.storage import KVStorage
from kvstack.model.arch.decoder import LlamaModel
from kvstack.model.attention import AttentionMetadata, PrefillSeq, decode_attention
from kvstack.model.kernels.loader import Kernels, load_kernels
from kvstack.testing.tiny_models import hf_config_dict, tiny_llama_config

BS = 4
BLOCKS = [7, 3, 9, 1, 12, 5]  # a shuffled block table: logical order != physical order


def slots(positions: range | list[int]) -> torch.Tensor:
    return torch.tensor([BLOCKS[p // BS] * BS + p % BS for p in positions])


def meta(
    slot_mapping: torch.Tensor,
    prefills: list[PrefillSeq],
    decode_len: int | None = None,
    kernels: bool = False,
) -> AttentionMetadata:
    if decode_len is None:
        return AttentionMetadata(slot_mapping, 0, None, None, None, prefills)
    table = torch.tensor([BLOCKS])
    bias = torch.zeros(1, len(BLOCKS) * BS)
    bias[0, decode_len:] = float("-inf")
    return AttentionMetadata(
        slot_mapping,
        1,
        table,
        torch.tensor([decode_len]),
        bias[:, None, None, :],
        [],
        kernels=load_kernels() if kernels else None,
    )


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, LlamaModel, ModelConfig]:
    """transformers' LlamaForCausalLM with random weights, and kvstack's model on them."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tiny_llama_config(vocab_size=300, max_position_embeddings=256)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config_dict(cfg))).eval()
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return hf, LlamaModel(cfg, weights, torch.float32), cfg


@pytest.mark.slow
@pytest.mark.parametrize("kernels", [False, True])
def test_prefill_chunked_and_decode_match_transformers(
    models: tuple[torch.nn.Module, LlamaModel, ModelConfig], kernels: bool
) -> None:
    hf, model, cfg = models
    ids = torch.randint(0, 300, (21,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]

    kv = KVStorage(cfg, 16, BS, torch.float32)
    full = model.forward(
        ids,
        torch.arange(21),
        meta(slots(range(21)), [PrefillSeq(0, 21, 21, None, None)]),
        kv,
        None,
    )
    assert (full - ref).abs().max() < 1e-4

    # Chunked: 13 tokens, then 7 more attending to the cached 13, then one decode token.
    kv = KVStorage(cfg, 16, BS, torch.float32)
    o1 = model.forward(
        ids[:13],
        torch.arange(13),
        meta(slots(range(13)), [PrefillSeq(0, 13, 13, None, None)]),
        kv,
        None,
    )
    pos = torch.arange(13, 20)
    mask = torch.arange(20)[None] <= pos[:, None]
    o2 = model.forward(
        ids[13:20],
        pos,
        meta(slots(range(13, 20)), [PrefillSeq(0, 7, 20, torch.tensor(BLOCKS), mask)]),
        kv,
        None,
    )
    o3 = model.forward(
        ids[20:],
        torch.tensor([20]),
        meta(slots([20]), [], decode_len=21, kernels=kernels),
        kv,
        None,
    )
    assert (torch.cat([o1, o2, o3]) - ref).abs().max() < 1e-4


@pytest.mark.parametrize("max_len", [100, 1300])  # 1300: three 512-token partitions
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_decode_kernel_matches_fallback(
    kernels: Kernels, dtype: torch.dtype, max_len: int
) -> None:
    g = torch.Generator().manual_seed(0)
    d, h, kvh, hd, bs, nb = 8, 9, 3, 64, 16, 96
    kc = torch.randn(nb, bs, kvh, hd, generator=g).to(dtype)
    vc = torch.randn(nb, bs, kvh, hd, generator=g).to(dtype)
    q = torch.randn(d, h, hd, generator=g).to(dtype)
    lens = torch.randint(1, max_len, (d,), generator=g)
    lens[0] = 1  # a single key
    out, ref = _kernel_and_reference(kernels, q, kc, vc, lens, g)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.float() - ref.float()).abs().max() < tol


def _kernel_and_reference(
    kernels: Kernels,
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    lens: torch.Tensor,
    g: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The C++ decode kernel's output and the PyTorch fallback's for rows of ``lens`` keys
    over random block tables of the cache ``kc``/``vc`` ``[blocks, bs, kvh, hd]``."""
    d, (nb, bs, kvh, hd) = q.shape[0], kc.shape
    mb = int((lens.max() + bs - 1) // bs)
    tables = torch.stack([torch.randperm(nb, generator=g)[:mb] for _ in range(d)])
    bias = torch.zeros(d, mb * bs)
    bias[torch.arange(mb * bs)[None] >= lens[:, None]] = float("-inf")
    keys, vals = kc[tables].view(d, -1, kvh, hd), vc[tables].view(d, -1, kvh, hd)
    ref = decode_attention(q, keys, vals, bias[:, None, None, :], hd**-0.5)
    return kernels.paged_decode_attention(q, kc, vc, tables, lens, hd**-0.5), ref


@pytest.mark.parametrize(
    ("h", "kvh"),
    # q heads per KV head 1..8; an item takes min(kvh, 16 // group) KV heads
    # (paged_attention_hd64.h): one item for all heads, two equal, and a short last one
    [(8, 8), (20, 20), (32, 8), (24, 3), (6, 3), (35, 5)],
)
def test_cpp_decode_kernel_splits_kv_heads_into_items(kernels: Kernels, h: int, kvh: int) -> None:
    g = torch.Generator().manual_seed(h * 100 + kvh)
    d, hd, bs, nb = 3, 64, 16, 64
    kc, vc = (torch.randn(nb, bs, kvh, hd, generator=g) for _ in range(2))
    q = torch.randn(d, h, hd, generator=g)
    lens = torch.tensor([1, 77, 600])  # one key; one partition; two (two threads' worth)
    out, ref = _kernel_and_reference(kernels, q, kc, vc, lens, g)
    assert (out - ref).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_decode_row_does_not_depend_on_its_batch_mates(
    kernels: Kernels, dtype: torch.dtype
) -> None:
    """decode_split.h cuts a row by its own length only (a lone long row into parts that
    occupy every thread): the row's output is bit-identical alone and next to rows of
    other lengths, on 1 and 2 threads."""
    g = torch.Generator().manual_seed(3)
    h, kvh, hd, bs, nb = 9, 3, 64, 16, 200
    kc = torch.randn(nb, bs, kvh, hd, generator=g).to(dtype)
    vc = torch.randn(nb, bs, kvh, hd, generator=g).to(dtype)
    lens = torch.tensor([700, 3, 1500, 129, 300])
    mb = int((lens.max() + bs - 1) // bs)
    tables = torch.stack([torch.randperm(nb, generator=g)[:mb] for _ in range(len(lens))])
    q = torch.randn(len(lens), h, hd, generator=g).to(dtype)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            batch = kernels.paged_decode_attention(q, kc, vc, tables, lens, hd**-0.5)
            for i in range(len(lens)):
                alone = kernels.paged_decode_attention(
                    q[i : i + 1], kc, vc, tables[i : i + 1], lens[i : i + 1], hd**-0.5
                )
                where = f"row {i} ({int(lens[i])} keys), {n} threads"
                assert torch.equal(alone[0], batch[i]), where
    finally:
        torch.set_num_threads(threads)


def test_cpp_decode_kernel_refuses_out_of_range_lengths_and_blocks(kernels: Kernels) -> None:
    kc = torch.zeros(4, 16, 3, 64)
    q = torch.zeros(1, 9, 64)
    table = torch.tensor([[0, 1]])
    with pytest.raises(RuntimeError, match="context length 33 outside"):
        kernels.paged_decode_attention(q, kc, kc, table, torch.tensor([33]), 0.125)
    with pytest.raises(RuntimeError, match="block id 4 outside"):
        kernels.paged_decode_attention(q, kc, kc, torch.tensor([[0, 4]]), torch.tensor([20]), 0.125)
