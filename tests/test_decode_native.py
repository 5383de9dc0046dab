"""The native decode loop (docs/guides/backends.md, "Decode"): one query token per sequence over caches read in
place, each K / V row once for the GQA group's query heads, long sequences split into chunks of DECODE_SPLIT keys
whose partial sums are combined in a fixed order. Against the float64 oracle (groups that the key-pair and the
packed-query score kernels take, sequences of several chunks, D not a multiple of 8), and bitwise: 1 vs 2 threads,
AVX-512 vs AVX2 steps, paged vs contiguous caches."""

from __future__ import annotations

import pytest
import torch

from cann_attn.backends.reference import native
from fia_cases import check_fia, make_qkv

pytestmark = pytest.mark.skipif(native.library() is None, reason="needs the native loops")

SCALE = 0.125
# Past two split chunks (DECODE_SPLIT = 512 keys), a partial last tile; a short one; an empty one.
LENGTHS = [1100, 37, 0]


@pytest.fixture
def decode_calls(monkeypatch) -> list[int]:
    from cann_attn.backends.reference import decode_forward

    calls: list[int] = []
    original = decode_forward.forward
    monkeypatch.setattr(decode_forward, "forward", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n, nkv", [(4, 1), (6, 2), (16, 2), (24, 2)], ids=["G4", "G3", "G8", "G12"])
def test_decode_matches_the_oracle(dtype, n, nkv, decode_calls):
    if dtype == torch.float16 and not native.has_f16c():
        pytest.skip("fp16 caches need F16C")
    gen = torch.Generator().manual_seed(n * 10 + nkv)
    q, k, v = make_qkv("BNSD", gen, b=3, n=n, nkv=nkv, sq=1, skv=max(LENGTHS), d=40, dtype=dtype)
    check_fia(q, k, v, num_heads=n, num_key_value_heads=nkv, input_layout="BNSD", scale=SCALE,
              softmax_lse_flag=True, actual_seq_lengths_kv=LENGTHS, backend="reference")
    assert decode_calls, "the decode loop did not run"


def _decode_inputs(group: int, heads_kv: int = 2, dim: int = 40, dtype=torch.bfloat16, seed: int = 0,
                   bf16_query: bool = False):
    """Query rows fp32 and scaled, or (`bf16_query`) bf16 and unscaled (the bf16 dot products' scores)."""
    gen = torch.Generator().manual_seed(seed)
    batch, seq = len(LENGTHS), max(LENGTHS)
    q = torch.randn(batch * heads_kv, group, dim, generator=gen)
    q = q.to(torch.bfloat16) if bf16_query else q * SCALE
    k = torch.randn(batch, heads_kv, seq, dim, generator=gen).to(dtype)
    v = torch.randn(batch, heads_kv, seq, dim, generator=gen).to(dtype)
    return q, k, v, torch.tensor(LENGTHS)


def _decode(q, k, v, lengths, block_table=None):
    pairs, group, _ = q.shape
    out = torch.zeros(pairs, group, v.shape[-1])
    row_max, row_sum = torch.zeros(pairs, group), torch.zeros(pairs, group)
    bf16_query = q.dtype == torch.bfloat16
    native.decode_rows(q, k, v, lengths, out, row_max, row_sum, block_table, scale=SCALE if bf16_query else 1.0)
    return out, row_max, row_sum


def _assert_same(first, second):
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bf16_query", [False, True], ids=["fp32q", "bf16q"])
@pytest.mark.parametrize("group", [3, 4, 8])
def test_decode_does_not_depend_on_the_thread_count(group, bf16_query):
    inputs = _decode_inputs(group, bf16_query=bf16_query)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _decode(*inputs)
        torch.set_num_threads(2)
        two = _decode(*inputs)
    finally:
        torch.set_num_threads(previous)
    _assert_same(one, two)


@pytest.mark.parametrize("group, dim", [(3, 40), (4, 40), (8, 40), (12, 40), (4, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_avx512_steps_give_the_avx2_bits(group, dim, dtype):
    """D 40: partial vectors and column blocks; D 128: whole ones (the two paths of each AVX-512 kernel)."""
    if not native.library().cann_attn_has_avx512():
        pytest.skip("needs AVX-512F")
    if dtype == torch.float16 and not native.has_f16c():
        pytest.skip("fp16 caches need F16C")
    inputs = _decode_inputs(group, dim=dim, dtype=dtype, seed=group)
    _assert_bits_kept_without(inputs, AVX512)


AVX512 = (native.set_avx512, native.AVX512_SWITCH)
BF16_DOT = (native.set_bf16_dot, native.BF16_SWITCH)


def _assert_bits_kept_without(inputs, *switches) -> None:
    """The loop's outputs with the switches (setter, environment variable) off equal those with each restored to its
    setting at load."""
    try:
        for off, _ in switches:
            assert off(False) is False
        without = _decode(*inputs)
    finally:
        for on, variable in switches:
            on(not native._switched_off(variable))
    _assert_same(without, _decode(*inputs))


@pytest.mark.parametrize("emulation", ["avx512", "avx2"])
@pytest.mark.parametrize("group, dim", [(1, 128), (2, 40), (3, 40), (4, 128), (6, 33), (8, 128)])
def test_decode_bf16_dot_products_give_the_emulation_bits(group, dim, emulation):
    """bf16 query rows and keys: the scores from AVX512-BF16 dot products or their emulation (decode_dots.c: 16 lanes,
    or 8 with the AVX2 steps), the same bits through the whole loop (head blocks of 4, 2 and 1; D not whole chunks
    of 32)."""
    if not native.set_bf16_dot(True):
        pytest.skip("no AVX512-BF16 on this CPU")
    inputs = _decode_inputs(group, dim=dim, seed=group, bf16_query=True)
    _assert_bits_kept_without(inputs, BF16_DOT, *([AVX512] if emulation == "avx2" else []))


@pytest.mark.parametrize("bf16_query", [False, True], ids=["fp32q", "bf16q"])
@pytest.mark.parametrize("page", [16, 128])
def test_decode_paged_caches_give_the_contiguous_bits(page, bf16_query):
    """Several chunks of a long sequence through a shuffled block table: the same rows, tiles and chunks."""
    q, k, v, lengths = _decode_inputs(4, seed=page, bf16_query=bf16_query)
    batch, heads_kv, seq, dim = k.shape
    per_seq = -(-seq // page)
    order = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(page))
    table = order.view(batch, per_seq).to(torch.int32)

    def paged(x):
        padded = torch.zeros(batch, heads_kv, per_seq * page, dim, dtype=x.dtype)
        padded[:, :, :seq] = x
        blocks = padded.view(batch, heads_kv, per_seq, page, dim).permute(0, 2, 1, 3, 4)
        blocks = blocks.reshape(-1, heads_kv, page, dim)
        cache = torch.empty_like(blocks)
        cache[order] = blocks
        return cache

    _assert_same(_decode(q, k, v, lengths), _decode(q, paged(k), paged(v), lengths, table))


def _heads_adjacent(x: torch.Tensor) -> torch.Tensor:
    """x [B, N2, S, D] as a BSH cache (a position's kv heads adjacent) seen as [B, N2, S, D]."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _paged_heads_adjacent(x: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, N2, S, D] as a paged BSH cache (blocks [page, N2 * D], shuffled in the pool) seen as [blocks, N2, page,
    D], and its block table."""
    batch, heads_kv, seq, dim = x.shape
    per_seq = -(-seq // page)
    order = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(page))
    padded = torch.zeros(batch, per_seq * page, heads_kv, dim, dtype=x.dtype)
    padded[:, :seq] = x.transpose(1, 2)
    pool = torch.empty(batch * per_seq, page, heads_kv, dim, dtype=x.dtype)
    pool[order] = padded.view(batch * per_seq, page, heads_kv, dim)
    return pool.transpose(1, 2), order.view(batch, per_seq).to(torch.int32)


@pytest.mark.parametrize("group, heads_kv, dim", [(3, 2, 40), (4, 3, 128), (12, 2, 64), (8, 2, 40)])
@pytest.mark.parametrize("dtype, bf16_query", [(torch.bfloat16, False), (torch.float16, False), (torch.bfloat16, True)],
                         ids=["bf16", "fp16", "bf16-bf16q"])
def test_decode_heads_adjacent_caches_give_the_bnsd_bits(group, heads_kv, dim, dtype, bf16_query):
    """BSH and paged BSH caches (a position's kv heads side by side: the loop takes each tile's kv heads at once)
    against BNSD ones (each kv head's tiles in turn): the same sums per head, so the same bits; on 1 and 2 threads,
    with sequences of several chunks, a partial last tile (1100 = 17 x 64 + 12: a block of 8 keys and 4 more) and a
    short one."""
    if dtype == torch.float16 and not native.has_f16c():
        pytest.skip("fp16 caches need F16C")
    q, k, v, lengths = _decode_inputs(group, heads_kv=heads_kv, dim=dim, dtype=dtype, seed=group + dim,
                                      bf16_query=bf16_query)
    want = _decode(q, k, v, lengths)
    (k_paged, table), (v_paged, _) = (_paged_heads_adjacent(x, 128) for x in (k, v))
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            _assert_same(want, _decode(q, _heads_adjacent(k), _heads_adjacent(v), lengths))
            _assert_same(want, _decode(q, k_paged, v_paged, lengths, table))
    finally:
        torch.set_num_threads(previous)


def test_decode_split_combine_matches_one_pass_to_rounding():
    """A sequence of several chunks against the float64 softmax of its own rows: the chunks' combine is exact up
    to fp32 rounding (statistics included)."""
    q, k, v, lengths = _decode_inputs(4, dtype=torch.float32, seed=3)
    out, row_max, row_sum = _decode(q, k, v, lengths)
    heads_kv = k.shape[1]
    for b, n in enumerate(LENGTHS):
        for h in range(heads_kv):
            pair = b * heads_kv + h
            if n == 0:
                assert torch.equal(out[pair], torch.zeros_like(out[pair]))
                continue
            s = q[pair].double() @ k[b, h, :n].double().T
            m = s.amax(-1)
            p = torch.exp(s - m[:, None])
            want = p @ v[b, h, :n].double()
            torch.testing.assert_close(row_max[pair].double(), m, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(row_sum[pair].double(), p.sum(-1), rtol=1e-5, atol=0)
            torch.testing.assert_close(out[pair].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("nz", [False, True], ids=["ND", "NZ"])
def test_mla_paged_decode_reads_latent_and_rope_caches_in_place(nz, monkeypatch):
    """MLA decode over paged caches (a 512-wide latent as key and value, 64-wide rope keys; ND and NZ): the decode
    loop reads both caches in place, joining each key's latent and rope rows, a sequence of two chunks included;
    the same bits as the contiguous call (whose keys are joined before the loop) and the oracle's values."""
    import cann_attn
    from cann_attn.backends.reference import decode_forward
    from cann_attn.testing.fia_oracle import fia_oracle
    from fia_cases import compare, rand
    from test_nz_cache import mla_caches

    ropes: list[bool] = []
    original = decode_forward.forward
    monkeypatch.setattr(decode_forward, "forward",
                        lambda *a, **k: ropes.append(k.get("key_rope") is not None) or original(*a, **k))
    gen = torch.Generator().manual_seed(9)
    lengths, page, heads = [700, 9], 16, 2
    latent, rope, nd, nz_caches, table = mla_caches(lengths, page, gen, torch.bfloat16)
    q, qr = rand((2, 1, heads, 512), torch.bfloat16, gen), rand((2, 1, heads, 64), torch.bfloat16, gen)
    common = dict(query_rope=qr, num_query_heads=heads, num_key_value_heads=1, input_layout="BSND",
                  softmax_scale=0.05)
    if nz:
        k, r = nz_caches["k"], nz_caches["r"]
    else:
        blocks = nd["k"].shape[0]
        k, r = nd["k"].view(blocks, page, 512), nd["r"].view(blocks, page, 64)
    paged, _ = cann_attn.fused_infer_attention_score_v2(q, k, k, key_rope=r, block_table=table, block_size=page,
                                                        actual_seq_kvlen=lengths, **common)
    assert ropes == [True], "the paged MLA decode did not read the rope cache in the loop"
    contiguous, _ = cann_attn.fused_infer_attention_score_v2(q, latent, latent, key_rope=rope,
                                                             actual_seq_kvlen=lengths, **common)
    assert torch.equal(paged, contiguous)
    golden, _ = fia_oracle(q, latent, latent, query_rope=qr, key_rope=rope, num_heads=heads, num_key_value_heads=1,
                           scale=0.05, input_layout="BSND", actual_seq_lengths_kv=lengths)
    compare(paged, golden, torch.bfloat16)
