"""The decode loop's scores of an int8 MLA query (docs/operators/fused_infer_attention_score.md, "int8 MLA query";
docs/guides/backends.md, "Decode"): the latent part an exact int32 dot product (AVX512-VNNI's unsigned-by-signed
form with its correction, or an integer loop: the same integers), plus the rope's fp32 sum in row_dots's order, times
(softmax_scale * dequant_scale_query) * dequant_scale_key. Checked against exact integer products, against a model of
the documented order (through softmax_lse of one key, which is the score itself), VNNI against the loop end to end,
and one thread against two."""

from __future__ import annotations

import pytest
import torch

import cann_attn
from cann_attn.backends.reference import native
from cann_attn.problem.nz import to_nz
from fia_cases import rand
from paged_utils import int8_mla_pages

pytestmark = pytest.mark.skipif(native.library() is None, reason="needs the native loops")


def _default_setting() -> bool:
    """The setting the library loads with (CANN_ATTN_NATIVE_VNNI=0 turns VNNI off)."""
    return not native._switched_off(native.VNNI_SWITCH)


HAS_VNNI = native.library() is not None and native.set_int8_dot(True)
if native.library() is not None:
    native.set_int8_dot(_default_setting())
LATENT, ROPE, PAGE = 512, 64, 16
PATHS = [True, False] if HAS_VNNI else [False]


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    monkeypatch.setenv("CANN_ATTN_BACKEND", "reference")
    yield
    native.set_int8_dot(_default_setting())


@pytest.mark.parametrize("vnni", PATHS)
@pytest.mark.parametrize("heads, n, dim", [(7, 70, 512), (4, 4, 64), (5, 9, 100), (1, 1, 576), (9, 65, 512)])
def test_int8_dots_are_exact_integers(vnni, heads, n, dim):
    g = torch.Generator().manual_seed(heads * n + dim)
    q = torch.randint(-128, 128, (heads, dim), generator=g, dtype=torch.int8)
    k = torch.randint(-128, 128, (n, dim), generator=g, dtype=torch.int8)
    q[0], k[0] = -128, -128  # the extreme product, 512 * 2^14 = 2^23 in a row
    if n > 1:
        k[1] = 127
    assert torch.equal(native.int8_dots(q, k, emulate=not vnni).long(), q.long() @ k.long().T)


def _cache(lengths: list[int], seed: int, nz: bool, heads: int):
    g = torch.Generator().manual_seed(seed)
    _latent, _rope, nd, table = int8_mla_pages(lengths, LATENT, ROPE, PAGE, g)
    blocks = nd["k"].shape[0]
    if nz:
        key, rope_cache = to_nz(nd["k"]), to_nz(nd["r"])
    else:
        key, rope_cache = nd["k"].view(blocks, PAGE, LATENT), nd["r"].view(blocks, PAGE, ROPE)
    query = rand((len(lengths), heads, 1, LATENT), torch.int8, g)
    query_rope = rand((len(lengths), heads, 1, ROPE), torch.bfloat16, g)
    scale_q = torch.rand((len(lengths), heads, 1), generator=g) * 0.01 + 0.001
    return key, rope_cache, table, query, query_rope, scale_q


def _call(lengths, key, rope, table, query, query_rope, scale_q, threads: int = 1):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return cann_attn.fused_infer_attention_score_v2(
            query, key, key, query_rope=query_rope, key_rope=rope, dequant_scale_query=scale_q,
            dequant_scale_key=torch.tensor([0.02]), dequant_scale_value=torch.tensor([0.02]), query_quant_mode=3,
            num_query_heads=query.shape[1], num_key_value_heads=1, input_layout="BNSD", softmax_scale=0.05,
            block_table=table, block_size=PAGE, actual_seq_kvlen=lengths, return_softmax_lse=True)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("nz, heads", [(False, 8), (True, 8), (False, 2), (True, 16)])
def test_vnni_and_loop_and_threads_give_the_same_bits(nz, heads):
    lengths = [700, 37, 1]  # two chunks of the split, a partial tile, one key
    args = _cache(lengths, 3, nz, heads)
    native.set_int8_dot(False)
    loop = _call(lengths, *args)
    native.set_int8_dot(True)
    for threads in (1, 2):
        for name, a, b in zip(("out", "lse"), loop, _call(lengths, *args, threads=threads), strict=True):
            assert torch.equal(a, b), f"{name}, {threads} thread(s): differs from the integer loop on one thread"


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fma(a, b, c) of bf16 operands: the product is exact in float64, the sum rounds once to fp32's value."""
    return (a.double() * b.double() + c.double()).float()


def documented_scores(q8, k8, q_rope, k_rope, scale_q, key_scale: float, softmax_scale: float) -> torch.Tensor:
    """((float)(q8 . k8) + r) * ((softmax_scale * dsq) * dsk) per row: r the 8-lane sum of fp32 FMAs in increasing
    column (column d in lane d % 8), lanes summed as ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))."""
    integer = (q8.long() * k8.long()).sum(-1).float()
    lanes = torch.zeros(*q_rope.shape[:-1], 8)
    for d in range(q_rope.shape[-1]):
        lanes[..., d % 8] = _fma32(q_rope[..., d].float(), k_rope[..., d].float(), lanes[..., d % 8])
    pair = lanes[..., :4] + lanes[..., 4:]
    r = (pair[..., 0] + pair[..., 2]) + (pair[..., 1] + pair[..., 3])
    f32 = torch.float32
    factor = scale_q.to(f32) * torch.tensor(softmax_scale, dtype=f32) * torch.tensor(key_scale, dtype=f32)
    return (integer + r) * factor


@pytest.mark.parametrize("vnni", PATHS)
@pytest.mark.parametrize("heads", [8, 2])
def test_scores_follow_the_documented_order(vnni, heads):
    """With one key per sequence the softmax is that key's alone: lse = max + log(1) is the score's fp32 value."""
    lengths = [1, 1, 1]
    key, rope, table, query, query_rope, scale_q = _cache(lengths, 7, False, heads)
    native.set_int8_dot(vnni)
    _out, lse = _call(lengths, key, rope, table, query, query_rope, scale_q)
    k8 = key[table[:, 0].long(), 0]  # [B, D]: each sequence's one key
    kr = rope[table[:, 0].long(), 0]
    expected = documented_scores(query[:, :, 0], k8[:, None], query_rope[:, :, 0], kr[:, None], scale_q[..., 0],
                                 0.02, 0.05)
    assert torch.equal(lse.reshape(expected.shape), expected)
