"""Test-side handle on the independent oracle (``import oracle`` in tests) and the precision rules."""

from cann_attn.testing.oracle import *  # noqa: F403
from cann_attn.testing.oracle import (
    FLT_MAX,
    INT_MAX,
    LAYOUTS,
    cum_to_lengths,
    fa_forward_oracle,
    make_compressed_mask,
    naive_same_dtype_forward,
    pack_drop_mask,
    unpack_drop_mask,
)
from cann_attn.testing.precision import (
    ASCEND_THRESHOLDS,
    EPS,
    ascend_rule,
    assert_close_to_oracle,
    flash_attn_rule,
    mere_mare,
)

__all__ = [
    "ASCEND_THRESHOLDS",
    "EPS",
    "FLT_MAX",
    "INT_MAX",
    "LAYOUTS",
    "ascend_rule",
    "assert_close_to_oracle",
    "cum_to_lengths",
    "fa_forward_oracle",
    "flash_attn_rule",
    "make_compressed_mask",
    "mere_mare",
    "naive_same_dtype_forward",
    "pack_drop_mask",
    "unpack_drop_mask",
]


# ----------------------------------------------------------------------------------------------------
# Test helpers shared by the op tests: random inputs in any layout, masks, and the oracle comparison.
# ----------------------------------------------------------------------------------------------------
import torch

__all__ += ["check_fa_result", "from_bnsd", "full_mask", "keep_drop_mask", "make_qkv", "tnd_cum"]


def from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    """[B, N, S, D] -> layout (contiguous)."""
    b, n, s, d = t.shape
    if layout == "BSH":
        return t.permute(0, 2, 1, 3).reshape(b, s, n * d).contiguous()
    if layout == "SBH":
        return t.permute(2, 0, 1, 3).reshape(s, b, n * d).contiguous()
    if layout == "BSND":
        return t.permute(0, 2, 1, 3).contiguous()
    if layout == "BNSD":
        return t.contiguous()
    raise ValueError(layout)


def tnd_cum(lengths) -> list[int]:
    """Per-sequence lengths -> cumulative ends without a leading 0."""
    out, total = [], 0
    for n in lengths:
        total += int(n)
        out.append(total)
    return out


def make_qkv(
    layout,
    *,
    gen,
    b=2,
    n1=2,
    n2=None,
    sq=16,
    skv=None,
    d=32,
    dv=None,
    dtype=torch.float32,
    q_lens=None,
    kv_lens=None,
    std=1.0,
):
    """Random query/key/value in ``layout`` (TND: packed from ``q_lens``/``kv_lens``)."""
    n2 = n1 if n2 is None else n2
    skv = sq if skv is None else skv
    dv = d if dv is None else dv

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen, dtype=torch.float32) * std).to(dtype)

    if layout == "TND":
        return rnd(sum(q_lens), n1, d), rnd(sum(kv_lens), n2, d), rnd(sum(kv_lens), n2, dv)
    return (
        from_bnsd(rnd(b, n1, sq, d), layout),
        from_bnsd(rnd(b, n2, skv, d), layout),
        from_bnsd(rnd(b, n2, skv, dv), layout),
    )


def full_mask(shape, *, gen, p=0.3, dtype=torch.bool) -> torch.Tensor:
    """Random explicit mask (True = masked) where column 0 is never masked: no fully masked row."""
    m = torch.rand(shape, generator=gen) < p
    m[..., 0] = False
    return m.to(dtype)


def keep_drop_mask(numel: int, *, gen, keep_prob: float = 0.8, ascend_padding: bool = False):
    """Random keep flags and their LSB-first packing (optionally padded like Ascend: ceil(numel/128)*16 B)."""
    keep = torch.rand(numel, generator=gen) < keep_prob
    packed = pack_drop_mask(keep)
    if ascend_padding:
        nbytes = -(-numel // 128) * 16
        packed = torch.cat([packed, torch.zeros(nbytes - packed.numel(), dtype=torch.uint8)])
    return keep, packed


def check_fa_result(result, query, key, value, head_num, input_layout, **kwargs):
    """Compare a FlashAttentionScoreResult with the oracle (Ascend rule, else flash-attn rule)."""
    golden = fa_forward_oracle(query, key, value, head_num, input_layout, **kwargs)
    naive = naive_same_dtype_forward(query, key, value, head_num, input_layout, **kwargs)
    out, smax, ssum, softmax_out = result
    assert out.dtype == query.dtype, f"attention_out dtype {out.dtype} != query dtype {query.dtype}"
    stats_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    assert smax.dtype == stats_dtype and ssum.dtype == stats_dtype, (smax.dtype, ssum.dtype)
    assert softmax_out.numel() == 0, "softmax_out is reserved: expected an empty tensor"
    names = ("attention_out", "softmax_max", "softmax_sum")
    for name, actual, gold, nv in zip(names, (out, smax, ssum), golden, naive, strict=True):
        assert tuple(actual.shape) == tuple(gold.shape), (
            f"{name}: shape {tuple(actual.shape)} != {tuple(gold.shape)}"
        )
        assert_close_to_oracle(actual, gold, nv, dtype=actual.dtype, name=name)
    return golden
