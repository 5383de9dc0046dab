"""Operators called from several Python threads at once give, bitwise, their single-thread results
(docs/guides/backends.md, "Threads").

A fuzz of 4 threads running flash_attention forward and backward aborted once in 7 runs (`free(): corrupted unsorted
chunks`). Shared mutable state is now locked or immutable: the compressed-mask cache (problem/mask.py), the native
library's loading (native.library), the Triton autotuner table; the C loops allocate their scratch per call. This
test runs every family on the reference backend (native loops included) from THREADS threads, each operator
several times, interleaved; `tests/test_native_sanitizers.py` runs it again under AddressSanitizer, which reports
heap corruption where it happens rather than at a later free().
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import cann_attn
from cann_attn.problem import mask as mask_rules
from dsa_utils import SFACase
from paged_utils import paginate

THREADS = 4
ROUNDS = 3
B, N, S, D = 1, 4, 96, 16


def _flash_attention(variant: str) -> Callable[[], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(B, N, S, D, generator=gen) for _ in range(3))
    kw: dict = {"scale_value": D**-0.5}
    if variant == "causal":
        kw.update(atten_mask=cann_attn.compressed_mask(2), sparse_mode=2)
    elif variant == "alibi":
        kw.update(pse=torch.tensor([0.5, 0.25, 0.1, 2.0**-6]), pse_type=2)
    elif variant == "pse_band":
        kw.update(pse=torch.randn(B, N, S, S, generator=gen), atten_mask=torch.rand(S, S, generator=gen) < 0.3)
    elif variant == "bf16":
        q, k, v = (t.bfloat16() for t in (q, k, v))

    def call() -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = cann_attn.flash_attention(*leaves, N, "BNSD", **kw)
        out.backward(torch.ones_like(out))
        return [out.detach(), *(t.grad for t in leaves)]

    return call


def _prompt_flash_attention() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(2, N, 40, D, generator=gen) for _ in range(3))
    return [cann_attn.prompt_flash_attention(q, k, v, num_heads=N, input_layout="BNSD", scale_value=0.25,
                                             atten_mask=cann_attn.compressed_mask(3), sparse_mode=3,
                                             actual_seq_lengths=[40, 17])]


def _decode(paged: bool) -> Callable[[], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(13)
    lengths, n_kv, page = [37, 70], 2, 16
    q = torch.randn(2, N, 1, D, generator=gen)
    k, v = (torch.randn(2, n_kv, 72, D, generator=gen) for _ in range(2))
    common = dict(num_heads=N, num_key_value_heads=n_kv, input_layout="BNSD", actual_seq_lengths_kv=lengths,
                  scale=0.3, softmax_lse_flag=True)
    if paged:
        per_seq = {"key": [k[b, :, :n].transpose(0, 1) for b, n in enumerate(lengths)],
                   "value": [v[b, :, :n].transpose(0, 1) for b, n in enumerate(lengths)]}
        caches, table = paginate(per_seq, page, gen)
        k, v = (caches[name].flatten(2) for name in ("key", "value"))
        common.update(block_table=table, block_size=page)
        q = q.transpose(1, 2).reshape(2, 1, N * D)
        common["input_layout"] = "BSH"
    return lambda: list(cann_attn.fused_infer_attention_score(q, k, v, **common))


def _sparse_attention() -> list[torch.Tensor]:
    case = SFACase(gen=torch.Generator().manual_seed(14), b=2, s1=12, s2=40, k=8)
    t = case.tensors
    leaves = {name: None if x is None else x.clone().requires_grad_() for name, x in t.items()}
    out = cann_attn.sparse_attention(leaves["query"], leaves["key"], leaves["value"], case.inputs["sparse_indices"],
                                     query_rope=leaves["query_rope"], key_rope=leaves["key_rope"], **case.kw)
    out.backward(case.d_out)
    return [out.detach(), *(x.grad for x in leaves.values() if x is not None)]


def _lightning_indexer() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(15)
    qi, ki, w = torch.randn(2, 24, 4, 32, generator=gen), torch.randn(2, 48, 1, 32, generator=gen), \
        torch.randn(2, 24, 4, generator=gen)
    res = cann_attn.lightning_indexer(qi, ki, w, sparse_count=8, sparse_mode=3, return_value=True)
    return [res.sparse_indices, res.sparse_values]


OPERATORS: dict[str, Callable[[], list[torch.Tensor]]] = {
    **{f"flash_attention_{v}": _flash_attention(v) for v in ("dense", "causal", "alibi", "pse_band", "bf16")},
    "prompt_flash_attention": _prompt_flash_attention,
    "fia_decode": _decode(paged=False),
    "fia_paged_decode": _decode(paged=True),
    "sparse_attention": _sparse_attention,
    "lightning_indexer": _lightning_indexer,
}


@pytest.fixture
def two_intra_op_threads():
    """Two OpenMP / intra-op threads per call, so that concurrent calls also run concurrent parallel regions."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def test_concurrent_calls_match_single_thread_bitwise(two_intra_op_threads, monkeypatch) -> None:
    want = {name: op() for name, op in OPERATORS.items()}
    # The mask cache starts empty, so that the threads race to fill it.
    monkeypatch.setattr(mask_rules, "_MASK_CACHE", {})
    jobs = [name for _ in range(ROUNDS) for name in OPERATORS]

    def run(name: str) -> tuple[str, list[torch.Tensor]]:
        return name, OPERATORS[name]()

    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(run, jobs))
    for name, got in results:
        assert len(got) == len(want[name])
        for i, (a, b) in enumerate(zip(got, want[name], strict=True)):
            assert torch.equal(a, b) or (a.isnan().any() and torch.equal(a.isnan(), b.isnan())
                                         and torch.equal(a.nan_to_num(), b.nan_to_num())), \
                f"{name} output {i} differs from its single-thread result"
