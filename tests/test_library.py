"""The torch.library custom ops of cann_attn.library: ``torch.library.opcheck`` on every op (schema, autograd
registration, FakeTensor twin, AOT dispatch with dynamic shapes), the fake shape/dtype rules, the Python wrappers
and the (seed, offset) dropout-mask op."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cann_attn
from cann_attn import library
from dsa_utils import SFACase

OPS = torch.ops.cann_attn
F32 = torch.float32


def _rand(gen, *shape, dtype=F32, grad=False):
    t = torch.randn(*shape, generator=gen).to(dtype)
    return t.requires_grad_(grad)


def _qkv(gen, q_shape, kv_shape, grad=True):
    return _rand(gen, *q_shape, grad=grad), _rand(gen, *kv_shape, grad=grad), _rand(gen, *kv_shape, grad=grad)


# ------------------------------------------------------------------------------------------------ opcheck cases
def _fa_bsnd(gen):
    """BSND, GQA 2:1, type-1 pse, drop mask, right-down causal with the compressed mask."""
    b, s, n1, n2, d = 1, 5, 2, 1, 8
    q, k, v = _qkv(gen, (b, s, n1, d), (b, s + 1, n2, d))
    pse = _rand(gen, 1, n1, s, s + 1, grad=True)
    drop = library.dropout_mask(3, 0, b * n1 * s * (s + 1), 0.8)
    kwargs = dict(pse=pse, drop_mask=drop, atten_mask=cann_attn.compressed_mask(3), scale_value=0.35, keep_prob=0.8,
                  sparse_mode=3)
    return OPS.flash_attention_score.default, (q, k, v, n1, "BSND"), kwargs


def _fa_tnd(gen, op=None):
    """TND varlen with left-up causal (mode 2), outputs keep the token count."""
    q, k, v = _qkv(gen, (7, 2, 8), (7, 2, 8))
    kwargs = dict(atten_mask=cann_attn.compressed_mask(2), actual_seq_qlen=[3, 7], actual_seq_kvlen=[3, 7],
                  scale_value=0.35, sparse_mode=2)
    return op or OPS.flash_attention_score.default, (q, k, v, 2, "TND"), kwargs


def _fa_varlen(gen):
    return _fa_tnd(gen, OPS.flash_attention_var_len_score.default)


def _fa_grad(gen, with_pse=True):
    """GradV2 in BSH from the forward's statistics (dpse real with pse, the (0,) placeholder without)."""
    b, s, n, d = 2, 4, 2, 4
    q, k, v = _qkv(gen, (b, s, n * d), (b, s, n * d), grad=False)
    pse = _rand(gen, b, n, s, s) if with_pse else None
    fwd = cann_attn.flash_attention_score(q, k, v, n, "BSH", pse=pse, scale_value=0.5)
    dy = _rand(gen, *fwd.attention_out.shape)
    kwargs = dict(pse=pse, softmax_max=fwd.softmax_max, softmax_sum=fwd.softmax_sum, attention_in=fwd.attention_out,
                  scale_value=0.5)
    return OPS.flash_attention_score_grad.default, (q, k, v, dy, n, "BSH"), kwargs


def _fa_grad_nopse(gen):
    return _fa_grad(gen, with_pse=False)


def _pfa_fp32(gen):
    """BNSD_BSND (output layout differs from the input's) with a band mask, GQA."""
    q, k, v = _qkv(gen, (1, 4, 5, 8), (1, 2, 6, 8), grad=False)
    mask = torch.zeros(5, 6, dtype=torch.bool)
    kwargs = dict(atten_mask=mask, actual_seq_lengths=[4], num_heads=4, scale_value=0.3, next_tokens=1,
                  input_layout="BNSD_BSND", num_key_value_heads=2)
    return OPS.prompt_flash_attention.default, (q, k, v), kwargs


def _pfa_int8(gen):
    """int8 in, float16 out (docs/operators/prompt_flash_attention.md)."""
    q, k, v = (torch.randint(-20, 21, (1, 3, 8), generator=gen, dtype=torch.int8) for _ in range(3))
    one = torch.tensor([0.01], dtype=F32)
    kwargs = dict(deq_scale1=one, quant_scale1=torch.tensor([100.0]), deq_scale2=one, num_heads=2)
    return OPS.prompt_flash_attention.default, (q, k, v), kwargs


def _tqp(gen):
    return OPS.trans_quant_param.default, (torch.rand(4, generator=gen), torch.tensor([1.0, -2.0, 3.0, 0.0])), {}


def _tqp_rounded_broadcast(gen):
    """round_mode 1, and a per-tensor scale with per-channel offsets: the output takes the offsets' shape."""
    return (OPS.trans_quant_param.default, (torch.rand(1, generator=gen), torch.tensor([1.0, -2.0, 3.0, 0.0])),
            {"round_mode": 1})


def _sfa_case(gen, layout):
    if layout == "TND":
        return SFACase("TND", gen=gen, s1=4, s2=6, n1=2, d=8, d_rope=None, k=3)
    return SFACase("BSND", gen=gen, b=1, s1=4, s2=6, n1=2, d=8, d_rope=4, k=3)


def _sfa_args(case, grad):
    i = case.inputs
    tensors = [None if t is None else t.detach().requires_grad_(grad) for t in
               (i["query"], i["key"], i["value"], i["query_rope"], i["key_rope"])]
    kw = dict(case.kw)
    scale = kw.pop("scale_value")
    return tensors, i["sparse_indices"], scale, kw


def _sfa(gen, layout="BSND"):
    (q, k, v, qr, kr), idx, scale, kw = _sfa_args(_sfa_case(gen, layout), True)
    return OPS.sparse_flash_attention.default, (q, k, v, idx, scale), dict(query_rope=qr, key_rope=kr, **kw)


def _sfa_tnd(gen):
    return _sfa(gen, "TND")


def _sfa_grad(gen, layout="BSND"):
    case = _sfa_case(gen, layout)
    fwd = case.forward()
    (q, k, v, qr, kr), idx, scale, kw = _sfa_args(case, False)
    block = kw.pop("sparse_block_size")
    args = (q, k, v, idx, case.d_out, fwd.attention_out, fwd.softmax_max, fwd.softmax_sum, scale, block)
    return OPS.sparse_flash_attention_grad.default, args, dict(query_rope=qr, key_rope=kr, **kw)


def _sfa_grad_tnd(gen):
    return _sfa_grad(gen, "TND")


def _li(gen, return_value=True):
    qi, ki, w = _rand(gen, 2, 5, 2, 8), _rand(gen, 2, 6, 1, 8), _rand(gen, 2, 5, 2)
    kwargs = dict(actual_seq_lengths_query=[5, 4], sparse_count=4, return_value=return_value)
    return OPS.lightning_indexer.default, (qi, ki, w), kwargs


def _li_novalue(gen):
    return _li(gen, return_value=False)


def _sli_kl(gen):
    case = _sfa_case(gen, "BSND")
    fwd = case.forward()
    i = case.inputs
    qi, ki, w = _rand(gen, 1, 4, 2, 8), _rand(gen, 1, 6, 1, 8), _rand(gen, 1, 4, 2)
    args = (i["query"], i["key"], qi, ki, w, i["sparse_indices"], fwd.softmax_max, fwd.softmax_sum,
            case.kw["scale_value"])
    return OPS.sparse_lightning_indexer_grad_kl_loss.default, args, dict(query_rope=i["query_rope"],
                                                                         key_rope=i["key_rope"])


def _count_tokens(gen):
    """The divisor of indexer_kl_loss(reduction="mean") as an op: TND, a sequence whose rows select only -1."""
    qi, ki = _rand(gen, 5, 2, 8), _rand(gen, 7, 1, 8)
    idx = torch.tensor([[0, -1], [1, 0], [-1, -1], [0, 2], [1, -1]], dtype=torch.int32).view(5, 1, 2)
    kwargs = dict(actual_seq_lengths_query=[3, 5], actual_seq_lengths_key=[3, 7])
    return OPS.count_tokens_with_keys.default, (qi, ki, idx, "TND", 3), kwargs


def _dropout(gen):
    return OPS.dropout_mask.default, (torch.tensor([7, 96], dtype=torch.int64), 45, 0.7), {}


def _lanes(t):
    return t.unsqueeze(-1).expand(*t.shape, 8).contiguous()


def _ring_tnd(gen):
    """RingAttentionUpdate, TND with per-sequence statistics and end-of-document padding (lengths [0, 2, 5], T=6)."""
    a, b = _rand(gen, 6, 2, 64), _rand(gen, 6, 2, 64)
    stats = [_lanes(_rand(gen, 6, 2)) for _ in range(4)]
    stats[1], stats[3] = stats[1].abs() + 1, stats[3].abs() + 1
    return (OPS.ring_attention_update.default, (a, stats[0], stats[1], b, stats[2], stats[3]),
            dict(actual_seq_qlen=[0, 2, 5], input_layout="TND"))


def _ring_sbh(gen):
    a, b = _rand(gen, 5, 2, 24).half(), _rand(gen, 5, 2, 24).half()
    stats = [_lanes(_rand(gen, 2, 3, 5)) for _ in range(4)]
    stats[1], stats[3] = stats[1].abs() + 1, stats[3].abs() + 1
    return OPS.ring_attention_update.default, (a, stats[0], stats[1], b, stats[2], stats[3]), {}


def _attention_update(gen, update_type=1):
    lse = [_rand(gen, 6) for _ in range(3)]
    outs = [_rand(gen, 6, 16).to(torch.bfloat16) for _ in range(3)]
    return OPS.attention_update.default, (lse, outs, update_type), {}


CASES = {
    "ring_attention_update_tnd_eod": _ring_tnd,
    "ring_attention_update_sbh": _ring_sbh,
    "attention_update": _attention_update,
    "attention_update_out_only": lambda gen: _attention_update(gen, 0),
    "fa_bsnd_pse_dropout_mode3": _fa_bsnd,
    "fa_tnd_mode2": _fa_tnd,
    "fa_varlen_tnd": _fa_varlen,
    "fa_grad_bsh_pse": _fa_grad,
    "fa_grad_bsh_nopse": _fa_grad_nopse,
    "pfa_fp32_bnsd_bsnd": _pfa_fp32,
    "pfa_int8_fp16_out": _pfa_int8,
    "trans_quant_param": _tqp,
    "trans_quant_param_rounded_broadcast": _tqp_rounded_broadcast,
    "sfa_bsnd_rope": _sfa,
    "sfa_tnd_norope": _sfa_tnd,
    "sfa_grad_bsnd_rope": _sfa_grad,
    "sfa_grad_tnd_norope": _sfa_grad_tnd,
    "lightning_indexer_values": _li,
    "lightning_indexer": _li_novalue,
    "sli_kl_loss": _sli_kl,
    "dropout_mask": _dropout,
    "count_tokens_with_keys": _count_tokens,
}


def test_count_tokens_is_float32_whatever_the_default_dtype(rng):
    """The op's fake promises a float32 0-d tensor; eager must agree also under a float64 default dtype (common in
    gradcheck set-ups)."""
    op, args, kwargs = _count_tokens(rng)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert op(*args, **kwargs).dtype == torch.float32
    finally:
        torch.set_default_dtype(previous)


def test_operators_accept_inputs_that_require_grad(rng):
    """The operators are not differentiable themselves (the autograd layer pairs them): given inputs that require
    grad, they compute as usual and return plain tensors (no in-place-into-out= error from a kernel)."""
    case = SFACase("BSND", gen=rng, b=1, s1=5, s2=12, k=3, n1=4, d=16, style="random")
    i = {k: v.detach().clone().requires_grad_() if v is not None and v.is_floating_point() else v
         for k, v in case.inputs.items()}
    kw = {k: v for k, v in case.kw.items() if k != "scale_value"}
    scale = case.kw["scale_value"]
    fwd = cann_attn.sparse_flash_attention(i["query"], i["key"], i["value"], i["sparse_indices"], scale,
                                           query_rope=i["query_rope"], key_rope=i["key_rope"], **kw)
    grads = cann_attn.sparse_flash_attention_grad(
        i["query"], i["key"], i["value"], i["sparse_indices"], case.d_out, fwd.attention_out, fwd.softmax_max,
        fwd.softmax_sum, scale, query_rope=i["query_rope"], key_rope=i["key_rope"], **kw)
    qi, ki, w = _rand(rng, 1, 5, 2, 8, grad=True), _rand(rng, 1, 12, 1, 8, grad=True), _rand(rng, 1, 5, 2, grad=True)
    li = cann_attn.lightning_indexer(qi, ki, w, sparse_count=3, return_value=True)
    kl = cann_attn.sparse_lightning_indexer_grad_kl_loss(
        i["query"], i["key"], qi, ki, w, li.sparse_indices, fwd.softmax_max, fwd.softmax_sum, scale,
        query_rope=i["query_rope"], key_rope=i["key_rope"])
    for result in (fwd, grads, li, kl):
        assert not any(t.requires_grad for t in result if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("case", list(CASES))
def test_opcheck(case, rng):
    """All four opcheck utilities (schema, autograd registration, FakeTensor, AOT dispatch with dynamic shapes)."""
    op, args, kwargs = CASES[case](rng)
    result = torch.library.opcheck(op, args, kwargs)
    assert all(v == "SUCCESS" for v in result.values()), result


def test_every_operator_is_registered():
    expected = {"flash_attention_score", "flash_attention_var_len_score", "flash_attention_score_grad",
                "prompt_flash_attention", "trans_quant_param", "sparse_flash_attention", "sparse_flash_attention_grad",
                "lightning_indexer", "sparse_lightning_indexer_grad_kl_loss", "dropout_mask",
                "count_tokens_with_keys", "ring_attention_update", "attention_update"}
    tested = {CASES[c](torch.Generator().manual_seed(0))[0].name().split("::")[1].split(".")[0] for c in CASES}
    assert expected <= tested
    for name in expected:
        assert hasattr(OPS, name), name


# ----------------------------------------------------------------------------------------- fake shape rules
def test_fake_shapes_and_dtypes():
    with FakeTensorMode():
        q, k, v = torch.empty(9, 4, 16), torch.empty(9, 2, 16), torch.empty(9, 2, 8)
        out, smax, ssum, soft = OPS.flash_attention_score(q, k, v, 4, "TND", actual_seq_qlen=[4, 9],
                                                          actual_seq_kvlen=[4, 9])
        assert out.shape == (9, 4, 8) and smax.shape == (9, 4, 8) and ssum.dtype == F32 and soft.shape == (0,)
        q, k, v = torch.empty(2, 5, 32), torch.empty(2, 7, 16), torch.empty(2, 7, 8)  # BSH, N1=4, N2=2, Dv=4
        out, smax, _, _ = OPS.flash_attention_score(q, k, v, 4, "BSH")
        assert out.shape == (2, 5, 16) and smax.shape == (2, 4, 5, 8)
        out, smax, _, _ = OPS.flash_attention_score(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), 4, "SBH")
        assert out.shape == (5, 2, 16) and smax.shape == (2, 4, 5, 8)
        dq, dk, dv, dpse, dsink = OPS.flash_attention_score_grad(q, k, v, torch.empty(2, 5, 16), 4, "BSH")
        assert dsink.shape == (0,)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and dpse.shape == (0,)
        i8 = torch.empty(1, 3, 8, dtype=torch.int8)
        one = torch.empty(1)
        assert OPS.prompt_flash_attention(i8, i8, i8, num_heads=2).dtype == torch.float16
        assert OPS.prompt_flash_attention(i8, i8, i8, quant_scale2=one, num_heads=2).dtype == torch.int8
        h = torch.empty(1, 3, 8, dtype=torch.float16)
        assert OPS.prompt_flash_attention(h, h, h, quant_scale2=one, num_heads=2).dtype == torch.int8
        assert OPS.prompt_flash_attention(h, h, h, num_heads=2).dtype == torch.float16
        q4 = torch.empty(1, 2, 5, 8)
        assert OPS.prompt_flash_attention(q4, q4, q4, num_heads=2, input_layout="BNSD_BSND").shape == (1, 5, 2, 8)
        out, smax, _ = OPS.sparse_flash_attention(torch.empty(6, 4, 8), torch.empty(7, 1, 8), torch.empty(7, 1, 8),
                                                  torch.empty(6, 1, 3, dtype=torch.int32), 0.1, layout="TND",
                                                  actual_seq_lengths_query=[6], actual_seq_lengths_kv=[7])
        assert out.shape == (6, 4, 8) and smax.shape == (1, 6, 4)
        idx, values = OPS.lightning_indexer(torch.empty(6, 4, 8), torch.empty(7, 1, 8), torch.empty(6, 4),
                                            layout="TND", sparse_count=5)
        assert idx.shape == (6, 1, 5) and idx.dtype == torch.int32 and values.shape == (0,)
        assert OPS.dropout_mask(torch.zeros(2, dtype=torch.int64), 17, 0.5).shape == (3,)


# ----------------------------------------------------------------------------------------------- wrappers
def test_wrappers_match_eager_ops_and_map_placeholders(rng):
    q, k, v = _qkv(rng, (7, 2, 8), (7, 2, 8), grad=False)
    lens = dict(actual_seq_qlen=torch.tensor([3, 7]), actual_seq_kvlen=torch.tensor([3, 7]))  # tensors -> lists
    eager = cann_attn.flash_attention_score(q, k, v, 2, "TND", scale_value=0.3, **lens)
    wrapped = library.flash_attention_score(q, k, v, 2, "TND", scale_value=0.3, **lens)
    for a, b in zip(eager, wrapped, strict=True):
        assert torch.equal(a, b)
    varlen = library.flash_attention_var_len_score(q, k, v, 2, scale_value=0.3, **lens)
    assert torch.equal(varlen.attention_out, eager.attention_out)
    grads = library.flash_attention_score_grad(q, k, v, torch.ones_like(q), 2, "TND", scale_value=0.3, **lens)
    assert grads.dpse is None
    assert torch.equal(grads.dq, cann_attn.flash_attention_score_grad(q, k, v, torch.ones_like(q), 2, "TND",
                                                                       scale_value=0.3, **lens).dq)

    case = _sfa_case(rng, "TND")
    (sq, sk, sv, _, _), idx, scale, kw = _sfa_args(case, False)
    fwd = library.sparse_flash_attention(sq, sk, sv, idx, scale, **kw)
    assert torch.equal(fwd.attention_out, case.forward().attention_out)
    g = library.sparse_flash_attention_grad(sq, sk, sv, idx, case.d_out, *fwd, scale, **kw)
    assert g.d_query_rope is None and g.d_key_rope is None
    assert torch.equal(g.d_query, case.grad().d_query)

    qi, ki, w = _rand(rng, 6, 2, 8), _rand(rng, 7, 1, 8), _rand(rng, 6, 2)
    li = library.lightning_indexer(qi, ki, w, actual_seq_lengths_query=torch.tensor([6]),
                                   actual_seq_lengths_key=torch.tensor([7]), layout="TND", sparse_count=3)
    assert li.sparse_values is None
    assert torch.equal(li.sparse_indices, cann_attn.lightning_indexer(qi, ki, w, actual_seq_lengths_query=[6],
                                                                       actual_seq_lengths_key=[7], layout="TND",
                                                                       sparse_count=3).sparse_indices)
    scale_t = torch.tensor([0.5, 2.0])
    assert torch.equal(library.trans_quant_param(scale_t), cann_attn.trans_quant_param(scale_t))
    assert torch.equal(library.trans_quant_param(0.25), cann_attn.trans_quant_param(torch.tensor(0.25)))


def test_autograd_through_the_op_matches_the_differentiable_layer(rng):
    """Gradients of the custom op (q, k, v and a type-1 pse) equal cann_attn.flash_attention's."""
    q, k, v = _qkv(rng, (1, 6, 2, 8), (1, 6, 2, 8))
    pse = _rand(rng, 1, 2, 6, 6, grad=True)
    kw = dict(pse=pse, atten_mask=cann_attn.compressed_mask(3), sparse_mode=3, scale_value=0.4)
    dy = _rand(rng, 1, 6, 2, 8)
    library.flash_attention_score(q, k, v, 2, "BSND", **kw).attention_out.backward(dy)
    ours = [t.grad.clone() for t in (q, k, v, pse)]
    for t in (q, k, v, pse):
        t.grad = None
    cann_attn.flash_attention(q, k, v, 2, "BSND", **kw).backward(dy)
    for a, t in zip(ours, (q, k, v, pse), strict=True):
        assert torch.equal(a, t.grad)


# ------------------------------------------------------------------------------------------ dropout masks
def test_mix_seed_formula():
    assert library.mix_seed(0, 0) == 0
    # splitmix64 of the golden-ratio increment: the first output of splitmix64 seeded with 0
    assert library.mix_seed(1, 0) == 0xE220A8397B1DCDAF
    assert library.mix_seed(1, 1) != library.mix_seed(1, 0) != library.mix_seed(2, 0)
    assert 0 <= library.mix_seed(-5, 2**70) < 2**64


def test_dropout_mask_is_reproducible_from_seed_and_offset():
    numel = 1000
    a = library.dropout_mask(11, 4096, numel, 0.75)
    b = library.dropout_mask(torch.tensor(11), torch.tensor(4096), numel, 0.75)
    gen = torch.Generator().manual_seed(library.mix_seed(11, 4096))
    assert torch.equal(a, b) and torch.equal(a, cann_attn.gen_drop_mask(numel, 0.75, generator=gen))
    assert a.shape == (125,) and a.dtype == torch.uint8
    assert not torch.equal(a, library.dropout_mask(11, 4096 + numel, numel, 0.75))
    kept = torch.tensor([(int(x) >> i) & 1 for x in a.tolist() for i in range(8)]).float().mean()
    assert 0.65 < float(kept) < 0.85
