"""Every documented constraint of FusedInferAttentionScore / IncreFlashAttention is a ParamInvalidError (or
ParamNullptrError) naming the parameter, and every parameter we do not support yet says so
(docs/operators/fused_infer_attention_score.md, "Constraints" and "Not supported yet")."""

from __future__ import annotations

import pytest
import torch

import cann_attn
from cann_attn import ParamInvalidError, ParamNullptrError

G = torch.Generator().manual_seed(0)


def t(*shape, dtype=torch.float16):
    if dtype == torch.int8:
        return torch.randint(-5, 5, shape, generator=G).to(torch.int8)
    if dtype == torch.int32:
        return torch.zeros(shape, dtype=torch.int32)
    return torch.randn(shape, generator=G).to(dtype)


def bnsd(b=2, n=2, nkv=None, sq=4, skv=6, d=16, dtype=torch.float16, kv_dtype=None):
    nkv = nkv or n
    return t(b, n, sq, d, dtype=dtype), t(b, nkv, skv, d, dtype=kv_dtype or dtype), t(b, nkv, skv, d,
                                                                                      dtype=kv_dtype or dtype)


def fia(q, k, v, **kw):
    kw.setdefault("input_layout", "BNSD")
    if q is not None:
        kw.setdefault("num_heads", q.shape[1] if kw["input_layout"].startswith("BNSD") else 1)
    return cann_attn.fused_infer_attention_score(q, k, v, **kw)


def dec(**kw):
    return bnsd(sq=1, **kw)


PACKED = (t(6, 2, 128), t(6, 2, 128), t(6, 2, 128))

CASES = {
    # ---- inputs, dtypes, layouts, heads
    "query None": (lambda: fia(None, *bnsd()[1:], num_heads=2, input_layout="BNSD"), ParamNullptrError, "query"),
    "query dtype": (lambda: fia(*bnsd(dtype=torch.float64)), ParamInvalidError, "query"),
    "int4 value not int32": (lambda: fia(dec()[0], t(2, 2, 6, 2, dtype=torch.int32), dec()[2]),
                             ParamInvalidError, "value: expected int32"),
    "int4 D not 64x": (lambda: fia(dec()[0], t(2, 2, 6, 2, dtype=torch.int32), t(2, 2, 6, 2, dtype=torch.int32),
                                   key_antiquant_scale=t(2, 16), value_antiquant_scale=t(2, 16)),
                       ParamInvalidError, "multiple of 64"),
    "int4 float32 query": (lambda: fia(dec(dtype=torch.float32)[0], t(2, 2, 6, 8, dtype=torch.int32),
                                       t(2, 2, 6, 8, dtype=torch.int32)), ParamInvalidError, "query"),
    "int4 int8 output": (lambda: fia(dec(d=64)[0], t(2, 2, 6, 8, dtype=torch.int32), t(2, 2, 6, 8, dtype=torch.int32),
                                     quant_scale2=torch.ones(1)), ParamInvalidError, "quant_scale2"),
    "key dtype": (lambda: fia(bnsd()[0], *bnsd(dtype=torch.bfloat16)[1:]), ParamInvalidError, "key"),
    "value dtype": (lambda: fia(*bnsd()[:2], bnsd(dtype=torch.float32)[2]), ParamInvalidError, "value"),
    "layout": (lambda: fia(*bnsd(), input_layout="SBH"), ParamInvalidError, "input_layout"),
    "num_heads 0": (lambda: fia(*bnsd(), num_heads=0), ParamInvalidError, "num_heads"),
    "num_heads vs query": (lambda: fia(*bnsd(), num_heads=4), ParamInvalidError, "num_heads"),
    "num_key_value_heads negative": (lambda: fia(*bnsd(), num_key_value_heads=-1), ParamInvalidError,
                                     "num_key_value_heads"),
    "num_key_value_heads vs key": (lambda: fia(*bnsd(n=4, nkv=2), num_key_value_heads=1), ParamInvalidError,
                                   "num_key_value_heads"),
    "gqa not divisible": (lambda: fia(*bnsd(n=3, nkv=2), num_key_value_heads=2), ParamInvalidError,
                          "num_key_value_heads"),
    "gqa ratio > 64": (lambda: fia(t(1, 65, 2, 16), t(1, 1, 3, 16), t(1, 1, 3, 16), num_key_value_heads=1),
                       ParamInvalidError, "ratio <= 64"),
    "heads > 256": (lambda: fia(t(1, 2, 257 * 16), t(1, 2, 257 * 16), t(1, 2, 257 * 16), input_layout="BSH",
                                num_heads=257), ParamInvalidError, "num_heads"),
    "key head dim": (lambda: fia(bnsd()[0], *bnsd(d=32)[1:]), ParamInvalidError, "key"),
    "value shape": (lambda: fia(*bnsd()[:2], bnsd(skv=5)[2]), ParamInvalidError, "value"),
    "batch": (lambda: fia(bnsd()[0], *bnsd(b=3)[1:]), ParamInvalidError, "key"),
    "head dim > 512": (lambda: fia(*bnsd(d=528)), ParamInvalidError, "query"),
    "unaligned D with B > 128": (lambda: fia(*bnsd(b=129, d=8, sq=2, skv=2)), ParamInvalidError, "B <= 128"),
    "BSH hidden >= 65535": (lambda: fia(t(1, 2, 128 * 512), t(1, 2, 128 * 512), t(1, 2, 128 * 512),
                                        input_layout="BSH", num_heads=128), ParamInvalidError, "N * D"),
    "BNSD_BSND decode": (lambda: fia(*dec(), input_layout="BNSD_BSND"), ParamInvalidError, "input_layout"),
    "BNSD_NBSD Q_S > 16": (lambda: fia(*bnsd(sq=17), input_layout="BNSD_NBSD", num_heads=2), ParamInvalidError,
                           "input_layout"),
    "rope-only layout": (lambda: cann_attn.fused_infer_attention_score(*(x.transpose(1, 2) for x in bnsd()),
                                                                       input_layout="BSND_BNSD", num_heads=2),
                         ParamInvalidError,
                         "input_layout"),
    "decode KV_S > 262144": (lambda: fia(t(1, 1, 1, 16), t(1, 1, 262145, 16), t(1, 1, 262145, 16)),
                             ParamInvalidError, "KV_S"),
    "decode int8 qkv": (lambda: fia(*dec(dtype=torch.int8)), ParamInvalidError, "query"),
    # ---- not supported (yet) / reserved / no effect
    "key_rope_antiquant_scale": (lambda: fia(*bnsd(), key_rope_antiquant_scale=t(1)), ParamInvalidError,
                                 "key_rope_antiquant_scale"),
    "inner_precise 4": (lambda: fia(*bnsd(), inner_precise=4), ParamInvalidError, "inner_precise"),
    "inner_precise 2 decode": (lambda: fia(*dec(), inner_precise=2), ParamInvalidError, "inner_precise"),
    "sparse_mode 5": (lambda: fia(*bnsd(), sparse_mode=5, atten_mask=torch.zeros(4, 6, dtype=torch.bool)),
                      ParamInvalidError, "sparse_mode"),
    # ---- masks and pse
    "mask required": (lambda: fia(*bnsd(), sparse_mode=3), ParamInvalidError, "atten_mask"),
    "mask dtype": (lambda: fia(*bnsd(), atten_mask=torch.zeros(4, 6)), ParamInvalidError, "atten_mask"),
    "mask too small": (lambda: fia(*bnsd(), atten_mask=torch.zeros(3, 6, dtype=torch.bool)), ParamInvalidError,
                       "atten_mask"),
    "compressed mask shape": (lambda: fia(*bnsd(), sparse_mode=2, atten_mask=torch.zeros(64, 64, dtype=torch.bool)),
                              ParamInvalidError, "atten_mask"),
    "band empty": (lambda: fia(*bnsd(), atten_mask=torch.zeros(4, 6, dtype=torch.bool), pre_tokens=-3,
                               next_tokens=1), ParamInvalidError, "pre_tokens"),
    "pse dtype": (lambda: fia(*bnsd(), pse_shift=t(2, 2, 4, 6, dtype=torch.float32)), ParamInvalidError,
                  "pse_shift"),
    "pse shape": (lambda: fia(*bnsd(), pse_shift=t(2, 1, 4, 6)), ParamInvalidError, "pse_shift"),
    "decode pse rows": (lambda: fia(*dec(), pse_shift=t(2, 2, 2, 6)), ParamInvalidError, "pse_shift"),
    "decode pse D % 16": (lambda: fia(*dec(d=8), pse_shift=t(2, 2, 1, 6)), ParamInvalidError, "query"),
    # ---- lengths
    "actual length > S": (lambda: fia(*bnsd(), actual_seq_lengths=[5]), ParamInvalidError, "actual_seq_lengths"),
    "kv length count": (lambda: fia(*bnsd(b=3), actual_seq_lengths_kv=[1, 2]), ParamInvalidError,
                        "actual_seq_lengths_kv"),
    # ---- packed layouts
    "TND lengths missing": (lambda: fia(*PACKED, input_layout="TND", num_heads=2), ParamNullptrError,
                            "actual_seq_lengths"),
    "TND last length": (lambda: fia(*PACKED, input_layout="TND", num_heads=2, actual_seq_lengths=[2, 5],
                                    actual_seq_lengths_kv=[3, 6]), ParamInvalidError, "actual_seq_lengths"),
    "TND count": (lambda: fia(*PACKED, input_layout="TND", num_heads=2, actual_seq_lengths=[2, 6],
                              actual_seq_lengths_kv=[6]), ParamInvalidError, "actual_seq_lengths_kv"),
    "TND head dim": (lambda: fia(t(6, 2, 32), t(6, 2, 32), t(6, 2, 32), input_layout="TND", num_heads=2,
                                 actual_seq_lengths=[6], actual_seq_lengths_kv=[6]), ParamInvalidError, "D=128"),
    "TND pse": (lambda: fia(*PACKED, input_layout="TND", num_heads=2, actual_seq_lengths=[6],
                            actual_seq_lengths_kv=[6], pse_shift=t(1, 2, 6, 6)), ParamInvalidError, "pse_shift"),
    "TND explicit mask": (lambda: fia(*PACKED, input_layout="TND", num_heads=2, actual_seq_lengths=[6],
                                      actual_seq_lengths_kv=[6], atten_mask=torch.zeros(6, 6, dtype=torch.bool)),
                          ParamInvalidError, "atten_mask"),
    "TND sequences > 4096": (lambda: fia(t(4097, 1, 128), t(4097, 1, 128), t(4097, 1, 128), input_layout="TND",
                                         actual_seq_lengths=list(range(1, 4098)),
                                         actual_seq_lengths_kv=list(range(1, 4098))), ParamInvalidError,
                             "actual_seq_lengths"),
    # ---- MLA rope
    "rope alone": (lambda: fia(*bnsd(d=128), query_rope=t(2, 2, 4, 64)), ParamInvalidError, "query_rope/key_rope"),
    "rope dtype": (lambda: fia(*bnsd(d=128), query_rope=t(2, 2, 4, 64, dtype=torch.bfloat16),
                               key_rope=t(2, 2, 6, 64)), ParamInvalidError, "query_rope"),
    "rope head dim": (lambda: fia(*bnsd(d=64), query_rope=t(2, 2, 4, 64), key_rope=t(2, 2, 6, 64)),
                      ParamInvalidError, "query"),
    "rope shape": (lambda: fia(*bnsd(d=128), query_rope=t(2, 2, 4, 32), key_rope=t(2, 2, 6, 64)),
                   ParamInvalidError, "query_rope"),
    "rope 512 kv heads": (lambda: fia(*bnsd(d=512), query_rope=t(2, 2, 4, 64), key_rope=t(2, 2, 6, 64)),
                          ParamInvalidError, "num_key_value_heads"),
    "rope 512 sparse 1": (lambda: fia(*bnsd(nkv=1, d=512), num_key_value_heads=1, query_rope=t(2, 2, 4, 64),
                                      key_rope=t(2, 1, 6, 64), sparse_mode=1,
                                      atten_mask=torch.zeros(4, 6, dtype=torch.bool)), ParamInvalidError,
                          "sparse_mode"),
    "rope pse": (lambda: fia(*bnsd(d=128), query_rope=t(2, 2, 4, 64), key_rope=t(2, 2, 6, 64),
                             pse_shift=t(2, 2, 4, 6)), ParamInvalidError, "pse_shift"),
    # ---- int8 quantisation
    "deq scale with float": (lambda: fia(*bnsd(), dequant_scale1=torch.tensor([1.0])), ParamInvalidError,
                             "deq_scale1"),
    "int8 needs deq": (lambda: fia(*bnsd(dtype=torch.int8, d=32)), ParamInvalidError, "deq_scale1"),
    "offset without scale": (lambda: fia(*bnsd(), quant_offset2=torch.tensor([1.0])), ParamInvalidError,
                             "quant_offset2"),
    "int8 out layout": (lambda: fia(*bnsd(), input_layout="BNSD_NBSD", quant_scale2=torch.tensor([1.0])),
                        ParamInvalidError, "quant_scale2"),
    "per-channel out with lse": (lambda: fia(*bnsd(d=32), quant_scale2=torch.ones(2, 32), softmax_lse_flag=True),
                                 ParamInvalidError, "quant_scale2"),
    "int8 out band negative": (lambda: fia(*bnsd(), quant_scale2=torch.tensor([1.0]), sparse_mode=4,
                                           atten_mask=cann_attn.compressed_mask(4), pre_tokens=3, next_tokens=-1),
                               ParamInvalidError, "quant_scale2"),
    "offset with invalid rows": (lambda: fia(*bnsd(), quant_scale2=torch.tensor([1.0]),
                                             quant_offset2=torch.tensor([2.0]), sparse_mode=3,
                                             atten_mask=cann_attn.compressed_mask(3), actual_seq_lengths_kv=[2]),
                                 ParamInvalidError, "quant_offset2"),
    "int8 qkv lse": (lambda: fia(*bnsd(dtype=torch.int8, d=32), dequant_scale1=torch.tensor([1.0]),
                                 quant_scale1=torch.tensor([1.0]), dequant_scale2=torch.tensor([1.0]),
                                 softmax_lse_flag=True), ParamInvalidError, "softmax_lse_flag"),
    # ---- KV anti-quantisation
    "int8 kv without scale": (lambda: fia(*dec(kv_dtype=torch.int8)), ParamInvalidError, "antiquant_scale"),
    "scale without int8 kv": (lambda: fia(*dec(), antiquant_scale=t(2)), ParamInvalidError, "antiquant_scale"),
    "prefill antiquant bf16": (lambda: fia(*bnsd(dtype=torch.bfloat16, kv_dtype=torch.int8),
                                           antiquant_scale=t(2, dtype=torch.bfloat16)), ParamInvalidError, "query"),
    "both antiquant forms": (lambda: fia(*dec(kv_dtype=torch.int8), antiquant_scale=t(2),
                                         key_antiquant_scale=t(1), value_antiquant_scale=t(1)), ParamInvalidError,
                             "antiquant_scale"),
    "antiquant offset alone": (lambda: fia(*dec(kv_dtype=torch.int8), antiquant_offset=t(2)), ParamInvalidError,
                               "antiquant_offset"),
    "antiquant leading axis": (lambda: fia(*dec(kv_dtype=torch.int8), antiquant_scale=t(3)), ParamInvalidError,
                               "antiquant_scale"),
    "antiquant channel shape": (lambda: fia(*dec(kv_dtype=torch.int8), antiquant_scale=t(2, 2, 8)),
                                ParamInvalidError, "antiquant_scale"),
    "antiquant dtype": (lambda: fia(*dec(kv_dtype=torch.int8), antiquant_scale=t(2, dtype=torch.float32)),
                        ParamInvalidError, "antiquant_scale"),
    "antiquant_mode 2": (lambda: fia(*dec(kv_dtype=torch.int8), antiquant_scale=t(2), antiquant_mode=2),
                         ParamInvalidError, "antiquant_mode"),
    "per-token shape": (lambda: fia(*dec(kv_dtype=torch.int8), antiquant_scale=t(2, 2, 5, dtype=torch.float32),
                                    antiquant_mode=1), ParamInvalidError, "antiquant_scale"),
    "antiquant offset shape": (lambda: fia(*dec(kv_dtype=torch.int8), antiquant_scale=t(2),
                                           antiquant_offset=t(2, 2, 16)), ParamInvalidError, "antiquant_offset"),
    "key scale alone": (lambda: fia(*dec(kv_dtype=torch.int8), key_antiquant_scale=t(1)), ParamInvalidError,
                        "key_antiquant_scale/value_antiquant_scale"),
    "key offset alone": (lambda: fia(*dec(kv_dtype=torch.int8), key_antiquant_scale=t(1),
                                     value_antiquant_scale=t(1), key_antiquant_offset=t(1)), ParamInvalidError,
                         "key_antiquant_offset/value_antiquant_offset"),
    "paged antiquant mode": (lambda: fia(*dec(kv_dtype=torch.int8), key_antiquant_scale=t(1),
                                         value_antiquant_scale=t(1), key_antiquant_mode=4, value_antiquant_mode=4),
                             ParamInvalidError, "not supported yet"),
    "prefill antiquant mode 2": (lambda: fia(*bnsd(kv_dtype=torch.int8), key_antiquant_scale=t(2),
                                             value_antiquant_scale=t(2), key_antiquant_mode=2,
                                             value_antiquant_mode=2), ParamInvalidError, "key_antiquant_mode"),
    "antiquant modes differ": (lambda: fia(*dec(kv_dtype=torch.int8), key_antiquant_scale=t(1, 2, 6),
                                           value_antiquant_scale=t(1), key_antiquant_mode=1, value_antiquant_mode=0),
                               ParamInvalidError, "key_antiquant_mode/value_antiquant_mode"),
    "antiquant mode without int8": (lambda: fia(*dec(), key_antiquant_mode=1), ParamInvalidError,
                                    "key_antiquant_mode"),
    # ---- shared prefix
    "prefix alone": (lambda: fia(*bnsd(), key_shared_prefix=t(1, 2, 3, 16)), ParamInvalidError,
                     "key_shared_prefix/value_shared_prefix"),
    "prefix batch": (lambda: fia(*bnsd(), key_shared_prefix=t(2, 2, 3, 16), value_shared_prefix=t(2, 2, 3, 16)),
                     ParamInvalidError, "key_shared_prefix"),
    "prefix S differ": (lambda: fia(*bnsd(), key_shared_prefix=t(1, 2, 3, 16), value_shared_prefix=t(1, 2, 4, 16)),
                        ParamInvalidError, "value_shared_prefix"),
    "prefix dtype": (lambda: fia(*bnsd(), key_shared_prefix=t(1, 2, 3, 16, dtype=torch.float32),
                                 value_shared_prefix=t(1, 2, 3, 16, dtype=torch.float32)), ParamInvalidError,
                     "key_shared_prefix"),
    "prefix length": (lambda: fia(*bnsd(), key_shared_prefix=t(1, 2, 3, 16), value_shared_prefix=t(1, 2, 3, 16),
                                  actual_shared_prefix_len=[4]), ParamInvalidError, "actual_shared_prefix_len"),
    "prefix length alone": (lambda: fia(*bnsd(), actual_shared_prefix_len=[1]), ParamInvalidError,
                            "actual_shared_prefix_len"),
    "prefix int8 qkv": (lambda: fia(*bnsd(dtype=torch.int8, d=32), key_shared_prefix=t(1, 2, 3, 32, dtype=torch.int8),
                                    value_shared_prefix=t(1, 2, 3, 32, dtype=torch.int8)), ParamInvalidError,
                        "key_shared_prefix"),
    "prefix mask too small": (lambda: fia(*bnsd(), key_shared_prefix=t(1, 2, 3, 16),
                                          value_shared_prefix=t(1, 2, 3, 16),
                                          atten_mask=torch.zeros(4, 6, dtype=torch.bool)), ParamInvalidError,
                              "atten_mask"),
    "prefix with padding": (lambda: fia(*bnsd(), key_shared_prefix=t(1, 2, 3, 16), value_shared_prefix=t(1, 2, 3, 16),
                                        actual_seq_lengths_kv=[3], kv_padding_size=torch.tensor([1])),
                            ParamInvalidError, "key_shared_prefix"),
    # ---- left padding
    "query padding decode": (lambda: fia(*dec(), actual_seq_lengths=[1], query_padding_size=torch.tensor([0])),
                             ParamInvalidError, "query_padding_size"),
    "query padding alone": (lambda: fia(*bnsd(), query_padding_size=torch.tensor([1])), ParamInvalidError,
                            "query_padding_size"),
    "kv padding alone": (lambda: fia(*bnsd(), kv_padding_size=torch.tensor([1])), ParamInvalidError,
                         "kv_padding_size"),
    "query padding start": (lambda: fia(*bnsd(), actual_seq_lengths=[3], query_padding_size=torch.tensor([2])),
                            ParamInvalidError, "query_padding_size"),
    "kv padding start prefill": (lambda: fia(*bnsd(), actual_seq_lengths_kv=[6], kv_padding_size=torch.tensor([1])),
                                 ParamInvalidError, "kv_padding_size"),
    "padding dtype": (lambda: fia(*bnsd(), actual_seq_lengths_kv=[2], kv_padding_size=torch.tensor([1.0])),
                      ParamInvalidError, "kv_padding_size"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fia_constraint(name):
    call, error, needle = CASES[name]
    with pytest.raises(error) as info:
        call()
    assert needle in str(info.value), f"{name}: {info.value}"


V2_CASES = {
    "learnable_sink": ({"learnable_sink": torch.zeros(2, dtype=torch.bfloat16)}, "learnable_sink"),
    "dequant_scale_query": ({"dequant_scale_query": torch.ones(1)}, "dequant_scale_query"),
    "quant_scale_p": ({"quant_scale_p": torch.ones(1)}, "quant_scale_p: reserved"),
    "query_quant_mode 6": ({"query_quant_mode": 6}, "query_quant_mode"),
    "dequant_scale_key_rope": ({"dequant_scale_key_rope": torch.ones(1)}, "dequant_scale_key_rope: reserved"),
    "query_dtype": ({"query_dtype": 1}, "query_dtype: reserved"),
    "out_dtype": ({"out_dtype": 1}, "out_dtype"),
    "query_quant_mode": ({"query_quant_mode": 3}, "query_quant_mode"),
    "tree mask": ({"sparse_mode": 9}, "sparse_mode"),
    "renamed lengths": ({"actual_seq_qlen": [9]}, "actual_seq_qlen"),
    "renamed heads": ({"num_query_heads": 3}, "num_query_heads"),
}


@pytest.mark.parametrize("name", list(V2_CASES))
def test_v2_constraint_names_v2_parameters(name):
    kwargs, needle = V2_CASES[name]
    kwargs = {"num_query_heads": 2, "input_layout": "BNSD", **kwargs}
    with pytest.raises(ParamInvalidError) as info:
        cann_attn.fused_infer_attention_score_v2(*bnsd(), **kwargs)
    assert needle in str(info.value)


IFA_CASES = {
    "padding_mask": (lambda: cann_attn.incre_flash_attention(*dec(), num_heads=2, input_layout="BNSD",
                                                             padding_mask=t(2, 6)), "padding_mask"),
    "layout": (lambda: cann_attn.incre_flash_attention(*dec(), num_heads=2, input_layout="TND"), "input_layout"),
    "query S": (lambda: cann_attn.incre_flash_attention(*bnsd(), num_heads=2, input_layout="BNSD"), "query"),
    "int8 qkv": (lambda: cann_attn.incre_flash_attention(*dec(), num_heads=2, input_layout="BNSD",
                                                         dequant_scale1=torch.ones(1)), "dequant_scale1"),
    "renamed lengths": (lambda: cann_attn.incre_flash_attention(*dec(), num_heads=2, input_layout="BNSD",
                                                                actual_seq_lengths=[1, 2, 3, 99][3:]),
                        "actual_seq_lengths"),
}


@pytest.mark.parametrize("name", list(IFA_CASES))
def test_ifa_constraint(name):
    call, needle = IFA_CASES[name]
    with pytest.raises(ParamInvalidError) as info:
        call()
    assert needle in str(info.value)
