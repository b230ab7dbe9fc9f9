"""GGUF file reader: header, metadata and tensor table over a read-only ``mmap``.

A GGUF file is a header, a table of tensors and one aligned blob of tensor data::

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x   (key str, value type u32, value)           <- metadata ("llama.block_count", ...)
    n_tensors x (name str, n_dims u32, dims u64[n_dims], ggml type u32, offset u64)
    padding to ``general.alignment`` (32)
    tensor data; tensor i lives at data_start + offset_i

The header is parsed with ``struct`` rather than with ``gguf.GGUFReader``: the reader builds
one numpy view per array element, which takes 3-6 s for the 49k tokens and merges of the
default model, against ~0.1 s here. Dequantization uses the ``gguf`` package
(``gguf.quants.dequantize``) and its type tables. Every malformed input (bad magic, header
or tensor data running past the end of the file, unknown types) raises ``ModelLoadError``.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from kvstack.core.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
Q = GGMLQuantizationType
SUPPORTED_TYPES = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}
    | {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's entry in the table: ``shape`` is numpy order (GGUF dims reversed)."""

    name: str
    shape: tuple[int, ...]
    qtype: int
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class GGUFFile:
    """A parsed GGUF header plus a read-only ``mmap`` of the file (close it when done)."""

    path: Path
    version: int
    metadata: dict[str, Any]
    value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]]
    tensors: dict[str, GGUFTensorInfo]
    _mm: mmap.mmap = field(repr=False)

    @classmethod
    def open(cls, path: str | Path) -> GGUFFile:
        """Parse ``path``'s header; raise ``ModelLoadError`` on anything malformed."""
        p = Path(path)
        if not p.is_file():
            raise ModelLoadError(f"GGUF file not found: {p}")
        size = p.stat().st_size
        if size < 24:
            raise ModelLoadError(f"{p} is not a GGUF file: only {size} bytes")
        with open(p, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            return _parse(p, mm)
        except ModelLoadError:
            mm.close()
            raise
        except (struct.error, ValueError, UnicodeDecodeError, IndexError, OverflowError) as e:
            mm.close()
            raise ModelLoadError(f"{p}: corrupt or truncated GGUF header ({e})") from e

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes, shaped ``[..., row_bytes]`` as ``gguf.quants`` expects."""
        block, type_size = GGML_QUANT_SIZES[Q(info.qtype)]
        row_bytes = info.shape[-1] // block * type_size
        data = np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return data.reshape(*info.shape[:-1], row_bytes)

    def tensor(self, name: str) -> torch.Tensor:
        """Dequantize one tensor to a float32 torch tensor (a copy, independent of the mmap)."""
        info = self.tensors[name]
        qtype = Q(info.qtype)
        if qtype not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} has unsupported quantization type {qtype.name}; "
                f"supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))}"
            )
        raw = self.raw(info)
        if qtype == Q.F32:
            out = np.array(raw.view(np.float32))
        else:
            out = np.asarray(dequantize(raw, qtype), dtype=np.float32)
        return torch.from_numpy(out.reshape(info.shape))

    def close(self) -> None:
        """Unmap the file (left to the garbage collector while arrays still view it)."""
        with contextlib.suppress(BufferError):
            self._mm.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_U64 = struct.Struct("<Q")


def _read_strings(mm: mmap.mmap, pos: int, count: int, path: Path) -> tuple[list[str], int]:
    """``count`` length-prefixed strings from ``pos``: (strings, the position after them).
    One tight loop: a tokenizer's vocabulary and merges are ~150k strings each (Qwen2)."""
    size, unpack = len(mm), _U64.unpack_from
    out: list[str] = []
    append = out.append
    for _ in range(count):
        (n,) = unpack(mm, pos)
        pos += 8
        if pos + n > size:
            raise ModelLoadError(f"{path}: truncated GGUF header (string runs past end of file)")
        append(mm[pos : pos + n].decode("utf-8"))
        pos += n
    return out, pos


def _parse(path: Path, mm: mmap.mmap) -> GGUFFile:
    """Parse header, metadata and tensor table; check every tensor lies inside the file."""
    size = len(mm)
    if mm[:4] != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (magic {mm[:4]!r}, expected b'GGUF')")
    (version,) = struct.unpack_from("<I", mm, 4)
    if version not in (2, 3):
        if struct.unpack_from(">I", mm, 4)[0] in (2, 3):
            raise ModelLoadError(f"{path}: big-endian GGUF files are not supported")
        raise ModelLoadError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors, n_kv = struct.unpack_from("<QQ", mm, 8)
    if n_tensors > size or n_kv > size:
        raise ModelLoadError(f"{path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} keys)")
    pos = 24

    def read(fmt: str) -> Any:
        nonlocal pos
        (v,) = struct.unpack_from(fmt, mm, pos)
        pos += struct.calcsize(fmt)
        return v

    def read_str() -> str:
        nonlocal pos
        n = read("<Q")
        if pos + n > size:
            raise ModelLoadError(f"{path}: truncated GGUF header (string runs past end of file)")
        s = mm[pos : pos + n].decode("utf-8")
        pos += n
        return s

    def read_value(vtype: GGUFValueType) -> Any:
        nonlocal pos
        if vtype == GGUFValueType.STRING:
            return read_str()
        if vtype == GGUFValueType.ARRAY:
            raise ModelLoadError(f"{path}: nested GGUF arrays are not supported")
        return read(_SCALAR_FORMATS[vtype])

    metadata: dict[str, Any] = {}
    vtypes: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
    for _ in range(n_kv):
        key = read_str()
        vtype = GGUFValueType(read("<I"))
        if vtype != GGUFValueType.ARRAY:
            value = read_value(vtype)
            if vtype == GGUFValueType.FLOAT32:  # shortest decimal: 1e-05, not 9.99999974e-06
                value = float(str(np.float32(value)))
            metadata[key], vtypes[key] = value, (vtype, None)
            continue
        etype = GGUFValueType(read("<I"))
        count = read("<Q")
        if count > size - pos:
            raise ModelLoadError(f"{path}: truncated GGUF header (array {key!r} too long)")
        if etype == GGUFValueType.STRING:
            metadata[key], pos = _read_strings(mm, pos, count, path)
        else:
            fmt = _SCALAR_FORMATS[etype]
            dt = np.dtype(fmt.replace("?", "b1"))
            metadata[key] = np.frombuffer(mm, dtype=dt, count=count, offset=pos).tolist()
            pos += count * dt.itemsize
        vtypes[key] = (GGUFValueType.ARRAY, etype)

    infos = []
    for _ in range(n_tensors):
        name = read_str()
        n_dims = read("<I")
        if not 1 <= n_dims <= 4:
            raise ModelLoadError(f"{path}: tensor {name!r} has {n_dims} dimensions")
        dims = [read("<Q") for _ in range(n_dims)]
        qtype_id, offset = read("<I"), read("<Q")
        try:
            qtype = Q(qtype_id)
        except ValueError:
            raise ModelLoadError(
                f"{path}: tensor {name!r} has unknown ggml type id {qtype_id}"
            ) from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise ModelLoadError(f"{path}: tensor {name!r} row {dims[0]} not a multiple of {block}")
        nbytes = math.prod(dims) // block * type_size
        infos.append((name, tuple(reversed(dims)), int(qtype), offset, nbytes))

    align = int(metadata.get("general.alignment", 32))
    if align <= 0 or align & (align - 1):
        raise ModelLoadError(f"{path}: invalid general.alignment {align}")
    data_start = (pos + align - 1) // align * align
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, shape, qtype_id, offset, nbytes in infos:
        start = data_start + offset
        if start + nbytes > size:
            raise ModelLoadError(
                f"{path}: truncated GGUF file: tensor {name!r} needs bytes "
                f"{start}..{start + nbytes} but the file has {size} bytes"
            )
        tensors[name] = GGUFTensorInfo(name, shape, qtype_id, start, nbytes)
    return GGUFFile(path, version, metadata, vtypes, tensors, mm)
