"""Hypothesis fuzzing of flash_attention_score_grad against autograd through the float64 oracle.

Random valid configurations: layout, B, N1/N2 (GQA/MQA), Sq/Skv (TND lengths with zeros), Dqk/Dv, sparse mode with
the mask it expects (or no mask: full attention), pre/next, prefix, pse type 0..3 in every accepted shape, dropout,
statistics given or recomputed, softmax layout, fp32/fp64. Tiny shapes (S <= 24).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fa_grad_utils import LAYOUTS, GradCase, valid_grad_modes
from matrix_sample import fuzz_examples
from oracle import INT_MAX

MAX_S = 24


pytestmark = pytest.mark.usefixtures("single_thread")


@st.composite
def configs(draw):
    layout = draw(st.sampled_from(LAYOUTS))
    tnd = layout == "TND"
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    n2 = draw(st.integers(1, 2))
    n1 = n2 * draw(st.integers(1, 3))
    d = draw(st.integers(1, 12))
    dv = draw(st.integers(1, d))
    if tnd:
        nb = draw(st.integers(1, 4))
        q_lens = draw(st.lists(st.integers(0, MAX_S), min_size=nb, max_size=nb))
        if sum(q_lens) == 0:
            q_lens[draw(st.integers(0, nb - 1))] = draw(st.integers(1, MAX_S))
        kv_lens = [draw(st.integers(1 if sq > 0 else 0, MAX_S)) for sq in q_lens]  # Sq_b > 0 needs Skv_b > 0
        b, sq, skv = nb, None, None
    else:
        q_lens = kv_lens = None
        b, sq, skv = draw(st.integers(1, 3)), draw(st.integers(1, MAX_S)), draw(st.integers(1, MAX_S))
    cfg = {
        "layout": layout,
        "dtype": dtype,
        "b": b,
        "n1": n1,
        "n2": n2,
        "d": d,
        "dv": dv,
        "sq": sq,
        "skv": skv,
        "q_lens": q_lens,
        "kv_lens": kv_lens,
        "seed": draw(st.integers(0, 2**31 - 1)),
    }
    max_sq = max(q_lens) if tnd else sq
    max_skv = max(kv_lens) if tnd else skv
    seq_q = q_lens if tnd else [sq] * b
    seq_kv = kv_lens if tnd else [skv] * b

    kw: dict = {"scale_value": draw(st.sampled_from([d**-0.5, 1.0, 0.3]))}
    # ---- sparse mode and its mask
    mode = draw(st.sampled_from(valid_grad_modes(layout)))
    with_mask = draw(st.integers(0, 9)) > 0  # mostly with a mask; without one every mode is full attention
    kw["sparse_mode"] = mode
    band = st.one_of(st.just(INT_MAX), st.integers(-MAX_S, MAX_S))
    if mode in (0, 4):
        pre, nxt = draw(band), draw(band)
        if pre < INT_MAX and nxt < INT_MAX and pre + nxt < 0:  # the band must be non-empty
            nxt = -pre
        kw.update(pre_tokens=pre, next_tokens=nxt)
    elif mode in (7, 8):
        kw.update(pre_tokens=draw(band), next_tokens=draw(band))
    if mode in (5, 6):
        prefix = []
        for q_len, kv_len in zip(seq_q, seq_kv, strict=True):
            lo = 0 if q_len > kv_len else kv_len - q_len
            prefix.append(draw(st.integers(lo, kv_len)))
        kw["prefix"] = prefix
    cfg["mask"] = None
    if with_mask:
        if mode in (0, 1):
            shapes = (
                [(max_sq, max_skv)]
                if tnd
                else [(sq, skv), (1, sq, skv), (1, 1, sq, skv), (b, 1, sq, skv), (b, n1, sq, skv)]
            )
            cfg["mask"] = (
                "full",
                draw(st.sampled_from(shapes)),
                draw(st.sampled_from([0.0, 0.3, 0.7])),
                draw(st.sampled_from([torch.bool, torch.uint8])),
            )
        elif mode == 5:
            cfg["mask"] = ("prefix", draw(st.sampled_from([1, n1])))
        else:
            cfg["mask"] = ("compressed", mode)
    # ---- pse
    pse_type = draw(st.sampled_from([None, 0, 1, 2, 3]))
    if pse_type is not None and tnd and (
        0 in q_lens or (with_mask and (mode == 7 or (mode == 8 and q_lens != kv_lens)))
    ):
        # TND pse rules, ALiBi slopes included: none with a zero-length query sequence, nor with mode 7, and with
        # mode 8 only when every sequence has Sq_b == Skv_b (FlashAttentionVarLenScore documentation).
        pse_type = None
    cfg["pse"] = None
    if pse_type is not None:
        kw["pse_type"] = pse_type
        if pse_type in (0, 1):
            forms = ["full", "batch_broadcast"] if tnd else ["full", "batch_broadcast", "row_broadcast"]
            cfg["pse"] = draw(st.sampled_from(forms))
        else:
            cfg["pse"] = draw(st.sampled_from(["slopes_N", "slopes_BN"]))
            kw["q_start_idx"] = draw(st.one_of(st.none(), st.lists(st.integers(0, 6), min_size=1, max_size=2)))
            kw["kv_start_idx"] = draw(st.one_of(st.none(), st.lists(st.integers(0, 6), min_size=1, max_size=2)))
    # ---- dropout, statistics
    cfg["keep_prob"] = draw(st.sampled_from([1.0, 1.0, 0.8, 0.5]))
    cfg["with_stats"] = draw(st.booleans())
    if tnd:
        kw["softmax_layout"] = draw(st.sampled_from(["", "TND"]))
    cfg["kw"] = kw
    return cfg


def _build(cfg) -> tuple[GradCase, dict]:
    gen = torch.Generator().manual_seed(cfg["seed"])
    case = GradCase(
        cfg["layout"],
        gen,
        b=cfg["b"],
        n1=cfg["n1"],
        n2=cfg["n2"],
        sq=cfg["sq"] or 1,
        skv=cfg["skv"],
        d=cfg["d"],
        dv=cfg["dv"],
        dtype=cfg["dtype"],
        q_lens=cfg["q_lens"],
        kv_lens=cfg["kv_lens"],
    )
    kw = dict(cfg["kw"])
    mask = cfg["mask"]
    if mask is not None:
        if mask[0] == "full":
            _, shape, p, mask_dtype = mask
            # may fully mask rows on purpose: invalid rows must get 0 gradients
            kw["atten_mask"] = (torch.rand(shape, generator=gen) < p).to(mask_dtype)
        elif mask[0] == "prefix":
            kw["atten_mask"] = case.prefix_full_mask(kw["prefix"], heads=mask[1])
        else:
            kw["atten_mask"] = case.mode_kwargs(mask[1])["atten_mask"]
    form = cfg["pse"]
    if form == "full":
        kw["pse"] = case.pse_full()
    elif form == "batch_broadcast":
        kw["pse"] = case.pse_full(batch=1)
    elif form == "row_broadcast":
        kw["pse"] = case.pse_full(rows=1)
    elif form in ("slopes_N", "slopes_BN"):
        kw["pse"] = case.slopes(per_batch=form == "slopes_BN")
    if cfg["keep_prob"] < 1.0:
        kw.update(keep_prob=cfg["keep_prob"], drop_mask=case.drop_mask(cfg["keep_prob"]))
    return case, kw


@pytest.mark.filterwarnings("ignore:sparse_mode=.* without atten_mask:UserWarning")  # on purpose
@settings(max_examples=fuzz_examples(200), deadline=None)
@given(cfg=configs())
def test_grad_matches_oracle(cfg):
    case, kw = _build(cfg)
    case.kw.update(scale_value=kw.pop("scale_value"))
    case.check(stats=(cfg["with_stats"],), naive=False, **kw)
