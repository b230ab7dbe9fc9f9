"""KIVI 2-bit KV codec (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for
KV Cache", ICML 2024), on paged blocks.

Keys have outlier *channels*, so KIVI quantizes them per channel over a group of tokens;
values per token. Here a key group is one block: a full block stores 2-bit key codes and,
per channel, a bf16 scale and zero over its ``block_size`` tokens. Values are 2-bit per
token in groups of 32 channels. A block that is still filling cannot have per-channel
key ranges yet, so its K and V stay in full precision in a small *residual* pool (KIVI's
"recent tokens in full precision"), one slot per filling block::

    request tokens:  [ block 0 full ][ block 1 full ][ block 2: 5 of 16 ]
    stored as:        2-bit codes     2-bit codes     residual slot (bf16)

The step that fills a block quantizes it from the residual plus the new rows and frees
the slot. Invariants (``check_integrity``): a block has a residual slot iff it is
partially filled; slots in use + free slots == capacity; a request has at most one
filling block, and a press compaction needs one more for a moment, so ``max_num_seqs +
1`` slots always suffice.

What a row reads (``own_block_exact``): the token at KV position ``p`` attends to the
blocks before its own block decoded from their 2-bit codes and to the tokens of its own
block (``p // block_size``) at full precision, even when this very step filled and
quantized that block. So a row sees the same K/V however the tokens were cut into steps
(one prefill, chunked prefill, a prefix hit, recompute after preemption, decodes)::

    row p = 37 (bs 16):  [ block 0: codes ][ block 1: codes ][ block 2: 32..37 exact ]

Every row of a step lies in a block the step wrote, so the full-precision rows of a
row's own block are the write's ``[blocks touched, bs, H, d]`` buffer of the layer
(residual rows + this step's rows), kept until the next layer's write (``gather_own``;
the kernel reads it as its residual pool through ``step_index``).

Under the hybrid KV manager (``kv/groups.py``: sliding-window models) the storage's layers
are the ``num_layers`` slots of a page and each of the ``num_groups`` groups writes its own
pages, with its own slot mapping, in layers interleaved with the other groups' (Gemma 3:
group 1's slots 0-2 are layers 0-2, group 0's slot 0 is layer 5). So everything that
belongs to a step is kept per group: the write plan (made at the group's slot 0), the
``step_index`` row and the residual slots to release after the group's last slot. A
request has one filling page per group, and a press compaction one more per group for a
moment: ``num_groups * (max_num_seqs + 1)`` residual slots.
A window group frees only full pages (whose codes a window may still read partly: the
kernels start a row at its window).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvstack.core.errors import ConfigError
from kvstack.kv.codecs.base import CacheShape, KernelView, KVCodec
from kvstack.kv.codecs.bits import pack, quant_asym, unpack

BITS = 2
V_GROUP = 32


@dataclass
class _WritePlan:
    """How this step's rows map onto the blocks they touch (same for every layer), as index
    tensors so that each layer's write is a few ``index_select`` / ``index_copy_`` calls."""

    blocks: torch.Tensor  # [n] touched block ids
    rows: torch.Tensor  # [T] row of each written slot in the [n * bs] temp buffer
    old_pos: torch.Tensor  # positions (in blocks) whose block had earlier rows ...
    old_slots: torch.Tensor  # ... in these residual slots
    done_pos: torch.Tensor  # positions of the blocks full after this step ...
    done_blocks: torch.Tensor  # ... and their block ids
    live_pos: torch.Tensor  # positions of the blocks still filling after this step ...
    live_slots: torch.Tensor  # ... and their residual slots
    release: list[int]  # residual slots freed once every layer of the group has read them


class Kivi2Codec(KVCodec):
    name = "kivi2"
    rolls_back = False  # a filled block is quantized at once: rejected drafts would stay in
    own_block_exact = True

    @classmethod
    def check_head_dim(cls, head_dim: int) -> None:
        if head_dim % V_GROUP:
            raise ConfigError(
                f"--kv-cache-dtype kivi2 needs head_dim divisible by {V_GROUP}, got {head_dim}"
            )

    @classmethod
    def bytes_per_token_head(cls, head_dim: int, block_size: int, act_itemsize: int) -> float:
        codes = 2 * head_dim * BITS / 8
        key_params = 4 * head_dim / block_size  # scale + zero per channel, per block
        value_params = 4 * head_dim / V_GROUP
        return codes + key_params + value_params

    @staticmethod
    def residual_slots(shape: CacheShape, max_num_seqs: int) -> int:
        """One filling block per sequence and KV group, plus one per group for a press
        compaction in flight (the request's old partial blocks are freed only after its
        new ones are written)."""
        return shape.num_groups * (max_num_seqs + 1)

    @classmethod
    def fixed_bytes(cls, shape: CacheShape, max_num_seqs: int, act_itemsize: int) -> int:
        s = shape
        per_slot = 2 * s.num_layers * s.block_size * s.num_kv_heads * s.head_dim * act_itemsize
        return cls.residual_slots(shape, max_num_seqs) * per_slot

    def __init__(self, shape: CacheShape, dtype: torch.dtype, max_num_seqs: int = 0) -> None:
        super().__init__(shape, dtype, max_num_seqs)
        if max_num_seqs < 1:
            raise ValueError("kivi2 needs max_num_seqs (one residual block per sequence)")
        s = shape
        L, N, bs, H, d = s.num_layers, s.num_blocks, s.block_size, s.num_kv_heads, s.head_dim
        self.k_codes = torch.zeros((L, N, bs, H, d * BITS // 8), dtype=torch.uint8)
        self.k_params = torch.zeros((L, N, H, d, 2), dtype=torch.bfloat16)  # per channel
        self.v_codes = torch.zeros((L, N, bs, H, d * BITS // 8), dtype=torch.uint8)
        self.v_params = torch.zeros((L, N, bs, H, d // V_GROUP * 2), dtype=torch.bfloat16)
        self.capacity = cap = self.residual_slots(shape, max_num_seqs)
        self.res_k = torch.zeros((L, cap, bs, H, d), dtype=dtype)
        self.res_v = torch.zeros((L, cap, bs, H, d), dtype=dtype)
        self.residual_of = torch.full((N,), -1, dtype=torch.long)
        self.filled = [0] * N  # rows written into each block since it was (re)allocated
        self.free_res = list(range(cap - 1, -1, -1))
        self._plans: dict[int, _WritePlan] = {}  # per KV group, this step's
        # This step's touched blocks at full precision, for the last layer written:
        # step_index[g, b] = row of group g's block b in _step_k/_step_v, -1 if not written.
        self.step_index = torch.full((s.num_groups, N), -1, dtype=torch.long)
        self._no_step = torch.full((N,), -1, dtype=torch.long)
        self._step_layer = (-1, -1)  # (group, layer) of the last write
        self._step_k = self._step_v = self.res_k[0, :0]
        self._gather_views: dict[int, KernelView] = {}

    def tensors(self) -> list[torch.Tensor]:
        return [self.k_codes, self.k_params, self.v_codes, self.v_params]

    @property
    def nbytes(self) -> int:
        extra = self.res_k.numel() * self.res_k.element_size() * 2
        return super().nbytes + extra

    # ------------------------------------------------------------------ write
    def _make_plan(self, slots: torch.Tensor) -> _WritePlan:
        """The step's plan for one group's ``slots``. A block this step fills gives its
        residual slot back; a block that starts filling takes one, first from those given
        back in this plan (safe: each layer's write copies every old slot's rows out
        before it writes any live slot), so a request never holds two slots of a group,
        even while one chunk completes its block and starts the next. Slots not reused go
        back after the group's last layer (``release``). Checked before anything changes:
        an exhausted pool raises with the codec untouched."""
        bs = self.shape.block_size
        block_of = slots // bs
        blocks, inverse, counts = torch.unique(block_of, return_inverse=True, return_counts=True)
        rows = (inverse * bs + slots % bs).to(torch.long)
        ids = blocks.tolist()
        old_res = [int(r) for r in self.residual_of[blocks].tolist()]
        # rows in each block after this step (a full block written again was reallocated)
        after = [
            (0 if self.filled[b] >= bs else self.filled[b]) + n
            for b, n in zip(ids, counts.tolist(), strict=True)
        ]
        complete = [f >= bs for f in after]
        reuse = [r for r, c in zip(old_res, complete, strict=True) if c and r >= 0]
        need = sum(1 for r, c in zip(old_res, complete, strict=True) if not c and r < 0)
        if need > len(reuse) + len(self.free_res):
            raise RuntimeError(
                "kivi2 residual pool exhausted (more filling blocks than max_num_seqs)"
            )
        new_res = []
        for i, b in enumerate(ids):
            self.filled[b] = after[i]
            r = -1 if complete[i] else old_res[i]
            if not complete[i] and r < 0:
                r = reuse.pop() if reuse else self.free_res.pop()
            self.residual_of[b] = r
            new_res.append(r)
        old = [i for i, r in enumerate(old_res) if r >= 0]
        done = [i for i, c in enumerate(complete) if c]
        live = [i for i, c in enumerate(complete) if not c]

        def idx(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long)

        return _WritePlan(
            blocks,
            rows,
            idx(old),
            idx([old_res[i] for i in old]),
            idx(done),
            blocks[idx(done)],
            idx(live),
            idx([new_res[i] for i in live]),
            reuse,
        )

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kernels: Any = None,
        group: int = 0,
    ) -> bool:
        """This step's rows into their blocks: a block the step fills is quantized, one
        still filling keeps its rows in a residual slot. With the C++ ``kernels``, each of
        K and V in one pass (``csrc/kivi2_write.cpp``, the same bits); else PyTorch.
        A group's slot 0 starts its step (``slots`` are the same for its other slots)."""
        s = self.shape
        if layer == 0:
            old = self._plans.get(group)
            if old is not None:  # the group's previous step's blocks
                self.step_index[group, old.blocks] = -1
                self.free_res.extend(old.release)  # a step that failed before its last layer
                old.release = []
            plan = self._plans[group] = self._make_plan(slots)
            self.step_index[group, plan.blocks] = torch.arange(plan.blocks.numel())
        plan = self._plans[group]
        n = plan.blocks.numel()
        steps = []
        native = kernels is not None
        for x, res, codes, params, per_channel in (
            (k, self.res_k, self.k_codes, self.k_params, True),
            (v, self.res_v, self.v_codes, self.v_params, False),
        ):
            tmp = torch.zeros((n, s.block_size, s.num_kv_heads, s.head_dim), dtype=self.dtype)
            if native and x.dtype == self.dtype and x.stride(-1) == 1:
                kernels.kivi2_write(
                    x, plan.rows, tmp, res[layer], plan.old_pos, plan.old_slots, plan.done_pos,
                    plan.done_blocks, plan.live_pos, plan.live_slots, codes[layer], params[layer],
                    per_channel,
                )  # fmt: skip
                steps.append(tmp)
                continue
            native = False
            if plan.old_pos.numel():
                tmp.index_copy_(0, plan.old_pos, res[layer].index_select(0, plan.old_slots))
            tmp.view(-1, s.num_kv_heads, s.head_dim)[plan.rows] = x.to(self.dtype)
            steps.append(tmp)
            if plan.done_pos.numel():
                full = tmp.index_select(0, plan.done_pos).float()  # [m, bs, H, d]
                if per_channel:  # keys: range of each channel over the block's tokens
                    q, sz = quant_asym(full, BITS, 1)  # sz [m, 2, H, d] (scale, zero)
                    p = sz.permute(0, 2, 3, 1).contiguous().to(params.dtype)
                else:  # values: each token, groups of V_GROUP channels
                    q, sz = quant_asym(full.unflatten(-1, (-1, V_GROUP)), BITS, -1)
                    q = q.flatten(-2)
                    p = sz.flatten(-2)
                params[layer].index_copy_(0, plan.done_blocks, p)
                codes[layer].index_copy_(0, plan.done_blocks, pack(q, BITS))
            if plan.live_pos.numel():
                res[layer].index_copy_(0, plan.live_slots, tmp.index_select(0, plan.live_pos))
        self._step_k, self._step_v = steps
        self._step_layer = (group, layer)
        if layer == s.num_layers - 1:
            self.free_res.extend(plan.release)
            plan.release = []
        return native

    # ------------------------------------------------------------------ read
    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = block_ids.reshape(-1)
        kq = unpack(self.k_codes[layer, flat], BITS).float()  # [n, bs, H, d]
        kp = self.k_params[layer, flat].float()  # [n, H, d, 2]
        k = kq * kp[None, ..., 0].transpose(0, 1) + kp[None, ..., 1].transpose(0, 1)
        vq = unpack(self.v_codes[layer, flat], BITS).float().unflatten(-1, (-1, V_GROUP))
        vp = self.v_params[layer, flat].float().unflatten(-1, (-1, 2))
        v = (vq * vp[..., :1] + vp[..., 1:]).flatten(-2)
        k, v = k.to(self.dtype), v.to(self.dtype)
        res = self.residual_of[flat]
        live = res >= 0
        if live.any():
            k[live] = self.res_k[layer, res[live]]
            v[live] = self.res_v[layer, res[live]]
        tail = (*block_ids.shape, *k.shape[1:])
        return k.view(tail), v.view(tail)

    def overlay_own(
        self,
        layer: int,
        block_ids: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks as the rows inside them read them: this step's full-precision rows of a
        block the step wrote at ``layer`` of ``group`` (even one it filled and quantized)
        replace the gathered ones."""
        if self._step_layer != (group, layer):
            return k, v
        idx = self.step_index[group, block_ids]
        live = idx >= 0
        if live.any():
            k[live] = self._step_k[idx[live]]
            v[live] = self._step_v[idx[live]]
        return k, v

    def _view(
        self, layer: int, res_k: torch.Tensor, res_v: torch.Tensor, residual_of: torch.Tensor
    ) -> KernelView:
        """Layer ``layer``'s codes and parameters in place with a residual pool."""
        return KernelView(
            "kivi2",
            self.k_codes[layer],
            self.v_codes[layer],
            self.k_params[layer],
            self.v_params[layer],
            group=V_GROUP,
            res_k=res_k,
            res_v=res_v,
            residual_of=residual_of,
        )

    def gather_view(self, layer: int) -> KernelView | None:
        """Codes and parameters in place with the residual pool of the filling blocks
        (``residual_of``): ``codec_gather`` then returns what ``gather`` does."""
        if layer not in self._gather_views:
            self._gather_views[layer] = self._view(
                layer, self.res_k[layer], self.res_v[layer], self.residual_of
            )
        return self._gather_views[layer]

    def kernel_view(self, layer: int, group: int = 0) -> KernelView | None:
        """Codes and parameters in place; as the residual pool, the full-precision rows of
        the blocks this step wrote at ``layer`` of ``group`` (``step_index``), which the
        kernel reads for a row's own block only (the layer's last write; none before it)."""
        if self._step_layer == (group, layer):
            return self._view(layer, self._step_k, self._step_v, self.step_index[group])
        return self._view(layer, self.res_k[layer, :0], self.res_v[layer, :0], self._no_step)

    # ------------------------------------------------------------------ bookkeeping
    def on_block_freed(self, block_id: int) -> None:
        r = int(self.residual_of[block_id])
        if r >= 0:
            self.residual_of[block_id] = -1
            self.free_res.append(r)
        self.filled[block_id] = 0

    def check_integrity(self) -> None:
        used = [int(r) for r in self.residual_of.tolist() if r >= 0]
        assert len(set(used)) == len(used), "a residual slot serves two blocks"
        assert not set(used) & set(self.free_res), "a residual slot both used and free"
        assert len(used) + len(self.free_res) == self.capacity, "residual slots leaked"
        bs = self.shape.block_size
        for b, r in enumerate(self.residual_of.tolist()):
            if r >= 0:
                assert 0 < self.filled[b] < bs, f"block {b} has a residual but is not filling"
