"""The differentiable wrappers report bad input with the operators' own errors (docs/semantics/errors.md), also on the
paths that size something before calling the operator: the dropout mask of `flash_attention` and the token count of
`indexer_kl_loss(reduction="mean")`."""

from __future__ import annotations

import pytest
import torch

import cann_attn
from cann_attn import ParamInvalidError, ParamNullptrError

N, D = 2, 4


def _bsh(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


FA_CASES = {
    "query None": (lambda: (None, _bsh(2, 6, N * D), _bsh(2, 6, N * D)), "BSH", {}, ParamNullptrError, "query"),
    "1-D query": (lambda: (_bsh(8), _bsh(2, 6, N * D), _bsh(2, 6, N * D)), "BSH", {}, ParamInvalidError, "query"),
    "TND without lengths": (lambda: (_bsh(6, N, D), _bsh(6, N, D), _bsh(6, N, D)), "TND", {}, ParamNullptrError,
                            "actual_seq_qlen"),
    "TND float lengths": (lambda: (_bsh(6, N, D), _bsh(6, N, D), _bsh(6, N, D)), "TND",
                          {"actual_seq_qlen": [6.5], "actual_seq_kvlen": [6]}, ParamInvalidError, "actual_seq_qlen"),
    "mode 9": (lambda: (_bsh(2, 6, N * D), _bsh(2, 6, N * D), _bsh(2, 6, N * D)), "BSH",
               {"atten_mask": torch.zeros(6, 6, dtype=torch.bool), "sparse_mode": 9}, ParamInvalidError,
               "sparse_mode"),
}


@pytest.mark.parametrize("dropout_p", [None, 0.25])
@pytest.mark.parametrize("case", list(FA_CASES))
def test_flash_attention_reports_bad_input_with_and_without_dropout(case, dropout_p):
    make, layout, kwargs, error, param = FA_CASES[case]
    query, key, value = make()
    with pytest.raises(error, match=param):
        cann_attn.flash_attention(query, key, value, N, layout, dropout_p=dropout_p, **kwargs)


def _kl_inputs() -> dict:
    gen = torch.Generator().manual_seed(1)
    b, s1, s2, n1, nidx, d, didx, k = 1, 4, 6, 2, 2, 8, 4, 4

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    query, key = r(b, s1, n1, d), r(b, s2, 1, d)
    query_index, key_index, weights = r(b, s1, nidx, didx), r(b, s2, 1, didx), r(b, s1, nidx)
    indices = cann_attn.lightning_indexer(query_index, key_index, weights, sparse_count=k).sparse_indices
    sfa = cann_attn.sparse_flash_attention(query, key, key, indices, 0.5)
    return dict(query=query, key=key, query_index=query_index, key_index=key_index, weights=weights,
                sparse_indices=indices, softmax_max=sfa.softmax_max, softmax_sum=sfa.softmax_sum, scale_value=0.5)


KL_CASES = {
    "query None": ({"query": None}, ParamNullptrError, "query"),
    "sparse_indices None": ({"sparse_indices": None}, ParamNullptrError, "sparse_indices"),
    "sparse_indices wrong tokens": ({"sparse_indices": torch.zeros(1, 3, 1, 4, dtype=torch.int32)},
                                    ParamInvalidError, "sparse_indices"),
    "layout BNSD": ({"layout": "BNSD"}, ParamInvalidError, "layout"),
}


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("case", list(KL_CASES))
def test_indexer_kl_loss_reports_bad_input_for_both_reductions(case, reduction):
    override, error, param = KL_CASES[case]
    inputs = {**_kl_inputs(), **override}
    with pytest.raises(error, match=param):
        cann_attn.indexer_kl_loss(**inputs, reduction=reduction)


def test_indexer_kl_loss_mean_divides_by_tokens_with_keys():
    inputs = _kl_inputs()
    total = cann_attn.indexer_kl_loss(**inputs, reduction="sum")
    mean = cann_attn.indexer_kl_loss(**inputs, reduction="mean")
    # mode 3 with S1=4 <= S2=6: every row sees at least three keys, so all 4 tokens count.
    torch.testing.assert_close(mean, total / 4)


# ------------------------------------------------------------------ first derivatives only; frozen arguments
def _fa_inputs(requires_grad: bool = True):
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 5, N, D, generator=gen, dtype=torch.float64) for _ in range(3))
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _sfa_inputs():
    """(query [1, 3, N, D] requiring grad, latent [1, 6, 1, D] used as key and value, indices selecting all 6 keys)."""
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(1, 3, N, D, generator=gen, dtype=torch.float64, requires_grad=True)
    latent = torch.randn(1, 6, 1, D, generator=gen, dtype=torch.float64)
    indices = torch.arange(6, dtype=torch.int32).view(1, 1, 1, 6).expand(1, 3, 1, 6).contiguous()
    return query, latent, indices


@pytest.mark.parametrize("wrapper", ["flash_attention", "sparse_attention", "indexer_kl_loss"])
def test_differentiating_a_gradient_raises(wrapper):
    """The grad ops are first derivatives: create_graph=True and a second backward raise, instead of returning a
    gradient without its second-order terms (a gradient penalty would silently train on the wrong objective)."""
    if wrapper == "flash_attention":
        q, k, v = _fa_inputs()
        x, out = q, cann_attn.flash_attention(q, k, v, N, "BSND", scale_value=0.5)
    elif wrapper == "sparse_attention":
        x, latent, indices = _sfa_inputs()
        out = cann_attn.sparse_attention(x, latent, latent, indices, 0.5, sparse_mode=0)
    else:
        kw = _kl_inputs()
        x = kw["query_index"].requires_grad_()
        out = cann_attn.indexer_kl_loss(**kw) ** 2  # a non-constant upstream gradient
    (grad,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"once_differentiable|not have been used in the graph"):
        torch.autograd.grad(grad.pow(2).sum(), x)


def test_first_derivatives_still_match_autograd_after_once_differentiable():
    q, k, v = _fa_inputs()
    torch.autograd.gradcheck(lambda q, k, v: cann_attn.flash_attention(q, k, v, N, "BSND", scale_value=0.5),
                             (q, k, v))


def test_atten_mask_changed_in_place_after_forward_raises():
    """The mask is saved for the backward like every tensor it reads: reusing the buffer before backward is caught
    by autograd's version check, not answered with gradients for another mask."""
    q, k, v = _fa_inputs()
    mask = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)
    out = cann_attn.flash_attention(q, k, v, N, "BSND", atten_mask=mask, sparse_mode=0, scale_value=0.5)
    mask.fill_(False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("as_tensor", [False, True])
def test_lengths_changed_after_forward_do_not_change_the_backward(as_tensor):
    """TND lengths (and prefix / start indices) are copied at the forward: the backward solves the forward's
    problem even if the caller's list or tensor is changed in between."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(7, N, D, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    lens = torch.tensor([3, 7]) if as_tensor else [3, 7]
    out = cann_attn.flash_attention(q, k, v, N, "TND", actual_seq_qlen=lens, actual_seq_kvlen=[3, 7],
                                    scale_value=0.5)
    dy = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    expected = torch.autograd.grad(out, (q, k, v), dy, retain_graph=True)
    lens[0] = 5
    got = torch.autograd.grad(out, (q, k, v), dy)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


WRAPPER_ARG_CASES = {
    "keep_prob string": ({"keep_prob": "0.5"}, "keep_prob"),
    "keep_prob None": ({"keep_prob": None}, "keep_prob"),
    "keep_prob tensor": ({"keep_prob": torch.tensor(0.5)}, "keep_prob"),
    "dropout_p 1": ({"dropout_p": 1.0}, "dropout_p"),
    "dropout_p negative": ({"dropout_p": -0.5}, "dropout_p"),
    "dropout_p string": ({"dropout_p": "x"}, "dropout_p"),
    "dropout_p with keep_prob": ({"dropout_p": 0.2, "keep_prob": 0.5}, "dropout_p"),
    "generator int": ({"keep_prob": 0.5, "generator": 42}, "generator"),
    "bad backend with dropout": ({"keep_prob": 0.5, "backend": "bogus"}, "backend"),
    "triton for float64 with dropout": ({"keep_prob": 0.5, "backend": "triton"}, "backend"),
}


@pytest.mark.parametrize("case", list(WRAPPER_ARG_CASES))
def test_wrapper_arguments_are_checked_before_the_generator_is_used(case, monkeypatch):
    """flash_attention's own arguments raise ParamInvalidError naming them, and a call that raises leaves the
    caller's generator untouched (nothing half-done: a retry draws the same mask)."""
    monkeypatch.delenv("CANN_ATTN_BACKEND", raising=False)
    kwargs, param = WRAPPER_ARG_CASES[case]
    gen = torch.Generator().manual_seed(5)
    kwargs = {"generator": gen, **kwargs}
    state = gen.get_state()
    q, k, v = _fa_inputs(requires_grad=False)
    with pytest.raises(ParamInvalidError, match=param):
        cann_attn.flash_attention(q, k, v, N, "BSND", **kwargs)
    assert torch.equal(gen.get_state(), state)


@pytest.mark.parametrize("flag", ["no", None, 1])
def test_deterministic_must_be_a_bool(flag):
    x, latent, indices = _sfa_inputs()
    with pytest.raises(ParamInvalidError, match="deterministic"):
        cann_attn.sparse_attention(x, latent, latent, indices, 0.5, sparse_mode=0, deterministic=flag)
    out = cann_attn.sparse_flash_attention(x.detach(), latent, latent, indices, 0.5, sparse_mode=0)
    with pytest.raises(ParamInvalidError, match="deterministic"):
        cann_attn.sparse_flash_attention_grad(x.detach(), latent, latent, indices, torch.ones_like(out.attention_out),
                                              out.attention_out, out.softmax_max, out.softmax_sum, 0.5,
                                              sparse_mode=0, deterministic=flag)
    kw = _kl_inputs()
    with pytest.raises(ParamInvalidError, match="deterministic"):
        cann_attn.sparse_lightning_indexer_grad_kl_loss(
            kw["query"], kw["key"], kw["query_index"], kw["key_index"], kw["weights"], kw["sparse_indices"],
            kw["softmax_max"], kw["softmax_sum"], 0.5, deterministic=flag)


def test_indexer_kl_loss_statistics_get_no_gradient():
    """Like query/key, the SFA statistics are constants of the loss: a loss whose only grad-requiring inputs are the
    statistics has no graph (instead of a graph whose backward never reaches them)."""
    kw = _kl_inputs()
    kw["softmax_max"].requires_grad_()
    assert not cann_attn.indexer_kl_loss(**kw).requires_grad
