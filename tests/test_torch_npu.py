"""``import cann_attn.torch_npu as torch_npu`` runs Ascend code: a small MindSpeed-style attention module written
against torch_npu names (BSH and TND, causal sparse_mode 2/3 with the compressed mask, dropout from a fixed
manual_seed) matches the float64 oracle forward and backward, and gives the same outputs and gradients under
``torch.compile(fullgraph=True)`` (backend "aot_eager": AOTAutograd traces the forward and backward graphs through
the custom ops' fake twins and autograd registrations; inductor is left out for CPU test time)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import cann_attn
import cann_attn.torch_npu as torch_npu
from cann_attn import library
from cann_attn.testing.oracle import fa_forward_oracle
from cann_attn.testing.precision import assert_close_to_oracle
from dsa_utils import SFACase

F32, F64 = torch.float32, torch.float64
HIDDEN, HEADS = 16, 2
SEQ_LENS = [5, 3]  # TND sequences


class MindSpeedSelfAttention(nn.Module):
    """Shaped like MindSpeed's flash self-attention: QKV projection, torch_npu.npu_fusion_attention with the
    2048x2048 compressed causal mask, output projection. BSH input [B, S, H]; TND input [T, H] plus cumulative
    sequence ends."""

    def __init__(self, layout: str, sparse_mode: int, keep_prob: float, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.layout, self.sparse_mode, self.keep_prob = layout, sparse_mode, keep_prob
        self.head_dim = HIDDEN // HEADS
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.dense = nn.Linear(HIDDEN, HIDDEN, bias=False)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.randn(3 * HIDDEN, HIDDEN, generator=gen) * 0.5)
            self.dense.weight.copy_(torch.randn(HIDDEN, HIDDEN, generator=gen) * 0.5)
        self.atten_mask = cann_attn.compressed_mask(sparse_mode)

    def split_qkv(self, x: torch.Tensor, w_qkv: torch.Tensor):
        q, k, v = torch.nn.functional.linear(x, w_qkv).chunk(3, dim=-1)
        if self.layout == "TND":  # [T, H] -> [T, N, D]
            q, k, v = (t.reshape(t.shape[0], HEADS, self.head_dim) for t in (q, k, v))
        return q, k, v

    def forward(self, x: torch.Tensor, actual_seq_qlen=None, actual_seq_kvlen=None) -> torch.Tensor:
        q, k, v = self.split_qkv(x, self.qkv.weight)
        out = torch_npu.npu_fusion_attention(
            q, k, v, HEADS, self.layout, pse=None, padding_mask=None, atten_mask=self.atten_mask, scale=self.scale,
            pre_tockens=65536, next_tockens=0, keep_prob=self.keep_prob, inner_precise=0,
            sparse_mode=self.sparse_mode, actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen,
        )[0]
        if self.layout == "TND":
            out = out.reshape(out.shape[0], HIDDEN)
        return self.dense(out)

    def oracle(self, x: torch.Tensor, drop_mask=None, actual_seq_qlen=None, actual_seq_kvlen=None):
        """The same computation in float64 with the oracle's attention; returns (y, leaves) for autograd."""
        leaves = [t.detach().to(F64).requires_grad_() for t in (x, self.qkv.weight, self.dense.weight)]
        x64, w_qkv, w_dense = leaves
        q, k, v = self.split_qkv(x64, w_qkv)
        out = fa_forward_oracle(q, k, v, HEADS, self.layout, atten_mask=self.atten_mask, scale_value=self.scale,
                                keep_prob=self.keep_prob, drop_mask=drop_mask, sparse_mode=self.sparse_mode,
                                actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen)[0]
        if self.layout == "TND":
            out = out.reshape(out.shape[0], HIDDEN)
        return torch.nn.functional.linear(out, w_dense), leaves


def _inputs(layout: str, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    if layout == "TND":
        ends = [sum(SEQ_LENS[: i + 1]) for i in range(len(SEQ_LENS))]
        return torch.randn(ends[-1], HIDDEN, generator=gen), {"actual_seq_qlen": ends, "actual_seq_kvlen": ends}
    return torch.randn(2, 6, HIDDEN, generator=gen), {}


def _numels(layout: str, x: torch.Tensor) -> int:
    if layout == "TND":
        return HEADS * sum(n * n for n in SEQ_LENS)
    return x.shape[0] * HEADS * x.shape[1] ** 2


def _run(module, x, lens, dy, seed=1234):
    """Forward + backward from a fresh manual_seed; returns (y, d_x, d_w_qkv, d_w_dense)."""
    torch_npu.manual_seed(seed)
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = module(x, **lens)
    y.backward(dy)
    return y.detach(), x.grad, module.qkv.weight.grad, module.dense.weight.grad


MODULE_CASES = [("BSH", 2), ("BSH", 3), ("TND", 2), ("TND", 3)]


@pytest.mark.parametrize("keep_prob", [1.0, 0.9])
@pytest.mark.parametrize(("layout", "mode"), MODULE_CASES)
def test_module_matches_oracle(layout, mode, keep_prob):
    """Forward and gradients vs autograd through the float64 oracle; with dropout the oracle gets the keep mask
    regenerated from (seed=1234, offset=0), the generator state of the first call after manual_seed(1234)."""
    module = MindSpeedSelfAttention(layout, mode, keep_prob)
    x, lens = _inputs(layout)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    y, *grads = _run(module, x, lens, dy)
    drop_mask = None
    if keep_prob < 1:
        numels = _numels(layout, x)
        assert torch_npu.get_rng_state().tolist() == [1234, numels]  # offset advanced by numels
        drop_mask = library.dropout_mask(1234, 0, numels, keep_prob)
    golden, leaves = module.oracle(x, drop_mask, **lens)
    golden.backward(dy.to(F64))
    assert_close_to_oracle(y, golden.detach(), dtype=F32, name="y")
    for name, actual, leaf in zip(("d_x", "d_w_qkv", "d_w_dense"), grads, leaves, strict=True):
        assert_close_to_oracle(actual, leaf.grad, dtype=F32, name=name)


@pytest.mark.parametrize(("layout", "mode"), [("BSH", 2), ("TND", 3)])
def test_module_under_torch_compile(layout, mode):
    """fullgraph=True (no graph break) gives the same output and gradients as eager, dropout included (the manual
    seed is reset before each run), and advances the generator the same way."""
    module = MindSpeedSelfAttention(layout, mode, keep_prob=0.9)
    x, lens = _inputs(layout)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    eager = _run(module, x, lens, dy)
    eager_state = torch_npu.get_rng_state()
    compiled_module = torch.compile(module, fullgraph=True, backend="aot_eager")
    for _ in range(2):  # the second run reuses the compiled graphs
        compiled = _run(compiled_module, x, lens, dy)
        assert torch.equal(torch_npu.get_rng_state(), eager_state)
        for a, b in zip(eager, compiled, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_tnd_trailing_zero_lengths_leave_batches_out():
    """torch_npu's documented form for batches left out at the end of a TND call: lengths [2, 3, 4] plus two
    batches out are passed as [2, 5, 9, 0, 0]. Forward (dropout included), statistics and gradients equal the
    empty-sequence form [2, 5, 9, 9, 9]."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(9, 2, 8, generator=gen).requires_grad_() for _ in range(3))
    dy = torch.randn(9, 2, 8, generator=gen)
    results = []
    for q_ends, kv_ends in (([2, 5, 9, 0, 0], [2, 5, 9, 0, 0]), ([2, 5, 9, 9, 9], [2, 5, 9, 9, 9])):
        torch_npu.manual_seed(5)
        out, smax, ssum, _, seed, offset, numels = torch_npu.npu_fusion_attention(
            q, k, v, 2, "TND", scale=0.3, keep_prob=0.8, actual_seq_qlen=q_ends, actual_seq_kvlen=kv_ends,
            sparse_mode=0)
        grads = torch_npu.npu_fusion_attention_grad(
            q, k, v, dy, 2, "TND", softmax_max=smax, softmax_sum=ssum, attention_in=out.detach(), scale_value=0.3,
            keep_prob=0.8, actual_seq_qlen=q_ends, actual_seq_kvlen=kv_ends, seed=seed, offset=offset,
            numels=numels)
        results.append((out.detach(), smax, ssum, numels, *grads[:3]))
    assert results[0][3] == results[1][3] == 2 * (2 * 2 + 3 * 3 + 4 * 4)
    for a, b in zip(*results, strict=True):
        assert a == b if isinstance(a, int) else torch.equal(a, b)


def _attention_inputs(layout: str, gen: torch.Generator):
    if layout == "TND":
        shape, lens = (8, 2, 8), {"actual_seq_qlen": [5, 8], "actual_seq_kvlen": [5, 8]}
    else:
        shape, lens = (2, 6, 16), {}
    q, k, v = (torch.randn(shape, generator=gen).requires_grad_() for _ in range(3))
    return q, k, v, lens


@pytest.mark.parametrize(("layout", "mode"), [("BSH", 2), ("TND", 3)])
def test_dropout_grads_equal_the_grad_op_with_the_regenerated_mask(layout, mode):
    """Autograd of npu_fusion_attention, npu_fusion_attention_grad(seed, offset, numels) and
    cann_attn.flash_attention_score_grad given the regenerated keep mask agree exactly."""
    gen = torch.Generator().manual_seed(4)
    q, k, v, lens = _attention_inputs(layout, gen)
    common = dict(atten_mask=cann_attn.compressed_mask(mode), sparse_mode=mode, keep_prob=0.9, **lens)
    torch_npu.manual_seed(77)
    torch_npu.npu_fusion_attention(q, k, v, 2, layout, scale=0.3, **common)  # advances the offset
    out, smax, ssum, soft, seed, offset, numels = torch_npu.npu_fusion_attention(q, k, v, 2, layout, scale=0.3,
                                                                                 **common)
    assert isinstance(seed, int) and isinstance(offset, int) and (seed, offset) == (77, numels)
    assert soft.numel() == 0
    dy = torch.randn(out.shape, generator=gen)
    out.backward(dy)
    grads = dict(softmax_max=smax, softmax_sum=ssum, attention_in=out.detach(), **common)
    shim = torch_npu.npu_fusion_attention_grad(q, k, v, dy, 2, layout, scale_value=0.3, seed=seed, offset=offset,
                                               numels=numels, **grads)
    drop_mask = library.dropout_mask(seed, offset, numels, 0.9)
    direct = cann_attn.flash_attention_score_grad(q.detach(), k.detach(), v.detach(), dy, 2, layout, scale_value=0.3,
                                                  drop_mask=drop_mask, **grads)
    assert shim[3] is None and direct.dpse is None  # op-plugin: an undefined dpse without pse
    assert shim[4].shape == (0,) and shim[4].dtype == torch.float32  # and an empty float32 dsink without sink
    for t, a, b in zip((q, k, v), shim[:3], direct[:3], strict=True):
        assert torch.equal(t.grad, a) and torch.equal(a, b)
    with pytest.raises(cann_attn.ParamInvalidError, match="numels"):
        torch_npu.npu_fusion_attention_grad(q, k, v, dy, 2, layout, scale_value=0.3, seed=seed, offset=offset,
                                            numels=numels + 1, **grads)


def test_compiled_forward_returns_tensor_seed_offset_usable_by_the_grad():
    gen = torch.Generator().manual_seed(5)
    q, k, v, _ = _attention_inputs("BSH", gen)

    def fwd(q, k, v):
        return torch_npu.npu_fusion_attention(q, k, v, 2, "BSH", scale=0.3, keep_prob=0.8)

    torch_npu.manual_seed(9)
    eager = fwd(q, k, v)
    torch_npu.manual_seed(9)
    compiled = torch.compile(fwd, fullgraph=True, backend="eager")(q, k, v)
    seed, offset = compiled[4], compiled[5]
    assert isinstance(seed, torch.Tensor) and seed.dim() == 0 and seed.dtype == torch.int64
    assert (int(seed), int(offset), compiled[6]) == (eager[4], eager[5], eager[6]) == (9, 0, 2 * 2 * 6 * 6)
    assert torch.equal(compiled[0], eager[0])
    dy = torch.ones_like(eager[0])
    kw = dict(softmax_max=eager[1], softmax_sum=eager[2], attention_in=eager[0], scale_value=0.3, keep_prob=0.8)
    a = torch_npu.npu_fusion_attention_grad(q, k, v, dy, 2, "BSH", seed=seed, offset=offset, numels=compiled[6], **kw)
    b = torch_npu.npu_fusion_attention_grad(q, k, v, dy, 2, "BSH", seed=eager[4], offset=eager[5], **kw)
    for x, y in zip(a[:3], b[:3], strict=True):
        assert torch.equal(x, y)


def test_v1_without_dropout_returns_zero_seed_and_pse_grad(rng):
    q, k, v, _ = _attention_inputs("BSH", rng)
    pse = torch.randn(1, 2, 6, 6, generator=rng).requires_grad_()
    before = torch_npu.get_rng_state()
    out, _, _, _, seed, offset, numels = torch_npu.npu_fusion_attention(q, k, v, 2, "BSH", pse=pse, scale=0.3)
    # Nothing drawn, but numels is the mask size B*N1*Sq*Skv, as torch_npu reports it without dropout too.
    assert (seed, offset, numels) == (0, 0, _numels("BSH", q)) and torch.equal(torch_npu.get_rng_state(), before)
    out.sum().backward()
    grads = torch_npu.npu_fusion_attention_grad(q, k, v, torch.ones_like(out), 2, "BSH", pse=pse, scale_value=0.3)
    for g, t in zip(grads[:4], (q, k, v, pse), strict=True):
        torch.testing.assert_close(g, t.grad, rtol=1e-5, atol=1e-6)


def test_v2_alibi_and_rope(rng):
    """pse_type 2 (ALiBi slopes) and query_rope/key_rope in BSH: equal to v1-style attention on [q ; q_rope]; the
    grad_v2 rope gradients equal autograd through the v2 forward."""
    b, s, n, d, dr = 1, 6, 2, 8, 4
    q, k, v = (torch.randn(b, s, n * d, generator=rng).requires_grad_() for _ in range(3))
    qr, kr = (torch.randn(b, s, n * dr, generator=rng).requires_grad_() for _ in range(2))
    slopes = torch.tensor([0.5, 0.25])
    kw = dict(pse=slopes, pse_type=2, atten_mask=cann_attn.compressed_mask(3), sparse_mode=3, scale=0.25,
              q_start_idx=[0], kv_start_idx=[0])
    out, smax, ssum, *_ = torch_npu.npu_fusion_attention_v2(q, k, v, n, "BSH", query_rope=qr, key_rope=kr, **kw)
    q_full = torch.cat([q.unflatten(-1, (n, d)), qr.unflatten(-1, (n, dr))], -1).flatten(-2)
    k_full = torch.cat([k.unflatten(-1, (n, d)), kr.unflatten(-1, (n, dr))], -1).flatten(-2)
    ref = cann_attn.flash_attention_score(q_full, k_full, v, n, "BSH", pse=slopes, pse_type=2, scale_value=0.25,
                                          atten_mask=kw["atten_mask"], sparse_mode=3)
    assert torch.equal(out, ref.attention_out)
    dy = torch.randn(out.shape, generator=rng)
    out.backward(dy)
    grads = torch_npu.npu_fusion_attention_grad_v2(
        q, k, v, dy, n, "BSH", pse=slopes, pse_type=2, atten_mask=kw["atten_mask"], sparse_mode=3, scale_value=0.25,
        softmax_max=smax, softmax_sum=ssum, attention_in=out.detach(), query_rope=qr, key_rope=kr)
    assert len(grads) == 7 and grads[6].shape == (0,) and grads[6].dtype == torch.float32
    assert torch.equal(grads[3], torch.zeros_like(slopes))  # ALiBi slopes: dpse allocated like pse, no gradient
    for t, g in zip((q, k, v, qr, kr), (grads[0], grads[1], grads[2], grads[4], grads[5]), strict=True):
        torch.testing.assert_close(g, t.grad, rtol=1e-5, atol=1e-6)


def test_prompt_flash_attention_and_trans_quant_param(rng):
    q, k, v = (torch.randn(2, 5, 16, generator=rng) for _ in range(3))
    mask = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
    out = torch_npu.npu_prompt_flash_attention(q, k, v, atten_mask=mask, num_heads=2, scale_value=0.25,
                                               actual_seq_lengths=[5, 3])
    ref = cann_attn.prompt_flash_attention(q, k, v, atten_mask=mask, num_heads=2, scale_value=0.25,
                                           actual_seq_lengths=[5, 3], pre_tokens=torch_npu.PFA_PRE_TOKENS)
    assert torch.equal(out, ref)
    scale = torch.tensor([0.5, 3.0])
    assert torch.equal(torch_npu.npu_trans_quant_param(scale), cann_attn.trans_quant_param(scale))
    # round_mode 1 (R_INT), as the torch_npu documentation's example calls it: rounded, not truncated
    offset = torch.tensor([1.0, -3.0])
    assert torch.equal(torch_npu.npu_trans_quant_param(scale, offset, 1),
                       cann_attn.trans_quant_param(scale, offset, round_mode=1))
    with pytest.raises(cann_attn.ParamInvalidError, match="round_mode"):
        torch_npu.npu_trans_quant_param(scale, round_mode=2)
    # torch_npu declares `int? round_mode=0`: None means the default
    assert torch.equal(torch_npu.npu_trans_quant_param(scale, round_mode=None), cann_attn.trans_quant_param(scale))


@pytest.mark.parametrize("layout", ["BSH", "TND"])
def test_fusion_attention_numels_without_dropout(layout):
    x, lens = _inputs(layout)
    x = x.view(x.shape[0], HEADS, -1) if layout == "TND" else x  # TND takes [T, N, D]
    before = torch_npu.get_rng_state()
    *_, seed, offset, numels = torch_npu.npu_fusion_attention(x, x, x, HEADS, layout, scale=0.3, **lens)
    assert (seed, offset, numels) == (0, 0, _numels(layout, x)) and torch.equal(torch_npu.get_rng_state(), before)


@pytest.mark.parametrize("layout", ["bsh", "Bsh", "tnd"])
def test_fusion_attention_layout_is_case_insensitive(layout, rng):
    """torch_npu upper-cases input_layout before checking it; forward, grad and their v2 forms alike."""
    x, lens = _inputs(layout.upper())
    x = x.view(x.shape[0], HEADS, -1) if layout.upper() == "TND" else x  # TND takes [T, N, D]
    dy = torch.randn(x.shape, generator=rng)
    for forward, grad in ((torch_npu.npu_fusion_attention, torch_npu.npu_fusion_attention_grad),
                          (torch_npu.npu_fusion_attention_v2, torch_npu.npu_fusion_attention_grad_v2)):
        upper = forward(x, x, x, HEADS, layout.upper(), scale=0.3, **lens)
        mixed = forward(x, x, x, HEADS, layout, scale=0.3, **lens)
        assert torch.equal(upper[0], mixed[0])
        g_upper = grad(x, x, x, dy, HEADS, layout.upper(), scale_value=0.3, **lens)
        g_mixed = grad(x, x, x, dy, HEADS, layout, scale_value=0.3, **lens)
        for a, b in zip(g_upper[:3], g_mixed[:3], strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_sparse_flash_attention_shims(layout, rng):
    """Forward equals cann_attn's; autograd through npu_sparse_flash_attention equals
    npu_sparse_flash_attention_grad; length tensors (int32, as torch_npu callers pass them) are accepted."""
    rope = 4 if layout == "BSND" else None
    case = SFACase(layout, gen=rng, b=1, s1=4, s2=6, n1=2, d=8, d_rope=rope, k=3)
    i, kw = case.inputs, dict(case.kw)
    scale, block = kw.pop("scale_value"), kw.pop("sparse_block_size")
    lens = {name: torch.tensor(kw.pop(name), dtype=torch.int32) for name in list(kw) if name.startswith("actual")}
    layout_kw = dict(layout_query=layout, layout_kv=layout, sparse_mode=kw["sparse_mode"])
    leaves = {n: None if t is None else t.detach().requires_grad_() for n, t in case.tensors.items()}
    out, smax, ssum = torch_npu.npu_sparse_flash_attention(
        leaves["query"], leaves["key"], leaves["value"], i["sparse_indices"], scale, query_rope=leaves["query_rope"],
        key_rope=leaves["key_rope"], sparse_block_size=block, attention_mode=2, return_softmax_lse=True, **lens,
        **layout_kw)
    ref = case.forward()
    assert torch.equal(out, ref.attention_out) and torch.equal(smax, ref.softmax_max)
    out.backward(case.d_out)
    grad_lens = {"actual_seq_qlen": lens.get("actual_seq_lengths_query"),
                 "actual_seq_kvlen": lens.get("actual_seq_lengths_kv")}
    grads = torch_npu.npu_sparse_flash_attention_grad(
        i["query"], i["key"], i["value"], i["sparse_indices"], case.d_out, out.detach(), smax, ssum, scale, block,
        query_rope=i["query_rope"], key_rope=i["key_rope"], layout=layout, sparse_mode=kw["sparse_mode"],
        **grad_lens)
    for name, g in zip(("query", "key", "value", "query_rope", "key_rope"), grads, strict=True):
        if leaves[name] is None:
            assert g.shape == (0,)  # torch_npu returns empty rope gradients without rope inputs
        else:
            assert torch.equal(g, leaves[name].grad), name
    _, no_max, no_sum = torch_npu.npu_sparse_flash_attention(i["query"], i["key"], i["value"], i["sparse_indices"],
                                                             scale, query_rope=i["query_rope"],
                                                             key_rope=i["key_rope"], **lens, **layout_kw)
    assert no_max.shape == (0,) and no_sum.shape == (0,)
    with pytest.raises(cann_attn.ParamInvalidError, match="only with layout_kv"):
        torch_npu.npu_sparse_flash_attention(i["query"], i["key"], i["value"], i["sparse_indices"], scale,
                                             block_table=torch.zeros(1, 1, dtype=torch.int32))


def test_indexer_shims(rng):
    case = SFACase("BSND", gen=rng, b=1, s1=4, s2=6, n1=2, d=8, d_rope=4, k=3)
    fwd = case.forward()
    i = case.inputs
    qi, ki, w = (torch.randn(1, 4, 2, 8, generator=rng), torch.randn(1, 6, 1, 8, generator=rng),
                 torch.randn(1, 4, 2, generator=rng))
    lens = dict(actual_seq_lengths_query=torch.tensor([4], dtype=torch.int32),
                actual_seq_lengths_key=torch.tensor([5], dtype=torch.int32))
    idx, values = torch_npu.npu_lightning_indexer(qi, ki, w, sparse_count=3, return_value=True, **lens)
    ref = cann_attn.lightning_indexer(qi, ki, w, sparse_count=3, return_value=True, actual_seq_lengths_query=[4],
                                      actual_seq_lengths_key=[5])
    assert torch.equal(idx, ref.sparse_indices) and torch.equal(values, ref.sparse_values)
    assert torch_npu.npu_lightning_indexer(qi, ki, w, sparse_count=3)[1].shape == (0,)
    res = torch_npu.npu_sparse_lightning_indexer_grad_kl_loss(
        i["query"], i["key"], qi, ki, w, i["sparse_indices"], fwd.softmax_max, fwd.softmax_sum,
        case.kw["scale_value"], query_rope=i["query_rope"], key_rope=i["key_rope"])
    ref = cann_attn.sparse_lightning_indexer_grad_kl_loss(
        i["query"], i["key"], qi, ki, w, i["sparse_indices"], fwd.softmax_max, fwd.softmax_sum,
        case.kw["scale_value"], query_rope=i["query_rope"], key_rope=i["key_rope"])
    for a, b in zip(res, ref, strict=True):
        assert torch.equal(a, b)
