"""PageAttention for FusedInferAttentionScore / IncreFlashAttention: their paged key/value caches
(docs/semantics/paged-kv.md; the page-table rule itself is `problem/page_table.py`).

Cache layouts (npu_fused_infer_attention_score / npu_incre_flash_attention): BnBsH [block_num, block_size, H]
(H = N2 * D; every query layout) and BnNBsD [block_num, N2, block_size, D] (query layouts BNSD and TND). key_rope
(MLA) is a cache of the same layout with D = 64. Block sizes: Q_S = 1 (decode) 16-aligned (32 for int8 key/value)
up to 512; Q_S > 1 a multiple of 128 in [128, 512]; MLA with D = 512 and the packed layouts a multiple of 16 up to
1024. The caller gives `block_size`, which must be the caches' block dimension.

NZ caches [block_num, KV_N, D/c0, block_size, c0] (`problem/nz.py`, the one rule of where their elements live):
int8 (c0 = 32) for GQA anti-quantisation + KV NZ (vLLM's C8 decode), float16 / bfloat16 (c0 = 16) for MLA.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..backends.reference.workspace import Workspace
from ..errors import ParamInvalidError, describe, require
from ..problem import antiquant as antiquants
from ..problem.nz import check_nz_cache, gather_nz_tokens, nz_tokens, nz_width
from ..problem.page_table import BlockSizeRule, PageTable, page_table

# Query layouts that take a BnNBsD cache ("BNSD/TND支持BnBsH和BnNBsD", FIA PageAttention constraints).
BNNBSD_QUERY_LAYOUTS = ("BNSD", "TND")
# Query layouts (of the input_layout) an NZ cache takes: int8 GQA anti-quantisation lists BSH/BSND/BNSD; MLA with
# D = 512 lists BSH, BSND, BNSD, BNSD_NBSD, BSND_NBSD, BSH_NBSD, TND and TND_NTD.
NZ_QUERY_LAYOUTS = {torch.int8: ("BSH", "BSND", "BNSD"), torch.float16: ("BSH", "BSND", "BNSD", "TND"),
                    torch.bfloat16: ("BSH", "BSND", "BNSD", "TND")}


def fia_block_sizes(*, decode: bool, wide: bool, int8_kv: bool) -> BlockSizeRule:
    """The documented block sizes of FIA/IFA: `wide` = MLA with D = 512 or a packed (TND/NTD) layout."""
    if wide:
        return BlockSizeRule(multiple=16, maximum=1024)
    if decode:
        return BlockSizeRule(multiple=32 if int8_kv else 16, maximum=512)
    return BlockSizeRule(multiple=128, maximum=512, minimum=128)


@dataclass(frozen=True)
class CacheShape:
    block_num: int
    block_size: int
    heads: int
    dim: int
    token_dim: int  # 1: BnBsH, 2: BnNBsD, 3: NZ [block_num, N, D/c0, block_size, c0]
    c0: int = 0  # the NZ cache's innermost channel group (problem/nz.py: 32 for int8, 16 for float16 / bfloat16)

    @property
    def nz(self) -> bool:
        return self.token_dim == 3


def cache_shape(cache: torch.Tensor, param: str, heads_kv: int, q_layout: str) -> CacheShape:
    """Block count, block size, heads and head dim of a paged key/value cache."""
    require(isinstance(cache, torch.Tensor), param, "a torch.Tensor", cache)
    if cache.dim() == 3:
        require(cache.shape[2] % heads_kv == 0, param,
                f"[block_num, block_size, H] with H a multiple of num_key_value_heads={heads_kv}", cache)
        return CacheShape(cache.shape[0], cache.shape[1], heads_kv, cache.shape[2] // heads_kv, 1)
    if cache.dim() == 4:
        if q_layout not in BNNBSD_QUERY_LAYOUTS:
            raise ParamInvalidError(f"{param}: a [block_num, N, block_size, D] cache needs a BNSD or TND query "
                                    f"layout (else [block_num, block_size, H]), got {describe(cache)} with "
                                    f"{q_layout}")
        return CacheShape(cache.shape[0], cache.shape[2], cache.shape[1], cache.shape[3], 2)
    if cache.dim() == 5:
        c0 = check_nz_cache(cache, param)
        if q_layout not in NZ_QUERY_LAYOUTS[cache.dtype]:
            raise ParamInvalidError(f"{param}: a {cache.dtype} NZ cache takes query layouts "
                                    f"{', '.join(NZ_QUERY_LAYOUTS[cache.dtype])}, got {q_layout}")
        return CacheShape(cache.shape[0], cache.shape[3], cache.shape[1], nz_width(cache), 3, c0)
    raise ParamInvalidError(f"{param}: expected a paged cache [block_num, block_size, H], [block_num, N, "
                            f"block_size, D] or NZ [block_num, N, D/c0, block_size, c0] with block_table, got "
                            f"{describe(cache)}")


@dataclass(frozen=True)
class PagedKv:
    """Validated paged key/value (and key_rope) caches with their page table."""

    pages: PageTable
    key: torch.Tensor
    value: torch.Tensor
    key_rope: torch.Tensor | None
    shape: CacheShape

    def select(self, batches: range) -> PagedKv:
        """The caches as seen by the consecutive sequences `batches` alone."""
        return replace(self, pages=self.pages.select(batches))

    def _tokens(self, cache: torch.Tensor) -> torch.Tensor:
        """[block_num, block_size, N2, d] view of a cache in any layout (NZ: [block_num, block_size, N2, d/c0, c0])."""
        if self.shape.token_dim == 1:
            # The head dim spelled out: a cache of 0 blocks has no elements to infer it from.
            return cache.view(cache.shape[0], cache.shape[1], self.shape.heads, cache.shape[2] // self.shape.heads)
        if self.shape.nz:
            return nz_tokens(cache)
        return cache.permute(0, 2, 1, 3)

    def cache_views(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Key and value caches as [block_num, N2, block_size, D] views (no copy), for loops that read them in
        place through the table; None for an NZ cache (its channels are not one axis)."""
        if self.shape.nz:
            return None
        return tuple(self._tokens(t).permute(0, 2, 1, 3) for t in (self.key, self.value))

    def loop_caches(self, rope: bool = False):
        """What the decode loop reads in place: key and value (`rope`: key_rope) as [block_num, N2, block_size, D]
        views, or an NZ cache as it is (the loop reads its channels chunk by chunk)."""
        caches = (self.key_rope,) if rope else (self.key, self.value)
        views = tuple(t if self.shape.nz else self._tokens(t).permute(0, 2, 1, 3) for t in caches)
        return views[0] if rope else views

    def joined_views(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """[block_num, 1, block_size, D + Dr] key ++ key_rope and [block_num, 1, block_size, Dv] value views (no
        copy) when key_rope's columns follow the key's in one buffer (a single kv head: each token row is
        already key ++ rope, e.g. the int8 MLA query's float32 pool, problem/antiquant.py): the rows a gather
        copies whole. None otherwise."""
        if self.key_rope is None or self.shape.nz or self.shape.heads != 1:
            return None
        key, rope = (self._tokens(t).permute(0, 2, 1, 3) for t in (self.key, self.key_rope))
        width = key.shape[-1]
        if (key.stride(-1) != 1 or rope.stride(0) != key.stride(0) or rope.stride(2) != key.stride(2)
                or rope.stride(3) != 1 or key.dtype != rope.dtype
                or key.untyped_storage().data_ptr() != rope.untyped_storage().data_ptr()
                or rope.storage_offset() != key.storage_offset() + width):
            return None
        joined = key.as_strided((*key.shape[:3], width + rope.shape[-1]), key.stride(), key.storage_offset())
        return joined, self.cache_views()[1]

    def dequantized_blocks(self, antiquant: antiquants.KvAntiquant, dtype: torch.dtype
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(key, value, table): the blocks some sequence reads, anti-quantised per block (`problem/antiquant.py`,
        factors that do not depend on the token: per-channel, per-tensor, per-head) into compact [used, N2,
        block_size, D] caches of the query's dtype, and the table over them. Only the pages read are converted,
        never the whole pool."""
        used = self.pages.used_blocks().to(self.key.device)
        table = self.pages.compacted(used)
        caches = []
        for cache, factors in ((self.key, antiquant.key), (self.value, antiquant.value)):
            blocks = self._tokens(PageTable.take_blocks(cache, used))  # [used, block_size, N2, D (or D/c0, c0)]
            if self.shape.nz:
                blocks = blocks.flatten(-2)
            caches.append(antiquants.dequantize(blocks.permute(0, 2, 1, 3), factors, dtype))
        return caches[0], caches[1], table

    def group_bnsd(self, batches: range, workspace: Workspace | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """[c, N2, L, D (+ rope)] key and [c, N2, L, Dv] value of consecutive sequences of one length L,
        contiguous (what the attention makes of the contiguous layouts' BNSD views before it computes), gathered
        straight into place: key_rope into the key's last columns. With a `workspace` they are views of its
        buffers (valid until the next group): the groups of one call then reuse one pair of buffers instead of
        faulting fresh pages in for each."""
        length = self.pages.kv_lengths[batches[0]]
        joined = self.joined_views()
        if joined is not None:
            return self._group_joined(batches, length, *joined, workspace)
        parts = [self.key] + ([] if self.key_rope is None else [self.key_rope])
        dims = [self._width(t) for t in parts]
        k_shape = (len(batches), self.shape.heads, length, sum(dims))
        v_shape = (len(batches), self.shape.heads, length, self._width(self.value))
        if workspace is None:
            k = torch.empty(k_shape, dtype=self.key.dtype, device=self.key.device)
            v = torch.empty(v_shape, dtype=self.value.dtype, device=self.value.device)
        else:
            k = workspace.take("paged_key", k_shape, self.key.dtype)
            v = workspace.take("paged_value", v_shape, self.value.dtype)
        for i, b in enumerate(batches):
            col = 0
            for cache, d in zip(parts, dims, strict=True):
                self._gather(cache, b, k[i, :, :, col : col + d].permute(1, 0, 2))
                col += d
            self._gather(self.value, b, v[i].permute(1, 0, 2))
        return k, v

    def _group_joined(self, batches: range, length: int, key: torch.Tensor, value: torch.Tensor,
                      workspace: Workspace | None) -> tuple[torch.Tensor, torch.Tensor]:
        """group_bnsd over `joined_views`: whole key ++ rope rows in one gather; the value, when it is the key's
        first Dv columns, as a view of the gathered key."""
        k_shape = (len(batches), 1, length, key.shape[-1])
        k = (torch.empty(k_shape, dtype=key.dtype, device=key.device) if workspace is None
             else workspace.take("paged_key", k_shape, key.dtype))
        for i, b in enumerate(batches):
            self.pages.gather_tokens(key.permute(0, 2, 1, 3), [b], out=k[i].permute(1, 0, 2))
        if value.data_ptr() == key.data_ptr() and value.stride() == key.stride():
            return k, k[..., : value.shape[-1]]
        v_shape = (len(batches), 1, length, value.shape[-1])
        v = (torch.empty(v_shape, dtype=value.dtype, device=value.device) if workspace is None
             else workspace.take("paged_value", v_shape, value.dtype))
        for i, b in enumerate(batches):
            self.pages.gather_tokens(value.permute(0, 2, 1, 3), [b], out=v[i].permute(1, 0, 2))
        return k, v

    def _gather(self, cache: torch.Tensor, b: int, rows: torch.Tensor) -> None:
        """Sequence b's keys of `cache` into the [L, N2, d] destination `rows` (a view)."""
        if self.shape.nz:
            gather_nz_tokens(cache, self.pages.blocks_of(b).tolist(), self.pages.kv_lengths[b],
                             self._token_rows(rows, cache))
        else:
            self.pages.gather_tokens(self._tokens(cache), [b], out=self._token_rows(rows, cache))

    def _width(self, cache: torch.Tensor) -> int:
        """The head dim of a cache's tokens."""
        return nz_width(cache) if self.shape.nz else self._tokens(cache).shape[-1]

    def _token_rows(self, rows: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """[L, N2, d] destination rows as `cache`'s token shape ([L, N2, d/c0, c0] for NZ; a view)."""
        return rows.unflatten(-1, (-1, cache.shape[-1])) if self.shape.nz else rows


def paged_kv(key: torch.Tensor, value: torch.Tensor, key_rope: torch.Tensor | None, block_table, *, block_size,
             kv_lengths, batch: int, heads_kv: int, q_layout: str, rule: BlockSizeRule) -> PagedKv:
    """Validate the caches against each other, `block_size` and the block table (docs/semantics/paged-kv.md)."""
    shape = cache_shape(key, "key", heads_kv, q_layout)
    v_shape = cache_shape(value, "value", heads_kv, q_layout)
    require((v_shape.block_num, v_shape.block_size, v_shape.heads, v_shape.token_dim)
            == (shape.block_num, shape.block_size, shape.heads, shape.token_dim), "value",
            f"the key cache's blocks, block size and heads {list(key.shape)}", value)
    if key_rope is not None:
        r_shape = cache_shape(key_rope, "key_rope", heads_kv, q_layout)
        require((r_shape.block_num, r_shape.block_size, r_shape.token_dim)
                == (shape.block_num, shape.block_size, shape.token_dim), "key_rope",
                f"the key cache's blocks and block size {list(key.shape)}", key_rope)
    if block_size != shape.block_size:
        raise ParamInvalidError(f"block_size: expected the caches' block size {shape.block_size} "
                                f"({describe(key)}), got {block_size}")
    pages = page_table(block_table, block_size=shape.block_size, block_count=shape.block_num,
                       kv_lengths=kv_lengths, batch=batch, rule=rule, lengths_param="actual_seq_lengths_kv")
    return PagedKv(pages, key, value, key_rope, shape)


def length_groups(act_q: list[int], act_kv: list[int]) -> list[range]:
    """Consecutive sequences with equal query and key lengths: the attention computes each such group in one
    batched pass, so gathering per group gives it the very tensors (and results) of the contiguous layouts."""
    groups: list[range] = []
    for b in range(len(act_kv)):
        if groups and (act_q[b], act_kv[b]) == (act_q[groups[-1].start], act_kv[groups[-1].start]):
            groups[-1] = range(groups[-1].start, b + 1)
        else:
            groups.append(range(b, b + 1))
    return groups
