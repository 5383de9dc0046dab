"""Hypothesis fuzzing: random VALID FlashAttentionScore configurations against the float64 oracle.

Each example draws a layout, batch, heads (MHA/GQA/MQA), lengths (TND: random lengths including zeros),
head dims (Dv <= Dqk), dtype, sparse mode with a matching mask (or none), pre/next, pse type and shape,
dropout and the TND softmax layout, then checks attention_out, softmax_max and softmax_sum against the oracle.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

import cann_attn
from matrix_sample import fuzz_examples
from oracle import INT_MAX, check_fa_result, make_compressed_mask, make_qkv, pack_drop_mask, tnd_cum

LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_S = 40


def _band(draw, mode):
    """pre/next for modes 0 and 4: INT_MAX or small values, the band non-empty (pre + next >= 0)."""
    pre = draw(st.one_of(st.just(INT_MAX), st.integers(-8, MAX_S)))
    nxt = draw(st.one_of(st.just(INT_MAX), st.integers(-8, MAX_S)))
    if pre < INT_MAX and nxt < INT_MAX and pre + nxt < 0:
        nxt = -pre
    return pre, nxt


def _prefix(draw, q_lens, kv_lens):
    out = []
    for sq, skv in zip(q_lens, kv_lens, strict=True):
        lo = 0 if sq > skv else skv - sq
        out.append(draw(st.integers(lo, skv)))
    return out


@st.composite
def fa_configs(draw):
    layout = draw(st.sampled_from(LAYOUTS))
    tnd = layout == "TND"
    dtype = draw(st.sampled_from(DTYPES))
    n2 = draw(st.sampled_from([1, 2]))
    n1 = n2 * draw(st.sampled_from([1, 2, 3]))
    d = draw(st.sampled_from([4, 8, 16, 24]))
    dv = draw(st.sampled_from(sorted({d, max(1, d // 2), max(1, d - 3)})))
    if tnd:
        nseq = draw(st.integers(1, 4))
        q_lens = draw(st.lists(st.integers(0, MAX_S), min_size=nseq, max_size=nseq))
        kv_lens = [draw(st.integers(1 if q > 0 else 0, MAX_S)) for q in q_lens]
        batch = nseq
    else:
        batch = draw(st.integers(1, 3))
        q_lens = [draw(st.integers(1, MAX_S))] * batch
        kv_lens = [draw(st.integers(1, MAX_S))] * batch
    max_sq, max_skv = max(q_lens), max(kv_lens)
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)

    kw: dict = {}
    modes = (0, 1, 2, 3, 4, 6, 7, 8) if tnd else (0, 1, 2, 3, 4, 5, 6)
    mode = draw(st.sampled_from(modes))
    with_mask = draw(st.sampled_from([True, True, True, False]))
    kw["sparse_mode"] = mode
    if mode in (5, 6):
        kw["prefix"] = _prefix(draw, q_lens, kv_lens)
    if mode in (0, 4):
        kw["pre_tokens"], kw["next_tokens"] = _band(draw, mode)
    if mode in (7, 8):
        kw["next_tokens"] = draw(st.one_of(st.just(INT_MAX), st.integers(-5, MAX_S)))
    if with_mask:
        if mode in (0, 1):
            if tnd:
                shape = (max_sq, max_skv)
            else:
                shape = draw(
                    st.sampled_from(
                        [
                            (max_sq, max_skv),
                            (1, max_sq, max_skv),
                            (batch, 1, max_sq, max_skv),
                            (1, 1, max_sq, max_skv),
                            (batch, n1, max_sq, max_skv),
                        ]
                    )
                )
            p = draw(st.sampled_from([0.0, 0.3, 0.8]))  # 0.8 may fully mask rows: they must output 0
            mask = torch.rand(shape, generator=gen) < p
            kw["atten_mask"] = mask.to(draw(st.sampled_from([torch.bool, torch.uint8])))
        elif mode == 5:
            heads = draw(st.sampled_from([1, n1]))
            i = torch.arange(max_sq).unsqueeze(1)
            j = torch.arange(max_skv).unsqueeze(0)
            blocks = [((j > i + max_skv - max_sq) & (j >= p)).expand(heads, -1, -1) for p in kw["prefix"]]
            kw["atten_mask"] = torch.stack(blocks)
        else:
            kw["atten_mask"] = make_compressed_mask(mode).to(draw(st.sampled_from([torch.bool, torch.uint8])))

    pse_kind = draw(st.sampled_from(["none", "none", "tensor", "alibi"]))
    if tnd and (min(q_lens) == 0):
        pse_kind = "none"  # no pse when a TND sequence is empty
    if mode in (7, 8) and with_mask:
        pse_kind = "none"  # documented: mode 7 takes no pse; mode 8 only with equal q/kv lengths
    if pse_kind == "tensor":
        kw["pse_type"] = draw(st.sampled_from([0, 1]))
        pb = draw(st.sampled_from([1, batch]))
        rows = max_sq if tnd else draw(st.sampled_from([max_sq, 1]))
        kw["pse"] = torch.randn(pb, n1, rows, max_skv, generator=gen).to(dtype)
    elif pse_kind == "alibi":
        kw["pse_type"] = draw(st.sampled_from([2, 3]))
        shape = draw(st.sampled_from([(n1,), (batch, n1)]))
        kw["pse"] = torch.rand(shape, generator=gen) * 0.5
        if draw(st.booleans()):
            kw["q_start_idx"] = [draw(st.integers(0, 12))]
            kw["kv_start_idx"] = [draw(st.integers(0, 12))]

    keep_prob = draw(st.sampled_from([1.0, 1.0, 0.8, 0.5]))
    if keep_prob < 1.0:
        numel = n1 * sum(a * b for a, b in zip(q_lens, kv_lens, strict=True))
        kw["keep_prob"] = keep_prob
        kw["drop_mask"] = pack_drop_mask(torch.rand(numel, generator=gen) < keep_prob)
    kw["scale_value"] = draw(st.sampled_from([d**-0.5, 1.0, 0.125]))
    if tnd:
        kw["actual_seq_qlen"] = tnd_cum(q_lens)
        kw["actual_seq_kvlen"] = tnd_cum(kv_lens)
        kw["softmax_layout"] = draw(st.sampled_from(["", "TND"]))

    q, k, v = make_qkv(
        layout,
        gen=gen,
        b=batch,
        n1=n1,
        n2=n2,
        sq=max_sq,
        skv=max_skv,
        d=d,
        dv=dv,
        dtype=dtype,
        q_lens=q_lens,
        kv_lens=kv_lens,
    )
    var_len = tnd and draw(st.booleans())
    summary = {key: (tuple(val.shape) if isinstance(val, torch.Tensor) else val) for key, val in kw.items()}
    note(
        f"layout={layout} dtype={dtype} B={batch} N1={n1} N2={n2} D={d} Dv={dv} q_lens={q_lens} "
        f"kv_lens={kv_lens} var_len={var_len} kwargs={summary}"
    )
    return layout, n1, q, k, v, kw, var_len


@pytest.mark.filterwarnings("ignore:sparse_mode=.* without atten_mask:UserWarning")  # on purpose
@settings(max_examples=fuzz_examples(200), deadline=None)
@given(cfg=fa_configs())
def test_random_valid_configurations(cfg):
    layout, n1, q, k, v, kw, var_len = cfg
    if var_len:
        result = cann_attn.flash_attention_var_len_score(q, k, v, n1, input_layout="TND", **kw)
    else:
        result = cann_attn.flash_attention_score(q, k, v, n1, layout, **kw)
    check_fa_result(result, q, k, v, n1, layout, **kw)
