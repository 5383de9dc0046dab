"""Attention masks: sparse_mode 0..8, pre/next tokens, prefix, explicit and compressed masks (docs/semantics/masks.md).

Every mode reduces to one `SequenceMask` per sequence: a diagonal band `lower <= j - i <= upper` (None = no
bound), optionally widened by a prefix (`j < prefix` is also visible), optionally intersected with an explicit
boolean mask (True = masked). Kernels consume the band as integers to skip tiles; the explicit mask is read per
tile. The mode table lives in `sequence_mask` and nowhere else.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from enum import Enum

import torch

from ..errors import ParamInvalidError, describe

INT_MAX = 2147483647
COMPRESSED_SIZE = 2048
PREFIX_COMPRESSED_ROWS = 3072
# Modes whose mask tensor is the 2048x2048 compressed triangle rather than a full mask.
COMPRESSED_MODES = (2, 3, 4, 7, 8)


class TileState(Enum):
    EMPTY = 0  # nothing visible: skip the tile
    FULL = 1  # everything visible: no mask needed
    PARTIAL = 2  # apply `SequenceMask.masked_tile`


@dataclass(frozen=True)
class SequenceMask:
    """Visibility of (i, j) inside one sequence of Sq x Skv.

    visible(i, j) = [lower <= j - i] and ([j - i <= upper] or [j < prefix]) and not explicit[i, j]
    `explicit` is a boolean-like view broadcastable to [batch, heads, Sq, Skv] (True / 1 = masked).
    """

    seq_q: int
    seq_kv: int
    lower: int | None = None
    upper: int | None = None
    prefix: int | None = None
    explicit: torch.Tensor | None = None

    @property
    def hides_keys(self) -> bool:
        """Whether the mask (a tensor, a band or a prefix) can hide some keys at all."""
        return self.explicit is not None or self.lower is not None or self.upper is not None or self.prefix is not None

    @property
    def structure(self) -> tuple:
        """What decides tile skipping; sequences with equal structure can be batched together."""
        return (self.seq_q, self.seq_kv, self.lower, self.upper, self.prefix)

    def key_range(self, i0: int, i1: int) -> tuple[int, int]:
        """Half-open range of key columns that rows [i0, i1) may see (a superset)."""
        lo = 0 if self.lower is None or self.prefix is not None else max(0, i0 + self.lower)
        hi = self.seq_kv if self.upper is None else min(self.seq_kv, i1 - 1 + self.upper + 1)
        if self.prefix is not None:
            hi = max(hi, min(self.seq_kv, self.prefix))
        return lo, max(lo, hi)

    def _band_state(self, i0: int, i1: int, j0: int, j1: int) -> TileState:
        d_min, d_max = j0 - (i1 - 1), (j1 - 1) - i0
        lower = -(1 << 62) if self.lower is None else self.lower
        upper = 1 << 62 if self.upper is None else self.upper
        if d_max < lower or d_min > upper:
            return TileState.EMPTY
        if d_min >= lower and d_max <= upper:
            return TileState.FULL
        return TileState.PARTIAL

    def tile_state(self, i0: int, i1: int, j0: int, j1: int) -> TileState:
        """Structural state of the tile rows [i0, i1) x cols [j0, j1), before the explicit mask."""
        state = self._band_state(i0, i1, j0, j1)
        if self.prefix is not None and j0 < self.prefix:
            if j1 <= self.prefix and self.lower is None:
                state = TileState.FULL
            if state is TileState.EMPTY:
                state = TileState.PARTIAL
        if self.explicit is not None and state is TileState.FULL:
            return TileState.PARTIAL
        return state

    def masked_tile(self, i0: int, i1: int, j0: int, j1: int, device: torch.device) -> torch.Tensor:
        """Boolean tile (True = masked), broadcastable to [batch, heads, i1 - i0, j1 - j0]."""
        rows = torch.arange(i0, i1, device=device).view(-1, 1)
        cols = torch.arange(j0, j1, device=device).view(1, -1)
        diff = cols - rows
        masked = torch.zeros((i1 - i0, j1 - j0), dtype=torch.bool, device=device)
        if self.upper is not None:
            above = diff > self.upper
            if self.prefix is not None:
                above &= cols >= self.prefix
            masked |= above
        if self.lower is not None:
            masked |= diff < self.lower
        if self.explicit is not None:
            masked = masked | (self.explicit[..., i0:i1, j0:j1] != 0)
        return masked

    def exclude_masked_(self, logits: torch.Tensor, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
        """The masked-logit rule on a logits tile [..., i1 - i0, j1 - j0] in place: masked elements become -inf
        whatever their value (see `add_mask_bias`, the additive form the fast kernels use)."""
        return logits.masked_fill_(self.masked_tile(i0, i1, j0, j1, logits.device), MASKED_LOGIT)

    def tile_key(self, i0: int, i1: int, j0: int, j1: int) -> tuple[int, int, int] | None:
        """A key equal for tiles whose `masked_tile` is equal (band-only masks depend on j - i alone), or None
        when the tile has its own pattern (prefix or explicit mask); lets kernels reuse a tile's mask."""
        if self.prefix is not None or self.explicit is not None:
            return None
        return j0 - i0, i1 - i0, j1 - j0

    def bias_tile(self, i0: int, i1: int, j0: int, j1: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """`masked_tile` as a 0 / MASKED_LOGIT additive tile of `dtype` (`mask_bias`). Tiles with a `tile_key` come from
        a process-wide cache shared by every call with the same band: read-only, callers must never modify them."""
        key = self.tile_key(i0, i1, j0, j1)
        if key is None:
            return mask_bias(self.masked_tile(i0, i1, j0, j1, device), dtype)
        key = (self.lower, self.upper, *key, dtype, str(device))
        bias = _BIAS_TILES.get(key)
        if bias is None:
            bias = mask_bias(self.masked_tile(i0, i1, j0, j1, device), dtype)
            if sum(t.numel() for t in list(_BIAS_TILES.values())) + bias.numel() > BIAS_CACHE_ELEMENTS:
                _BIAS_TILES.clear()
            bias = _BIAS_TILES.setdefault(key, bias)
        return bias

    def row_bounds(self, i0: int, i1: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(lo, hi), int64 [i1 - i0]: row i sees the columns lo <= j < hi as far as the band and the prefix decide
        (`masked_tile`'s rule without the explicit mask: lower <= j - i, and j - i <= upper or j < prefix, an interval);
        None where neither restricts any row."""
        if self.lower is None and self.upper is None:
            return None
        rows = torch.arange(i0, i1, dtype=torch.int64, device=device)
        lo = (rows + self.lower).clamp_(min=0) if self.lower is not None else torch.zeros_like(rows)
        hi = torch.full_like(rows, self.seq_kv)
        if self.upper is not None:
            hi = (rows + self.upper + 1).clamp_(max=self.seq_kv)
            if self.prefix is not None:
                hi.clamp_(min=min(self.prefix, self.seq_kv))
        return lo, hi

    def visible_end(self, i0: int, i1: int, j0: int, j1: int) -> int:
        """One past the last column of the tile rows [i0, i1) x cols [j0, j1) that the explicit mask leaves visible
        in some row (j0 when it hides them all; j1 without an explicit mask): the columns after it add exact zeros
        to every row's softmax, so a kernel may stop there."""
        if self.explicit is None or j1 <= j0:
            return j1
        visible = (self.explicit[..., i0:i1, j0:j1] == 0).reshape(-1, j1 - j0).any(0)
        return j0 + int((visible * torch.arange(1, j1 - j0 + 1, device=visible.device)).max())

    def visible_columns(self, i0: int, i1: int, j0: int, j1: int) -> VisibleColumns:
        """The columns of [j0, j1) the explicit mask leaves visible to some row of [i0, i1), read once for every tile
        of these rows and columns (`VisibleColumns`)."""
        if self.explicit is None:
            return VisibleColumns(None, j0, j1)
        if j1 <= j0:
            return VisibleColumns([], j0, j1)
        tile = self.explicit[..., i0:i1, j0:j1]
        if tile.dtype in (torch.bool, torch.uint8):  # a column's least byte is 0 where some row sees it (one pass)
            visible = tile.view(torch.uint8).reshape(-1, j1 - j0).amin(0) == 0
        else:
            visible = (tile == 0).reshape(-1, j1 - j0).any(0)
        return VisibleColumns((visible.nonzero().flatten() + j0).tolist(), j0, j1)

    def explicit_tile_all_masked(self, i0: int, i1: int, j0: int, j1: int) -> bool:
        """True when the explicit mask hides the whole tile (lets kernels skip it)."""
        if self.explicit is None:
            return False
        return bool((self.explicit[..., i0:i1, j0:j1] != 0).all())



@dataclass(frozen=True)
class VisibleColumns:
    """The key columns (ascending; None: no explicit mask, all) of [start, end) that an explicit mask leaves visible to
    some row of a query tile (`SequenceMask.visible_columns`): `explicit_tile_all_masked` and `visible_end` of each
    key tile of those rows within [start, end) without reading the mask again."""

    columns: list[int] | None
    start: int  # the columns read: [start, end)
    end: int

    def all_masked(self, j0: int, j1: int) -> bool:
        """`SequenceMask.explicit_tile_all_masked` of the tile's columns [j0, j1)."""
        assert self.start <= j0 and j1 <= self.end, (j0, j1, self.start, self.end)
        if self.columns is None:
            return False
        k = bisect.bisect_left(self.columns, j0)
        return k == len(self.columns) or self.columns[k] >= j1

    def visible_end(self, j0: int, j1: int) -> int:
        """`SequenceMask.visible_end` of the tile's columns [j0, j1)."""
        assert self.start <= j0 and j1 <= self.end, (j0, j1, self.start, self.end)
        if self.columns is None or j1 <= j0:
            return j1
        k = bisect.bisect_left(self.columns, j1)
        return j0 if k == 0 or self.columns[k - 1] < j0 else self.columns[k - 1] + 1


# The additive form of "masked" in a 0 / -inf mask tile.
MASKED_LOGIT = float("-inf")

# Band-only bias tiles (`SequenceMask.bias_tile`), kept across calls: building one is ~6 elementwise passes over the
# tile, each a parallel region of PyTorch's threads, serial work between the native calls (~12 ms per pass on a
# busy 2-core machine when a thread has to wait for a busy core). Bounded (32 MiB of fp32); no lock, as
# `_MASK_CACHE` below: a race builds a tile twice at worst.
BIAS_CACHE_ELEMENTS = 1 << 23
_BIAS_TILES: dict[tuple, torch.Tensor] = {}


def mask_bias(masked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean tile (True = masked) as a 0 / MASKED_LOGIT additive tile of `dtype`, for `add_mask_bias`."""
    return torch.zeros(masked.shape, dtype=dtype, device=masked.device).masked_fill_(masked, MASKED_LOGIT)


def add_mask_bias(logits: torch.Tensor, bias: torch.Tensor, *, finite: bool, in_place: bool) -> torch.Tensor:
    """The masked-logit rule (docs/semantics/masks.md): a masked element's logit is -inf whatever its unmasked value
    (scale * q.k + pse), NaN and +inf included, so it adds exactly 0 to its row's softmax; a visible one keeps its
    value. Returns logits + bias (the 0 / -inf tile, broadcast), into `logits` when `in_place`. `finite`: the caller
    knows that no logit is NaN or +inf; then the add alone gives the rule (NaN + -inf would be NaN), and the fill,
    ~20x the cost of the add, is skipped."""
    total = logits.add_(bias) if in_place else logits + bias
    if not finite:
        total.masked_fill_(bias == MASKED_LOGIT, MASKED_LOGIT)
    return total


def compressed_mask(sparse_mode: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The mask tensor Ascend expects for a compressed mode: 2048x2048 strict upper triangle, or [3072, 2048]
    for mode 6 (triangle over a [1024, 2048] block whose left half is 0 and right half 1). A fresh copy of a
    cached tensor: callers may modify it."""
    return _cached_compressed_mask(sparse_mode, torch.device(device)).clone()


def _build_compressed_mask(sparse_mode: int, device: torch.device) -> torch.Tensor:
    tri = torch.ones(COMPRESSED_SIZE, COMPRESSED_SIZE, dtype=torch.bool, device=device).triu(1)
    if sparse_mode != 6:
        return tri
    tail = torch.zeros(PREFIX_COMPRESSED_ROWS - COMPRESSED_SIZE, COMPRESSED_SIZE, dtype=torch.bool, device=device)
    tail[:, COMPRESSED_SIZE // 2 :] = True
    return torch.cat([tri, tail])


def validate_compressed_mask(atten_mask: torch.Tensor, sparse_mode: int) -> None:
    """The given mask must be exactly the compressed mask of `sparse_mode` (shape, and content sampled)."""
    rows = PREFIX_COMPRESSED_ROWS if sparse_mode == 6 else COMPRESSED_SIZE
    if tuple(atten_mask.shape) != (rows, COMPRESSED_SIZE):
        raise ParamInvalidError(
            f"atten_mask: sparse_mode {sparse_mode} expects the compressed mask of shape [{rows}, 2048] "
            f"(see cann_attn.compressed_mask({sparse_mode})), got {describe(atten_mask)}"
        )
    # A strided sample plus the diagonals next to the triangle's edge keeps validation O(2048) while catching
    # inverted, dense and off-by-one masks.
    expected = _cached_compressed_mask(sparse_mode, atten_mask.device)  # never handed out: safe to share
    step = 61
    ok = torch.equal(atten_mask[::step, ::step] != 0, expected[::step, ::step])
    square = atten_mask[:COMPRESSED_SIZE]
    for offset in (-1, 0, 1, 2):
        ok = ok and torch.equal(square.diagonal(offset) != 0, expected[:COMPRESSED_SIZE].diagonal(offset))
    if sparse_mode == 6:
        tail = atten_mask[COMPRESSED_SIZE:]
        ok = ok and torch.equal(tail[:, ::7] != 0, expected[COMPRESSED_SIZE:, ::7])
        ok = ok and torch.equal(tail[:, 1020:1028] != 0, expected[COMPRESSED_SIZE:, 1020:1028])
    if not ok:
        raise ParamInvalidError(
            f"atten_mask: sparse_mode {sparse_mode} expects the compressed mask (True where col > row"
            + ("; rows 2048.. = [0]*1024 + [1]*1024" if sparse_mode == 6 else "")
            + "), but the given tensor's content differs"
        )


# Built once per (kind, device) and never modified afterwards (`compressed_mask` hands out clones). Threads racing on
# the first call may each build one; `setdefault` (atomic on a dict) keeps the first, so every caller shares one
# tensor (docs/guides/backends.md, "Threads"). No lock: torch.compile traces this function, and a lock is a context
# manager it cannot enter (fullgraph would break).
_MASK_CACHE: dict[tuple[int, str], torch.Tensor] = {}


def _cached_compressed_mask(sparse_mode: int, device: torch.device) -> torch.Tensor:
    key = (6 if sparse_mode == 6 else 2, str(device))
    mask = _MASK_CACHE.get(key)
    if mask is None:
        mask = _MASK_CACHE.setdefault(key, _build_compressed_mask(sparse_mode, device))
    return mask


def check_mask_dtype(atten_mask: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if atten_mask.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise ParamInvalidError(f"atten_mask: expected dtype in ({names}), got {describe(atten_mask)}")


def explicit_mask_views(
    atten_mask: torch.Tensor, batch: int, heads: int, seq_q: int, seq_kv: int
) -> list[torch.Tensor]:
    """Per-batch [heads or 1, Sq, Skv] views of a full mask in any documented broadcast shape."""
    shape = tuple(atten_mask.shape)
    allowed = {
        (seq_q, seq_kv),
        (1, seq_q, seq_kv),
        (1, 1, seq_q, seq_kv),
        (batch, 1, seq_q, seq_kv),
        (batch, heads, seq_q, seq_kv),
    }
    if shape not in allowed:
        raise ParamInvalidError(
            f"atten_mask: expected one of [Sq,Skv], [1,Sq,Skv], [1,1,Sq,Skv], [B,1,Sq,Skv], [B,N,Sq,Skv] "
            f"with B={batch}, N={heads}, Sq={seq_q}, Skv={seq_kv}, got {describe(atten_mask)}"
        )
    if atten_mask.dim() == 2:
        return [atten_mask.unsqueeze(0)] * batch
    if atten_mask.dim() == 3:
        return [atten_mask] * batch
    if shape[0] == 1:
        return [atten_mask[0]] * batch
    return [atten_mask[b] for b in range(batch)]


def check_band(pre_tokens: int, next_tokens: int) -> None:
    """The window i - pre <= j <= i + next (any origin) must be non-empty: pre + next >= 0 (docs/semantics/masks.md).
    INT_MAX means "no bound", so only finite pairs can fail."""
    if pre_tokens + next_tokens < 0:
        raise ParamInvalidError(
            f"pre_tokens/next_tokens: the band [i - pre_tokens, i + next_tokens] must be non-empty, got "
            f"pre_tokens={pre_tokens}, next_tokens={next_tokens}"
        )


def band_batch_index(sparse_mode: int, seq_q: list[int]) -> int | None:
    """Mode 7: the last sequence with Sq_b > 0; mode 8: the first one."""
    candidates = [b for b, s in enumerate(seq_q) if s > 0]
    if not candidates:
        return None
    return candidates[-1] if sparse_mode == 7 else candidates[0]


def sequence_mask(
    sparse_mode: int,
    seq_q: int,
    seq_kv: int,
    *,
    pre_tokens: int,
    next_tokens: int,
    explicit: torch.Tensor | None,
    prefix: int | None = None,
    is_band_batch: bool = False,
) -> SequenceMask:
    """The mode table of docs/semantics/masks.md for one sequence. `explicit` is the user's full mask (modes
    0, 1, 5) for this sequence, or None. The caller has already dropped everything when no mask was given."""
    delta = seq_kv - seq_q
    pre = None if pre_tokens >= INT_MAX else pre_tokens
    nxt = None if next_tokens >= INT_MAX else next_tokens
    common = {"seq_q": seq_q, "seq_kv": seq_kv}
    if sparse_mode == 0:
        return SequenceMask(
            **common, lower=None if pre is None else -pre, upper=nxt, explicit=explicit
        )
    if sparse_mode in (1, 5):
        return SequenceMask(**common, explicit=explicit)
    if sparse_mode == 2:
        return SequenceMask(**common, upper=0)
    if sparse_mode == 3:
        return SequenceMask(**common, upper=delta)
    if sparse_mode == 4:
        return SequenceMask(
            **common,
            lower=None if pre is None else delta - pre,
            upper=None if nxt is None else delta + nxt,
        )
    if sparse_mode == 6:
        return SequenceMask(**common, upper=delta, prefix=prefix)
    if sparse_mode in (7, 8):
        if is_band_batch:
            return SequenceMask(**common, upper=None if nxt is None else delta + nxt)
        return SequenceMask(**common, upper=delta if sparse_mode == 7 else 0)
    raise ParamInvalidError(f"sparse_mode: expected 0..8, got {sparse_mode}")


def full_attention(seq_q: int, seq_kv: int) -> SequenceMask:
    """atten_mask None in the FA family: every mode and pre/next are ignored (docs/semantics/masks.md)."""
    return SequenceMask(seq_q=seq_q, seq_kv=seq_kv)
