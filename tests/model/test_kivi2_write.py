"""kivi2's C++ KV write (``csrc/kivi2_write.cpp``) stores exactly what the codec's PyTorch
write stores: the 2-bit codes, the bf16 per-channel key and per-token value parameters,
the residual slots of filling blocks and the step's full-precision blocks, bit for bit,
for bf16 and float32, strided rows (views into a fused qkv), prefill chunks, decode steps
that fill blocks, and a block written again after it was reallocated; bad input is
refused."""

from __future__ import annotations

import pytest
import torch

from kvstack.kv.codecs import CacheShape, codec_class
from kvstack.kv.codecs.kivi import Kivi2Codec
from kvstack.model.kernels.loader import Kernels

BS, KVH, HD = 16, 3, 64


def _rows(g: torch.Generator, t: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v as views into one [t, (9 + 2 KVH) HD] qkv block, as the model splits it."""
    qkv = torch.randn(t, (9 + 2 * KVH) * HD, generator=g) * 3
    qkv[:, 9 * HD + 5] += 40.0  # an outlier key channel
    qkv[0, (9 + KVH) * HD :] = torch.arange(KVH * HD) % 4 - 1.5  # value quotients at ties
    qkv = qkv.to(dtype)
    k = qkv[:, 9 * HD : (9 + KVH) * HD].view(t, KVH, HD)
    return k, qkv[:, (9 + KVH) * HD :].view(t, KVH, HD)


def _slots(blocks: list[int], start: int, n: int) -> list[int]:
    return [blocks[p // BS] * BS + p % BS for p in range(start, start + n)]


def _state(c: Kivi2Codec) -> list[torch.Tensor]:
    return [c.k_codes, c.k_params, c.v_codes, c.v_params, c.res_k, c.res_v, c._step_k, c._step_v]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kivi2_write_matches_the_pytorch_write(kernels: Kernels, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    shape = CacheShape(2, 12, BS, KVH, HD)
    ref, cpp = (codec_class("kivi2")(shape, dtype, 4) for _ in range(2))
    assert isinstance(ref, Kivi2Codec) and isinstance(cpp, Kivi2Codec)
    a, b = [1, 2, 3], [4, 5, 6]
    steps = [_slots(a, 0, 37) + _slots(b, 0, 20)]  # two prefills in one step
    steps += [_slots(a, 37 + i, 1) + _slots(b, 20 + i, 1) for i in range(11)]  # fills a's 3rd
    chunk = _slots(b, 31, 9)  # fills b's 2nd block, starts its 3rd
    steps.append([chunk[i] for i in torch.randperm(9, generator=g).tolist()])  # any order
    steps.append(_slots([1], 0, 5))  # block 1 reallocated (after a free) and written again
    for slots in steps:
        s = torch.tensor(slots)
        for layer in range(shape.num_layers):
            k, v = _rows(g, len(slots), dtype)
            assert ref.write(layer, s, k, v) is False
            assert cpp.write(layer, s, k, v, kernels) is True
            for want, got in zip(_state(ref), _state(cpp), strict=True):
                assert torch.equal(want, got)
    ref.check_integrity()
    cpp.check_integrity()
    assert cpp.k_codes.any() and cpp.v_params.any()  # blocks were quantized


def test_kivi2_write_refuses_bad_input(kernels: Kernels) -> None:
    codec = codec_class("kivi2")(CacheShape(1, 4, BS, KVH, HD), torch.float32, 2)
    assert isinstance(codec, Kivi2Codec)
    x = torch.randn(2, KVH, HD)
    tmp = torch.zeros(1, BS, KVH, HD)
    idx = torch.zeros(0, dtype=torch.long)
    args = (idx, idx, idx, idx, idx, idx, codec.k_codes[0], codec.k_params[0], True)
    with pytest.raises(RuntimeError, match="outside tmp"):
        kernels.kivi2_write(x, torch.tensor([0, 99]), tmp, codec.res_k[0], *args)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernels.kivi2_write(x.double(), torch.tensor([0, 1]), tmp, codec.res_k[0], *args)
    bad = (idx, idx, torch.tensor([0]), torch.tensor([9]), idx, idx, *args[6:])
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.kivi2_write(x, torch.tensor([0, 1]), tmp, codec.res_k[0], *bad)
    assert not tmp.any() and not codec.k_codes.any()  # checked before anything is written
