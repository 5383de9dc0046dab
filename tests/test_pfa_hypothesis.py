"""Hypothesis fuzzing of prompt_flash_attention over random VALID configurations against the independent oracle.

Drawn: layout, B, GQA (N2, G), Sq/Skv, D, input dtype (fp16 / bf16 / int8), actual-length lists (None, one value, B
values, more than B), sparse mode 0..4 with a mask of any documented shape and dtype, pre/next (non-empty band),
pse_shift (batch 1 or B, larger than needed), scale, output quantization (per-tensor or per-channel, fp32 or bf16
scales, with a zero or nonzero offset where the interception rule of docs/operators/prompt_flash_attention.md allows),
deq scales as FLOAT32 or trans_quant_param words.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cann_attn
from matrix_sample import fuzz_examples
from pfa_cases import INT_MAX, LAYOUTS, channel_tensor, check_pfa, int8_scales, make_qkv, rand_bnsd

PER_CHANNEL = {"BSH": ["H", "11H"], "BNSD": ["ND", "1N1D"], "BSND": ["ND", "11ND"], "BNSD_BSND": ["ND", "11ND"]}


def _lengths(draw, kind: str, b: int, s: int):
    if kind == "none":
        return None
    count = {"one": 1, "B": b, "more": b + 2}[kind]
    return draw(st.lists(st.integers(0, s), min_size=count, max_size=count))


def _used(lengths, b, s):
    if lengths is None:
        return [s] * b
    return lengths * b if len(lengths) == 1 else lengths[:b]


def _has_interceptable_rows(mode, has_mask, act_q, act_kv, pre, nxt) -> bool:
    """docs/operators/prompt_flash_attention.md: configurations where a nonzero quant_offset2 is rejected."""
    for sq, skv in zip(act_q, act_kv, strict=True):
        if mode == 0 and has_mask and (sq - skv - pre > 0 or nxt < 0):
            return True
        if mode == 3 and skv < sq:
            return True
        if mode == 4 and (pre < 0 or nxt + skv - sq < 0):
            return True
    return False


@st.composite
def pfa_configs(draw):
    layout = draw(st.sampled_from(LAYOUTS))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.int8]))
    b = draw(st.integers(1, 3))
    nkv = draw(st.integers(1, 2))
    n = nkv * draw(st.sampled_from([1, 2, 3]))
    sq = draw(st.integers(1, 9))
    skv = draw(st.integers(1, 11))
    d = 32 if dtype == torch.int8 else draw(st.sampled_from([4, 8, 16]))
    lens_q = _lengths(draw, draw(st.sampled_from(["none", "one", "B", "more"])), b, sq)
    lens_kv = _lengths(draw, draw(st.sampled_from(["none", "one", "B", "more"])), b, skv)
    mode = draw(st.integers(0, 4))
    cfg = {
        "layout": layout,
        "dtype": dtype,
        "b": b,
        "n": n,
        "nkv": nkv,
        "sq": sq,
        "skv": skv,
        "d": d,
        "lens_q": lens_q,
        "lens_kv": lens_kv,
        "mode": mode,
        "scale": draw(st.floats(0.05, 1.5)),
    }
    has_mask = mode != 0 or draw(st.booleans())
    cfg["mask"] = None
    if has_mask:
        cfg["mask_dtype"] = draw(st.sampled_from([torch.bool, torch.int8, torch.uint8]))
        if mode in (0, 1):
            cfg["mask"] = draw(st.sampled_from(["SS", "BSS", "1SS", "B1SS", "11SS"]))
            cfg["mask_p"] = draw(st.sampled_from([0.0, 0.2, 0.5]))
        else:
            cfg["mask"] = draw(st.sampled_from(["SS", "1SS", "11SS"]))
    pre, nxt = INT_MAX, 0
    if mode in (0, 4) and has_mask:
        pre = draw(st.one_of(st.just(INT_MAX), st.integers(-4, 12)))
        nxt = draw(st.one_of(st.just(INT_MAX), st.just(0), st.integers(-4, 12)))
        if pre + nxt < 0:
            pre = -nxt
    elif draw(st.booleans()):  # ignored by the mode (or no mask): any values
        pre, nxt = draw(st.integers(-5, 5)), draw(st.integers(-5, 5))
    cfg["pre"], cfg["nxt"] = pre, nxt
    cfg["pse"] = draw(st.sampled_from([None, "B", "1"]))
    cfg["pse_extra"] = (draw(st.integers(0, 3)), draw(st.integers(0, 3)))
    quant = draw(st.sampled_from(["none", "tensor", "channel"]))
    cfg["quant"] = (
        quant if quant == "none" else (quant if quant == "tensor" else draw(st.sampled_from(PER_CHANNEL[layout])))
    )
    cfg["scale_dtype"] = (
        draw(st.sampled_from([torch.float32, torch.bfloat16])) if dtype == torch.bfloat16 else torch.float32
    )
    offset = draw(st.sampled_from(["none", "zero", "nonzero"]))
    if offset == "nonzero" and _has_interceptable_rows(
        mode, has_mask, _used(lens_q, b, sq), _used(lens_kv, b, skv), pre, nxt
    ):
        offset = "zero"
    cfg["offset"] = offset
    cfg["uint64"] = draw(st.booleans())
    return cfg


def build(cfg, gen):
    layout, dtype, b, n, nkv = cfg["layout"], cfg["dtype"], cfg["b"], cfg["n"], cfg["nkv"]
    sq, skv, d = cfg["sq"], cfg["skv"], cfg["d"]
    q, k, v = make_qkv(layout, gen, b=b, n=n, nkv=nkv, sq=sq, skv=skv, d=d, dtype=dtype)
    kw = {
        "num_heads": n,
        "num_key_value_heads": nkv if nkv != n else 0,
        "input_layout": layout,
        "scale_value": cfg["scale"],
        "sparse_mode": cfg["mode"],
        "pre_tokens": cfg["pre"],
        "next_tokens": cfg["nxt"],
        "actual_seq_lengths": cfg["lens_q"],
        "actual_seq_lengths_kv": cfg["lens_kv"],
    }
    if cfg["mask"] is not None:
        if cfg["mode"] in (0, 1):
            shape = {
                "SS": (sq, skv),
                "BSS": (b, sq, skv),
                "1SS": (1, sq, skv),
                "B1SS": (b, 1, sq, skv),
                "11SS": (1, 1, sq, skv),
            }[cfg["mask"]]
            mask = torch.rand(shape, generator=gen) < cfg["mask_p"]
        else:
            shape = {"SS": (2048, 2048), "1SS": (1, 2048, 2048), "11SS": (1, 1, 2048, 2048)}[cfg["mask"]]
            mask = cann_attn.compressed_mask(cfg["mode"]).reshape(shape)
        kw["atten_mask"] = mask.to(cfg["mask_dtype"])
    if cfg["pse"] is not None:
        pse_dtype = torch.float16 if dtype == torch.int8 else dtype
        eq, ekv = cfg["pse_extra"]
        kw["pse_shift"] = rand_bnsd((b if cfg["pse"] == "B" else 1, n, sq + eq, skv + ekv), pse_dtype, gen)
    if dtype == torch.int8:
        kw.update(int8_scales(d, gen, uint64=cfg["uint64"]))
    if cfg["quant"] != "none":
        kind = cfg["quant"]
        kw["quant_scale2"] = channel_tensor(kind, n, d, gen, lo=10.0, hi=80.0, dtype=cfg["scale_dtype"])
        if cfg["offset"] == "zero":
            kw["quant_offset2"] = torch.zeros_like(kw["quant_scale2"])
        elif cfg["offset"] == "nonzero":
            kw["quant_offset2"] = channel_tensor(kind, n, d, gen, lo=-12.0, hi=12.0, dtype=cfg["scale_dtype"])
    return q, k, v, kw


@settings(max_examples=fuzz_examples(200), deadline=None)
@given(cfg=pfa_configs(), seed=st.integers(0, 2**31 - 1))
def test_pfa_random_configurations(cfg, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, kw = build(cfg, gen)
    check_pfa(q, k, v, **kw)
