"""flash_attention_score / flash_attention_var_len_score against the independent float64 oracle.

Every test compares attention_out, softmax_max and softmax_sum with ``oracle.fa_forward_oracle`` through the
docs/semantics/precision.md rules (Ascend rule, else the flash-attn rule against a naive same-dtype run).
"""

from __future__ import annotations

import pytest
import torch

import cann_attn
import oracle
from oracle import FLT_MAX, INT_MAX, check_fa_result, full_mask, keep_drop_mask, make_compressed_mask, tnd_cum

NON_TND = ("BSH", "SBH", "BSND", "BNSD")
LAYOUTS = (*NON_TND, "TND")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DT_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


class Case:
    """Random inputs of one configuration plus the keyword arguments every op call shares."""

    def __init__(
        self,
        layout,
        gen,
        *,
        b=2,
        n1=2,
        n2=None,
        sq=24,
        skv=None,
        d=32,
        dv=None,
        dtype=torch.float32,
        q_lens=None,
        kv_lens=None,
    ):
        skv = sq if skv is None else skv
        self.layout, self.n1, self.dtype = layout, n1, dtype
        self.tnd = layout == "TND"
        if self.tnd:
            q_lens = [sq, max(1, sq // 2 - 1)] if q_lens is None else q_lens
            kv_lens = [skv, max(1, skv // 2 + 3)] if kv_lens is None else kv_lens
            self.q_lens, self.kv_lens = list(q_lens), list(kv_lens)
        else:
            self.q_lens, self.kv_lens = [sq] * b, [skv] * b
        self.b = len(self.q_lens)
        self.max_sq, self.max_skv = max(self.q_lens, default=0), max(self.kv_lens, default=0)
        self.q, self.k, self.v = oracle.make_qkv(
            layout,
            gen=gen,
            b=b,
            n1=n1,
            n2=n2,
            sq=sq,
            skv=skv,
            d=d,
            dv=dv,
            dtype=dtype,
            q_lens=self.q_lens,
            kv_lens=self.kv_lens,
        )
        self.kw = {"scale_value": d**-0.5}
        if self.tnd:
            self.kw.update(actual_seq_qlen=tnd_cum(self.q_lens), actual_seq_kvlen=tnd_cum(self.kv_lens))

    @property
    def drop_numel(self):
        return self.n1 * sum(a * b for a, b in zip(self.q_lens, self.kv_lens, strict=True))

    def full_mask_shape(self):
        """The canonical explicit-mask shape: [Sq, Skv] (TND: [maxSq, maxSkv])."""
        return (self.max_sq, self.max_skv)

    def run(self, var_len=False, **kwargs):
        kw = {**self.kw, **kwargs}
        if var_len:
            assert self.tnd
            result = cann_attn.flash_attention_var_len_score(
                self.q, self.k, self.v, self.n1, input_layout="TND", **kw
            )
        else:
            result = cann_attn.flash_attention_score(self.q, self.k, self.v, self.n1, self.layout, **kw)
        golden = check_fa_result(result, self.q, self.k, self.v, self.n1, self.layout, **kw)
        return result, golden


def _prefix_for(case: Case, fractions=(0.3, 0.7, 0.5, 0.9)) -> list[int]:
    """A valid prefix per sequence: Sq > Skv -> [0, Skv], else [Skv - Sq, Skv]."""
    out = []
    for b, (sq, skv) in enumerate(zip(case.q_lens, case.kv_lens, strict=True)):
        lo = 0 if sq > skv else skv - sq
        out.append(lo + round((skv - lo) * fractions[b % len(fractions)]))
    return out


def _prefix_full_mask(case: Case, prefix, heads=1):
    """Mode 5's full mask [B, heads, Sq, Skv] as Ascend expects it: (j > i + delta) & (j >= prefix)."""
    sq, skv = case.max_sq, case.max_skv
    i = torch.arange(sq).unsqueeze(1)
    j = torch.arange(skv).unsqueeze(0)
    blocks = [((j > i + (skv - sq)) & (j >= p)).expand(heads, sq, skv) for p in prefix]
    return torch.stack(blocks)


def _mode_kwargs(case: Case, mode: int, gen) -> dict:
    """Mask/prefix/pre/next arguments that make ``mode`` meaningful for this case."""
    if mode in (0, 1):
        kw = {"atten_mask": full_mask(case.full_mask_shape(), gen=gen)}
        if mode == 0:
            kw.update(pre_tokens=9, next_tokens=4)
        return kw
    if mode == 5:
        prefix = _prefix_for(case)
        return {"atten_mask": _prefix_full_mask(case, prefix, heads=case.n1), "prefix": prefix}
    if mode == 6:
        return {"atten_mask": make_compressed_mask(6), "prefix": _prefix_for(case)}
    kw = {"atten_mask": make_compressed_mask(mode)}
    if mode == 4:
        kw.update(pre_tokens=5, next_tokens=3)
    if mode in (7, 8):
        kw.update(next_tokens=2)
    return kw


def _valid_modes(layout):
    return (0, 1, 2, 3, 4, 6, 7, 8) if layout == "TND" else (0, 1, 2, 3, 4, 5, 6)


# ------------------------------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS.get)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_and_dtypes(rng, layout, dtype):
    Case(layout, rng, sq=24, skv=40, dtype=dtype).run()


@pytest.mark.parametrize("layout", ["BNSD", "SBH", "TND"])
def test_float64_smoke(rng, layout):
    case = Case(layout, rng, sq=12, skv=17, dtype=torch.float64)
    pse_shape = (case.b, case.n1, case.max_sq, case.max_skv)
    pse = torch.randn(pse_shape, generator=rng, dtype=torch.float64)
    case.run(atten_mask=make_compressed_mask(3), sparse_mode=3, pse=pse)


def test_var_len_entry_matches_flash_attention_score(rng):
    case = Case("TND", rng, q_lens=[7, 13, 2], kv_lens=[9, 13, 5], dtype=torch.float16)
    a, _ = case.run(var_len=True, atten_mask=make_compressed_mask(3), sparse_mode=3)
    b, _ = case.run(var_len=False, atten_mask=make_compressed_mask(3), sparse_mode=3)
    for x, y in zip(a[:3], b[:3], strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------- sparse modes
@pytest.mark.parametrize(
    ("layout", "mode"), [(lay, m) for lay in LAYOUTS for m in _valid_modes(lay)], ids=lambda x: str(x)
)
def test_sparse_modes(rng, layout, mode):
    case = Case(layout, rng, sq=20, skv=33, q_lens=[20, 7, 12], kv_lens=[33, 7, 30])
    case.run(var_len=layout == "TND" and mode % 2 == 0, sparse_mode=mode, **_mode_kwargs(case, mode, rng))


@pytest.mark.parametrize("mode", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DT_IDS.get)
@pytest.mark.parametrize("layout", ["BSH", "TND"])
def test_causal_modes_low_precision(rng, layout, dtype, mode):
    case = Case(layout, rng, sq=40, skv=40, dtype=dtype, q_lens=[40, 17], kv_lens=[40, 25])
    case.run(sparse_mode=mode, **_mode_kwargs(case, mode, rng))


@pytest.mark.parametrize("mode", [2, 4, 6, 8])
def test_compressed_mask_as_uint8(rng, mode):
    layout = "TND" if mode == 8 else "BSH"
    case = Case(layout, rng, sq=20, skv=26, q_lens=[20, 7], kv_lens=[26, 9])
    kw = _mode_kwargs(case, mode, rng)
    kw["atten_mask"] = kw["atten_mask"].to(torch.uint8)
    case.run(sparse_mode=mode, **kw)


@pytest.mark.filterwarnings("ignore:sparse_mode=.* without atten_mask:UserWarning")  # on purpose
@pytest.mark.parametrize("mode", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_no_atten_mask_means_full_attention(rng, layout, mode):
    """FA family: without atten_mask, sparse_mode / pre / next are ignored (full attention, every mode)."""
    case = Case(layout, rng, sq=16, skv=21, q_lens=[16, 5], kv_lens=[21, 9])
    extra = {"prefix": _prefix_for(case)} if mode == 6 else {}
    (out, smax, _, _), _ = case.run(sparse_mode=mode, pre_tokens=1, next_tokens=0, **extra)
    (ref, ref_max, _, _), _ = case.run()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(smax, ref_max)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8], ids=["bool", "uint8"])
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("shape", ["SqSkv", "1SqSkv", "B1SqSkv", "11SqSkv", "BNSqSkv"])
def test_full_mask_shapes(rng, shape, mode, mask_dtype):
    b, n, sq, skv = 2, 3, 19, 26
    case = Case("BSND", rng, b=b, n1=n, sq=sq, skv=skv)
    dims = {
        "SqSkv": (sq, skv),
        "1SqSkv": (1, sq, skv),
        "B1SqSkv": (b, 1, sq, skv),
        "11SqSkv": (1, 1, sq, skv),
        "BNSqSkv": (b, n, sq, skv),
    }[shape]
    mask = full_mask(dims, gen=rng, p=0.4, dtype=mask_dtype)
    case.run(atten_mask=mask, sparse_mode=mode)


@pytest.mark.parametrize("heads", [1, 2])
def test_mode5_prefix_mask_shapes(rng, heads):
    case = Case("BNSD", rng, b=3, n1=2, sq=14, skv=23)
    prefix = [9, 23, 15]
    case.run(sparse_mode=5, prefix=prefix, atten_mask=_prefix_full_mask(case, prefix, heads=heads))


def test_mode5_batch_one_takes_1_1_sq_skv_mask(rng):
    """B = 1: [1,1,Sq,Skv] is the documented [B,1,Sq,Skv] (the B > 1 refusal lives in test_fa_errors)."""
    case = Case("BNSD", rng, b=1, n1=2, sq=10, skv=12)
    case.run(sparse_mode=5, prefix=[6], atten_mask=_prefix_full_mask(case, [6], heads=1))


def test_mode5_uses_mask_content(rng):
    """Mode 5: the given full mask's content decides (not the prefix formula)."""
    case = Case("BSH", rng, b=2, n1=2, sq=10, skv=12)
    mask = full_mask((2, 1, 10, 12), gen=rng, p=0.5)
    case.run(sparse_mode=5, prefix=[4, 6], atten_mask=mask)


@pytest.mark.parametrize(("sq", "skv"), [(20, 33), (33, 20), (25, 25)])
@pytest.mark.parametrize("layout", ["BNSD", "TND"])
def test_mode6_prefix_compressed(rng, layout, sq, skv):
    case = Case(layout, rng, sq=sq, skv=skv, q_lens=[sq, 6, 11], kv_lens=[skv, 9, 11])
    for fractions in ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0), (0.4, 0.5, 0.6)):
        case.run(sparse_mode=6, atten_mask=make_compressed_mask(6), prefix=_prefix_for(case, fractions))


# ------------------------------------------------------------------------------------------------ bands
BANDS = [(5, 0), (0, 5), (10, -3), (-3, 10), (3, 3), (INT_MAX, 0), (0, INT_MAX)]


@pytest.mark.parametrize(("pre", "nxt"), BANDS, ids=str)
@pytest.mark.parametrize(("layout", "sq", "skv"), [("BSH", 30, 30), ("SBH", 20, 35), ("TND", 0, 0)])
def test_mode0_band(rng, layout, sq, skv, pre, nxt):
    case = Case(layout, rng, sq=sq, skv=skv, q_lens=[18, 30, 7], kv_lens=[25, 12, 7])
    zeros = torch.zeros(case.full_mask_shape(), dtype=torch.bool)  # only the band masks
    case.run(sparse_mode=0, atten_mask=zeros, pre_tokens=pre, next_tokens=nxt)


@pytest.mark.parametrize(("pre", "nxt"), [(5, 0), (3, 3), (10, -3)], ids=str)
def test_mode0_band_agrees_with_mask(rng, pre, nxt):
    """The documented use: the explicit mask equals the band (Ascend requires them to agree)."""
    case = Case("BSND", rng, sq=27, skv=27)
    i = torch.arange(27).unsqueeze(1)
    j = torch.arange(27).unsqueeze(0)
    mask = (j > i + nxt) | (j < i - pre)
    case.run(sparse_mode=0, atten_mask=mask.to(torch.uint8), pre_tokens=pre, next_tokens=nxt)


@pytest.mark.parametrize(
    ("pre", "nxt"), [(4, 2), (0, 0), (-2, 6), (7, -3), (INT_MAX, 0), (2, INT_MAX)], ids=str
)
@pytest.mark.parametrize(("layout", "sq", "skv"), [("BNSD", 20, 35), ("BSH", 35, 20), ("TND", 0, 0)])
def test_mode4_band(rng, layout, sq, skv, pre, nxt):
    case = Case(layout, rng, sq=sq, skv=skv, q_lens=[11, 25, 8], kv_lens=[30, 14, 8])
    case.run(sparse_mode=4, atten_mask=make_compressed_mask(4), pre_tokens=pre, next_tokens=nxt)


@pytest.mark.parametrize("nxt", [0, 3, -2])
@pytest.mark.parametrize("mode", [7, 8])
def test_modes_7_8(rng, mode, nxt):
    q_lens, kv_lens = [9, 0, 14, 6, 0], [12, 5, 14, 10, 0]  # band batch: mode 7 -> index 3, mode 8 -> index 0
    case = Case("TND", rng, n1=3, n2=1, q_lens=q_lens, kv_lens=kv_lens)
    case.run(sparse_mode=mode, atten_mask=make_compressed_mask(mode), next_tokens=nxt, pre_tokens=1)


@pytest.mark.parametrize("mode", [3, 4])
@pytest.mark.parametrize(("sq", "skv"), [(13, 29), (29, 13)])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_sq_ne_skv(rng, layout, sq, skv, mode):
    case = Case(layout, rng, sq=sq, skv=skv, q_lens=[sq, skv], kv_lens=[skv, sq])
    case.run(sparse_mode=mode, **_mode_kwargs(case, mode, rng))


# ---------------------------------------------------------------------------------------------- invalid rows
@pytest.mark.parametrize("softmax_layout", ["", "TND"])
def test_invalid_rows_tnd_mode3(rng, softmax_layout):
    """TND mode 3 with Sq_b > Skv_b: rows with no visible key output 0, max = -FLT_MAX, sum = +FLT_MAX."""
    case = Case("TND", rng, n1=2, q_lens=[6, 4], kv_lens=[3, 4])
    (out, smax, ssum, _), _ = case.run(
        sparse_mode=3, atten_mask=make_compressed_mask(3), softmax_layout=softmax_layout
    )
    assert torch.all(out[:3] == 0)  # sequence 0, rows 0..2: j <= i - 3 is empty
    assert torch.all(out[3:6].abs().sum(-1) > 0)
    if softmax_layout == "TND":
        rows_max, rows_sum = smax[:3], ssum[:3]
    else:  # per-sequence [N1, Sq_b, 8] blocks: sequence 0 is the first 2*6*8 floats
        rows_max = smax.reshape(-1)[:96].reshape(2, 6, 8)[:, :3]
        rows_sum = ssum.reshape(-1)[:96].reshape(2, 6, 8)[:, :3]
    assert torch.all(rows_max == -FLT_MAX) and torch.all(rows_sum == FLT_MAX)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=DT_IDS.get)
def test_invalid_rows_fully_masked_by_mode1_mask(rng, dtype):
    case = Case("BNSD", rng, b=2, n1=2, sq=8, skv=10, dtype=dtype)
    mask = full_mask((8, 10), gen=rng)
    mask[3] = True
    mask[7] = True
    (out, smax, ssum, _), _ = case.run(sparse_mode=1, atten_mask=mask)
    assert torch.all(out[:, :, [3, 7]] == 0)
    assert torch.all(smax[:, :, [3, 7]] == -FLT_MAX) and torch.all(ssum[:, :, [3, 7]] == FLT_MAX)


def test_invalid_rows_mode3_sq_gt_skv_bsnd(rng):
    case = Case("BSND", rng, b=1, n1=1, sq=9, skv=4)
    (out, smax, _, _), _ = case.run(sparse_mode=3, atten_mask=make_compressed_mask(3))
    assert torch.all(out[:, :5] == 0) and torch.all(smax[:, :, :5] == -FLT_MAX)


# ------------------------------------------------------------------------------------------------------ pse
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=DT_IDS.get)
@pytest.mark.parametrize("shape", ["BNSqSkv", "BN1Skv", "1NSqSkv", "1N1Skv"])
@pytest.mark.parametrize("pse_type", [0, 1])
@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
def test_pse_tensor(rng, layout, pse_type, shape, dtype):
    b, n, sq, skv = 2, 2, 15, 22
    case = Case(layout, rng, b=b, n1=n, sq=sq, skv=skv, dtype=dtype)
    dims = {
        "BNSqSkv": (b, n, sq, skv),
        "BN1Skv": (b, n, 1, skv),
        "1NSqSkv": (1, n, sq, skv),
        "1N1Skv": (1, n, 1, skv),
    }[shape]
    pse = torch.randn(dims, generator=rng).to(dtype)
    case.run(pse=pse, pse_type=pse_type, sparse_mode=3, atten_mask=make_compressed_mask(3))


@pytest.mark.parametrize(
    ("layout", "mode", "pse_batch", "dtype"),
    [("BNSD", 2, 1, torch.float32), ("BSH", 3, 2, torch.float16), ("BSND", 0, 1, torch.float32)],
    ids=str,
)
def test_pse_compressed_1024_rows(rng, layout, mode, pse_batch, dtype):
    """Sq == Skv > 1024 with a [B or 1, N1, 1024, Skv] pse (the last 1024 rows of a Toeplitz pse)."""
    s = 1100
    case = Case(layout, rng, b=2, n1=1, sq=s, skv=s, d=16, dtype=dtype)
    pse = torch.randn(pse_batch, 1, 1024, s, generator=rng).to(
        dtype
    )  # random: checks the exact index formula
    if mode == 0:
        i = torch.arange(s).unsqueeze(1)
        kw = {"atten_mask": torch.arange(s).unsqueeze(0) > i, "next_tokens": 0}
    else:
        kw = {"atten_mask": make_compressed_mask(mode)}
    case.run(pse=pse, pse_type=1, sparse_mode=mode, **kw)


def test_pse_compressed_equals_full_toeplitz(rng):
    """A true Toeplitz (ALiBi-like) pse gives the same result given in full or compressed."""
    s = 1050
    case = Case("BNSD", rng, b=1, n1=2, sq=s, skv=s, d=16)
    i = torch.arange(s).unsqueeze(1)
    j = torch.arange(s).unsqueeze(0)
    full = (-torch.tensor([0.05, 0.3]).reshape(1, 2, 1, 1) * (j - i).abs()).float()
    kw = {"sparse_mode": 3, "atten_mask": make_compressed_mask(3), "pse_type": 0}
    (a, _, _, _), _ = case.run(pse=full, **kw)
    (b, _, _, _), _ = case.run(pse=full[:, :, -1024:].contiguous(), **kw)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pse_batch", ["B", "1"])
@pytest.mark.parametrize("pse_type", [0, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=DT_IDS.get)
def test_pse_tnd_bottom_right_blocks(rng, dtype, pse_type, pse_batch):
    case = Case("TND", rng, n1=2, q_lens=[10, 17, 5], kv_lens=[14, 20, 9], dtype=dtype)
    pb = case.b if pse_batch == "B" else 1
    pse = torch.randn(pb, 2, case.max_sq, case.max_skv, generator=rng).to(dtype)
    case.run(pse=pse, pse_type=pse_type)
    case.run(pse=pse, pse_type=pse_type, sparse_mode=3, atten_mask=make_compressed_mask(3))


def test_pse_tnd_1024_rows(rng):
    """TND compressed form: Hp = max(1024, maxSq) rows; each sequence uses its bottom-right block."""
    case = Case("TND", rng, n1=2, q_lens=[10, 17, 5], kv_lens=[10, 17, 5])
    pse = torch.randn(1, 2, 1024, case.max_skv, generator=rng)
    case.run(pse=pse, pse_type=1, sparse_mode=3, atten_mask=make_compressed_mask(3))


def test_pse_tnd_1024_rows_long_sequence(rng):
    """TND with Sq_b == Skv_b > 1024 and a 1024-row pse: that sequence uses the compressed rule."""
    case = Case("TND", rng, n1=1, q_lens=[1030, 20], kv_lens=[1030, 20], d=16)
    pse = torch.randn(2, 1, 1024, case.max_skv, generator=rng)
    case.run(pse=pse, pse_type=1, sparse_mode=3, atten_mask=make_compressed_mask(3))


@pytest.mark.parametrize(("q_start", "kv_start"), [(None, None), ([5], [2]), ([0], [7])], ids=str)
@pytest.mark.parametrize("slopes_shape", ["N", "BN"])
@pytest.mark.parametrize("pse_type", [2, 3])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_alibi(rng, layout, pse_type, slopes_shape, q_start, kv_start):
    case = Case(layout, rng, n1=4, n2=2, sq=18, skv=26, q_lens=[18, 9, 4], kv_lens=[26, 9, 11])
    shape = (4,) if slopes_shape == "N" else (case.b, 4)
    slopes = torch.rand(shape, generator=rng, dtype=torch.float32) * 0.5 + 0.05
    case.run(pse=slopes, pse_type=pse_type, q_start_idx=q_start, kv_start_idx=kv_start)
    case.run(
        pse=slopes,
        pse_type=pse_type,
        q_start_idx=q_start,
        kv_start_idx=kv_start,
        sparse_mode=3,
        atten_mask=make_compressed_mask(3),
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DT_IDS.get)
def test_alibi_low_precision(rng, dtype):
    case = Case("BSH", rng, n1=2, sq=30, skv=30, dtype=dtype)
    slopes = torch.tensor([0.25, 0.0625])
    case.run(
        pse=slopes,
        pse_type=2,
        q_start_idx=[3],
        kv_start_idx=[1],
        sparse_mode=2,
        atten_mask=make_compressed_mask(2),
    )


# -------------------------------------------------------------------------------------------------- dropout
@pytest.mark.parametrize("ascend_padding", [False, True], ids=["exact", "ascend_padded"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dropout(rng, layout, ascend_padding):
    case = Case(layout, rng, n1=4, n2=2, sq=13, skv=21, q_lens=[13, 0, 7], kv_lens=[21, 3, 9])
    keep, packed = keep_drop_mask(case.drop_numel, gen=rng, keep_prob=0.8, ascend_padding=ascend_padding)
    assert 0 < int(keep.sum()) < keep.numel()
    case.run(drop_mask=packed, keep_prob=0.8)
    case.run(drop_mask=packed, keep_prob=0.8, sparse_mode=3, atten_mask=make_compressed_mask(3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DT_IDS.get)
def test_dropout_low_precision_with_pse(rng, dtype):
    case = Case("BNSD", rng, n1=2, sq=17, skv=17, dtype=dtype)
    _, packed = keep_drop_mask(case.drop_numel, gen=rng, keep_prob=0.8)
    pse = torch.randn(2, 2, 17, 17, generator=rng).to(dtype)
    case.run(drop_mask=packed, keep_prob=0.8, pse=pse)


def test_keep_prob_one_ignores_drop_mask(rng):
    case = Case("BSND", rng, sq=9, skv=11)
    drop_nothing_kept = torch.zeros((case.drop_numel + 7) // 8, dtype=torch.uint8)
    (a, _, _, _), _ = case.run(drop_mask=drop_nothing_kept, keep_prob=1.0)
    (b, _, _, _), _ = case.run()
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_dropout_actually_drops(rng):
    """Sanity: a drop mask that keeps nothing gives zero output (and unchanged stats)."""
    case = Case("BSH", rng, sq=9, skv=11)
    nothing = torch.zeros((case.drop_numel + 7) // 8, dtype=torch.uint8)
    (out, smax, _, _), _ = case.run(drop_mask=nothing, keep_prob=0.5)
    assert torch.all(out == 0)
    (_, ref_max, _, _), _ = case.run()
    torch.testing.assert_close(smax, ref_max)


# -------------------------------------------------------------------------------------- GQA / MQA / head dims
@pytest.mark.parametrize(("n1", "n2"), [(4, 2), (4, 1)], ids=["GQA", "MQA"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gqa_mqa(rng, layout, n1, n2):
    case = Case(layout, rng, n1=n1, n2=n2, sq=15, skv=23, dtype=torch.float16)
    case.run()
    case.run(sparse_mode=3, atten_mask=make_compressed_mask(3))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dv_smaller_than_dqk(rng, layout):
    case = Case(layout, rng, n1=4, n2=2, sq=19, skv=26, d=64, dv=48, dtype=torch.bfloat16)
    case.run()
    case.run(sparse_mode=2, atten_mask=make_compressed_mask(2))


@pytest.mark.parametrize(
    ("sq", "skv", "mode"),
    [(1, 1, 0), (1, 97, 3), (97, 1, 0), (97, 200, 3), (200, 97, 0), (200, 97, 2), (1025, 1025, 2)],
    ids=str,
)
def test_odd_lengths(rng, sq, skv, mode):
    big = max(sq, skv) > 500
    case = Case(
        "BSND",
        rng,
        b=1 if big else 2,
        n1=1 if big else 2,
        sq=sq,
        skv=skv,
        d=16 if big else 40,
        dtype=torch.float16,
    )
    kw = {"sparse_mode": mode, "atten_mask": make_compressed_mask(mode)} if mode else {}
    case.run(**kw)


def test_odd_lengths_tnd(rng):
    case = Case("TND", rng, n1=2, q_lens=[1, 97, 3, 200], kv_lens=[1, 200, 97, 1], d=24)
    case.run()
    case.run(sparse_mode=2, atten_mask=make_compressed_mask(2))


# --------------------------------------------------------------------------------------------------- TND
ZERO_LEN_CASES = {
    "middle": ([3, 0, 7], [4, 0, 8]),  # cumulative [3, 3, 10] / [4, 4, 12]
    "trailing": ([3, 0, 7, 0, 0], [4, 0, 8, 0, 0]),  # [..., 10, 10, 10]
    "q_only_zero": ([3, 0, 7], [4, 5, 3]),  # Sq_b = 0 with Skv_b > 0 is allowed
    "leading": ([0, 5, 4], [0, 5, 6]),
}


@pytest.mark.parametrize("variant", ["plain", "mode3", "dropout", "alibi"])
@pytest.mark.parametrize("lens", list(ZERO_LEN_CASES), ids=str)
def test_tnd_zero_length_sequences(rng, lens, variant):
    q_lens, kv_lens = ZERO_LEN_CASES[lens]
    case = Case("TND", rng, n1=2, q_lens=q_lens, kv_lens=kv_lens)
    assert case.kw["actual_seq_qlen"][-1] == sum(q_lens)
    kw = {}
    if variant == "mode3":
        kw = {"sparse_mode": 3, "atten_mask": make_compressed_mask(3)}
    elif variant == "dropout":
        kw = {"drop_mask": keep_drop_mask(case.drop_numel, gen=rng)[1], "keep_prob": 0.8}
    elif variant == "alibi":
        # FlashAttentionVarLenScore documentation: a sequence with Sq_b = 0 takes no pse, ALiBi slopes included.
        for var_len in (False, True):
            with pytest.raises(cann_attn.ParamInvalidError, match=r"\bpse\b"):
                case.run(var_len=var_len, pse=torch.tensor([0.5, 0.125]), pse_type=2)
        return
    for var_len in (False, True):
        case.run(var_len=var_len, **kw)


@pytest.mark.parametrize("softmax_layout", ["", "TND"])
def test_tnd_softmax_layouts(rng, softmax_layout):
    case = Case("TND", rng, n1=3, q_lens=[5, 9, 3], kv_lens=[6, 9, 8])
    (_, smax, _, _), _ = case.run(softmax_layout=softmax_layout)
    assert smax.shape == (17, 3, 8)
    # the two layouts hold the same numbers in different orders
    (_, other_max, _, _), _ = case.run(softmax_layout="TND" if softmax_layout == "" else "")
    assert not torch.equal(smax, other_max)
    torch.testing.assert_close(smax.reshape(-1).sort()[0], other_max.reshape(-1).sort()[0])


def test_tnd_softmax_default_layout_is_per_sequence_blocks(rng):
    case = Case("TND", rng, n1=2, q_lens=[3, 4], kv_lens=[5, 4])
    (_, tnd_max, _, _), _ = case.run(softmax_layout="TND")
    (_, flat_max, _, _), _ = case.run(softmax_layout="")
    seq0 = tnd_max[:3].permute(1, 0, 2).reshape(-1)  # [N1, Sq_0, 8]
    seq1 = tnd_max[3:].permute(1, 0, 2).reshape(-1)
    torch.testing.assert_close(flat_max.reshape(-1), torch.cat([seq0, seq1]), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ empty
@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD", "SBH", "TND"])
def test_empty_query_gives_empty_output(rng, layout):
    if layout == "TND":
        case = Case("TND", rng, n1=2, q_lens=[0, 0], kv_lens=[3, 5])
    else:
        case = Case(layout, rng, b=2, n1=2, sq=0, skv=5)
    (out, smax, ssum, _), golden = case.run()
    assert out.numel() == 0 and smax.numel() == 0 and ssum.numel() == 0
    assert tuple(out.shape) == tuple(golden[0].shape)


@pytest.mark.parametrize("layout", NON_TND)
def test_empty_key_gives_zero_output_and_invalid_row_stats(rng, layout):
    """Dense Skv = 0 with Sq > 0: every row sees no column, so out = 0, softmax_max = -FLT_MAX and softmax_sum =
    +FLT_MAX (docs/semantics/invalid-rows.md: never garbage), whichever backend computed it."""
    case = Case(layout, rng, b=2, n1=2, sq=5, skv=0)
    out, smax, ssum, _ = cann_attn.flash_attention_score(case.q, case.k, case.v, case.n1, layout, **case.kw)
    assert out.shape == case.q.shape and torch.all(out == 0)
    assert smax.shape == (2, 2, 5, 8) and torch.all(smax == -FLT_MAX) and torch.all(ssum == FLT_MAX)


def test_empty_batch(rng):
    q = torch.randn(0, 2, 5, 8)
    k = torch.randn(0, 2, 7, 8)
    v = torch.randn(0, 2, 7, 8)
    out, smax, ssum, _ = cann_attn.flash_attention_score(q, k, v, 2, "BNSD")
    assert out.shape == (0, 2, 5, 8) and smax.shape == (0, 2, 5, 8) and ssum.shape == (0, 2, 5, 8)


# ------------------------------------------------------------------------------------------- combinations
@pytest.mark.parametrize("layout", LAYOUTS)
def test_everything_at_once(rng, layout):
    """GQA + Dv < Dqk + pse + dropout + causal mask + Sq != Skv, in fp16."""
    case = Case(
        layout,
        rng,
        n1=4,
        n2=2,
        sq=21,
        skv=30,
        d=32,
        dv=24,
        dtype=torch.float16,
        q_lens=[21, 11, 6],
        kv_lens=[30, 11, 9],
    )
    if layout == "TND":
        pse = torch.randn(case.b, 4, case.max_sq, case.max_skv, generator=rng).half()
    else:
        pse = torch.randn(case.b, 4, 1, 30, generator=rng).half()
    _, packed = keep_drop_mask(case.drop_numel, gen=rng, keep_prob=0.8)
    case.run(
        pse=pse,
        pse_type=0,
        drop_mask=packed,
        keep_prob=0.8,
        sparse_mode=3,
        atten_mask=make_compressed_mask(3),
    )


# ----------------------------------------------------------------------------------------- argument forms
def test_lengths_prefix_and_starts_as_tensors(rng):
    """Lengths, prefix and start indices may be integer tensors as well as Python lists."""
    case = Case("TND", rng, n1=2, q_lens=[6, 9, 4], kv_lens=[10, 9, 7])
    as_list, _ = case.run(sparse_mode=6, atten_mask=make_compressed_mask(6), prefix=[6, 3, 5])
    case.kw["actual_seq_qlen"] = torch.tensor(case.kw["actual_seq_qlen"])
    case.kw["actual_seq_kvlen"] = torch.tensor(case.kw["actual_seq_kvlen"], dtype=torch.int32)
    as_tensor, _ = case.run(sparse_mode=6, atten_mask=make_compressed_mask(6), prefix=torch.tensor([6, 3, 5]))
    torch.testing.assert_close(as_list.attention_out, as_tensor.attention_out, rtol=0, atol=0)
    slopes = torch.tensor([0.3, 0.1])
    case.run(pse=slopes, pse_type=3, q_start_idx=torch.tensor([4]), kv_start_idx=torch.tensor([1]))


@pytest.mark.parametrize("layout", ["BSND", "BSH", "TND"])
def test_non_contiguous_inputs(rng, layout):
    """Views (e.g. a BSND tensor obtained by transposing BNSD storage) are read correctly."""
    case = Case(layout, rng, n1=2, sq=11, skv=14, d=16, q_lens=[11, 5], kv_lens=[14, 6])
    if layout == "BSND":
        case.q = case.q.transpose(1, 2).contiguous().transpose(1, 2)
        case.k = case.k.transpose(1, 2).contiguous().transpose(1, 2)
        case.v = case.v.transpose(1, 2).contiguous().transpose(1, 2)
        assert not case.q.is_contiguous()
    elif layout == "BSH":
        wide = torch.randn(2, 11, 64, generator=rng)
        case.q = wide[:, :, ::2]  # strided last dim
        assert not case.q.is_contiguous()
    else:
        case.k = torch.randn(case.k.shape[1], case.k.shape[0], case.k.shape[2], generator=rng).transpose(0, 1)
        assert not case.k.is_contiguous()
    case.run(sparse_mode=3, atten_mask=make_compressed_mask(3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=DT_IDS.get)
def test_large_logits_are_stable(rng, dtype):
    """Logits of magnitude ~100s (softmax nearly one-hot): the running max must keep everything finite."""
    case = Case("BNSD", rng, n1=2, sq=33, skv=65, d=32, dtype=dtype)
    case.q = (case.q.float() * 6).to(dtype)
    pse = (torch.randn(2, 2, 33, 65, generator=rng) * 30).to(dtype)
    (out, smax, ssum, _), _ = case.run(scale_value=1.0, pse=pse, pse_type=0)
    assert torch.isfinite(out).all() and torch.isfinite(smax).all() and torch.isfinite(ssum).all()
    assert float(smax.abs().max()) > 50


@pytest.mark.parametrize("inner_precise", [0, 1, 2])
def test_inner_precise_accepted(rng, inner_precise):
    case = Case("BSND", rng, sq=9, skv=9)
    kw = {**case.kw, "sparse_mode": 3, "atten_mask": make_compressed_mask(3)}
    result = cann_attn.flash_attention_score(
        case.q, case.k, case.v, 2, "BSND", inner_precise=inner_precise, **kw
    )
    check_fa_result(result, case.q, case.k, case.v, 2, "BSND", **kw)
