"""The differentiable wrappers report bad input with the operators' own errors (SEMANTICS.md 10), also on the paths
that size something before calling the operator: the dropout mask of `flash_attention` and the token count of
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
