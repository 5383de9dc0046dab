"""float16 / bfloat16 NZ paged caches [block_num, KV_N, D/16, block_size, 16] in FusedInferAttentionScore's MLA
(docs/semantics/paged-kv.md, "NZ caches"; the MLA constraints of the npu_fused_infer_attention_score(_v2) pages:
"当数据格式为NZ时，若数据类型为float16或bfloat16，输入参数key和value的格式为[blockNum, KV_N, D/16, blockSize, 16]").

The caches are built the callers' way: an ND buffer [block_num, block_size, 1, D] that an NZ scatter op fills,
element (block, slot, head, channel) at [block, head, channel // 16, slot, channel % 16] of its 5-D view, and that
view handed to FIA as key, value and (64 wide) key_rope:

* cann-recipes-infer models/deepseek_r1/models/modeling_deepseek.py:1176-1180 (``KV_CACHE_NZ_DIM = 16``,
  ``k_nope.view(block_num, 1, kv_lora_rank // 16, block_size, 16)``, the same for k_rope) and :1188-1203 (FIA v2,
  ``input_layout="TND_NTD"``, sparse_mode 3 with the mask when q_len > 1 (MTP), else 0);
* cann-recipes-infer models/kimi_k3/models/modeling_kimi_k3.py:2141-2146 (``_nz_cache_views``) and :2104-2120;
* vllm-ascend vllm_ascend/attention/mla_v1.py:1400-1407 (``enable_kv_nz``: ``k_nope.view(-1, num_kv_heads,
  kv_lora_rank // 16, block_size, 16)``) with ``input_layout="BSND_NBSD"`` (:1468) or ``"TND_NTD"`` (:1426), FIA v2
  called as ``(q_nope, k_nope, k_nope, query_rope=q_pe, key_rope=k_pe, ...)`` (:1573).

Every result is bit for bit the same call over the ND cache and over contiguous keys, and close to the float64
oracle (cann_attn.testing.fia_oracle, written from the FIA pages).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cann_attn
from cann_attn import ParamInvalidError
from cann_attn.problem.nz import from_nz, nz_tokens, to_nz
from cann_attn.testing.fia_oracle import fia_oracle
from fia_cases import compare, rand
from paged_utils import paginate

pytestmark = pytest.mark.usefixtures("single_thread")

LATENT, ROPE, NZ = 512, 64, 16


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    monkeypatch.setenv("CANN_ATTN_BACKEND", "reference")


def scatter_nz(buffer: torch.Tensor, block: int, slot: int, token: torch.Tensor) -> None:
    """Write one token [1, D] into an ND buffer [block_num, block_size, 1, D] the way an NZ scatter op does: channel
    d at [block, 0, d // 16, slot, d % 16] of the buffer's 5-D view (the recipes' `.view(...)`)."""
    block_num, block_size, heads, dim = buffer.shape
    view = buffer.view(block_num, heads, dim // NZ, block_size, NZ)
    channels = torch.arange(dim)
    view[block, 0, channels // NZ, slot, channels % NZ] = token[0, channels]


def mla_caches(lengths, page, gen, dtype):
    """(latent [B, S, 1, 512], rope [B, S, 1, 64], ND caches, NZ views, table): the per-sequence keys scattered over
    shuffled blocks (NaN elsewhere), once as ND [block_num, block_size, 1, D] and once in NZ order."""
    s = max(lengths) + 3
    latent, rope = rand((len(lengths), s, 1, LATENT), dtype, gen), rand((len(lengths), s, 1, ROPE), dtype, gen)
    per_seq = {"k": [latent[b, : lengths[b]] for b in range(len(lengths))],
               "r": [rope[b, : lengths[b]] for b in range(len(lengths))]}
    nd, table = paginate(per_seq, page, gen)
    nz = {}
    for name, cache in nd.items():
        buffer = torch.full_like(cache, float("nan"))
        for block in range(cache.shape[0]):
            for slot in range(page):
                scatter_nz(buffer, block, slot, cache[block, slot])
        block_num, _, heads, dim = cache.shape
        nz[name] = buffer.view(block_num, heads, dim // NZ, page, NZ)
    return latent, rope, nd, nz, table


def test_nz_rule_is_the_callers_view():
    """problem/nz.py's element rule is the recipes' view: to_nz writes what the scatter writes; from_nz inverts."""
    g = torch.Generator().manual_seed(1)
    nd = rand((3, 16, 2, 64), torch.bfloat16, g)
    buffer = torch.zeros_like(nd)
    for block in range(3):
        for slot in range(16):
            for head in range(2):
                view = buffer.view(3, 2, 64 // NZ, 16, NZ)
                view[block, head, :, slot, :] = nd[block, slot, head].view(64 // NZ, NZ)
    assert torch.equal(to_nz(nd), buffer.view(3, 2, 4, 16, NZ))
    assert torch.equal(from_nz(to_nz(nd)), nd)
    assert torch.equal(nz_tokens(to_nz(nd)).flatten(-2), nd)
    assert to_nz(rand((2, 32, 1, 64), torch.int8, g)).shape == (2, 1, 2, 32, 32)  # int8: c0 = 32


CASES = {
    # (input_layout, query lengths per sequence, sparse_mode)
    "deepseek_r1 TND_NTD decode": ("TND_NTD", [1, 1, 1], 0),
    "deepseek_r1 TND_NTD MTP": ("TND_NTD", [2, 2, 2], 3),
    "vllm-ascend BSND_NBSD decode": ("BSND_NBSD", [1, 1, 1], 0),
    "BNSD_NBSD decode": ("BNSD_NBSD", [1, 1, 1], 0),
    "BSND decode": ("BSND", [1, 1, 1], 0),
    "BSH_NBSD decode": ("BSH_NBSD", [1, 1, 1], 0),
    "TND prefill chunk": ("TND", [3, 1, 4], 3),
}


def _query(layout, q_lens, heads, dim, dtype, gen):
    """The query in `layout` ([T, N, D] packed, else [B, S, N, D] / [B, N, S, D] with S = q_lens[0])."""
    if layout.startswith("TND"):
        return rand((sum(q_lens), heads, dim), dtype, gen)
    q = rand((len(q_lens), q_lens[0], heads, dim), dtype, gen)
    if layout.startswith("BSH"):
        return q.flatten(2)
    return q.transpose(1, 2).contiguous() if layout.startswith("BNSD") else q


def _contiguous_keys(t: torch.Tensor, layout: str, lengths):
    """[B, S, 1, D] keys in the query's layout family (TND: the sequences' first lengths[b] tokens packed)."""
    if layout.startswith("TND"):
        return torch.cat([t[b, : lengths[b]] for b in range(len(lengths))])
    if layout.startswith("BSH"):
        return t.flatten(2)
    return t.transpose(1, 2).contiguous() if layout.startswith("BNSD") else t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_mla_over_nz_equals_nd_contiguous_and_oracle(name, dtype):
    layout, q_lens, sparse_mode = CASES[name]
    g = torch.Generator().manual_seed(len(name))
    lengths, page, heads = [40, 17, 33], 16, 4
    latent, rope, nd, nz, table = mla_caches(lengths, page, g, dtype)
    query, query_rope = _query(layout, q_lens, heads, LATENT, dtype, g), _query(layout, q_lens, heads, ROPE, dtype, g)
    packed = layout.startswith("TND")
    common = dict(query_rope=query_rope, num_query_heads=heads, num_key_value_heads=1, input_layout=layout,
                  softmax_scale=0.05, sparse_mode=sparse_mode)
    if sparse_mode == 3:
        common["atten_mask"] = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)
    if packed:
        common["actual_seq_qlen"] = torch.tensor(q_lens).cumsum(0).tolist()
    paged = dict(block_table=table, block_size=page, actual_seq_kvlen=lengths)
    block_num = nd["k"].shape[0]
    over_nz = cann_attn.fused_infer_attention_score_v2(query, nz["k"], nz["k"], key_rope=nz["r"], **common, **paged)
    over_nd = cann_attn.fused_infer_attention_score_v2(
        query, nd["k"].view(block_num, page, LATENT), nd["k"].view(block_num, page, LATENT),
        key_rope=nd["r"].view(block_num, page, ROPE), **common, **paged)
    kv_lens = torch.tensor(lengths).cumsum(0).tolist() if packed else lengths
    k, r = _contiguous_keys(latent, layout, lengths), _contiguous_keys(rope, layout, lengths)
    contiguous = cann_attn.fused_infer_attention_score_v2(query, k, k, key_rope=r, actual_seq_kvlen=kv_lens,
                                                          **common)
    assert torch.equal(over_nz[0], over_nd[0]), "NZ cache != ND cache"
    assert torch.equal(over_nz[0], contiguous[0]), "paged != contiguous"
    golden, _ = fia_oracle(query, k, k, query_rope=query_rope, key_rope=r, num_heads=heads, num_key_value_heads=1,
                           scale=0.05, input_layout=layout, sparse_mode=sparse_mode,
                           atten_mask=common.get("atten_mask"), actual_seq_lengths=common.get("actual_seq_qlen"),
                           actual_seq_lengths_kv=kv_lens)
    compare(over_nz[0], golden, dtype)


def test_v1_and_torch_npu_take_the_nz_cache():
    """FIA v1 (and its torch_npu spelling) over the same NZ views: the v2 result bit for bit."""
    import cann_attn.torch_npu as torch_npu

    g = torch.Generator().manual_seed(5)
    lengths, page, heads = [20, 9], 16, 2
    _, _, _, nz, table = mla_caches(lengths, page, g, torch.bfloat16)
    q, qr = rand((2, 1, heads, LATENT), torch.bfloat16, g), rand((2, 1, heads, ROPE), torch.bfloat16, g)
    v2, _ = cann_attn.fused_infer_attention_score_v2(
        q, nz["k"], nz["k"], query_rope=qr, key_rope=nz["r"], num_query_heads=heads, num_key_value_heads=1,
        input_layout="BSND", softmax_scale=0.1, block_table=table, block_size=page, actual_seq_kvlen=lengths)
    v1, _ = cann_attn.fused_infer_attention_score(
        q, nz["k"], nz["k"], query_rope=qr, key_rope=nz["r"], num_heads=heads, num_key_value_heads=1,
        input_layout="BSND", scale=0.1, block_table=table, block_size=page, actual_seq_lengths_kv=lengths)
    shim, _ = torch_npu.npu_fused_infer_attention_score(
        q, nz["k"], nz["k"], query_rope=qr, key_rope=nz["r"], num_heads=heads, num_key_value_heads=1,
        input_layout="BSND", scale=0.1, block_table=table, block_size=page, actual_seq_lengths_kv=lengths)
    assert torch.equal(v1, v2) and torch.equal(shim, v2)


def test_custom_op_over_nz_caches_passes_opcheck():
    """The custom op over NZ caches: schema, FakeTensor (the fake's D is D/16 x 16, not the chunk width: the fake
    gave 16 before), AOT dispatch with dynamic shapes."""
    g = torch.Generator().manual_seed(6)
    _, _, _, nz, table = mla_caches([20, 9], 16, g, torch.bfloat16)
    q, qr = rand((2, 1, 4, LATENT), torch.bfloat16, g), rand((2, 1, 4, ROPE), torch.bfloat16, g)
    kw = dict(num_query_heads=4, num_key_value_heads=1, input_layout="BSND_NBSD", softmax_scale=0.05,
              block_table=table, block_size=16, actual_seq_kvlen=[20, 9])
    op = torch.ops.cann_attn.fused_infer_attention_score_v2.default
    result = torch.library.opcheck(op, (q, nz["k"], nz["k"], qr, nz["r"]), kw)
    assert set(result.values()) == {"SUCCESS"}, result
    assert op(q, nz["k"], nz["k"], qr, nz["r"], **kw)[0].shape == (4, 2, 1, LATENT)


def _nz_call(key, value, key_rope, *, query_dim=LATENT, rope=True, layout="BSND"):
    q = torch.zeros(1, 1, 2, query_dim, dtype=torch.bfloat16)
    extra = dict(query_rope=torch.zeros(1, 1, 2, ROPE, dtype=torch.bfloat16), key_rope=key_rope) if rope else {}
    return lambda: cann_attn.fused_infer_attention_score_v2(
        q, key, value, num_query_heads=2, num_key_value_heads=1, input_layout=layout, block_size=16,
        block_table=torch.zeros(1, 1, dtype=torch.int32), actual_seq_kvlen=[3], **extra)


def _nz(dim, dtype=torch.bfloat16, c0=NZ, blocks=2):
    return torch.zeros(blocks, 1, dim // c0, 16, c0, dtype=dtype)


BAD = {
    "key chunk of 32 in bf16": (_nz_call(_nz(LATENT, c0=32), _nz(LATENT, c0=32), _nz(ROPE)), "key: an NZ cache"),
    "value not NZ": (_nz_call(_nz(LATENT), torch.zeros(2, 16, LATENT, dtype=torch.bfloat16), _nz(ROPE)), "value"),
    "value of other blocks": (_nz_call(_nz(LATENT), _nz(LATENT, blocks=3), _nz(ROPE)), "value"),
    "key_rope ND beside NZ key": (_nz_call(_nz(LATENT), _nz(LATENT), torch.zeros(2, 16, ROPE,
                                                                                 dtype=torch.bfloat16)), "key_rope"),
    "key_rope 32 wide": (_nz_call(_nz(LATENT), _nz(LATENT), _nz(32)), "key_rope"),
    "no rope": (_nz_call(_nz(LATENT), _nz(LATENT), None, rope=False), "key: a torch.bfloat16 NZ cache"),
    "D 128 NZ": (_nz_call(_nz(128), _nz(128), _nz(ROPE), query_dim=128), "key: a torch.bfloat16 NZ cache"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_nz_caches_name_the_parameter(name):
    call, message = BAD[name]
    with pytest.raises(ParamInvalidError, match=message):
        call()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=3), page=st.sampled_from([16, 32, 48]),
       heads=st.sampled_from([1, 2, 8]), layout=st.sampled_from(["TND_NTD", "BSND_NBSD", "BNSD_NBSD", "BSH"]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]), seed=st.integers(0, 2**16))
def test_nz_equals_nd_hypothesis(lengths, page, heads, layout, dtype, seed):
    """Any documented block size (a multiple of 16), sequences without keys, head counts and layouts: bit for bit."""
    g = torch.Generator().manual_seed(seed)
    _, _, nd, nz, table = mla_caches(lengths, page, g, dtype)
    q_lens = [1] * len(lengths)
    query, query_rope = _query(layout, q_lens, heads, LATENT, dtype, g), _query(layout, q_lens, heads, ROPE, dtype, g)
    kw = dict(query_rope=query_rope, num_query_heads=heads, num_key_value_heads=1, input_layout=layout,
              softmax_scale=0.05, block_table=table, block_size=page, actual_seq_kvlen=lengths, return_softmax_lse=True)
    if layout.startswith("TND"):
        kw["actual_seq_qlen"] = list(range(1, len(lengths) + 1))
    block_num = nd["k"].shape[0]
    over_nz = cann_attn.fused_infer_attention_score_v2(query, nz["k"], nz["k"], key_rope=nz["r"], **kw)
    over_nd = cann_attn.fused_infer_attention_score_v2(
        query, nd["k"].view(block_num, page, LATENT), nd["k"].view(block_num, page, LATENT),
        key_rope=nd["r"].view(block_num, page, ROPE), **kw)
    assert torch.equal(over_nz[0], over_nd[0]) and torch.equal(over_nz[1], over_nd[1])
