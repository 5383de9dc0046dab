"""The NZ (FRACTAL_NZ) paged cache: where each element of a block lives (docs/semantics/paged-kv.md, "NZ caches").

An NZ cache is the 5-D tensor ``[block_num, N, D/c0, block_size, c0]``: the D channels of a token are cut into
chunks of c0 consecutive channels, and each block stores, per head, chunk after chunk, the chunk of every slot in
turn. Channel d of the token in slot s of block n, head h, is at ``[n, h, d // c0, s, d % c0]``. c0 is 32 bytes of
elements: 16 for float16 / bfloat16 ("[blockNum, KV_N, D/16, blockSize, 16]") and 32 for int8 ("[blockNum, KV_N,
D/32, blockSize, 32]"), the two shapes the FusedInferAttentionScore pages give. Callers build it as a view of the
buffer an NZ scatter op fills (vllm-ascend ``mla_v1.py`` and the cann-recipes-infer MLA decodes view their
``[block_num, block_size, N, D]`` buffers as ``[block_num, N, D // 16, block_size, 16]``).

Reading it never needs a copy of the pool: :func:`nz_tokens` is a permuted view ``[block_num, block_size, N, D/c0,
c0]`` whose last two axes flatten to the channel index.
"""

from __future__ import annotations

import torch

from ..errors import ParamInvalidError, describe

# Elements per chunk, by cache dtype: 32 bytes of them.
NZ_CHUNK = {torch.int8: 32, torch.float16: 16, torch.bfloat16: 16}
NZ_DIMS = 5


def nz_chunk(dtype: torch.dtype) -> int | None:
    """c0 of an NZ cache of `dtype`; None where the pages give no NZ shape for it."""
    return NZ_CHUNK.get(dtype)


def nz_layout_chunk(dtype: torch.dtype) -> int:
    """c0 of the NZ layout a cache of `dtype` is read in: :func:`nz_chunk`, and float16's 16 for the dtypes the pages
    give no NZ shape for (float32 / float64 caches on the reference backend)."""
    return nz_chunk(dtype) or NZ_CHUNK[torch.float16]


def check_nz_cache(cache: torch.Tensor, param: str) -> int:
    """A 5-D NZ cache's c0, after checking its dtype and innermost axis; raises ParamInvalidError naming `param`."""
    c0 = nz_chunk(cache.dtype)
    if cache.dim() != NZ_DIMS or c0 is None or cache.shape[4] != c0:
        raise ParamInvalidError(
            f"{param}: an NZ cache is [block_num, N, D/16, block_size, 16] (float16 / bfloat16) or [block_num, N, "
            f"D/32, block_size, 32] (int8), got {describe(cache)}")
    return c0


def nz_shape(block_num: int, heads: int, dim: int, block_size: int, dtype: torch.dtype) -> tuple[int, ...]:
    """The NZ cache shape of `block_num` blocks of `block_size` tokens, `heads` heads of `dim` channels."""
    c0 = nz_layout_chunk(dtype)
    return (block_num, heads, dim // c0, block_size, c0)


def nz_tokens(cache: torch.Tensor) -> torch.Tensor:
    """[block_num, block_size, N, D/c0, c0] view of an NZ cache (no copy): slot-major like an ND cache."""
    return cache.permute(0, 3, 1, 2, 4)


def gather_nz_tokens(cache: torch.Tensor, blocks: list[int], length: int, out: torch.Tensor) -> torch.Tensor:
    """Write the first `length` tokens held by the NZ cache's `blocks` (in logical order) into `out` [length, N,
    D/c0, c0] (any strides). Within a block an NZ cache is contiguous, so each block is copied in one piece,
    transposed on the way ([N, D/c0, slots, c0] -> [slots, N, D/c0, c0]), instead of gathering the tokens through
    the permuted view one 32-byte chunk at a time."""
    block_size = cache.shape[3]
    for j, block in enumerate(blocks):
        first = j * block_size
        count = min(block_size, length - first)
        if count <= 0:
            break
        out[first : first + count].copy_(cache[block, :, :, :count].permute(2, 0, 1, 3))
    return out


def nz_width(cache: torch.Tensor) -> int:
    """The head dim D of an NZ cache."""
    return cache.shape[2] * cache.shape[4]


def to_nz(cache: torch.Tensor) -> torch.Tensor:
    """The NZ cache [block_num, N, D/c0, block_size, c0] (new, contiguous) holding the ND cache [block_num,
    block_size, N, D] element for element (what an NZ scatter op writes)."""
    c0 = nz_chunk(cache.dtype)
    if c0 is None or cache.dim() != 4 or cache.shape[-1] % c0:
        raise ParamInvalidError(f"cache: expected a float16 / bfloat16 / int8 [block_num, block_size, N, D] cache "
                                f"with D a multiple of {c0 or 16}, got {describe(cache)}")
    return cache.unflatten(-1, (-1, c0)).permute(0, 2, 3, 1, 4).contiguous()


def from_nz(cache: torch.Tensor) -> torch.Tensor:
    """The ND cache [block_num, block_size, N, D] (new, contiguous) of an NZ cache; the inverse of :func:`to_nz`."""
    return nz_tokens(cache).flatten(-2).contiguous()
