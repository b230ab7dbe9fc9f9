"""GGUF quantized blocks -> ``PackedWeight``, without expanding them to floats.

Block layouts, from llama.cpp's ``ggml-common.h`` (``d``, ``m``, ``dmin`` are fp16)::

    Q8_0  34 B / 32 w: d, qs int8[32]                    w = d * q
    Q4_0  18 B / 32 w: d, qs[16] (nibble pairs j, j+16)  w = d * (q - 8)
    Q4_1  20 B / 32 w: d, m, qs[16]                      w = d * q + m
    Q5_0  22 B / 32 w: d, qh u32, qs[16]                 w = d * (q - 16), q 5 bits:
         low nibbles as Q4_0's (j, j+16), bit j of qh the 5th bit of q_j
    Q6_K 210 B / 256 w: ql[128], qh[64], sc int8[16], d  w = d * sc_s * (q - 32), q 6 bits,
         sixteen 16-weight sub-blocks s (gguf-py's ``Q6_K.dequantize_blocks`` order)
    Q4_K 144 B / 256 w: d, dmin, scales[12], qs[128]     w = d * sc_s * q - dmin * m_s
         eight 32-weight sub-blocks s with 6-bit sc_s, m_s packed in ``scales`` (llama.cpp's
         ``get_scale_min_k4``); qs byte i of 64-chunk c holds sub-block 2c's value i in
         its low and sub-block 2c+1's value i in its high nibble.

Q4_0 / Q4_1 bytes are kvstack's 4-bit layout already (``packed.py``): they are copied, and
the scales widened to float32 (Q4_0's ``-8 d`` becomes the min). Q4_K's nibbles are
regrouped into that order, its sub-block scale ``d * sc`` and min ``-dmin * m`` computed in
float32 (exact: 11 x 6 bits). The dequantized values are bit-identical to gguf-py's
``gguf.quants.dequantize`` (``tests/model/test_quant_linear.py`` checks it).

Q5_0 and Q6_K become kvstack's 8-bit form (Q8_0's): the int8 codes ``q - 16`` / ``q - 32``
with the scale ``d`` per 32 weights / ``d * sc_s`` per 16 (fp16 x int8: exact in float32),
no min, so every 8-bit kernel serves them.

Deviations from llama.cpp: the fp16 scales are stored as float32 (4 extra bytes per
32 weights for Q4_0 / Q4_1 / Q8_0, +20 % for Q4_1): one kernel serves every format; Q5_0's
5 and Q6_K's 6 bits are widened to 8 (Q5_0 1.125 B a weight instead of llama.cpp's 0.69,
Q6_K 1.25 instead of 0.82; bf16 reads 2): one int8 code per weight keeps every 8-bit
kernel's arithmetic, instead of a bit-unpacking kernel per format.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from kvstack.core.model_config import ModelConfig
from kvstack.model.kernels.loader import note_fallback
from kvstack.model.loader.gguf import gguf_family, hf_name, unpermute_qk
from kvstack.model.loader.gguf_reader import GGUFFile
from kvstack.model.quant.packed import PackedWeight

Q = GGMLQuantizationType


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte ``at`` of every block, as float32 ``[N, blocks]``."""
    return (
        np.ascontiguousarray(blocks[..., at : at + 2]).view(np.float16)[..., 0].astype(np.float32)
    )


def _q8_0(blocks: np.ndarray) -> PackedWeight:
    n = blocks.shape[0]
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, -1)
    return PackedWeight(
        torch.from_numpy(q.copy()), torch.from_numpy(_f16(blocks, 0)), None, 8, 32, "Q8_0"
    )


def _q4_0(blocks: np.ndarray) -> PackedWeight:
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    q = np.ascontiguousarray(blocks[..., 2:]).reshape(n, -1)
    return PackedWeight(
        torch.from_numpy(q.copy()), torch.from_numpy(d), torch.from_numpy(-8 * d), 4, 32, "Q4_0"
    )


def _q4_1(blocks: np.ndarray) -> PackedWeight:
    n = blocks.shape[0]
    q = np.ascontiguousarray(blocks[..., 4:]).reshape(n, -1)
    return PackedWeight(
        torch.from_numpy(q.copy()),
        torch.from_numpy(_f16(blocks, 0)),
        torch.from_numpy(_f16(blocks, 2)),
        4,
        32,
        "Q4_1",
    )


def k4_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[..., 12]`` bytes -> the eight 6-bit (sc, m) of a Q4_K super-block (llama.cpp's
    ``get_scale_min_k4``): j < 4 from the low 6 bits of bytes j / j+4; j >= 4 from the
    nibbles of byte j+4 and the top 2 bits of bytes j-4 / j."""
    s = scales.astype(np.uint8)
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=-1)
    m = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, m


def _q4_k(blocks: np.ndarray) -> PackedWeight:
    n, nb = blocks.shape[0], blocks.shape[1]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, m = k4_scales(blocks[..., 4:16])
    scale = (d[..., None] * sc.astype(np.float32)).reshape(n, nb * 8)
    mn = -(dmin[..., None] * m.astype(np.float32)).reshape(n, nb * 8)
    # Chunk c's bytes i = 0..31 hold sub-block 2c's value i (low nibble) and 2c+1's (high);
    # kvstack's byte j of a sub-block holds its values j (low) and 16 + j (high): the nibbles
    # are regrouped byte-wise, never widened to one value per byte.
    qs = blocks[..., 16:].reshape(n, nb, 4, 2, 16)
    lo, hi = qs[..., 0, :], qs[..., 1, :]
    even = (lo & 15) | ((hi & 15) << 4)
    odd = (lo >> 4) | (hi & 0xF0)
    codes = np.stack([even, odd], axis=3).reshape(n, nb * 128)
    return PackedWeight(
        torch.from_numpy(codes),
        torch.from_numpy(np.ascontiguousarray(scale)),
        torch.from_numpy(np.ascontiguousarray(mn)),
        4,
        32,
        "Q4_K",
    )


def _q5_0(blocks: np.ndarray) -> PackedWeight:
    n = blocks.shape[0]
    qh = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")  # [N, blocks, 1]: bit j = q_j's 5th
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [N, blocks, 32]
    qs = blocks[..., 6:22]
    low = np.concatenate([qs & 15, qs >> 4], axis=-1)  # nibble order: j and j + 16
    codes = ((low | (high << 4)).astype(np.int16) - 16).astype(np.int8).reshape(n, -1)
    return PackedWeight(
        torch.from_numpy(codes), torch.from_numpy(_f16(blocks, 0)), None, 8, 32, "Q5_0"
    )


def _q6_k(blocks: np.ndarray) -> PackedWeight:
    n, nb = blocks.shape[0], blocks.shape[1]
    ql = blocks[..., 0:128].reshape(n, nb, 2, 1, 64)  # 128-weight halves h
    low = np.concatenate([ql & 15, ql >> 4], axis=3).reshape(n, nb, 2, 4, 32)
    qh = blocks[..., 128:192].reshape(n, nb, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3
    codes = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, nb * 256)
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    d = np.ascontiguousarray(blocks[..., 208:210]).view(np.float16)[..., 0].astype(np.float32)
    scale = (d[..., None] * sc).reshape(n, nb * 16)  # exact: 11 x 8 bits
    return PackedWeight(
        torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(scale)), None, 8, 16, "Q6_K"
    )


# GGUF type -> (bytes per block, decoder of [N, blocks, bytes] blocks)
PACKED_GGUF_TYPES = {
    Q.Q8_0: (34, _q8_0),
    Q.Q4_0: (18, _q4_0),
    Q.Q4_1: (20, _q4_1),
    Q.Q4_K: (144, _q4_k),
    Q.Q5_0: (22, _q5_0),
    Q.Q6_K: (210, _q6_k),
}


def pack_gguf(raw: np.ndarray, qtype: int) -> PackedWeight | None:
    """A 2-D GGUF tensor's bytes ``[N, row_bytes]`` as a ``PackedWeight``, or None when the
    type has no packed kernel (the caller dequantizes it and says so)."""
    entry = PACKED_GGUF_TYPES.get(Q(qtype))
    if entry is None or raw.ndim != 2:
        return None
    size, decode = entry
    return decode(raw.reshape(raw.shape[0], -1, size))


def packed_gguf_weights(path: str | Path, cfg: ModelConfig) -> dict[str, PackedWeight]:
    """The 2-D weights of a GGUF with a packed kernel, under Hugging Face names, q/k rows
    un-permuted as ``load_gguf`` does (for families whose GGUFs are permuted). Every other
    type is left to the dequantizing loader with one warning naming the type (and a
    ``kernel_fallback_total`` count)."""
    out: dict[str, PackedWeight] = {}
    unpacked: dict[str, list[str]] = {}
    permuted = gguf_family(cfg).gguf_permuted_qk
    with GGUFFile.open(path) as g:
        for name, info in g.tensors.items():
            target = hf_name(name)
            if target is None or len(info.shape) != 2:
                continue
            pw = pack_gguf(g.raw(info), info.qtype)
            if pw is None:
                unpacked.setdefault(Q(info.qtype).name, []).append(name)
                continue
            heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}.get(name.split(".")[-2])
            if heads is not None and permuted:
                pw = pw.rows(unpermute_qk(torch.arange(pw.out_features), heads))
            out[target] = pw
    for qtype, names in unpacked.items():
        note_fallback(
            "quant_linear",
            f"gguf_{qtype}",
            message=f"{path}: GGUF type {qtype} has no packed kernel: its {len(names)} "
            f"tensor(s) ({', '.join(names[:2])}{', ...' if len(names) > 2 else ''}) are "
            f"dequantized (kept packed: {', '.join(t.name for t in PACKED_GGUF_TYPES)})",
            count=len(names),
        )
    return out
