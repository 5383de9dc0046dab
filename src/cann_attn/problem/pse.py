"""Position encodings, pse_type 0..3 (docs/semantics/pse.md).

The logits entering the softmax are `S = scale * x + bias` with x = Q K^T; `SequencePse.tile` gives the bias
of one tile in fp32 already multiplied as the type requires (type 1 adds pse inside the scale, so its bias is
scale * pse). `SequencePse.accumulate_grad` is the exact transpose of `tile` and gives dpse in the pse
tensor's own shape (broadcast dimensions reduced, compressed elements accumulated where they were read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ParamInvalidError, describe

COMPRESSED_PSE_ROWS = 1024
ALIBI_TYPES = (2, 3)


@dataclass(frozen=True)
class SequencePse:
    """The pse of a run of sequences sharing Sq x Skv.

    Tensor pse (types 0/1): `source` is a view [nb or 1, N1, R, C] of the caller's pse; logical (i, j) reads
    source[..., row0 + i, col0 + j] (R == 1: row broadcast) or, when `compressed`, the Toeplitz formula.
    ALiBi (types 2/3): `slopes` is [nb or 1, N1] fp32 and the bias is generated.
    """

    pse_type: int
    scale: float
    seq_q: int
    seq_kv: int
    source: torch.Tensor | None = None
    row0: int = 0
    col0: int = 0
    compressed: bool = False
    slopes: torch.Tensor | None = None
    q_start: int = 0
    kv_start: int = 0

    def _compressed_index(self, i0: int, i1: int, j0: int, j1: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        first_tail_row = self.seq_q - COMPRESSED_PSE_ROWS
        rows = torch.arange(i0, i1, device=device)
        r = torch.where(rows >= first_tail_row, rows - first_tail_row, rows % COMPRESSED_PSE_ROWS)
        cols = torch.arange(j0, j1, device=device).view(1, -1) + (first_tail_row + r - rows).view(-1, 1)
        # Columns outside [0, Skv) only occur where the mask hides the element (j > i); clamp them.
        return r.view(-1, 1), cols.clamp_(0, self.seq_kv - 1) + self.col0

    def tile(
        self, i0: int, i1: int, j0: int, j1: int, device: torch.device, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Bias [nb or 1, N1, i1 - i0, j1 - j0] in `dtype` (fp32, or fp64 for float64 problems), possibly
        broadcast in dims of size 1."""
        if self.pse_type in ALIBI_TYPES:
            rows = torch.arange(i0, i1, device=device, dtype=dtype).view(-1, 1) + self.q_start
            cols = torch.arange(j0, j1, device=device, dtype=dtype).view(1, -1) + self.kv_start
            dist = (cols - rows).abs_()
            if self.pse_type == 3:
                dist.sqrt_()
            return dist * (-self.slopes.to(device=device, dtype=dtype))[:, :, None, None]
        src = self.source
        if self.compressed:
            r, c = self._compressed_index(i0, i1, j0, j1, src.device)
            values = src[:, :, r, c]
        elif src.shape[2] == 1:
            values = src[:, :, :, self.col0 + j0 : self.col0 + j1]
        else:
            values = src[:, :, self.row0 + i0 : self.row0 + i1, self.col0 + j0 : self.col0 + j1]
        values = values.to(device=device, dtype=dtype)
        return values * self.scale if self.pse_type == 1 else values

    def tile_bias_bound(
        self, i0: int, i1: int, j0: int, j1: int, device: torch.device, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor | None:
        """[nb or 1, N1, i1 - i0]: the largest ALiBi bias (types 2/3) of each row of the tile over its columns, by
        the formula of `tile` (-slope * f(|d|) is monotone in |d|, so it sits at the smallest or largest |d|);
        None for types 0/1. Kernels use it to skip tiles whose every term underflows."""
        if self.pse_type not in ALIBI_TYPES:
            return None
        rows = torch.arange(i0, i1, device=device, dtype=dtype) + self.q_start
        lo = (j0 + self.kv_start) - rows  # signed distances d = (j + kv_start) - (i + q_start) at j0 and j1 - 1
        hi = (j1 - 1 + self.kv_start) - rows
        nearest = torch.where(lo > 0, lo, torch.where(hi < 0, -hi, torch.zeros_like(lo)))
        farthest = torch.maximum(lo.abs(), hi.abs())
        if self.pse_type == 3:
            nearest, farthest = nearest.sqrt(), farthest.sqrt()
        neg_slopes = (-self.slopes.to(device=device, dtype=dtype))[:, :, None]
        return torch.maximum(nearest * neg_slopes, farthest * neg_slopes)

    def tile_center_distance(self, i0: int, i1: int, j0: int, j1: int) -> float:
        """|d| at the centre of the tile, d = (j + kv_start) - (i + q_start): the ALiBi distance that orders
        tiles nearest the diagonal first."""
        return abs((j0 + j1) / 2 + self.kv_start - (i0 + i1) / 2 - self.q_start)

    def linear_key_features(self, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """[Skv, 2] key features f_k(j) = (j, 1) of the rank-2 form of ALiBi type 2 (else None).

        Where the signed distance d = (j + kv_start) - (i + q_start) = j - (i + q_start - kv_start) has one sign
        over a whole tile, the bias -slope * |d| equals f_q(i) . f_k(j) with f_q from `linear_query_features`;
        kernels fold it into the Q K^T product by appending these two columns to K, so such tiles cost no
        elementwise pass. The positions are taken relative to kv_start: the fold subtracts two products of a slope
        and a position, whose fp32 rounding is that of the larger product, so absolute positions (q_start =
        kv_start = 131072 in context-parallel attention) would cost ~1e-3 in the logits; relative ones stay within
        Skv and the q/kv offset."""
        if self.pse_type != 2:
            return None
        cols = torch.arange(self.seq_kv, device=device, dtype=dtype)
        return torch.stack([cols, torch.ones_like(cols)], dim=1)

    def relative_row_positions(self, i0: int, i1: int, device: torch.device,
                               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[i1 - i0] positions i + q_start - kv_start of query rows [i0, i1) in key-column coordinates: the ALiBi
        distance of (i, j) is |j - position|. Exact in float64 before the one rounding to `dtype` (integers, exact in
        fp32 below 2^24)."""
        offsets = torch.arange(i0, i1, device=device, dtype=torch.float64) + float(self.q_start - self.kv_start)
        return offsets.to(dtype)

    def linear_query_features(
        self, i0: int, i1: int, j0: int, j1: int, device: torch.device, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor | None:
        """[nb or 1, N1, i1 - i0, 2] query features of the tile, or None where the tile straddles d = 0."""
        if self.pse_type != 2:
            return None
        d_min = (j0 + self.kv_start) - (i1 - 1 + self.q_start)
        d_max = (j1 - 1 + self.kv_start) - (i0 + self.q_start)
        if d_min >= 0:
            sign = 1.0
        elif d_max <= 0:
            sign = -1.0
        else:
            return None
        slopes = self.slopes.to(device=device, dtype=dtype)[:, :, None]
        rows = self.relative_row_positions(i0, i1, device, dtype)[None, None, :]
        # -slope*sign*(j - (i + q_start - kv_start)) = (-sign*slope)*j + (sign*slope*(i + q_start - kv_start))*1
        return torch.stack([(-sign * slopes).expand(-1, -1, rows.shape[-1]), sign * slopes * rows], dim=-1)

    def accumulate_grad(self, grad_source: torch.Tensor, i0: int, i1: int, j0: int, j1: int, ds: torch.Tensor) -> None:
        """Add d(loss)/d(pse) of this tile into `grad_source` (fp32, same shape as `source`); ds is dL/dS
        [nb, N1, ti, tj]. Type 1: dpse = scale * dS; type 0: dpse = dS."""
        g = ds * self.scale if self.pse_type == 1 else ds
        if grad_source.shape[0] == 1 and g.shape[0] != 1:
            g = g.sum(0, keepdim=True)
        if self.compressed:
            r, c = self._compressed_index(i0, i1, j0, j1, g.device)
            r = r.expand_as(c)
            target = grad_source
            for n in range(g.shape[1]):
                for b in range(g.shape[0]):
                    target[b, n].index_put_((r, c), g[b, n], accumulate=True)
        elif grad_source.shape[2] == 1:
            grad_source[:, :, :, self.col0 + j0 : self.col0 + j1] += g.sum(2, keepdim=True)
        else:
            grad_source[:, :, self.row0 + i0 : self.row0 + i1, self.col0 + j0 : self.col0 + j1] += g


def check_pse_type(pse_type: int) -> None:
    if pse_type not in (0, 1, 2, 3):
        raise ParamInvalidError(f"pse_type: expected 0, 1, 2 or 3, got {pse_type!r}")


def validate_slopes(pse: torch.Tensor, batch: int, heads: int) -> None:
    """ALiBi slopes (types 2/3): fp32 [B, N1] or [N1]."""
    if pse.dtype != torch.float32 or tuple(pse.shape) not in ((batch, heads), (heads,)):
        raise ParamInvalidError(
            f"pse: pse_type 2/3 expects ALiBi slopes of dtype float32 and shape [B, N1]=[{batch}, {heads}] "
            f"or [N1]=[{heads}], got {describe(pse)}"
        )


def slopes_for(pse: torch.Tensor, b0: int, count: int) -> torch.Tensor:
    """[count or 1, N1] slopes for sequences b0 .. b0 + count - 1."""
    return pse.view(1, -1) if pse.dim() == 1 else pse[b0 : b0 + count]


def batch_rows(pse: torch.Tensor, b0: int, count: int) -> torch.Tensor:
    """The [count or 1, ...] rows of a [B or 1, ...] pse for sequences b0 .. b0 + count - 1: a batch dim of 1 is
    shared by every sequence (docs/semantics/pse.md)."""
    return pse if pse.shape[0] == 1 else pse[b0 : b0 + count]


def compressed_pse_allowed(
    sparse_mode: int, next_tokens: int, has_mask: bool, seq_q: int, seq_kv: int
) -> bool:
    """The 1024-row pse only describes lower-triangular attention with Sq == Skv > 1024."""
    lower_triangular = has_mask and (sparse_mode in (2, 3) or (sparse_mode == 0 and next_tokens <= 0))
    return lower_triangular and seq_q == seq_kv and seq_q > COMPRESSED_PSE_ROWS


def classify_dense_pse(pse: torch.Tensor, batch: int, heads: int, seq_q: int, seq_kv: int) -> str:
    """'full', 'row_broadcast' or 'compressed' for a non-TND type 0/1 pse; raises on any other shape."""
    shape = tuple(pse.shape)
    if pse.dim() == 4 and shape[0] in (1, batch) and shape[1] == heads and shape[3] == seq_kv:
        if shape[2] == seq_q:
            return "full"
        if shape[2] == 1:
            return "row_broadcast"
        if shape[2] == COMPRESSED_PSE_ROWS and seq_q > COMPRESSED_PSE_ROWS:
            return "compressed"
    raise ParamInvalidError(
        f"pse: expected [B or 1, N1, Sq, Skv], [B or 1, N1, 1, Skv] or the compressed [B or 1, N1, 1024, Skv] "
        f"with B={batch}, N1={heads}, Sq={seq_q}, Skv={seq_kv}, got {describe(pse)}"
    )
