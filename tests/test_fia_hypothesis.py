"""Hypothesis fuzzing of FusedInferAttentionScore against the independent oracle: 250 random valid configurations
(small shapes) over layouts, prefill/decode, GQA, actual lengths, masks, pse_shift, shared prefix, left padding, KV
anti-quantisation, int8 output and the log-sum-exp."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cann_attn
from fia_cases import check_fia, rand, to_layout

LAYOUTS = ("BSH", "BSND", "BNSD", "BNSD_BSND", "BSH_NBSD", "BNSD_NBSD")


@st.composite
def configs(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    decode = draw(st.booleans())
    feature = draw(st.sampled_from(("plain", "antiquant", "int8_out", "prefix", "padding")))
    layout = draw(st.sampled_from(("BSH", "BSND", "BNSD", "BSH_NBSD") if decode else LAYOUTS))
    if feature == "int8_out" and layout.endswith("NBSD"):
        layout = "BSND"  # int8 output: BSH, BSND, BNSD, BNSD_BSND only
    b = draw(st.integers(1, 3))
    nkv = draw(st.sampled_from((1, 2)))
    n = nkv * draw(st.sampled_from((1, 2, 3)))
    sq = 1 if decode else draw(st.integers(2, 7))
    skv = draw(st.integers(0 if not decode else 1, 9))
    d = draw(st.sampled_from((16, 32)))
    dtype = torch.float16 if feature in ("antiquant", "int8_out") else draw(
        st.sampled_from((torch.float32, torch.float16, torch.bfloat16)))
    if feature == "antiquant" and decode:
        dtype = draw(st.sampled_from((torch.float16, torch.bfloat16)))
    kv_dtype = torch.int8 if feature == "antiquant" else dtype
    q = to_layout(rand((b, n, sq, d), dtype, g), layout)
    k = to_layout(rand((b, nkv, skv, d), kv_dtype, g), layout)
    v = to_layout(rand((b, nkv, skv, d), kv_dtype, g), layout)
    kw = {"num_heads": n, "num_key_value_heads": nkv, "input_layout": layout, "scale": draw(st.sampled_from(
        (0.1, 0.25, 1.0)))}
    kw["softmax_lse_flag"] = feature != "int8_out" and draw(st.booleans())
    if not decode and draw(st.booleans()):
        kw["actual_seq_lengths"] = [draw(st.integers(0, sq)) for _ in range(b)]
    if draw(st.booleans()) or feature == "padding":
        kw["actual_seq_lengths_kv"] = [draw(st.integers(0, skv)) for _ in range(b)]
    prefix = 0
    if feature == "prefix":
        p_seq = draw(st.integers(1, 4))
        pk = to_layout(rand((1, nkv, p_seq, d), dtype, g), layout)
        pv = to_layout(rand((1, nkv, p_seq, d), dtype, g), layout)
        kw.update(key_shared_prefix=pk, value_shared_prefix=pv)
        prefix = p_seq
        if draw(st.booleans()):
            prefix = draw(st.integers(0, p_seq))
            kw["actual_shared_prefix_len"] = [prefix]
    if feature == "padding":
        kv_pad = draw(st.integers(0, 3 if decode else min(3, skv)))
        kv_len = kw["actual_seq_lengths_kv"]
        if not decode:
            kv_len[:] = [min(x, max(0, skv - kv_pad)) for x in kv_len]
        kw["kv_padding_size"] = torch.tensor([kv_pad])
        if not decode and draw(st.booleans()):
            q_pad = draw(st.integers(0, 2))
            kw["actual_seq_lengths"] = [draw(st.integers(0, max(0, sq - q_pad))) for _ in range(b)]
            kw["query_padding_size"] = torch.tensor([q_pad])
    mode = 0 if decode else draw(st.sampled_from((0, 0, 1, 2, 3, 4)))
    total_kv = skv + prefix
    if decode:
        if draw(st.booleans()):
            kw["atten_mask"] = torch.rand(b, total_kv, generator=g) < 0.3
    elif mode in (0, 1) and (mode == 1 or draw(st.booleans())):
        kw["atten_mask"] = torch.rand(sq, total_kv, generator=g) < 0.3
        kw["sparse_mode"] = mode
        if mode == 0:
            kw["pre_tokens"] = draw(st.integers(0, 8))
            kw["next_tokens"] = draw(st.integers(-kw["pre_tokens"], 8))
    elif mode in (2, 3, 4):
        kw["atten_mask"] = cann_attn.compressed_mask(mode)
        kw["sparse_mode"] = mode
        if mode == 4:
            kw["pre_tokens"] = draw(st.integers(0, 6))
            kw["next_tokens"] = draw(st.integers(0, 6))
    if draw(st.booleans()) and dtype != torch.float32 and feature not in ("antiquant",):
        kw["pse_shift"] = rand((draw(st.sampled_from((1, b))), n, sq, total_kv), dtype, g)
    if feature == "antiquant":
        if draw(st.booleans()):
            kw["antiquant_scale"] = (0.01 + 0.02 * torch.rand(2, nkv, 1, d, generator=g)).to(dtype)
            if draw(st.booleans()):
                kw["antiquant_offset"] = torch.randn(2, nkv, 1, d, generator=g).to(dtype)
        else:
            mode_kv = draw(st.sampled_from((0, 1, 2, 3) if decode else (0, 1)))
            shape = {0: (nkv, d), 1: (1, b, skv), 2: (nkv,), 3: (b, nkv, skv)}[mode_kv]
            kw.update(key_antiquant_scale=0.01 + 0.02 * torch.rand(shape, generator=g),
                      value_antiquant_scale=0.01 + 0.02 * torch.rand(shape, generator=g),
                      key_antiquant_mode=mode_kv, value_antiquant_mode=mode_kv)
    if feature == "int8_out":
        kw["quant_scale2"] = torch.tensor([float(draw(st.integers(10, 60)))])
    return q, k, v, kw


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(configs())
def test_fia_matches_oracle(config):
    q, k, v, kw = config
    check_fia(q, k, v, **kw)
