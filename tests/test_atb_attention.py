"""The ATB attention operators vLLM calls through torch_npu (docs/operators/atb_attention.md), against the float64
oracle of cann_attn.testing.atb_oracle, with the arguments built the way vllm-ascend builds them: context_lens and
seq_len int32 on the host, block tables whose unused entries hold -1, stale or out-of-range ids, poisoned (NaN)
pages wherever nothing may be read, GQA, value heads narrower than the key's, float16 and bfloat16 additive masks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cann_attn.torch_npu as torch_npu
from cann_attn.errors import ParamInvalidError, ParamNullptrError
from cann_attn.testing.atb_oracle import (
    paged_attention_oracle,
    self_attention_oracle,
    splitfuse_oracle,
)
from matrix_sample import fuzz_examples
from paged_utils import paginate

pytestmark = pytest.mark.usefixtures("single_thread")

TOL = {torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def _host_int32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)  # vllm-ascend keeps seq_lens / query lens on the CPU


def causal_additive_mask(size: int, dtype: torch.dtype) -> torch.Tensor:
    """vllm-ascend's AttentionMaskBuilder310.gen_causal_additive_mask: 0 on and below the diagonal, -inf above."""
    upper = ~torch.ones(size, size, dtype=torch.bool).tril_()
    return torch.zeros(size, size, dtype=dtype).masked_fill_(upper, float("-inf"))


def vllm_prefill_mask(size: int, dtype: torch.dtype) -> torch.Tensor:
    """vllm-ascend's prefill mask for _npu_flash_attention (AttentionMaskBuilder before v0.12): the upper triangle
    -inf in float16; in bfloat16 1 there, scaled by get_mask_scale_factor's -10000."""
    upper = ~torch.ones(size, size, dtype=torch.bool).tril_()
    if dtype == torch.float16:
        return torch.zeros(size, size, dtype=dtype).masked_fill_(upper, float("-inf"))
    return torch.zeros(size, size, dtype=dtype).masked_fill_(upper, 1) * -10000


def _cache(kv_lens, heads_kv, dim, dim_v, block_size, dtype, gen):
    keys = [torch.randn(n, heads_kv, dim, generator=gen).to(dtype) for n in kv_lens]
    values = [torch.randn(n, heads_kv, dim_v, generator=gen).to(dtype) for n in kv_lens]
    caches, table = paginate({"key": keys, "value": values}, block_size, gen)
    return caches["key"], caches["value"], table


def _sentinel(shape, dtype) -> torch.Tensor:
    return torch.full(shape, 7.0, dtype=dtype)


# ------------------------------------------------------------------------------------------- _npu_paged_attention
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("heads", "heads_kv", "dim", "dim_v"), [(4, 2, 32, 32), (4, 1, 48, 16), (2, 0, 16, 16)])
def test_paged_attention_decode_matches_the_oracle(dtype, heads, heads_kv, dim, dim_v, rng):
    """One decode token per sequence (vllm-ascend forward_paged_attention); num_kv_heads=0 means num_heads."""
    kv_lens = [37, 1, 16, 64, 0]
    n_kv = heads_kv or heads
    key_cache, value_cache, table = _cache(kv_lens, n_kv, dim, dim_v, 16, dtype, rng)
    query = torch.randn(len(kv_lens), heads, dim, generator=rng).to(dtype)
    out = torch.empty(len(kv_lens), heads, dim_v, dtype=dtype)
    context_lens = _host_int32(kv_lens)
    result = torch_npu._npu_paged_attention(query, key_cache, value_cache, heads_kv, heads, dim ** -0.5, table,
                                            context_lens, out)
    assert result is None  # `-> ()`: the result is in `out`
    golden = paged_attention_oracle(query, key_cache, value_cache, heads_kv, heads, dim ** -0.5, table, context_lens)
    assert torch.isfinite(out).all()  # nothing read from the NaN pages or through -1 / stale entries
    torch.testing.assert_close(out.double(), golden, **TOL[dtype])
    assert not out[-1].any()  # a sequence without keys gives zeros


def test_paged_attention_keyword_call_and_workspace_as_vllm_graph_capture_makes_them(rng):
    """vllm_ascend/attention/utils.py: get_workspace with the same arguments, then the call with workspace=."""
    key_cache, value_cache, table = _cache([20, 9], 2, 16, 16, 16, torch.float16, rng)
    query = torch.randn(2, 4, 16, generator=rng).half()
    out = torch.empty(2, 4, 16, dtype=torch.float16)
    kw = dict(query=query, key_cache=key_cache, value_cache=value_cache, num_kv_heads=2, num_heads=4,
              scale_value=0.25, block_table=table, context_lens=_host_int32([20, 9]), out=out)
    workspace = torch_npu._npu_paged_attention_get_workspace(**kw)
    assert workspace.dtype == torch.uint8
    torch_npu._npu_paged_attention(**kw, workspace=workspace)
    torch.testing.assert_close(out.double(), paged_attention_oracle(query, key_cache, value_cache, 2, 4, 0.25, table,
                                                                    [20, 9]), **TOL[torch.float16])


# -------------------------------------------------------------------------------- _npu_paged_attention_splitfuse
def splitfuse_mask(q_lens, kv_lens, max_seq_len, dtype):
    """vllm-ascend AttentionMaskBuilder310.get_splitfuse_mask: the causal rows of each query token's position."""
    positions = [p for ql, cl in zip(q_lens, kv_lens, strict=True) for p in range(cl - ql, cl)]
    return causal_additive_mask(max_seq_len, dtype).index_select(0, torch.tensor(positions))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_splitfuse_mixing_a_chunk_a_fresh_prompt_and_decodes_matches_the_oracle(dtype, rng):
    """A chunk of 8 after 20 cached tokens, a fresh prompt of 12, three decodes: chunked prefill as vLLM batches it."""
    q_lens, kv_lens = [8, 12, 1, 1, 1], [28, 12, 33, 5, 17]
    heads, heads_kv, dim = 4, 2, 32
    key_cache, value_cache, table = _cache(kv_lens, heads_kv, dim, dim, 16, dtype, rng)
    query = torch.randn(sum(q_lens), heads, dim, generator=rng).to(dtype)
    mask = splitfuse_mask(q_lens, kv_lens, 40, dtype)
    out = torch.empty(sum(q_lens), heads, dim, dtype=dtype)
    torch_npu._npu_paged_attention_splitfuse(
        query=query, key_cache=key_cache, value_cache=value_cache, mask=mask, block_table=table,
        seq_len=_host_int32(q_lens), context_lens=_host_int32(kv_lens), num_kv_heads=heads_kv, num_heads=heads,
        scale_value=dim ** -0.5, out=out)
    golden = splitfuse_oracle(query, key_cache, value_cache, table, kv_lens, mask, q_lens, heads_kv, heads,
                              dim ** -0.5)
    torch.testing.assert_close(out.double(), golden, **TOL[dtype])


def test_splitfuse_reads_the_mask_rows_of_each_token(rng):
    """op-plugin's test_atb_paged_attention_splitfuse mask (-10000 / 0 rows, bfloat16) and a random additive mask:
    each token adds its own row, so a permuted mask changes the result."""
    q_lens, kv_lens = [3, 1], [7, 4]
    key_cache, value_cache, table = _cache(kv_lens, 1, 16, 8, 16, torch.bfloat16, rng)
    query = torch.randn(4, 2, 16, generator=rng).bfloat16()
    mask = torch.randn(4, 9, generator=rng).bfloat16()
    args = dict(key_cache=key_cache, value_cache=value_cache, block_table=table, context_lens=_host_int32(kv_lens),
                seq_len=_host_int32(q_lens), num_kv_heads=1, num_heads=2, scale_value=0.3)
    out = torch.empty(4, 2, 8, dtype=torch.bfloat16)
    torch_npu._npu_paged_attention_splitfuse(query, mask=mask, out=out, **args)
    golden = splitfuse_oracle(query, key_cache, value_cache, table, kv_lens, mask, q_lens, 1, 2, 0.3)
    torch.testing.assert_close(out.double(), golden, **TOL[torch.bfloat16])
    flipped = torch.empty_like(out)
    torch_npu._npu_paged_attention_splitfuse(query, mask=mask.flip(0), out=flipped, **args)
    assert not torch.equal(flipped, out)


# -------------------------------------------------------------------- _npu_flash_attention / _npu_flash_attention_unpad
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_attention_with_the_shared_causal_mask_matches_the_oracle(dtype, rng):
    """vllm-ascend prefill: packed prompts, a [max_seqlen, max_seqlen] causal mask (-inf / -10000), seq_len on the host;
    GQA and a value head size below the key's (op-plugin's test_atb_flash_attention draws embed_v < embed)."""
    seq = [5, 9, 9, 3]
    heads, heads_kv, dim, dim_v = 4, 2, 32, 24
    query = torch.randn(sum(seq), heads, dim, generator=rng).to(dtype)
    key = torch.randn(sum(seq), heads_kv, dim, generator=rng).to(dtype)
    value = torch.randn(sum(seq), heads_kv, dim_v, generator=rng).to(dtype)
    mask = vllm_prefill_mask(16, dtype)
    out = torch.empty(sum(seq), heads, dim_v, dtype=dtype)
    torch_npu._npu_flash_attention(query=query, key=key, value=value, mask=mask, seq_len=_host_int32(seq),
                                   scale_value=dim ** -0.5, num_heads=heads, num_kv_heads=heads_kv, out=out)
    golden = self_attention_oracle(query, key, value, seq, dim ** -0.5, mask=mask)
    torch.testing.assert_close(out.double(), golden, **TOL[dtype])


def test_flash_attention_with_a_mask_per_sequence(rng):
    seq = [4, 6]
    query = torch.randn(10, 2, 16, generator=rng).half()
    key, value = (torch.randn(10, 2, 16, generator=rng).half() for _ in range(2))
    mask = torch.randn(2, 6, 6, generator=rng).half()
    out = torch.empty(10, 2, 16, dtype=torch.float16)
    torch_npu._npu_flash_attention(query, key, value, mask, _host_int32(seq), 0.25, 2, 2, out)
    torch.testing.assert_close(out.double(), self_attention_oracle(query, key, value, seq, 0.25, mask=mask),
                               **TOL[torch.float16])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_attention_unpad_matches_the_oracle(dtype, rng):
    """vllm-ascend's encoder path (device_op.npu_flash_attention): no mask, every token sees its whole sequence."""
    seq = [7, 1, 12]
    query = torch.randn(20, 4, 32, generator=rng).to(dtype)
    key, value = (torch.randn(20, 1, 32, generator=rng).to(dtype) for _ in range(2))
    out = torch.empty_like(query)
    torch_npu._npu_flash_attention_unpad(query=query, key=key, value=value, seq_len=_host_int32(seq),
                                         scale_value=32 ** -0.5, num_heads=4, num_kv_heads=1, out=out)
    torch.testing.assert_close(out.double(), self_attention_oracle(query, key, value, seq, 32 ** -0.5),
                               **TOL[dtype])


# --------------------------------------------------------------------------------------------------- bad input
def _paged_args(rng):
    key_cache, value_cache, table = _cache([20, 9], 2, 16, 16, 16, torch.float16, rng)
    return dict(query=torch.randn(2, 4, 16, generator=rng).half(), key_cache=key_cache, value_cache=value_cache,
                num_kv_heads=2, num_heads=4, scale_value=0.25, block_table=table,
                context_lens=_host_int32([20, 9]), out=_sentinel((2, 4, 16), torch.float16))


PAGED_BAD = [
    ({"num_heads": 0}, "num_heads"),
    ({"num_kv_heads": 3}, "num_kv_heads"),
    ({"num_kv_heads": -1}, "num_kv_heads"),
    ({"query": "q"}, "query"),
    ({"query": lambda a: a["query"].float()}, "query"),
    ({"query": lambda a: a["query"][:, :3]}, "query"),
    ({"key_cache": lambda a: a["key_cache"].bfloat16()}, "key_cache"),
    ({"key_cache": lambda a: a["key_cache"][..., :8]}, "key_cache"),
    ({"key_cache": lambda a: a["key_cache"][:, :, :1]}, "key_cache"),
    ({"value_cache": lambda a: a["value_cache"][:-1]}, "value_cache"),
    ({"key_cache": lambda a: a["key_cache"][:, :8], "value_cache": lambda a: a["value_cache"][:, :8]}, "key_cache"),
    ({"block_table": lambda a: a["block_table"].long()}, "block_table"),
    ({"block_table": lambda a: a["block_table"][:1]}, "block_table"),
    ({"block_table": lambda a: torch.full_like(a["block_table"], -1)}, "block_table"),
    ({"context_lens": lambda a: a["context_lens"].long()}, "context_lens"),
    ({"context_lens": _host_int32([20])}, "context_lens"),
    ({"context_lens": _host_int32([20, -1])}, "context_lens"),
    ({"context_lens": _host_int32([20, 200])}, "block_table"),
    ({"scale_value": "x"}, "scale_value"),
    ({"out": lambda a: a["out"][:, :, :8]}, "out"),
    ({"out": lambda a: a["out"].bfloat16()}, "out"),
]


def _apply(args: dict, change: dict) -> dict:
    return args | {k: (v(args) if callable(v) else v) for k, v in change.items()}


@pytest.mark.parametrize(("change", "param"), PAGED_BAD)
def test_paged_attention_bad_input_names_the_parameter_and_leaves_out_untouched(change, param, rng):
    args = _apply(_paged_args(rng), change)
    out = args["out"]
    with pytest.raises(ParamInvalidError, match=rf"\] {param}:"):
        torch_npu._npu_paged_attention(**args)
    if isinstance(out, torch.Tensor):
        assert (out == 7).all()


@pytest.mark.parametrize("missing", ["query", "block_table", "context_lens", "out", "key_cache"])
def test_paged_attention_missing_tensor_is_a_nullptr_error(missing, rng):
    args = _paged_args(rng) | {missing: None}
    with pytest.raises(ParamNullptrError, match=rf"\] {missing}:"):
        torch_npu._npu_paged_attention(**args)


def _splitfuse_args(rng):
    q_lens, kv_lens = [3, 1], [7, 4]
    key_cache, value_cache, table = _cache(kv_lens, 2, 16, 16, 16, torch.float16, rng)
    return dict(query=torch.randn(4, 4, 16, generator=rng).half(), key_cache=key_cache, value_cache=value_cache,
                block_table=table, context_lens=_host_int32(kv_lens), mask=splitfuse_mask(q_lens, kv_lens, 8,
                                                                                           torch.float16),
                seq_len=_host_int32(q_lens), num_kv_heads=2, num_heads=4, scale_value=0.25,
                out=_sentinel((4, 4, 16), torch.float16))


SPLITFUSE_BAD = [
    ({"seq_len": _host_int32([3, 2])}, "seq_len"),
    ({"seq_len": _host_int32([4, 0]), "context_lens": _host_int32([3, 4])}, "seq_len"),
    ({"context_lens": _host_int32([7])}, "context_lens"),
    ({"mask": lambda a: a["mask"].bfloat16()}, "mask"),
    ({"mask": lambda a: a["mask"][:3]}, "mask"),
    ({"mask": lambda a: a["mask"][:, :6]}, "mask"),
    ({"out": lambda a: a["out"][:3]}, "out"),
]


@pytest.mark.parametrize(("change", "param"), SPLITFUSE_BAD)
def test_splitfuse_bad_input_names_the_parameter(change, param, rng):
    args = _apply(_splitfuse_args(rng), change)
    with pytest.raises(ParamInvalidError, match=rf"\] {param}:"):
        torch_npu._npu_paged_attention_splitfuse(**args)
    assert (args["out"] == 7).all()


def _flash_args(rng):
    return dict(query=torch.randn(10, 4, 16, generator=rng).half(), key=torch.randn(10, 2, 16, generator=rng).half(),
                value=torch.randn(10, 2, 8, generator=rng).half(), mask=causal_additive_mask(6, torch.float16),
                seq_len=_host_int32([4, 6]), scale_value=0.25, num_heads=4, num_kv_heads=2,
                out=_sentinel((10, 4, 8), torch.float16))


FLASH_BAD = [
    ({"seq_len": _host_int32([4, 5])}, "seq_len"),
    ({"seq_len": torch.tensor([4, 6])}, "seq_len"),
    ({"key": lambda a: a["key"][:9]}, "key"),
    ({"key": lambda a: a["key"][..., :8]}, "key"),
    ({"value": lambda a: a["value"][:, :1]}, "value"),
    ({"mask": lambda a: a["mask"][:5, :5]}, "mask"),
    ({"mask": lambda a: a["mask"].expand(3, 6, 6)}, "mask"),
    ({"mask": lambda a: a["mask"].float()}, "mask"),
    ({"out": lambda a: a["out"][..., :4]}, "out"),
    ({"num_kv_heads": 3}, "num_kv_heads"),
]


@pytest.mark.parametrize(("change", "param"), FLASH_BAD)
def test_flash_attention_bad_input_names_the_parameter(change, param, rng):
    args = _apply(_flash_args(rng), change)
    with pytest.raises(ParamInvalidError, match=rf"\] {param}:"):
        torch_npu._npu_flash_attention(**args)
    assert (args["out"] == 7).all()
    unpad = {k: v for k, v in args.items() if k != "mask"}
    if param != "mask":
        with pytest.raises(ParamInvalidError, match=rf"\] {param}:"):
            torch_npu._npu_flash_attention_unpad(**unpad)


def test_flash_attention_requires_its_mask(rng):
    with pytest.raises(ParamNullptrError, match=r"\] mask:"):
        torch_npu._npu_flash_attention(**(_flash_args(rng) | {"mask": None}))


# ------------------------------------------------------------------------------------------------ torch.compile
def test_the_ops_trace_into_one_custom_op_each_under_torch_compile(rng):
    """fullgraph=True: the host-side lengths are read inside the cann_attn::atb_* custom ops, not by the tracer."""
    key_cache, value_cache, table = _cache([20, 9], 2, 16, 16, 16, torch.float16, rng)
    query = torch.randn(2, 4, 16, generator=rng).half()
    lens = _host_int32([20, 9])
    seq = _host_int32([2])
    packed = torch.randn(2, 4, 16, generator=rng).half()

    def step(query, packed, out, out2):
        torch_npu._npu_paged_attention(query, key_cache, value_cache, 2, 4, 0.25, table, lens, out)
        torch_npu._npu_flash_attention_unpad(packed, packed, packed, seq, 0.25, 4, 4, out2)
        return out * 2, out2 + 1

    eager = step(query, packed, torch.empty(2, 4, 16, dtype=torch.float16), torch.empty(2, 4, 16,
                                                                                          dtype=torch.float16))
    out, out2 = torch.empty(2, 4, 16, dtype=torch.float16), torch.empty(2, 4, 16, dtype=torch.float16)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(query, packed, out, out2)
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
    assert torch.equal(out * 2, eager[0])  # the caller's out was written


def _opcheck_cases(rng):
    key_cache, value_cache, table = _cache([20, 9], 2, 16, 8, 16, torch.float16, rng)
    q = torch.randn(2, 4, 16, generator=rng).half()
    packed, kv = torch.randn(5, 4, 16, generator=rng).half(), torch.randn(5, 2, 16, generator=rng).half()
    out = torch.empty(2, 4, 8, dtype=torch.float16)
    lens, seq = _host_int32([20, 9]), _host_int32([3, 2])
    mask = causal_additive_mask(3, torch.float16)
    rows = splitfuse_mask([1, 1], [20, 9], 20, torch.float16)
    ops = torch.ops.cann_attn
    return {
        "paged": (ops.atb_paged_attention.default, (q, key_cache, value_cache, 2, 4, 0.25, table, lens, out)),
        "splitfuse": (ops.atb_paged_attention_splitfuse.default,
                      (q, key_cache, value_cache, table, lens, rows, _host_int32([1, 1]), 2, 4, 0.25, out.clone())),
        "flash": (ops.atb_flash_attention.default,
                  (packed, kv, kv, mask, seq, 0.25, 4, 2, torch.empty(5, 4, 16, dtype=torch.float16))),
        "unpad": (ops.atb_flash_attention_unpad.default,
                  (packed, kv, kv, seq, 0.25, 4, 2, torch.empty(5, 4, 16, dtype=torch.float16))),
    }


@pytest.mark.parametrize("name", ["paged", "splitfuse", "flash", "unpad"])
def test_opcheck(name, rng):
    """Schema (the mutated out declared), FakeTensor and AOT dispatch of the cann_attn::atb_* custom ops."""
    op, args = _opcheck_cases(rng)[name]
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result


def test_a_row_masked_everywhere_with_minus_inf_gives_zeros_and_a_finite_fill_does_not(rng):
    """docs/operators/atb_attention.md: -inf at every key leaves the row without a softmax (invalid-row zeros);
    -10000 everywhere only shifts its scores."""
    query, key = torch.randn(4, 2, 16, generator=rng).half(), torch.randn(4, 2, 16, generator=rng).half()
    out = torch.empty(4, 2, 16, dtype=torch.float16)
    for fill in (float("-inf"), -10000.0):
        mask = torch.zeros(4, 4, dtype=torch.float16)
        mask[1] = fill
        torch_npu._npu_flash_attention(query, key, key, mask, _host_int32([4]), 0.25, 2, 2, out)
        if fill == float("-inf"):
            assert not out[1].any() and out[[0, 2, 3]].abs().sum() > 0
        else:
            golden = self_attention_oracle(query, key, key, [4], 0.25, mask=mask)
            torch.testing.assert_close(out.double(), golden, **TOL[torch.float16])


# ------------------------------------------------------------------------------------------------ random batches
@settings(max_examples=fuzz_examples(40), deadline=None)
@given(data=st.data())
def test_random_splitfuse_batches_match_the_oracle(data):
    """Random vLLM batches: each sequence a decode, a fresh prompt or a chunk after cached tokens; random GQA, block
    size, value head size and dtype; every table padded with -1 / stale ids and the pages with NaN."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    heads_kv = data.draw(st.sampled_from([1, 2]))
    heads = heads_kv * data.draw(st.sampled_from([1, 2, 4]))
    dim, dim_v = data.draw(st.sampled_from([(16, 16), (32, 16), (16, 8)]))
    block = data.draw(st.sampled_from([16, 32]))
    dtype = data.draw(st.sampled_from([torch.float16, torch.bfloat16]))
    kinds = data.draw(st.lists(st.sampled_from(["decode", "prompt", "chunk"]), min_size=1, max_size=4))
    q_lens, kv_lens = [], []
    for kind in kinds:
        cached = 0 if kind == "prompt" else data.draw(st.integers(0 if kind == "chunk" else 1, 40))
        new = 1 if kind == "decode" else data.draw(st.integers(1, 20))
        q_lens.append(new)
        kv_lens.append(cached + new)
    key_cache, value_cache, table = _cache(kv_lens, heads_kv, dim, dim_v, block, dtype, gen)
    query = torch.randn(sum(q_lens), heads, dim, generator=gen).to(dtype)
    mask = splitfuse_mask(q_lens, kv_lens, max(kv_lens), dtype)
    out = torch.empty(sum(q_lens), heads, dim_v, dtype=dtype)
    torch_npu._npu_paged_attention_splitfuse(query, key_cache, value_cache, table, _host_int32(kv_lens), mask,
                                             _host_int32(q_lens), heads_kv, heads, dim ** -0.5, out)
    golden = splitfuse_oracle(query, key_cache, value_cache, table, kv_lens, mask, q_lens, heads_kv, heads,
                              dim ** -0.5)
    torch.testing.assert_close(out.double(), golden, **TOL[dtype])
    if all(q == 1 for q in q_lens):  # a batch of decodes is _npu_paged_attention's call too (another kernel:
        decode = torch.empty_like(out)  # the decode loop without the all-zero mask rows)
        torch_npu._npu_paged_attention(query, key_cache, value_cache, heads_kv, heads, dim ** -0.5, table,
                                       _host_int32(kv_lens), decode)
        torch.testing.assert_close(decode.double(), golden, **TOL[dtype])


def test_torch_npu_7_1_has_no_workspace(rng):
    """op-plugin 7.1.0's _npu_paged_attention schema ends at `out` (the workspace and its helper came in 7.2)."""
    args = _paged_args(rng)
    previous = torch_npu.use_release("7.1")
    try:
        with pytest.raises(TypeError, match="workspace"):
            torch_npu._npu_paged_attention(**args, workspace=torch.empty(0, dtype=torch.uint8))
        torch_npu._npu_paged_attention(**args)
    finally:
        torch_npu.use_release(previous)
    assert not (args["out"] == 7).all()


# ---------------------------------------------------------------------------------------------------- out tensors
ATB_OUT_CALLS = {  # op -> (its arguments, an input at least as large as out)
    "_npu_paged_attention": (_paged_args, "value_cache"),
    "_npu_paged_attention_splitfuse": (_splitfuse_args, "key_cache"),
    "_npu_flash_attention": (_flash_args, "key"),
    "_npu_flash_attention_unpad": (lambda rng: {k: v for k, v in _flash_args(rng).items() if k != "mask"}, "key"),
}


def _inside(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A tensor of `like`'s shape and dtype whose memory is the start of `tensor`'s."""
    return tensor.flatten()[: like.numel()].view(like.shape)


@pytest.mark.parametrize("op", sorted(ATB_OUT_CALLS))
@pytest.mark.parametrize("case", ["stride 0", "inside query", "inside another input", "other device"])
def test_out_sharing_memory_or_on_another_device_is_refused_before_anything_is_written(op, case, rng):
    """Before: an expanded (stride-0) out gave a raw torch error from copy_; an out inside an input was accepted."""
    make, other = ATB_OUT_CALLS[op]
    args = make(rng)
    out = args["out"]
    if case == "stride 0":
        args["out"] = out[:1].expand(out.shape)
    elif case == "inside query":
        args["out"] = _inside(args["query"], out)
    elif case == "inside another input":
        args["out"] = _inside(args[other], out)
    else:
        args["out"] = torch.empty(out.shape, dtype=out.dtype, device="meta")
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"}
    named = {"inside query": "query", "inside another input": other}.get(case, "")
    with pytest.raises(ParamInvalidError, match=rf"\] out: .*{named}"):
        getattr(torch_npu, op)(**args)
    assert all(torch.equal(args[k].contiguous().view(torch.uint8), v.view(torch.uint8)) for k, v in before.items())


def test_too_few_cache_blocks_names_key_cache(rng):
    """Before: the error named `key`, which ATB's paged attention does not take."""
    args = _paged_args(rng)
    args |= {"key_cache": args["key_cache"][:1], "value_cache": args["value_cache"][:1]}
    with pytest.raises(ParamInvalidError, match=r"\] key_cache: expected at least 3 blocks"):
        torch_npu._npu_paged_attention(**args)
