"""One DeepSeek-V3.2-style attention layer over paged caches, written the way the inference recipes write it, checked
stage by stage against the same layer in plain PyTorch float64.

Each step (a prefill of every prompt token, then decode steps of one token per sequence) runs the layer as
cann-recipes-infer's deepseek_v3_2_exp does with an int8 KV cache, through the torch_npu spellings:

    npu_mla_prolog_v3(x, ..., kv_cache, kr_cache, cache_index=slots, cache_mode="PA_BSND", query_norm_flag=True)
        -> q_nope [T, N, 512], q_pe [T, N, 64], q_norm [T, Hcq]; latent and rope key written at the token slots
    indexer: q_idx = RoPE(q_norm W_qb), k_idx = RoPE(x W_k), w = x W_w; int8 per token (and head), fp16 scales
    npu_quant_lightning_indexer(q_idx, idx_cache, w, q_scale, idx_scale_cache, 0, 0, layout_key="PA_BSND", ...)
        -> top-k key positions of every new token
    npu_kv_quant_sparse_flash_attention(cat(q_nope, q_pe), c8_cache, c8_cache, indices, scale, 2, 2,
        layout_query="TND", layout_kv="PA_BSND", attention_mode=2, ...) -> [T, N, 512]
    out = (attention W_uv) W_o

The recipes' W8A8 prolog writes the int8 latent row (512 int8 values, the bf16 rope key, 4 fp32 tile scales: 656
bytes) itself with kv_cache_quant_mode=3, which needs an int8 weight_uq_qr (tests/test_mla_prolog.py runs that call
into this attention); this layer keeps bf16 weights, so the step packs the bf16 latent and rope key the prolog wrote
into that row (docs/operators/mla_prolog.md, docs/operators/quant_dsa.md).

The float64 layer computes every stage from the formulas of those pages with plain tensor operations: the prolog from
the weights (RmsNorm, interleaved-pair RoPE), the index scores of the same int8 tensors and their top-k, softmax
attention over the dequantised latent rows, the output projections. The operators' outputs must match it: the
prolog's and the attention's by the precision rules of their dtypes, the indices exactly.

    python examples/infer_dsa_layer.py                  # a few seconds on a 2-core CPU
    python examples/infer_dsa_layer.py --batch 3 --steps 4
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import cann_attn.torch_npu as torch_npu
from cann_attn.testing.precision import assert_close_to_oracle

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from infer_dsa import pack_latent_rows, quantize_int8  # noqa: E402  (the int8 rows of the DSA inference example)

LATENT, ROPE, TILE = 512, 64, 128  # the kv-quant cache row: 512 int8 latent values in 4 tiles, 64 bf16 rope values


@dataclass
class Config:
    batch: int = 2
    prompt: int = 24  # longest prompt; the others are shorter
    steps: int = 2  # decode steps after the prefill
    hidden: int = 64  # He
    q_latent: int = 48  # Hcq
    heads: int = 4  # N
    nope_dim: int = 16  # D
    idx_heads: int = 4
    idx_dim: int = 128  # the quantised indexer's head dim (DeepSeek-V3.2: 128); ROPE // 4 channels rotated
    top_k: int = 16
    block_size: int = 16
    seed: int = 0

    def prompt_lengths(self) -> list[int]:
        return [max(1, self.prompt - (b * self.prompt) // (self.batch + 1)) for b in range(self.batch)]


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The indexer's rotary embedding (half-split channels) of x [T, ..., R] with cos / sin [T, R]."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos.view(shape) + rotated * sin.view(shape)


def rotary(positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin rows [T, dim] of the half-split form (each frequency twice), float64."""
    freq = 10000.0 ** (-torch.arange(dim // 2, dtype=torch.float64) * 2 / dim)
    angle = positions.to(torch.float64)[:, None] * freq
    angle = torch.cat([angle, angle], -1)
    return angle.cos(), angle.sin()


class Layer:
    """The weights (bf16, as served) and the paged caches of one layer."""

    def __init__(self, cfg: Config):
        g = torch.Generator().manual_seed(cfg.seed)
        c = cfg

        def weight(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * shape[-2 if len(shape) > 1 else 0] ** -0.5).bfloat16()

        self.cfg = c
        self.w = {
            "weight_dq": weight(c.hidden, c.q_latent),
            "weight_uq_qr": weight(c.q_latent, c.heads * (c.nope_dim + ROPE)),
            "weight_uk": weight(c.heads, c.nope_dim, LATENT),
            "weight_dkv_kr": weight(c.hidden, LATENT + ROPE),
            "rmsnorm_gamma_cq": (1 + 0.1 * torch.randn(c.q_latent, generator=g)).bfloat16(),
            "rmsnorm_gamma_ckv": (1 + 0.1 * torch.randn(LATENT, generator=g)).bfloat16(),
        }
        self.w_idx_q = weight(c.q_latent, c.idx_heads * c.idx_dim)
        self.w_idx_k = weight(c.hidden, c.idx_dim)
        self.w_idx_w = weight(c.hidden, c.idx_heads)
        self.w_uv = weight(c.heads, LATENT, c.nope_dim)
        self.w_o = weight(c.heads * c.nope_dim, c.hidden)
        self.scale = (c.nope_dim + ROPE) ** -0.5
        capacity = max(c.prompt_lengths()) + c.steps
        per_seq = -(-capacity // c.block_size)
        blocks = c.batch * per_seq + 1  # one block nobody owns
        self.table = torch.full((c.batch, per_seq), -1, dtype=torch.int32)
        self.free = torch.randperm(blocks, generator=g).tolist()
        self.lengths = [0] * c.batch
        pool = (blocks, c.block_size, 1)
        # Unwritten rows hold NaN (bf16) or 0xFF bytes (NaN scales): a read of one poisons the step.
        self.kv_cache = torch.full((*pool, LATENT), float("nan"), dtype=torch.bfloat16)
        self.kr_cache = torch.full((*pool, ROPE), float("nan"), dtype=torch.bfloat16)
        self.c8_cache = torch.full((*pool, LATENT + 2 * ROPE + 4 * 4), -1, dtype=torch.int8)
        self.idx_cache = torch.full((*pool, c.idx_dim), -1, dtype=torch.int8)
        self.idx_scale_cache = torch.full(pool, float("nan"), dtype=torch.float16)

    def slots(self, new: list[int]) -> torch.Tensor:
        """The cache slots of every sequence's `new` tokens, taking a new block at each block boundary."""
        out = []
        for b, n in enumerate(new):
            for p in range(self.lengths[b], self.lengths[b] + n):
                if p % self.cfg.block_size == 0:
                    self.table[b, p // self.cfg.block_size] = self.free.pop()
                out.append(int(self.table[b, p // self.cfg.block_size]) * self.cfg.block_size + p % self.cfg.block_size)
            self.lengths[b] += n
        return torch.tensor(out, dtype=torch.int64)

    def step(self, x: torch.Tensor, new: list[int]) -> dict:
        """Everything one step computes for its new tokens x [T, He] (new[b] tokens of sequence b)."""
        c = self.cfg
        positions = torch.cat([torch.arange(self.lengths[b], self.lengths[b] + n) for b, n in enumerate(new)])
        slots = self.slots(new)
        cos, sin = rotary(positions, ROPE)
        q_nope, q_pe, _, q_norm, _ = torch_npu.npu_mla_prolog_v3(
            x, *self.w.values(), sin.bfloat16(), cos.bfloat16(), self.kv_cache, self.kr_cache, cache_index=slots,
            cache_mode="PA_BSND", query_norm_flag=True)
        # The int8 latent row of every new token, from the rows the prolog wrote.
        latent_q, latent_scale = quantize_int8(self.kv_cache.view(-1, LATENT)[slots].float(), groups=LATENT // TILE)
        rope_rows = self.kr_cache.view(-1, ROPE)[slots]
        self.c8_cache.view(-1, self.c8_cache.shape[-1])[slots] = pack_latent_rows(latent_q, rope_rows, latent_scale)
        # The indexer's query from q_norm, its key from x (the first ROPE // 4 channels rotated).
        r = ROPE // 4
        idx_cos, idx_sin = rotary(positions, r)
        idx_q = (q_norm.float() @ self.w_idx_q.float()).view(-1, c.idx_heads, c.idx_dim)
        idx_k = x.float() @ self.w_idx_k.float()
        idx_q = torch.cat([rotate_half_rope(idx_q[..., :r], idx_cos.float(), idx_sin.float()), idx_q[..., r:]], -1)
        idx_k = torch.cat([rotate_half_rope(idx_k[..., :r], idx_cos.float(), idx_sin.float()), idx_k[..., r:]], -1)
        weights = (x.float() @ self.w_idx_w.float()) * (c.idx_heads * c.idx_dim) ** -0.5
        q_int8, q_scale = quantize_int8(idx_q, groups=1, scale_dtype=torch.float16)
        k_int8, k_scale = quantize_int8(idx_k, groups=1, scale_dtype=torch.float16)
        self.idx_cache.view(-1, c.idx_dim)[slots] = k_int8
        self.idx_scale_cache.view(-1)[slots] = k_scale[:, 0]
        q_lens = torch.tensor(new, dtype=torch.int32).cumsum(0).to(torch.int32)
        kv_lens = torch.tensor(self.lengths, dtype=torch.int32)
        lengths = dict(actual_seq_lengths_query=q_lens, block_table=self.table, layout_query="TND",
                       layout_key="PA_BSND", sparse_mode=3)
        indices = torch_npu.npu_quant_lightning_indexer(
            q_int8, self.idx_cache, weights.half(), q_scale[..., 0], self.idx_scale_cache, 0, 0,
            actual_seq_lengths_key=kv_lens, sparse_count=c.top_k, **lengths)
        query = torch.cat([q_nope, q_pe], -1).contiguous()
        attention = torch_npu.npu_kv_quant_sparse_flash_attention(
            query, self.c8_cache, self.c8_cache, indices, self.scale, 2, 2, block_table=self.table,
            actual_seq_lengths_query=q_lens, actual_seq_lengths_kv=kv_lens, layout_query="TND",
            layout_kv="PA_BSND", sparse_mode=3, attention_mode=2, quant_scale_repo_mode=1, tile_size=TILE,
            rope_head_dim=ROPE)
        value = torch.einsum("tnc,ncd->tnd", attention.float(), self.w_uv.float()).bfloat16()
        out = value.flatten(1) @ self.w_o
        return {"x": x, "new": list(new), "positions": positions, "slots": slots, "q_nope": q_nope, "q_pe": q_pe,
                "q_norm": q_norm, "idx_q": q_int8, "idx_q_scale": q_scale[..., 0], "weights": weights.half(),
                "indices": indices, "attention": attention, "out": out, "kv_lens": list(self.lengths)}


# ------------------------------------------------------------------------------------ the float64 layer
def rms_norm(v: torch.Tensor, gamma: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return gamma.to(v.dtype) * v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps)


def pair_rope(v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pairs (v0, v1), (v2, v3), ... rotated, pair i written at channels i and R/2 + i."""
    half = v.shape[-1] // 2
    even, odd = v[..., 0::2], v[..., 1::2]
    return torch.cat([even * cos[..., :half] - odd * sin[..., :half], odd * cos[..., half:] + even * sin[..., half:]],
                     -1)


def prolog(layer: Layer, s: dict, dtype: torch.dtype) -> dict:
    """The prolog's formulas in `dtype`: float64 (the golden) or bf16 (the naive computation the precision rules
    compare against)."""
    c, w = layer.cfg, {k: v.to(dtype) for k, v in layer.w.items()}
    x = s["x"].to(dtype)
    cos, sin = (t.bfloat16().to(dtype) for t in rotary(s["positions"], ROPE))
    c_q = rms_norm(x @ w["weight_dq"], w["rmsnorm_gamma_cq"])
    heads = (c_q @ w["weight_uq_qr"]).view(-1, c.heads, c.nope_dim + ROPE)
    kv = x @ w["weight_dkv_kr"]
    return {"q_nope": torch.einsum("tnd,ndc->tnc", heads[..., : c.nope_dim], w["weight_uk"]),
            "q_pe": pair_rope(heads[..., c.nope_dim :], cos[:, None], sin[:, None]), "q_norm": c_q,
            "latent": rms_norm(kv[:, :LATENT], w["rmsnorm_gamma_ckv"]), "key_rope": pair_rope(kv[:, LATENT:], cos, sin)}


def cached_rows(layer: Layer, b: int, length: int) -> dict:
    """Sequence b's first `length` cached keys, dequantised, in position order (float64)."""
    bs = layer.cfg.block_size
    slots = torch.tensor([int(layer.table[b, p // bs]) * bs + p % bs for p in range(length)])
    rows = layer.c8_cache.view(-1, layer.c8_cache.shape[-1])[slots]
    latent = rows[:, :LATENT].double()
    scales = rows[:, LATENT + 2 * ROPE :].contiguous().view(torch.float32).double()
    rope = rows[:, LATENT : LATENT + 2 * ROPE].contiguous().view(torch.bfloat16).double()
    # the kv-quant attention dequantises into bf16 (docs/operators/quant_dsa.md)
    latent = (latent * scales.repeat_interleave(TILE, -1)).float().bfloat16().double()
    idx_k = layer.idx_cache.view(-1, layer.cfg.idx_dim)[slots].double()
    idx_scale = layer.idx_scale_cache.view(-1)[slots].double()
    return {"latent": latent, "rope": rope, "idx_k": idx_k * idx_scale[:, None]}


def attention64(layer: Layer, s: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices [T, 1, K] by the float64 index scores, attention [T, N, 512]) of the step."""
    c = layer.cfg
    t0, indices, outputs = 0, [], []
    query = torch.cat([s["q_nope"], s["q_pe"]], -1).double()
    idx_q = s["idx_q"].double() * s["idx_q_scale"].double()[..., None]
    for b, n in enumerate(s["new"]):
        kv_len = s["kv_lens"][b]
        keys = cached_rows(layer, b, kv_len)
        for i in range(n):
            t = t0 + i
            visible = kv_len - n + i + 1  # sparse_mode 3: right-aligned causality
            scores = (s["weights"][t].double()[:, None] * torch.relu(idx_q[t] @ keys["idx_k"][:visible].T)).sum(0)
            order = sorted(range(visible), key=lambda j: (-float(scores[j]), j))[: c.top_k]
            indices.append(order + [-1] * (c.top_k - len(order)))
            k = torch.cat([keys["latent"][order], keys["rope"][order]], -1)
            p = torch.softmax(layer.scale * query[t] @ k.T, -1)
            outputs.append(p @ keys["latent"][order])
        t0 += n
    return torch.tensor(indices, dtype=torch.int32)[:, None], torch.stack(outputs)


def check_step(layer: Layer, s: dict, name: str) -> dict:
    """Compare one step with the float64 layer; returns the largest relative deviations."""
    ref, naive = prolog(layer, s, torch.float64), prolog(layer, s, torch.bfloat16)
    report = {}
    for key in ("q_nope", "q_pe", "q_norm"):
        assert_close_to_oracle(s[key], ref[key], naive[key], name=f"{name}: {key}")
    for cache, key in ((layer.kv_cache, "latent"), (layer.kr_cache, "key_rope")):
        written = cache.view(-1, cache.shape[-1])[s["slots"]]
        assert_close_to_oracle(written, ref[key], naive[key], name=f"{name}: {key} in the cache")
    indices, attention = attention64(layer, s)
    assert torch.equal(s["indices"].view(indices.shape), indices), f"{name}: top-k indices differ"
    assert_close_to_oracle(s["attention"], attention, name=f"{name}: attention")
    out, out_naive = (torch.einsum("tnc,ncd->tnd", attention.to(dtype), layer.w_uv.to(dtype)).flatten(1)
                      @ layer.w_o.to(dtype) for dtype in (torch.float64, torch.bfloat16))
    assert_close_to_oracle(s["out"], out, out_naive, name=f"{name}: layer output")
    for key, got, want in (("attention", s["attention"], attention), ("out", s["out"], out)):
        report[key] = float((got.double() - want).abs().max() / want.abs().max())
    return report


def run(cfg: Config, verbose: bool = True) -> dict:
    torch.manual_seed(cfg.seed)
    layer = Layer(cfg)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    prompts = cfg.prompt_lengths()
    summary = {"config": asdict(cfg), "prompt_lengths": prompts, "steps": []}
    new = prompts
    for step in range(cfg.steps + 1):
        x = torch.randn(sum(new), cfg.hidden, generator=g).bfloat16()
        s = layer.step(x, new)
        name = "prefill" if step == 0 else f"decode {step}"
        summary["steps"].append({"step": name, "tokens": sum(new), **check_step(layer, s, name)})
        new = [1] * cfg.batch
    if verbose:
        for entry in summary["steps"]:
            print(f"{entry['step']}: {entry['tokens']} tokens; max relative deviation from the float64 layer: "
                  f"attention {entry['attention']:.2e}, output {entry['out']:.2e}; top-k indices equal")
    return summary


def cli(argv: list[str] | None, config: type, run_layer, doc: str) -> dict:
    """Parse one --option per field of the `config` dataclass (and --json), run `run_layer` on it, write the
    summary; shared by the layer examples."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    for name, value in asdict(config()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    args = vars(parser.parse_args(argv))
    out = args.pop("json")
    summary = run_layer(config(**args))
    if out is not None:
        out.write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> dict:
    return cli(argv, Config, run, __doc__)


if __name__ == "__main__":
    main()
