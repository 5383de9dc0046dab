"""FusedInferAttentionScore (v1, v2) and IncreFlashAttention: cases and goldens (``cann_attn.testing.fia_oracle``,
v2 / IFA parameters renamed to their v1 spelling)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

import cann_attn

from ...problem.antiquant import PAGED_TOKEN_MODE, QUERY_QUANT_MODES
from ...problem.nz import NZ_DIMS, from_nz
from ...testing.fia_oracle import fia_oracle
from ...testing.fia_quant_oracle import dequantised_mla_operands, dequantised_paged_tokens
from ...testing.paged_oracle import paginate, unpage_fia
from ._common import (
    BF16,
    F16,
    F32,
    OPERATORS,
    PRECISION_MODE,
    Call,
    Case,
    DTypes,
    Operator,
    Outputs,
    by_name,
    int8_values,
    layout_shape,
    outputs_of,
    randn,
    register,
    register_operator,
)

# v2 / IFA parameter -> FIA v1 parameter of the oracle.
_V2_TO_V1 = {"actual_seq_qlen": "actual_seq_lengths", "actual_seq_kvlen": "actual_seq_lengths_kv",
             "dequant_scale_key": "key_antiquant_scale", "dequant_offset_key": "key_antiquant_offset",
             "dequant_scale_value": "value_antiquant_scale", "dequant_offset_value": "value_antiquant_offset",
             "quant_scale_out": "quant_scale2", "quant_offset_out": "quant_offset2", "num_query_heads": "num_heads",
             "softmax_scale": "scale", "return_softmax_lse": "softmax_lse_flag", "key_quant_mode": "key_antiquant_mode",
             "value_quant_mode": "value_antiquant_mode"}
_IFA_TO_V1 = {"actual_seq_lengths": "actual_seq_lengths_kv", "scale_value": "scale"}


def _fia_golden(op: str, naive: bool = False) -> Callable[[Call], Outputs]:
    """The float64 golden of `op`; with `naive` the same attention in the input dtype (the flash-attn rule's
    reference, PromptFlashAttention's rule: float inputs and caches, no int8 output), else nothing."""

    def golden(call: Call) -> Outputs:
        named = by_name(op, call)
        if op == "fused_infer_attention_score_v2" and not naive:
            named = _dequantised_v2(named)
        kwargs = OPERATORS[op].oracle_kwargs(named)  # v1 spelling
        if naive:
            query = kwargs["query"]
            if (query.dtype not in (torch.float16, torch.bfloat16) or kwargs["key"].dtype != query.dtype
                    or kwargs.get("quant_scale2") is not None):
                return {}
            kwargs["naive_dtype"] = query.dtype
        if named.get("block_table") is not None:  # docs/semantics/paged-kv.md: the contiguous keys of the pages
            kwargs = unpage_fia({**kwargs, "block_table": named["block_table"], "block_size": named.get("block_size")})
        out, lse = fia_oracle(kwargs.pop("query"), kwargs.pop("key"), kwargs.pop("value"), **kwargs)
        result = {"attention_out": out}
        if lse is not None and not naive:  # the fp32 lse has no input-dtype computation to compare with
            result["softmax_lse"] = lse
        return result

    return golden


_V2_QUANT = ("dequant_scale_query", "dequant_scale_key", "dequant_scale_value", "query_quant_mode", "key_quant_mode",
             "value_quant_mode")


def _nd(cache: torch.Tensor) -> torch.Tensor:
    """An NZ cache [block_num, N, D/c0, block_size, c0] as the BnBsH cache it stands for; others unchanged."""
    return from_nz(cache).flatten(2) if cache.dim() == NZ_DIMS else cache


def _dequantised_v2(named: dict[str, Any]) -> dict[str, Any]:
    """FIA v2's quantised calls (docs/operators/fused_infer_attention_score.md, "Quantised queries and fp8
    caches") as the float64 call they stand for: the int8 MLA query (query_quant_mode 3) and its per-tensor int8
    latent (NZ caches read as ND), or paged caches with per-token scales (key/value_quant_mode 4). Others
    unchanged."""
    if named.get("query_quant_mode") in QUERY_QUANT_MODES:
        q, k, v, q_rope = dequantised_mla_operands(
            named["query"], _nd(named["key"]), _nd(named["value"]), named["query_rope"],
            named["dequant_scale_query"], named["dequant_scale_key"], named["dequant_scale_value"])
        named = {**named, "query": q, "key": k, "value": v, "query_rope": q_rope,
                 "key_rope": _nd(named["key_rope"]).to(torch.float64)}
    elif named.get("key_quant_mode") == PAGED_TOKEN_MODE:
        dtype = named["query"].dtype
        named = {**named, "key": dequantised_paged_tokens(named["key"], named["dequant_scale_key"], dtype),
                 "value": dequantised_paged_tokens(named["value"], named["dequant_scale_value"], dtype)}
    else:
        return named
    return {k: v for k, v in named.items() if k not in _V2_QUANT}


def _fia_dtypes(scale2: str) -> DTypes:
    def dtypes(named: Mapping[str, Any]) -> dict[str, torch.dtype]:
        q = named["query"].dtype
        int8_mla = q == torch.int8 and isinstance(named.get("query_rope"), torch.Tensor)
        out = (torch.int8 if named.get(scale2) is not None else named["query_rope"].dtype if int8_mla
               else torch.float16 if q == torch.int8 else q)
        return {"attention_out": out, "softmax_lse": torch.float32}

    return dtypes


_PAGED = {"block_table": "the pages are gathered into the contiguous keys they stand for (testing/paged_oracle.py)",
          "block_size": "the block dimension of the paged caches (checked against them by the operator)"}
_NO_EFFECT = {"inner_precise": PRECISION_MODE}
_V2_REFUSED = "the FIA oracle has no such input (MXFP8 / FP8 / HiFloat8 quantisation of v2)"
_V2_CONSUMED = {
    "dequant_scale_query": "the int8 MLA query (query_quant_mode 3) is dequantised with it per token and head, its "
                           "rope with it times dequant_scale_key, before the float64 oracle",
    "query_quant_mode": "3: the golden dequantises the int8 MLA query and latent first (the operator refuses other "
                        "non-zero values)",
}
for _name, _renames, _scale2, _outputs, _extra in (
    ("fused_infer_attention_score", {}, "quant_scale2", ("attention_out", "softmax_lse"), {}),
    ("fused_infer_attention_score_v2", _V2_TO_V1, "quant_scale_out", ("attention_out", "softmax_lse"),
     {"out_dtype": "the operator accepts only the output dtype quant_scale_out or the query already implies"}),
    ("incre_flash_attention", _IFA_TO_V1, "quant_scale2", ("attention_out",),
     {"padding_mask": "reserved by the IncreFlashAttention docs; not read"}),
):
    register_operator(Operator(
        _name, _outputs, _fia_golden(_name), _fia_dtypes(_scale2), oracle=fia_oracle, renames=_renames,
        naive=_fia_golden(_name, naive=True),
        consumed={**_PAGED, **(_V2_CONSUMED if _name == "fused_infer_attention_score_v2" else {})},
        no_effect={**_NO_EFFECT, **_extra},
        unsupported={n: _V2_REFUSED for n in ("dequant_scale_query", "dequant_scale_key_rope", "quant_scale_p",
                                               "query_quant_mode")}
        | {"key_rope_antiquant_scale": "the FIA oracle has no int8 rope keys"},
    ))


def fia_case(name: str, op: str = "fused_infer_attention_score", *, layout: str, dtype: torch.dtype, b: int = 1,
             n: int = 4, n_kv: int | None = None, sq: int = 64, skv: int | None = None, d: int = 64,
             kv_dtype: torch.dtype | None = None, extras: Callable[[torch.Generator], dict[str, Any]] | None = None,
             **kwargs: Any) -> Case:
    """A FusedInferAttentionScore / v2 / IncreFlashAttention case: random inputs in a dense `layout`; `extras(gen)`
    adds tensor keyword arguments, `kwargs` the scalar ones (in the operator's own spelling)."""
    n_kv = n if n_kv is None else n_kv
    skv = sq if skv is None else skv
    heads_name = {"fused_infer_attention_score_v2": "num_query_heads"}.get(op, "num_heads")
    scale_name = {"fused_infer_attention_score_v2": "softmax_scale", "incre_flash_attention": "scale_value"}.get(
        op, "scale")
    kwargs = {heads_name: n, "input_layout": layout, "num_key_value_heads": n_kv, scale_name: d**-0.5, **kwargs}
    base = layout.split("_")[0]

    def build(gen: torch.Generator) -> Call:
        def draw(heads: int, seq: int, dt: torch.dtype) -> torch.Tensor:
            shape = layout_shape(base, b, seq, heads, d, b * seq)
            return int8_values(gen, shape) if dt == torch.int8 else randn(gen, shape, dt)

        q = draw(n, sq, dtype)
        k, v = draw(n_kv, skv, kv_dtype or dtype), draw(n_kv, skv, kv_dtype or dtype)
        return Call((q, k, v), {**kwargs, **(extras(gen) if extras else {})})

    heads = f"N{n}" if n_kv == n else f"N{n}/{n_kv}"
    outputs = ("attention_out",) if op == "incre_flash_attention" else ("attention_out", "softmax_lse")
    return Case(op=op, name=name, dtype=dtype, shape=f"{layout} B{b} {heads} S{sq}x{skv} D{d}", build=build,
                run=outputs_of(op, outputs), oracle=_fia_golden(op), naive=_fia_golden(op, naive=True))


def _kv_scales(shape: tuple[int, ...], dtype: torch.dtype, *, separate: str = "", offset: bool = False):
    """Anti-quantisation factors in [0.01, 0.03] (int8 keys of std ~70 -> O(1) values): combined
    `antiquant_scale` (and offset), or with `separate` = "v1" / "v2" the key/value parameters of that spelling."""

    def build(gen: torch.Generator) -> dict[str, Any]:
        def factor() -> torch.Tensor:
            return (0.01 + 0.02 * torch.rand(shape, generator=gen)).to(dtype)

        if not separate:
            out = {"antiquant_scale": factor()}
            if offset:
                out["antiquant_offset"] = torch.randn(shape, generator=gen).to(dtype)
            return out
        names = ("key_antiquant_scale", "value_antiquant_scale") if separate == "v1" else (
            "dequant_scale_key", "dequant_scale_value")
        return {names[0]: factor(), names[1]: factor()}

    return build


register(
    fia_case("bnsd_gqa_lse", layout="BNSD", dtype=F16, b=2, n=8, n_kv=2, sq=64, skv=96, softmax_lse_flag=True),
    fia_case("bsh_causal_mode3_lse", layout="BSH", dtype=BF16, b=2, n=4, n_kv=1, sq=48, skv=80, sparse_mode=3,
             extras=lambda gen: {"atten_mask": cann_attn.compressed_mask(3)}, softmax_lse_flag=True),
    fia_case("bsnd_decode_actual_kv", layout="BSND", dtype=F16, b=4, n=8, n_kv=2, sq=1, skv=160,
             actual_seq_lengths_kv=[160, 7, 99, 31], softmax_lse_flag=True),
    fia_case("bnsd_nbsd_out", layout="BNSD_NBSD", dtype=F32, b=2, n=4, sq=12, skv=40),
    fia_case("decode_antiquant_per_token", layout="BSH", dtype=F16, b=2, n=4, n_kv=2, sq=1, skv=64, d=64,
             kv_dtype=torch.int8, extras=_kv_scales((1, 2, 64), F32, separate="v1"), key_antiquant_mode=1,
             value_antiquant_mode=1),
    fia_case("prefill_antiquant_per_channel", layout="BNSD", dtype=F16, b=1, n=4, sq=32, skv=48,
             kv_dtype=torch.int8, extras=_kv_scales((2, 4, 1, 64), F16, offset=True)),
    fia_case("shared_prefix_decode", layout="BNSD", dtype=F16, b=3, n=4, sq=1, skv=24, actual_seq_lengths_kv=[24, 5, 0],
             extras=lambda gen: {"key_shared_prefix": randn(gen, (1, 4, 40, 64), F16),
                                 "value_shared_prefix": randn(gen, (1, 4, 40, 64), F16)},
             actual_shared_prefix_len=[33], softmax_lse_flag=True),
    fia_case("mla_rope_d512_decode", layout="BSND", dtype=BF16, b=2, n=8, n_kv=1, sq=1, skv=64, d=512,
             extras=lambda gen: {"query_rope": randn(gen, (2, 1, 8, 64), BF16),
                                 "key_rope": randn(gen, (2, 64, 1, 64), BF16)}),
    fia_case("int8_out_left_padding", layout="BSND", dtype=F16, b=2, n=2, sq=24, skv=40,
             actual_seq_lengths=[16, 20], actual_seq_lengths_kv=[30, 36], sparse_mode=3,
             extras=lambda gen: {"atten_mask": cann_attn.compressed_mask(3), "quant_scale2": torch.tensor([40.0]),
                                 "query_padding_size": torch.tensor([3]), "kv_padding_size": torch.tensor([2])}),
    fia_case("v2_decode_antiquant", op="fused_infer_attention_score_v2", layout="BNSD", dtype=BF16, b=2, n=4,
             n_kv=2, sq=1, skv=48, kv_dtype=torch.int8, extras=_kv_scales((2, 64), BF16, separate="v2"),
             actual_seq_kvlen=[48, 13], return_softmax_lse=True),
    fia_case("v2_sink_tnd_window", op="fused_infer_attention_score_v2", layout="TND", dtype=BF16, b=2, n=4, sq=32,
             sparse_mode=4, pre_tokens=8, next_tokens=0, actual_seq_qlen=[20, 64], actual_seq_kvlen=[20, 64],
             extras=lambda gen: {"atten_mask": cann_attn.compressed_mask(4),
                                 "learnable_sink": randn(gen, (4,), BF16)}, return_softmax_lse=True),
    fia_case("decode_antiquant_leading_one", layout="BSND", dtype=BF16, b=2, n=4, n_kv=2, sq=1, skv=40,
             kv_dtype=torch.int8, extras=_kv_scales((1, 2, 1, 64), BF16, separate="v1"),
             actual_seq_lengths_kv=[40, 0], softmax_lse_flag=True),
    fia_case("prefill_bf16_separate_antiquant", layout="BNSD", dtype=BF16, b=2, n=4, n_kv=2, sq=16, skv=48,
             kv_dtype=torch.int8, extras=_kv_scales((2, 64), BF16, separate="v1"), softmax_lse_flag=True),
    fia_case("ifa_bsh_gqa", op="incre_flash_attention", layout="BSH", dtype=F16, b=4, n=8, n_kv=2, sq=1, skv=96,
             actual_seq_lengths=[96, 1, 50, 77]),
    fia_case("ifa_antiquant_mask", op="incre_flash_attention", layout="BNSD", dtype=F16, b=2, n=4, sq=1, skv=64,
             kv_dtype=torch.int8, extras=lambda gen: {**_kv_scales((2, 4, 1, 64), F16, offset=True)(gen),
                                                      "atten_mask": torch.rand(2, 64, generator=gen) < 0.2}),
)



def fia_paged_case(name: str, op: str = "fused_infer_attention_score", *, layout: str, dtype: torch.dtype,
                   lengths: tuple[int, ...], block_size: int, n: int = 4, n_kv: int = 2, d: int = 64, sq: int = 1,
                   heads_first: bool = False, **kwargs: Any) -> Case:
    """A FIA / IFA case over a paged cache (docs/semantics/paged-kv.md): per-sequence keys scattered over shuffled
    blocks of a BnBsH (or, `heads_first`, BnNBsD) cache, NaN in every slot no sequence uses."""
    heads_name = {"fused_infer_attention_score_v2": "num_query_heads"}.get(op, "num_heads")
    scale_name = {"fused_infer_attention_score_v2": "softmax_scale", "incre_flash_attention": "scale_value"}.get(
        op, "scale")
    lengths_name = {"fused_infer_attention_score_v2": "actual_seq_kvlen",
                    "incre_flash_attention": "actual_seq_lengths"}.get(op, "actual_seq_lengths_kv")
    b = len(lengths)

    def build(gen: torch.Generator) -> Call:
        q = randn(gen, layout_shape(layout, b, sq, n, d, b * sq), dtype)
        seqs = {name: [randn(gen, (length, n_kv, d), dtype) for length in lengths] for name in ("key", "value")}
        caches, table = paginate(seqs, block_size, gen, heads_first=heads_first)
        if not heads_first:
            caches = {name: c.flatten(2) for name, c in caches.items()}
        return Call((q, caches["key"], caches["value"]), {
            heads_name: n, "num_key_value_heads": n_kv, "input_layout": layout, scale_name: d**-0.5,
            "block_table": table, "block_size": block_size, lengths_name: list(lengths), **kwargs})

    cache = "BnNBsD" if heads_first else "BnBsH"
    outputs = ("attention_out",) if op == "incre_flash_attention" else ("attention_out", "softmax_lse")
    return Case(op=op, name=name, dtype=dtype, shape=f"{layout} paged {cache} bs{block_size} N{n}/{n_kv} D{d} "
                f"S{sq} kv={list(lengths)}", build=build, run=outputs_of(op, outputs), oracle=_fia_golden(op))


register(
    fia_paged_case("paged_decode_bsh", layout="BSH", dtype=F16, lengths=(20, 37, 1), block_size=16,
                   softmax_lse_flag=True),
    fia_paged_case("paged_prefill_bnnbsd", layout="BNSD", dtype=BF16, lengths=(150, 9), block_size=128, sq=6, n=2,
                   n_kv=1, heads_first=True, softmax_lse_flag=True),
    fia_paged_case("v2_paged_decode", op="fused_infer_attention_score_v2", layout="BSND", dtype=BF16,
                   lengths=(33, 64), block_size=32, return_softmax_lse=True),
    fia_paged_case("ifa_paged_bnnbsd", op="incre_flash_attention", layout="BNSD", dtype=F16, lengths=(50, 3, 17),
                   block_size=16, heads_first=True),
)


def fia_v2_quant_case(name: str, *, quant: str, lengths: tuple[int, ...], block_size: int = 16, n: int = 4,
                      layout: str = "TND_NTD") -> Case:
    """A FIA v2 decode over paged caches with a quantised operand (docs/operators/fused_infer_attention_score.md,
    "Quantised queries and fp8 caches"). `quant` "int8_query": deepseek_r1's int8 MLA query (query_quant_mode 3,
    dequant_scale_query per token and head) over one int8 latent cache passed as key and value (one float32 scale)
    with a bf16 rope cache; "per_token_cache": int8 [block_num, block_size, H] caches with one float32 scale per
    cached token (key/value_quant_mode 4) under a bf16 query, as qwen3_moe builds them."""
    op = "fused_infer_attention_score_v2"
    b = len(lengths)

    def build(gen: torch.Generator) -> Call:
        table_width = max(-(-length // block_size) for length in lengths)
        blocks = b * table_width + 1
        table = torch.randperm(blocks, generator=gen)[: b * table_width].view(b, table_width).int()
        kwargs: dict[str, Any] = {"num_query_heads": n, "input_layout": layout, "block_table": table,
                                  "block_size": block_size, "actual_seq_kvlen": list(lengths),
                                  "actual_seq_qlen": list(range(1, b + 1))}
        if quant == "int8_query":
            latent = int8_values(gen, (blocks, block_size, 512))
            query = int8_values(gen, (b, n, 512))
            scale_kv = torch.tensor([0.02])
            kwargs.update(query_rope=randn(gen, (b, n, 64), BF16), key_rope=randn(gen, (blocks, block_size, 64), BF16),
                          dequant_scale_query=torch.rand(b, n, generator=gen) * 0.01 + 0.001,
                          dequant_scale_key=scale_kv, dequant_scale_value=scale_kv, query_quant_mode=3,
                          num_key_value_heads=1, softmax_scale=576 ** -0.5)
            return Call((query, latent, latent), kwargs)
        heads_kv, dim = 2, 64
        key, value = (int8_values(gen, (blocks, block_size, heads_kv * dim)) for _ in range(2))
        kwargs.update(dequant_scale_key=torch.rand(blocks, block_size, generator=gen) / 64 + 1e-3,
                      dequant_scale_value=torch.rand(blocks, block_size, generator=gen) / 64 + 1e-3,
                      key_quant_mode=4, value_quant_mode=4, num_key_value_heads=heads_kv, softmax_scale=dim ** -0.5)
        return Call((randn(gen, (b, n, dim), BF16), key, value), kwargs)

    return Case(op=op, name=name, dtype=torch.int8 if quant == "int8_query" else BF16,
                shape=f"{layout} paged bs{block_size} N{n} kv={list(lengths)} {quant}", build=build,
                run=outputs_of(op, ("attention_out", "softmax_lse")), oracle=_fia_golden(op))


register(
    fia_v2_quant_case("v2_int8_mla_query_paged", quant="int8_query", lengths=(40, 17, 33)),
    fia_v2_quant_case("v2_per_token_int8_cache_paged", quant="per_token_cache", lengths=(20, 37), layout="TND"),
)
