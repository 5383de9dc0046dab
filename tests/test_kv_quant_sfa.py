"""KvQuantSparseFlashAttention against the independent float64 oracle (dequantise the combined int8 / fp8 rows as
documented, then the SparseFlashAttention oracle; docs/operators/quant_dsa.md): BSND / TND, paged and contiguous,
sparse_mode 0 / 3, lengths including 0, -1 padding, sinks, paged equal to contiguous bit for bit, the torch_npu
spelling, hypothesis fuzzing, mutants (tile-scale placement, block mapping) caught, errors naming the parameter."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cann_attn
import cann_attn.torch_npu as torch_npu
from cann_attn.ops import quant_dsa as quant_dsa_ops
from cann_attn.problem import dequant
from cann_attn.problem.page_table import PageTable
from cann_attn.testing import dsa_quant_oracle as oracle
from cann_attn.testing.precision import assert_close_to_oracle
from matrix_sample import fuzz_examples
from paged_utils import paginate

pytestmark = pytest.mark.usefixtures("single_thread")

BF16, F16, I8, FP8 = torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn
LENGTHS = {"BSND": ([4, 0, 3], [12, 5, 2]), "TND": ([3, 0, 2, 4], [9, 4, 2, 7])}


def pack_rows(latent: torch.Tensor, rope: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Combined cache rows [.., 656] in latent's dtype: latent bytes, rope bytes, fp32 scale bytes (the layout of
    op-plugin's golden: torch.cat((key, key_rope.view(int8), scale.view(int8)), -1))."""
    as_bytes = [latent.view(torch.uint8), rope.contiguous().view(torch.uint8), scales.contiguous().view(torch.uint8)]
    return torch.cat(as_bytes, dim=-1).view(latent.dtype)


class KvQuantCase:
    def __init__(self, layout, gen, *, dtype=I8, qdtype=BF16, n1=2, k=6, s1=4, s2=12, sinks=False):
        self.layout, self.gen = layout, gen
        q_lens, kv_lens = LENGTHS[layout]
        if layout == "BSND":
            q_lead, kv_lead = (len(q_lens), s1), (len(kv_lens), s2)
            self.kw = dict(layout="BSND", actual_seq_lengths_query=q_lens, actual_seq_lengths_kv=kv_lens)
        else:
            q_lead, kv_lead = (sum(q_lens),), (sum(kv_lens),)
            ends = lambda lens: [sum(lens[: i + 1]) for i in range(len(lens))]  # noqa: E731
            self.kw = dict(layout="TND", actual_seq_lengths_query=ends(q_lens), actual_seq_lengths_kv=ends(kv_lens))
        self.q_lens, self.kv_lens = q_lens, kv_lens
        latent = torch.randint(-127, 128, (*kv_lead, 1, 512), generator=gen)
        latent = latent.to(torch.float32).div(16).to(FP8) if dtype == FP8 else latent.to(I8)
        rope = torch.randn(*kv_lead, 1, 64, generator=gen).to(qdtype)
        scales = (torch.rand(*kv_lead, 1, 4, generator=gen) * 0.04 - 0.01).to(torch.float32)
        self.key = pack_rows(latent, rope, scales)
        self.query = torch.randn(*q_lead, n1, 576, generator=gen).to(qdtype)
        hi = max(kv_lens)
        idx = torch.randint(0, hi + 2, (*q_lead, 1, k), generator=gen)
        idx[..., k - 2 :] = -1  # trailing -1 padding
        self.sparse_indices = idx.to(torch.int32)
        self.sinks = torch.randn(n1, generator=gen) if sinks else None
        self.scale = 576 ** -0.5

    def run(self, value=None, **kw):
        return cann_attn.kv_quant_sparse_flash_attention(
            self.query, self.key, self.key if value is None else value, self.sparse_indices, self.scale,
            sinks=self.sinks, **{**self.kw, **kw})

    def oracle(self, **kw):
        return oracle.kv_quant_sparse_attention_oracle(
            self.query, self.key, self.key, self.sparse_indices, self.scale, sinks=self.sinks, **{**self.kw, **kw})

    def run_paged(self, block_size=16, **kw):
        starts = [sum(self.kv_lens[:b]) for b in range(len(self.kv_lens))]
        if self.layout == "BSND":
            rows = [self.key[b, :n] for b, n in enumerate(self.kv_lens)]
        else:
            rows = [self.key[s : s + n] for s, n in zip(starts, self.kv_lens, strict=True)]
        caches, table = paginate({"kv": rows}, block_size, self.gen)
        caches, table = {"kv": caches["kv"].to(self.query.device)}, table.to(self.query.device)
        paged = dict(self.kw, actual_seq_lengths_kv=self.kv_lens, block_table=table, layout_kv="PA_BSND")
        return cann_attn.kv_quant_sparse_flash_attention(
            self.query, caches["kv"], caches["kv"], self.sparse_indices, self.scale, sinks=self.sinks,
            **{**paged, **kw})


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("mode", [0, 3])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_matches_the_dequantising_oracle(layout, mode, sinks, rng):
    case = KvQuantCase(layout, rng, sinks=sinks)
    got = case.run(sparse_mode=mode)
    want = case.oracle(sparse_mode=mode)
    assert got.dtype == BF16 and got.shape == (*case.query.shape[:-1], 512)
    assert want.abs().max() > 0
    assert_close_to_oracle(got, want, name="attention_out")


@pytest.mark.parametrize("dtype, qdtype", [(FP8, BF16), (I8, F16)])
def test_fp8_cache_and_fp16_query(dtype, qdtype, rng):
    case = KvQuantCase("BSND", rng, dtype=dtype, qdtype=qdtype)
    assert_close_to_oracle(case.run(), case.oracle(), name="attention_out")


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_paged_equals_contiguous_bit_for_bit(layout, rng):
    case = KvQuantCase(layout, rng, s2=40, sinks=True) if layout == "BSND" else KvQuantCase(layout, rng)
    for mode in (0, 3):
        assert torch.equal(case.run_paged(16, sparse_mode=mode), case.run(sparse_mode=mode))


@pytest.mark.parametrize("block", [2, 4])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_block_sizes_2_and_4(layout, block, rng):
    """"sparse_block_size支持[1,16]，且要求是2的幂次方": 2 and 4 (outside SparseFlashAttention's own list) select
    blocks of 2 / 4 consecutive keys, against the oracle; paged equals contiguous bit for bit."""
    case = KvQuantCase(layout, rng, s2=40, sinks=True) if layout == "BSND" else KvQuantCase(layout, rng)
    case.sparse_indices = case.sparse_indices.clamp(max=-(-max(case.kv_lens) // block))
    for mode in (0, 3):
        got = case.run(sparse_mode=mode, sparse_block_size=block)
        assert_close_to_oracle(got, case.oracle(sparse_mode=mode, sparse_block_size=block), name="attention_out")
        assert not torch.equal(got, case.run(sparse_mode=mode))  # the block size changes the selection
        assert torch.equal(case.run_paged(16, sparse_mode=mode, sparse_block_size=block), got)


def test_sparse_attention_keeps_its_own_block_sizes(rng):
    """SparseFlashAttention's page lists 1, 8, 16, ...: 2 stays refused there."""
    case = KvQuantCase("BSND", rng)
    k_nope, k_rope = oracle.dequantize_combined_rows(case.key, BF16)
    with pytest.raises(cann_attn.ParamInvalidError, match="sparse_block_size"):
        cann_attn.sparse_flash_attention(case.query[..., :512], k_nope, k_nope, case.sparse_indices, case.scale,
                                         query_rope=case.query[..., 512:], key_rope=k_rope, sparse_block_size=2,
                                         **case.kw)


def test_equals_sparse_attention_on_the_dequantised_cache(rng):
    """The operator is SparseFlashAttention over the documented dequantisation, bit for bit, with a separate value
    tensor dequantised with its own scales."""
    case = KvQuantCase("BSND", rng)
    other = KvQuantCase("BSND", torch.Generator().manual_seed(7)).key
    k_nope, k_rope = oracle.dequantize_combined_rows(case.key, BF16)
    v_nope, _ = oracle.dequantize_combined_rows(other, BF16)
    want = cann_attn.sparse_flash_attention(
        case.query[..., :512], k_nope, v_nope, case.sparse_indices, case.scale, query_rope=case.query[..., 512:],
        key_rope=k_rope, **case.kw).attention_out
    assert torch.equal(case.run(value=other), want)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernel under the interpreter")
@pytest.mark.parametrize("dtype, qdtype", [(I8, BF16), (FP8, F16)])
def test_triton_dequantises_in_the_kernel(dtype, qdtype, rng, monkeypatch):
    """On the Triton backend the combined rows are read in place, contiguous and paged, and dequantised in the
    kernel: no dequantised temporary is built (those helpers raise here), and the result is the kernel's
    SparseFlashAttention on the dequantised cache bit for bit (same kernel, same rounded values)."""
    case = KvQuantCase("BSND", rng, dtype=dtype, qdtype=qdtype, s2=40, sinks=True)
    k_nope, k_rope = oracle.dequantize_combined_rows(case.key, qdtype)
    want = cann_attn.sparse_flash_attention(
        case.query[..., :512], k_nope, k_nope, case.sparse_indices, case.scale, query_rope=case.query[..., 512:],
        key_rope=k_rope, sinks=case.sinks, backend="triton", **case.kw).attention_out

    def no_temporary(*args, **kw):
        raise AssertionError("a dequantised temporary was built")

    for name in ("_dequantized", "_dequantized_rows", "_reference_attention"):
        monkeypatch.setattr(quant_dsa_ops, name, no_temporary)
    monkeypatch.setattr(dequant, "dequantize_tiles", no_temporary)
    assert torch.equal(case.run(backend="triton"), want)
    assert torch.equal(case.run_paged(16, backend="triton"), want)
    assert torch.equal(case.run(value=_latent_only(case)[0], backend="triton"), want)


@pytest.mark.parametrize("block", [2, 8])
def test_npu_mode_block_sizes(block, rng, monkeypatch):
    """The npu precision mode (SparseFlashAttention's NPU pipeline over a dequantised temporary) with blocks of
    several keys: against the oracle, paged equal to contiguous. Rows of the temporary that no entry reaches were
    left uninitialised and leaked NaN into the output."""
    monkeypatch.setenv("CANN_ATTN_PRECISION", "npu")
    case = KvQuantCase("BSND", rng, s2=40, sinks=True)
    case.sparse_indices = case.sparse_indices.clamp(max=40 // block)
    got = case.run(sparse_block_size=block)
    assert_close_to_oracle(got, case.oracle(sparse_block_size=block), name="attention_out")
    assert torch.equal(case.run_paged(16, sparse_block_size=block), got)


def _latent_only(case: KvQuantCase, latent: torch.Tensor | None = None):
    """(a latent-only value [.., 1, 512], the packed rows with that latent and the key rows' rope and scales)."""
    parts = dequant.split_combined(case.key, case.query.dtype)
    latent = parts.latent.contiguous() if latent is None else latent
    return latent, pack_rows(latent, parts.rope, parts.scales)


@pytest.mark.parametrize("npu_mode", [False, True])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_latent_only_value_equals_the_packed_value(layout, npu_mode, rng, monkeypatch):
    """op-plugin's own test passes value = the int8 latent alone [blocks, block_size, 1, 512] beside the packed key
    (test/test_custom_ops/test_npu_kv_quant_sparse_flash_attention.py:433-444: ``value = key.clone()`` before
    ``key = torch.cat((key, key_rope.view(torch.int8), antiquant_scale.view(torch.int8)), axis=3)``), and its
    golden dequantises the value with the key rows' tile scales: the result of the packed value, bit for bit, also
    with a latent that differs from the key's (read from `value`, scaled by the key rows' scales)."""
    if npu_mode:
        monkeypatch.setenv("CANN_ATTN_PRECISION", "npu")
    case = KvQuantCase(layout, rng, sinks=True)
    latent, packed = _latent_only(case)
    assert torch.equal(packed, case.key)
    assert torch.equal(case.run(value=latent), case.run())
    other = torch.randint(-127, 128, latent.shape, generator=rng).to(I8)
    other_latent, other_packed = _latent_only(case, other)
    got = case.run(value=other_latent)
    assert torch.equal(got, case.run(value=other_packed))
    want = oracle.kv_quant_sparse_attention_oracle(case.query, case.key, other_packed, case.sparse_indices,
                                                   case.scale, sinks=case.sinks, **case.kw)
    assert_close_to_oracle(got, want, name="attention_out")
    assert not torch.equal(got, case.run())


def test_latent_only_value_over_a_paged_cache(rng):
    """op-plugin's test call: PA_BSND key cache and the latent-only value cache of the same blocks."""
    case = KvQuantCase("BSND", rng, s2=40)
    rows = [case.key[b, :n] for b, n in enumerate(case.kv_lens)]
    caches, table = paginate({"kv": rows}, 16, case.gen)
    key_cache = caches["kv"]
    value_cache = dequant.split_combined(key_cache, BF16).latent.contiguous()
    paged = dict(case.kw, actual_seq_lengths_kv=case.kv_lens, block_table=table, layout_kv="PA_BSND")
    got = cann_attn.kv_quant_sparse_flash_attention(case.query, key_cache, value_cache, case.sparse_indices,
                                                    case.scale, **paged)
    assert torch.equal(got, case.run())


def test_torch_npu_spelling(rng):
    case = KvQuantCase("TND", rng)
    got = torch_npu.npu_kv_quant_sparse_flash_attention(
        case.query, case.key, case.key, case.sparse_indices, case.scale, 2, 2,
        actual_seq_lengths_query=torch.tensor(case.kw["actual_seq_lengths_query"], dtype=torch.int32),
        actual_seq_lengths_kv=torch.tensor(case.kw["actual_seq_lengths_kv"], dtype=torch.int32),
        layout_query="TND", layout_kv="TND", attention_mode=2, quant_scale_repo_mode=1, tile_size=128,
        rope_head_dim=64)
    assert torch.equal(got, case.run())


def test_mutant_tile_scales_swapped_is_caught(rng, monkeypatch):
    """Scale placement: applying tile i's scale to tile 3 - i must fail the oracle comparison."""
    case = KvQuantCase("BSND", rng)
    original = dequant.dequantize_tiles
    monkeypatch.setattr(dequant, "dequantize_tiles", lambda x, s, tile, dt: original(x, s.flip(-1), tile, dt))
    with pytest.raises(AssertionError):
        assert_close_to_oracle(case.run(backend="reference"), case.oracle(), name="attention_out")


def test_mutant_block_mapping_is_caught(rng, monkeypatch):
    """Block mapping: cache rows located one position off through the table must change the paged result."""
    case = KvQuantCase("BSND", rng, s2=40)
    want = case.run(backend="reference")
    original = PageTable.physical_rows
    monkeypatch.setattr(PageTable, "physical_rows", lambda self, b: original(self, b).roll(1))
    assert not torch.equal(case.run_paged(16, backend="reference"), want)


@settings(max_examples=fuzz_examples(10), deadline=None)
@given(s1=st.integers(1, 3), s2=st.integers(1, 10), n1=st.sampled_from([1, 2, 4]), k=st.integers(1, 6),
       mode=st.sampled_from([0, 3]), block=st.sampled_from([1, 2, 4, 8, 16]), seed=st.integers(0, 2**16))
def test_hypothesis_against_oracle(s1, s2, n1, k, mode, block, seed):
    gen = torch.Generator().manual_seed(seed)
    case = KvQuantCase("BSND", gen, n1=n1, k=max(k, 2), s1=s1, s2=s2)
    case.kw.update(actual_seq_lengths_query=None, actual_seq_lengths_kv=None)
    case.query, case.key, case.sparse_indices = case.query[:1], case.key[:1], case.sparse_indices[:1]
    got = case.run(sparse_mode=mode, sparse_block_size=block)
    assert_close_to_oracle(got, case.oracle(sparse_mode=mode, sparse_block_size=block), name="attention_out")


@pytest.mark.parametrize("change, param", [
    (lambda c: dict(query=c.query.float()), "query"),
    (lambda c: dict(query=c.query[..., :512]), "query"),
    # "Q_N值支持1/2/4/8/16/32/48/64/128"; before: Q_N = 3 was accepted.
    (lambda c: dict(query=torch.cat([c.query, c.query[..., :1, :]], -2)), r"query: expected Q_N \(heads\) among"),
    (lambda c: dict(key=c.key.view(torch.uint8)), "key"),
    (lambda c: dict(key=c.key[..., :640]), "key"),
    (lambda c: dict(value=c.key[..., :600]), "value"),
    (lambda c: dict(value=c.key[:, :5, :, :512]), "value"),
    (lambda c: dict(sparse_indices=c.sparse_indices.long()), "sparse_indices"),
    (lambda c: dict(key_quant_mode=0), "key_quant_mode"),
    (lambda c: dict(value_quant_mode=1), "value_quant_mode"),
    (lambda c: dict(key_dequant_scale=torch.ones(1)), "key_dequant_scale"),
    (lambda c: dict(value_dequant_scale=torch.ones(1)), "value_dequant_scale"),
    (lambda c: dict(attention_mode=0), "attention_mode"),
    (lambda c: dict(quant_scale_repo_mode=0), "quant_scale_repo_mode"),
    (lambda c: dict(tile_size=64), "tile_size"),
    (lambda c: dict(rope_head_dim=32), "rope_head_dim"),
    (lambda c: dict(key_dtype=290), "key_dtype"),
    (lambda c: dict(value_dtype=290), "value_dtype"),
    (lambda c: dict(pre_tokens=5), "pre_tokens"),
    (lambda c: dict(sparse_block_size=32), "sparse_block_size"),
    (lambda c: dict(sparse_block_size=3), "sparse_block_size"),
    (lambda c: dict(sparse_mode=1), "sparse_mode"),
    (lambda c: dict(layout_kv="TND"), "layout_kv"),
    (lambda c: dict(sinks=torch.zeros(3)), "sinks"),
    (lambda c: dict(actual_seq_lengths_kv=[13, 1, 1]), "actual_seq_lengths_kv"),
])
def test_errors_name_the_parameter(change, param, rng):
    case = KvQuantCase("BSND", rng)
    args = dict(query=case.query, key=case.key, value=case.key, sparse_indices=case.sparse_indices,
                scale_value=case.scale)
    kw = dict(case.kw)
    for name, value in change(case).items():
        (args if name in args else kw)[name] = value
    with pytest.raises(cann_attn.ParamInvalidError, match=param):
        cann_attn.kv_quant_sparse_flash_attention(*args.values(), **kw)


def test_tnd_sequence_with_queries_but_no_keys_outputs_zero_rows(rng, monkeypatch):
    """Lengths >= 0 are documented and a row that selects nothing outputs 0 (the paged form computed it already).
    Before: the contiguous TND form refused sequence 1 (2 query tokens, 0 keys)."""
    monkeypatch.setitem(LENGTHS, "TND", ([3, 2, 2, 4], [9, 0, 2, 7]))
    case = KvQuantCase("TND", rng)
    got = case.run()
    assert (got[3:5] == 0).all() and got[:3].abs().max() > 0
    assert_close_to_oracle(got, case.oracle(), name="attention_out")
    assert torch.equal(case.run_paged(16), got)
