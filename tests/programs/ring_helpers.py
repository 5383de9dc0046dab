"""Ring-attention helpers written the way sequence-parallel libraries for Ascend write theirs: module-level
``@torch.jit.script`` functions that build their buffers with torch's factories on the device of their inputs.
Importing this module compiles them, so it fails at import when ``torch.jit.script`` cannot resolve a factory."""
# ruff: noqa: UP006, UP035, UP045  (typing's spellings, as such libraries write their TorchScript signatures)

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F


@torch.jit.script
def merge_block(
    out: torch.Tensor,
    lse: torch.Tensor,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    # out, block_out [B, S, N, D]; lse [B, S, N, 1]; block_lse [B, N, S]
    block_out = block_out.to(torch.float32)
    block_lse = block_lse.transpose(-2, -1).unsqueeze(dim=-1)
    out = out - F.sigmoid(block_lse - lse) * (out - block_out)
    lse = lse - F.logsigmoid(lse - block_lse)
    return out, lse


@torch.jit.script
def padded_lse(lse, cu_seqlens: List[int], max_seqlen: int):
    # packed [N, T] log-sum-exp -> [batch, N, max_seqlen], -inf past each sequence's end
    batch = len(cu_seqlens) - 1
    heads = lse.shape[0]
    padded = torch.full((batch, heads, max_seqlen), float("-inf"), dtype=torch.float32, device=lse.device)
    for i in range(batch):
        start, end = cu_seqlens[i], cu_seqlens[i + 1]
        padded[i, :, : end - start] = lse[:, start:end]
    return padded


@torch.jit.script
def empty_lse(out: torch.Tensor, device: torch.device) -> torch.Tensor:
    # [B, S, N, 1] buffer on an explicitly passed device
    lse = torch.empty(out.shape[0], out.shape[1], out.shape[2], 1, dtype=torch.float32, device=device)
    return lse.fill_(float("-inf"))


@torch.jit.script
def causal_block_mask(rows: int, cols: int, offset: int, device: torch.device,
                      dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    # True where a key is masked out: col - row > offset
    row = torch.arange(rows, device=device).unsqueeze(1)
    col = torch.arange(cols, device=device).unsqueeze(0)
    mask = (col - row) > offset
    if dtype is not None:
        return mask.to(dtype)
    return mask


@torch.jit.script
def chunk_weights(x: torch.Tensor) -> torch.Tensor:
    # ones, zeros, randn-free factories with dtype / layout / device arguments taken from x
    ones = torch.ones(x.shape[0], dtype=x.dtype, layout=torch.strided, device=x.device)
    zeros = torch.zeros_like(x)
    steps = torch.linspace(0.0, 1.0, x.shape[-1], dtype=x.dtype, device=x.device)
    return zeros + ones.unsqueeze(-1) * steps + torch.eye(x.shape[0], x.shape[-1], dtype=x.dtype, device=x.device)
