"""Hashes of "exact"-mode outputs on a fixed set of cases, to show a change leaves them bitwise unchanged
(docs/semantics/precision.md: "exact" results do not change with the "npu" mode).

Run it in two checkouts on the same machine (the bits depend on the CPU's BLAS kernels) and compare the outputs:

    git worktree add /tmp/before <commit>
    (cd /tmp/before && PYTHONPATH=src python tests/exact_hashes.py) > before
    PYTHONPATH=src python tests/exact_hashes.py > after
    diff before after
"""

from __future__ import annotations

import hashlib

import torch

import cann_attn

SCALE = 0.125


def digest(*tensors: torch.Tensor | None) -> str:
    m = hashlib.sha256()
    for t in tensors:
        if t is not None:
            m.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return m.hexdigest()[:16]


def bsh(x: torch.Tensor) -> torch.Tensor:
    """[B, N, S, D] as [B, S, N * D]."""
    return x.transpose(1, 2).flatten(2).contiguous()


def dense_cases(dtype: torch.dtype) -> dict[str, str]:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(shape, generator=g).to(dtype) for shape in ((2, 4, 40, 64), (2, 2, 150, 64),
                                                                         (2, 2, 150, 64)))
    mask = torch.rand(40, 150, generator=g) < 0.3
    infer = {"num_heads": 4, "num_key_value_heads": 2, "input_layout": "BNSD"}
    out = {
        "pfa": digest(cann_attn.prompt_flash_attention(q, k, v, **infer, scale_value=SCALE, atten_mask=mask,
                                                       next_tokens=2**31 - 1)),
        "fia": digest(*cann_attn.fused_infer_attention_score(q, k, v, **infer, scale=SCALE, softmax_lse_flag=True)),
        "fia_decode": digest(*cann_attn.fused_infer_attention_score(q[:, :, :1], k, v, **infer, scale=SCALE)),
        "ifa": digest(cann_attn.incre_flash_attention(q[:, :, :1], k, v, **infer, scale_value=SCALE)),
        "fia_decode_bsh": digest(*cann_attn.fused_infer_attention_score(
            *(bsh(x) for x in (q[:, :, :1], k, v)), **{**infer, "input_layout": "BSH"}, scale=SCALE)),
    }
    qf, kf, vf, dy = (torch.randn(shape, generator=g).to(dtype) for shape in ((2, 4, 96, 64), (2, 2, 96, 64),
                                                                              (2, 2, 96, 64), (2, 4, 96, 64)))
    causal = torch.ones(96, 96, dtype=torch.bool).triu(1)
    fwd = cann_attn.flash_attention_score(qf, kf, vf, 4, "BNSD", scale_value=SCALE, atten_mask=causal)
    out["fa"] = digest(fwd.attention_out, fwd.softmax_max, fwd.softmax_sum)
    grads = cann_attn.flash_attention_score_grad(qf, kf, vf, dy, 4, "BNSD", attention_in=fwd.attention_out,
                                                 softmax_max=fwd.softmax_max, softmax_sum=fwd.softmax_sum,
                                                 scale_value=SCALE, atten_mask=causal)
    out["fa_grad"] = digest(*grads[:3])
    return out


def sparse_cases(dtype: torch.dtype) -> dict[str, str]:
    g = torch.Generator().manual_seed(2)
    q, key, value, dy = (torch.randn(shape, generator=g).to(dtype) for shape in ((2, 8, 4, 32), (2, 40, 1, 32),
                                                                                 (2, 40, 1, 32), (2, 8, 4, 32)))
    idx = torch.stack([torch.stack([torch.randperm(32, generator=g)[:16] for _ in range(8)]) for _ in range(2)])
    idx = idx.unsqueeze(2).to(torch.int32)
    fwd = cann_attn.sparse_flash_attention(q, key, value, idx, 0.2)
    grads = cann_attn.sparse_flash_attention_grad(q, key, value, idx, dy, fwd.attention_out, fwd.softmax_max,
                                                  fwd.softmax_sum, 0.2)
    q_index, k_index = torch.randn(2, 8, 4, 32, generator=g).to(dtype), torch.randn(2, 40, 1, 32, generator=g).to(dtype)
    weights = torch.randn(2, 8, 4, generator=g).to(dtype)
    stats = cann_attn.sparse_flash_attention(q, key, key, idx, 0.2)
    kl = cann_attn.sparse_lightning_indexer_grad_kl_loss(q, key, q_index, k_index, weights, idx, stats.softmax_max,
                                                         stats.softmax_sum, 0.2)
    return {"sfa": digest(*fwd), "sfa_grad": digest(*grads[:3]), "kl_loss": digest(*kl)}


def quant_cases() -> dict[str, str]:
    g = torch.Generator().manual_seed(3)
    q8 = torch.randint(-60, 60, (1, 2, 32, 64), generator=g, dtype=torch.int8)
    k8 = torch.randint(-60, 60, (1, 2, 96, 64), generator=g, dtype=torch.int8)
    pfa = cann_attn.prompt_flash_attention(q8, k8, k8, num_heads=2, input_layout="BNSD", scale_value=SCALE,
                                           deq_scale1=torch.tensor([1 / 512]), quant_scale1=torch.tensor([100.0]),
                                           deq_scale2=torch.tensor([1 / 4096]))
    out = {"pfa_int8": digest(pfa)}
    if hasattr(cann_attn, "quant_lightning_indexer"):  # absent from older checkouts
        qi = torch.randint(-127, 128, (1, 16, 8, 128), generator=g, dtype=torch.int8)
        ki = torch.randint(-127, 128, (1, 512, 1, 128), generator=g, dtype=torch.int8)
        w = torch.randn(1, 16, 8, generator=g).half()
        q_scale = (torch.rand(1, 16, 8, generator=g) * 0.01).half()
        k_scale = (torch.rand(1, 512, 1, generator=g) * 0.01).half()
        out["quant_indexer"] = digest(cann_attn.quant_lightning_indexer(qi, ki, w, q_scale, k_scale, sparse_count=64,
                                                                         sparse_mode=0))
    return out


def main() -> None:
    hashes = {}
    for dtype in (torch.float16, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        hashes.update({f"{case} {name}": h for case, h in {**dense_cases(dtype), **sparse_cases(dtype)}.items()})
    hashes.update(quant_cases())
    for case, h in hashes.items():
        print(case, h)


if __name__ == "__main__":
    main()
