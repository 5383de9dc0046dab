"""RingAttentionUpdate and AttentionUpdate: cases and goldens (``cann_attn.testing.merge_oracle``).

Inputs are FlashAttentionScore oracle results over two (or K) key blocks of the same queries, as a context-parallel
ring or a decode split produces them (merging a causal split also yields invalid rows in one block)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

import cann_attn

from ...problem.lengths import starts_of
from ...testing.merge_oracle import attention_update_oracle, ring_attention_update_oracle
from ._common import (
    BF16,
    F16,
    F32,
    Call,
    Case,
    Operator,
    Outputs,
    bind,
    by_name,
    cumulative,
    outputs_of,
    randn,
    register,
    register_operator,
    same_dtype,
    without,
)


def _ring_named(gen: torch.Generator, layout: str, dtype: torch.dtype, heads: int, dim: int,
                lengths: Sequence[int], batch: int = 1, softmax_layout: str = "") -> dict[str, Any]:
    from ...testing.oracle import fa_forward_oracle

    def partial(keys, values, mode, q_lens, kv_lens):
        kw: dict[str, Any] = {"atten_mask": cann_attn.compressed_mask(mode), "sparse_mode": mode,
                              "scale_value": dim ** -0.5}
        if layout == "TND":
            kw.update(actual_seq_qlen=cumulative(q_lens), actual_seq_kvlen=cumulative(kv_lens),
                      softmax_layout=softmax_layout)
        out, smax, ssum = fa_forward_oracle(query, keys, values, heads, layout, **kw)
        return out.to(dtype), smax.float(), ssum.float()

    if layout == "SBH":
        (seq,) = lengths
        shape: tuple[int, ...] = (seq, batch, heads * dim)
    else:
        shape = (sum(lengths), heads, dim)
    query, key, value = (randn(gen, shape, dtype) for _ in range(3))
    # the first half of every sequence's keys (top-left causal, mode 2) and the second half (bottom-right, mode 3):
    # together exactly causal attention; the rows before the second half see none of its keys (invalid rows).
    halves = [n // 2 for n in lengths]
    starts = starts_of(lengths)
    first = [p for st, h in zip(starts, halves, strict=True) for p in range(st, st + h)]
    second = [p for st, n, h in zip(starts, lengths, halves, strict=True) for p in range(st + h, st + n)]
    prev = partial(key[first], value[first], 2, lengths, halves)
    cur = partial(key[second], value[second], 3, lengths, [n - h for n, h in zip(lengths, halves, strict=True)])
    named = dict(zip(("prev_attn_out", "prev_softmax_max", "prev_softmax_sum"), prev, strict=True))
    named.update(zip(("cur_attn_out", "cur_softmax_max", "cur_softmax_sum"), cur, strict=True))
    named["input_layout"] = layout
    if layout == "TND":
        named["actual_seq_qlen"] = torch.tensor([0, *cumulative(lengths)], dtype=torch.int64)
        named["input_softmax_layout"] = softmax_layout
    return named


def _ring_golden(call: Call) -> Outputs:
    return ring_attention_update_oracle(**without(by_name("ring_attention_update", call)))


def ring_update_case(name: str, layout: str, dtype: torch.dtype, heads: int, dim: int, lengths: Sequence[int],
                     batch: int = 1, softmax_layout: str = "") -> Case:
    shape = (f"S={lengths[0]} B={batch} N={heads} D={dim}" if layout == "SBH"
             else f"TND lens={list(lengths)} N={heads} D={dim} softmax_layout={softmax_layout!r}")
    return Case(
        op="ring_attention_update", name=name, dtype=dtype, shape=shape,
        build=lambda gen: bind("ring_attention_update", _ring_named(gen, layout, dtype, heads, dim, lengths, batch,
                                                                     softmax_layout)),
        run=outputs_of("ring_attention_update", ("attn_out", "softmax_max", "softmax_sum")),
        oracle=_ring_golden,
    )


def attention_update_case(name: str, dtype: torch.dtype, parts: int, heads: int, dim: int, seq_kv: int,
                          batch: int = 2, update_type: int = 1, empty_part: bool = False) -> Case:
    """Decode (one query token) over a KV cache cut into `parts` shards; lse = softmax_max + log(softmax_sum);
    rows ordered (batch, token, head). With `empty_part` the last shard holds no keys (lse -inf, output 0)."""

    def build(gen: torch.Generator) -> Call:
        from ...testing.oracle import fa_forward_oracle

        query = randn(gen, (batch, heads, 1, dim), dtype)
        key, value = randn(gen, (batch, heads, seq_kv, dim), dtype), randn(gen, (batch, heads, seq_kv, dim), dtype)
        live = parts - 1 if empty_part else parts
        cuts = [round(i * seq_kv / live) for i in range(live + 1)]
        lse, outs = [], []
        for lo, hi in itertools.pairwise(cuts):
            out, smax, ssum = fa_forward_oracle(query, key[:, :, lo:hi], value[:, :, lo:hi], heads, "BNSD",
                                                scale_value=dim ** -0.5)
            lse.append((smax[..., 0] + torch.log(ssum[..., 0])).permute(0, 2, 1).reshape(-1).float())
            outs.append(out.permute(0, 2, 1, 3).reshape(-1, dim).to(dtype))
        if empty_part:
            lse.append(torch.full((batch * heads,), float("-inf")))
            outs.append(torch.zeros(batch * heads, dim, dtype=dtype))
        return Call((lse, outs, update_type))

    def golden(call: Call) -> Outputs:
        return attention_update_oracle(*call.args)

    return Case(
        op="attention_update", name=name, dtype=dtype,
        shape=f"sp={parts} rows={batch * heads} D={dim} update_type={update_type}",
        build=build, run=outputs_of("attention_update", ("out", "lse_out")), oracle=golden,
    )


register(
    ring_update_case("sbh_causal_split", "SBH", F16, heads=4, dim=32, lengths=(64,), batch=2),
    ring_update_case("tnd_causal_split", "TND", BF16, heads=2, dim=64, lengths=(24, 40, 16)),
    ring_update_case("tnd_causal_split_tnd_softmax", "TND", F32, heads=2, dim=128, lengths=(32, 8),
                     softmax_layout="TND"),
    attention_update_case("decode_sp4", F32, parts=4, heads=8, dim=128, seq_kv=96),
    attention_update_case("decode_sp3_empty_shard", BF16, parts=3, heads=4, dim=64, seq_kv=40, update_type=0,
                          empty_part=True),
)
def _attention_update_golden(call: Call) -> Outputs:
    return attention_update_oracle(**without(by_name("attention_update", call)))


register_operator(Operator("attention_update", ("out", "lse_out"), _attention_update_golden,
                           same_dtype(out="local_out", lse_out="float32"), oracle=attention_update_oracle))
register_operator(
    Operator(
        "ring_attention_update",
        ("attn_out", "softmax_max", "softmax_sum"),
        _ring_golden,
        same_dtype(attn_out="prev_attn_out", softmax_max="float32", softmax_sum="float32"),
        oracle=ring_attention_update_oracle,
    )
)


