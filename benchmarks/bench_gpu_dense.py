"""Dense FlashAttention Triton kernels on a CUDA GPU vs PyTorch SDPA (flash, cuDNN) and FlexAttention.

bf16, B*S = 16k tokens, N = 16, D = 128, S in {1k, 2k, 4k, 8k, 16k} (B = 16k / S), layout BNSD, causal and not:
forward and backward TFLOPS of ours (flash_attention_score / flash_attention_score_grad on backend="triton"),
SDPA's flash backend, SDPA's cuDNN backend and FlexAttention (torch.compile'd). Then masks at S = 4k (B = 4)
against FlexAttention: band (sparse_mode 4, pre = 512, next = 0), ALiBi (pse_type 2), prefix (sparse_mode 6,
prefix S/4) and varlen documents (TND, causal per document, 16k packed tokens).

FLOPs: forward = 2 * B * N * visible_pairs * (Dqk + Dv) (= 4 B N S^2 D dense), backward = 2.5 x
forward; the same count for every system. Ratios = other system's time / ours (> 1: we are faster). Targets:
forward >= 1.1x SDPA flash, backward >= 1.0x SDPA flash; masks >= 1.2x FlexAttention (forward and
backward). Each system's output is checked against ours (max abs diff) in the same run.

    python benchmarks/bench_gpu_dense.py [--quick] [--out DIR] [--device cuda] [--strict]

Writes DIR/gpu_dense_<gpu-model>.json and .png (default DIR: benchmarks/results). Exits with status 2 and a
message without CUDA.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

import cann_attn

# --device choices (the first is the default); cann-attn bench reads this line to pass --device only where it
# applies.
DEVICES = ("cuda",)

TOKENS, N, D = 16384, 16, 128
SEQS = (1024, 2048, 4096, 8192, 16384)
MASK_SEQ = 4096
BAND_PRE = 512
DOC_LENS = (3000, 517, 1200, 4096, 270, 2900, 1024, 3377)  # 16384 packed tokens
FWD_TARGET, BWD_TARGET, MASK_TARGET = 1.1, 1.0, 1.2
BWD_FACTOR = 2.5
SYSTEMS = ("ours", "sdpa_flash", "sdpa_cudnn", "flex")


def gpu_slug(name: str) -> str:
    """File-name form of a GPU model ("NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3")."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def causal_pairs(s: int) -> int:
    return s * (s + 1) // 2


def band_pairs(s: int, pre: int) -> int:
    """(i, j) with i - pre <= j <= i."""
    return common.visible_pairs(s, s, pre=pre, nxt=0)


def prefix_pairs(s: int, prefix: int) -> int:
    """(i, j) with j <= i or j < prefix."""
    return sum(max(i + 1, prefix) for i in range(s))


def forward_flops(batch: int, heads: int, pairs: int, d: int = D) -> float:
    return common.attention_flops(batch, heads, pairs, d)


def tflops(flops: float, seconds: float | None) -> float | None:
    return None if not seconds else flops / seconds / 1e12


def _time(fn: Callable[[], Any], repeats: int) -> float | None:
    """Median seconds of `fn` (None when the system cannot run this case)."""
    try:
        return common.time_fn(fn, warmup=2, repeats=repeats, device="cuda")["median_s"]
    except (RuntimeError, NotImplementedError, ValueError) as exc:  # a backend unavailable for this shape
        print(f"    skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        return None


class Case:
    """One benchmark case: bf16 BNSD (or TND) inputs, our forward/backward calls and the other systems'."""

    def __init__(self, name: str, batch: int, seq: int, pairs: int, *, our_kw: dict, flex_mask=None,
                 flex_score=None, causal: bool = False, tnd_lens: tuple[int, ...] | None = None) -> None:
        self.name, self.batch, self.seq, self.pairs = name, batch, seq, pairs
        self.our_kw, self.flex_mask, self.flex_score, self.causal = our_kw, flex_mask, flex_score, causal
        self.tnd_lens = tnd_lens
        gen = torch.Generator(device="cuda").manual_seed(0)
        shape = (batch, N, seq, D)
        self.q, self.k, self.v, self.dy = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
                                           for _ in range(4))
        self.flops = forward_flops(batch, N, pairs)

    # --- ours -------------------------------------------------------------------------------------------
    def _ours_args(self):
        if self.tnd_lens is None:
            return (self.q, self.k, self.v), "BNSD", {}
        # TND views of the same memory: [1, N, T, D] -> [T, N, D]
        t = [x[0].transpose(0, 1) for x in (self.q, self.k, self.v)]
        cum = torch.tensor(self.tnd_lens).cumsum(0).tolist()
        return tuple(t), "TND", {"actual_seq_qlen": cum, "actual_seq_kvlen": cum}

    def ours(self) -> tuple[Callable[[], Any], Callable[[], Any], torch.Tensor]:
        (q, k, v), layout, extra = self._ours_args()
        kw = {"scale_value": D**-0.5, "backend": "triton", **self.our_kw, **extra}
        fwd = cann_attn.flash_attention_score(q, k, v, N, layout, **kw)
        dy = self.dy if layout == "BNSD" else self.dy[0].transpose(0, 1)

        def forward():
            return cann_attn.flash_attention_score(q, k, v, N, layout, **kw)

        def backward():
            return cann_attn.flash_attention_score_grad(q, k, v, dy, N, layout, softmax_max=fwd.softmax_max,
                                                        softmax_sum=fwd.softmax_sum, attention_in=fwd.attention_out,
                                                        **kw)

        out = fwd.attention_out if layout == "BNSD" else fwd.attention_out.transpose(0, 1).unsqueeze(0)
        return forward, backward, out

    # --- others -----------------------------------------------------------------------------------------
    def sdpa(self, backend_name: str):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
        q, k, v = (x.detach().requires_grad_() for x in (self.q, self.k, self.v))

        def forward():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)

        out = forward()

        def backward():
            return torch.autograd.grad(out, (q, k, v), self.dy, retain_graph=True)

        return forward, backward, out.detach()

    def flex(self):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = _compiled_flex(flex_attention)
        block_mask = None
        if self.flex_mask is not None:
            block_mask = create_block_mask(self.flex_mask, B=None, H=None, Q_LEN=self.seq, KV_LEN=self.seq,
                                           device="cuda")
        q, k, v = (x.detach().requires_grad_() for x in (self.q, self.k, self.v))

        def forward():
            return compiled(q, k, v, score_mod=self.flex_score, block_mask=block_mask, scale=D**-0.5)

        out = forward()

        def backward():
            return torch.autograd.grad(out, (q, k, v), self.dy, retain_graph=True)

        return forward, backward, out.detach()


_FLEX: dict[str, Any] = {}


def _compiled_flex(flex_attention):
    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def run_case(case: Case, systems: tuple[str, ...], repeats: int) -> dict[str, Any]:
    rec: dict[str, Any] = {"case": case.name, "batch": case.batch, "seq": case.seq, "heads": N, "head_dim": D,
                           "visible_pairs": case.pairs, "forward_flops": case.flops,
                           "backward_flops": BWD_FACTOR * case.flops, "systems": {}}
    ours_out = None
    for system in systems:
        try:
            fwd, bwd, out = case.ours() if system == "ours" else case.flex() if system == "flex" else case.sdpa(system)
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            print(f"  {system}: unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
            rec["systems"][system] = None
            continue
        t_f, t_b = _time(fwd, repeats), _time(bwd, repeats)
        if system == "ours":
            ours_out = out
        diff = None if ours_out is None else float((out.float() - ours_out.float()).abs().max())
        rec["systems"][system] = {"forward_ms": None if t_f is None else t_f * 1e3,
                                  "backward_ms": None if t_b is None else t_b * 1e3,
                                  "forward_tflops": tflops(case.flops, t_f),
                                  "backward_tflops": tflops(BWD_FACTOR * case.flops, t_b),
                                  "max_abs_diff_vs_ours": diff}
        del fwd, bwd, out
        torch.cuda.empty_cache()
    rec["ratios"] = ratios(rec["systems"])
    return rec


def ratios(systems: dict[str, Any]) -> dict[str, float | None]:
    """other time / our time for forward and backward, per other system."""
    ours = systems.get("ours") or {}
    out: dict[str, float | None] = {}
    for name, res in systems.items():
        if name == "ours":
            continue
        for direction in ("forward", "backward"):
            mine, theirs = ours.get(f"{direction}_ms"), (res or {}).get(f"{direction}_ms")
            out[f"{direction}_vs_{name}"] = theirs / mine if mine and theirs else None
    return out


def dense_cases(seqs: tuple[int, ...]) -> list[Case]:
    def causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    cases = []
    for s in seqs:
        b = TOKENS // s
        cases.append(Case(f"S={s // 1024}k", b, s, s * s, our_kw={}))
        cases.append(Case(f"S={s // 1024}k causal", b, s, causal_pairs(s), causal=True, flex_mask=causal_mask,
                          our_kw={"atten_mask": cann_attn.compressed_mask(2, "cuda"), "sparse_mode": 2}))
    return cases


def mask_cases() -> list[Case]:
    s, b = MASK_SEQ, TOKENS // MASK_SEQ
    prefix = s // 4
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / N) for h in range(N)], device="cuda")

    def band(b_, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= BAND_PRE)

    def prefix_lm(b_, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix)

    def alibi(score, b_, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    doc_id = torch.repeat_interleave(torch.arange(len(DOC_LENS), device="cuda"),
                                     torch.tensor(DOC_LENS, device="cuda"))

    def document_causal(b_, h, q_idx, kv_idx):
        return (doc_id[q_idx] == doc_id[kv_idx]) & (kv_idx <= q_idx)

    compressed = cann_attn.compressed_mask(4, "cuda")
    return [
        Case("band (mode 4)", b, s, band_pairs(s, BAND_PRE), flex_mask=band,
             our_kw={"atten_mask": compressed, "sparse_mode": 4, "pre_tokens": BAND_PRE, "next_tokens": 0}),
        Case("ALiBi (pse_type 2)", b, s, s * s, flex_score=alibi, our_kw={"pse": slopes, "pse_type": 2}),
        Case("prefix (mode 6)", b, s, prefix_pairs(s, prefix), flex_mask=prefix_lm,
             our_kw={"atten_mask": cann_attn.compressed_mask(6, "cuda"), "sparse_mode": 6, "prefix": [prefix] * b}),
        Case("varlen documents (TND)", 1, sum(DOC_LENS), sum(causal_pairs(n) for n in DOC_LENS),
             flex_mask=document_causal, tnd_lens=DOC_LENS,
             our_kw={"atten_mask": compressed, "sparse_mode": 3}),
    ]


def missed_targets(dense: list[dict[str, Any]], masks: list[dict[str, Any]]) -> list[str]:
    missed = []
    for rec in dense:
        r = rec["ratios"]
        if (r.get("forward_vs_sdpa_flash") or 0) < FWD_TARGET:
            missed.append(f"{rec['case']} forward vs SDPA flash")
        if (r.get("backward_vs_sdpa_flash") or 0) < BWD_TARGET:
            missed.append(f"{rec['case']} backward vs SDPA flash")
    for rec in masks:
        for direction in ("forward", "backward"):
            if (rec["ratios"].get(f"{direction}_vs_flex") or 0) < MASK_TARGET:
                missed.append(f"{rec['case']} {direction} vs FlexAttention")
    return missed


def _print(rec: dict[str, Any]) -> None:
    parts = []
    for system in SYSTEMS:
        res = rec["systems"].get(system)
        if res is not None:
            f, b = res["forward_tflops"], res["backward_tflops"]
            parts.append(f"{system} {f or 0:6.1f}/{b or 0:6.1f}")
    print(f"{rec['case']:>24}  fwd/bwd TFLOPS  " + "  ".join(parts), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = common.gpu_args(__doc__, "S = 1k and 4k only, 3 repeats", argv, "bench_gpu_dense.py", DEVICES)
    if args is None:
        return 2
    gpu = torch.cuda.get_device_name()
    repeats = 3 if args.quick else 10
    seqs = (1024, 4096) if args.quick else SEQS
    dense = []
    for case in dense_cases(seqs):
        dense.append(run_case(case, SYSTEMS, repeats))
        _print(dense[-1])
    masks = []
    for case in mask_cases():
        masks.append(run_case(case, ("ours", "flex"), repeats))
        _print(masks[-1])
    missed = missed_targets(dense, masks)
    slug = gpu_slug(gpu)
    payload = {"gpu": gpu, "machine": common.machine_info("cuda"), "command": " ".join(sys.argv),
               "shape": {"tokens": TOKENS, "heads": N, "head_dim": D, "dtype": "bf16"},
               "targets": {"forward_vs_sdpa_flash": FWD_TARGET, "backward_vs_sdpa_flash": BWD_TARGET,
                           "masks_vs_flex": MASK_TARGET},
               "dense": dense, "masks": masks, "missed_targets": missed}
    path = common.write_json(args.out / f"gpu_dense_{slug}.json", payload)
    records = dense + masks
    labels = [f"{r['case']} {d}" for r in records for d in ("fwd", "bwd")]
    series = {system: [((r["systems"].get(system) or {}).get(f"{d}_tflops")) for r in records
                       for d in ("forward", "backward")] for system in SYSTEMS}
    ratio_values = [r["ratios"].get(f"{d}_vs_{'flex' if r in masks else 'sdpa_flash'}") for r in records
                    for d in ("forward", "backward")]
    targets = [(MASK_TARGET if r in masks else FWD_TARGET if d == "forward" else BWD_TARGET) for r in records
               for d in ("forward", "backward")]
    common.bar_plot(args.out / f"gpu_dense_{slug}.png", labels, series,
                    title=f"Dense attention on {gpu} (bf16, {TOKENS} tokens, N={N}, D={D})", ylabel="TFLOPS",
                    ratios=ratio_values, targets=targets)
    print(f"wrote {path}")
    if missed:
        print("missed targets: " + "; ".join(missed))
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
