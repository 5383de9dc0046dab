"""A DeepSeek-R1-style MLA attention layer over bf16 NZ paged caches, written the way the inference recipes write it,
checked stage by stage against the same layer in plain PyTorch float64.

Each step runs the absorbed MLA of cann-recipes-infer's deepseek_r1 (``forward_page_attention_mla_prolog``) through
the torch_npu spellings:

    npu_mla_prolog_v3(x, ..., nope_cache, rope_cache, cache_index=slots, cache_mode="PA_NZ")
        -> q_nope [T, N, 512], q_pe [T, N, 64]; the new latent and rope key written in NZ order into the
           [block_num, block_size, 1, D] buffers
    k_nope = nope_cache.view(block_num, 1, 512 // 16, block_size, 16)      # the recipes' "adapter nz"
    k_rope = rope_cache.view(block_num, 1, 64 // 16, block_size, 16)
    npu_fused_infer_attention_score_v2(q_nope, k_nope, k_nope, query_rope=q_pe, key_rope=k_rope,
        input_layout="TND_NTD", sparse_mode=3 with the mask when a sequence brings several tokens (prefill, MTP),
        else 0, block_table=..., block_size=...) -> [N, T, 512]
    out = (attention W_uv) W_o

The float64 layer computes every stage from the pages' formulas with plain tensor operations: the prolog from the
weights (RmsNorm, interleaved-pair RoPE), softmax attention of the float64 query over the keys the cache holds
(read back from the NZ buffers by the element rule [block, head, d // 16, slot, d % 16], not by the library), the
output projections. The same attention call over an ND copy of the caches must give the NZ result bit for bit
(docs/semantics/paged-kv.md, "NZ caches").

    python examples/infer_mla_nz.py                 # a few seconds on a 2-core CPU
    python examples/infer_mla_nz.py --batch 3 --steps 4 --mtp 2
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

import cann_attn.torch_npu as torch_npu
from cann_attn.testing.precision import assert_close_to_oracle

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import infer_dsa_layer as dsa_layer  # noqa: E402  (its weights, paged-cache bookkeeping, prolog formulas, CLI)

LATENT, ROPE, NZ = 512, 64, 16  # kv_lora_rank, qk_rope_head_dim, the bf16 NZ chunk (KV_CACHE_NZ_DIM)


@dataclass
class Config(dsa_layer.Config):
    prompt: int = 20  # longest prompt; the others are shorter
    mtp: int = 2  # after the decode steps, one step of `mtp` tokens per sequence (speculative decoding)


def nz_rows(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The tokens at `slots` of an NZ-written [block_num, block_size, 1, D] buffer, [len(slots), D], read by the element
    rule: channel d of slot s of block n at [n, 0, d // 16, s, d % 16] of the buffer's 5-D view."""
    blocks, block_size, heads, dim = buffer.shape
    view = buffer.view(blocks, heads, dim // NZ, block_size, NZ)
    d = torch.arange(dim)
    return torch.stack([view[int(slot) // block_size, 0, d // NZ, int(slot) % block_size, d % NZ] for slot in slots])


class Layer(dsa_layer.Layer):
    """The DSA example's weights and paged-cache bookkeeping; its bf16 latent / rope caches [block_num, block_size, 1,
    D] (NaN where unwritten) are written here in NZ order and read through their NZ views."""

    def __init__(self, cfg: Config):
        super().__init__(replace(cfg, steps=cfg.steps + cfg.mtp))  # room for the MTP tokens
        self.cfg = cfg

    def cached_slots(self, b: int) -> torch.Tensor:
        """The slots of sequence b's cached tokens, in position order."""
        bs = self.cfg.block_size
        return torch.tensor([int(self.table[b, p // bs]) * bs + p % bs for p in range(self.lengths[b])])

    def attention(self, q_nope, q_pe, k_nope, k_rope, new: list[int]) -> torch.Tensor:
        """FIA v2 as deepseek_r1 calls it, over the caches k_nope / k_rope (NZ views or ND caches)."""
        several = max(new) > 1
        out, _ = torch_npu.npu_fused_infer_attention_score_v2(
            q_nope, k_nope, k_nope, query_rope=q_pe, key_rope=k_rope,
            atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1) if several else None,
            actual_seq_kvlen=list(self.lengths), actual_seq_qlen=torch.tensor(new).cumsum(0).tolist(),
            block_table=self.table, num_query_heads=self.cfg.heads, num_key_value_heads=1,
            softmax_scale=self.scale, input_layout="TND_NTD", sparse_mode=3 if several else 0,
            block_size=self.cfg.block_size, query_quant_mode=0, key_quant_mode=0, value_quant_mode=0)
        return out

    def step(self, x: torch.Tensor, new: list[int]) -> dict:
        """Everything one step computes for its new tokens x [T, He] (new[b] tokens of sequence b)."""
        c = self.cfg
        positions = torch.cat([torch.arange(self.lengths[b], self.lengths[b] + n) for b, n in enumerate(new)])
        slots = self.slots(new)
        cos, sin = dsa_layer.rotary(positions, ROPE)
        q_nope, q_pe, _, _, _ = torch_npu.npu_mla_prolog_v3(
            x, *self.w.values(), sin.bfloat16(), cos.bfloat16(), self.kv_cache, self.kr_cache,
            cache_index=slots, cache_mode="PA_NZ")
        blocks = self.kv_cache.shape[0]
        k_nope = self.kv_cache.view(blocks, 1, LATENT // NZ, c.block_size, NZ)  # the recipes' "adapter nz"
        k_rope = self.kr_cache.view(blocks, 1, ROPE // NZ, c.block_size, NZ)
        attention = self.attention(q_nope, q_pe, k_nope, k_rope, new)  # [N, T, 512]
        # The same call over ND caches holding the same tokens (read back by the element rule).
        cached = torch.cat([self.cached_slots(b) for b in range(c.batch)])
        nd_nope = torch.full((blocks * c.block_size, LATENT), float("nan"), dtype=torch.bfloat16)
        nd_rope = torch.full((blocks * c.block_size, ROPE), float("nan"), dtype=torch.bfloat16)
        nd_nope[cached], nd_rope[cached] = nz_rows(self.kv_cache, cached), nz_rows(self.kr_cache, cached)
        over_nd = self.attention(q_nope, q_pe, nd_nope.view(blocks, c.block_size, LATENT),
                                 nd_rope.view(blocks, c.block_size, ROPE), new)
        value = torch.einsum("ntc,ncd->tnd", attention.float(), self.w_uv.float()).bfloat16()
        out = value.flatten(1) @ self.w_o
        return {"x": x, "new": list(new), "positions": positions, "slots": slots, "q_nope": q_nope, "q_pe": q_pe,
                "attention": attention, "attention_nd": over_nd, "out": out, "kv_lens": list(self.lengths)}


# ------------------------------------------------------------------------------------ the float64 layer
def attention64(layer: Layer, s: dict, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
    """[N, T, 512]: softmax over each new token's visible keys (right-aligned causality) of the cached rows."""
    t0, outputs = 0, []
    for b, n in enumerate(s["new"]):
        kv_len = s["kv_lens"][b]
        slots = layer.cached_slots(b)
        latent, rope = nz_rows(layer.kv_cache, slots).double(), nz_rows(layer.kr_cache, slots).double()
        for i in range(n):
            visible = kv_len - n + i + 1
            logits = q_nope[t0 + i] @ latent[:visible].T + q_pe[t0 + i] @ rope[:visible].T
            outputs.append(torch.softmax(layer.scale * logits, -1) @ latent[:visible])
        t0 += n
    return torch.stack(outputs).transpose(0, 1)


def check_step(layer: Layer, s: dict, name: str) -> dict:
    """Compare one step with the float64 layer; returns the largest relative deviations."""
    assert torch.equal(s["attention"], s["attention_nd"]), f"{name}: the NZ cache and the ND cache differ"
    ref, naive = dsa_layer.prolog(layer, s, torch.float64), dsa_layer.prolog(layer, s, torch.bfloat16)
    for key in ("q_nope", "q_pe"):
        assert_close_to_oracle(s[key], ref[key], naive[key], name=f"{name}: {key}")
    for cache, key in ((layer.kv_cache, "latent"), (layer.kr_cache, "key_rope")):
        assert_close_to_oracle(nz_rows(cache, s["slots"]), ref[key], naive[key], name=f"{name}: {key} in the cache")
    attention = attention64(layer, s, s["q_nope"].double(), s["q_pe"].double())
    assert_close_to_oracle(s["attention"], attention, name=f"{name}: attention")
    out, out_naive = (torch.einsum("ntc,ncd->tnd", attention.to(dtype), layer.w_uv.to(dtype)).flatten(1)
                      @ layer.w_o.to(dtype) for dtype in (torch.float64, torch.bfloat16))
    assert_close_to_oracle(s["out"], out, out_naive, name=f"{name}: layer output")
    return {key: float((got.double() - want).abs().max() / want.abs().max())
            for key, got, want in (("attention", s["attention"], attention), ("out", s["out"], out))}


def run_steps(cfg: Config, layer_type: type, check, describe, verbose: bool) -> dict:
    """A prefill, `cfg.steps` decode steps and one MTP step of a `layer_type` layer, each checked by
    `check(layer, step, name)` -> its deviations; `describe(entry)` is the line printed per step."""
    torch.manual_seed(cfg.seed)
    layer = layer_type(cfg)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    summary = {"config": asdict(cfg), "prompt_lengths": cfg.prompt_lengths(), "steps": []}
    plan = [("prefill", cfg.prompt_lengths())] + [(f"decode {i + 1}", [1] * cfg.batch) for i in range(cfg.steps)]
    if cfg.mtp > 1:
        plan.append((f"MTP {cfg.mtp}", [cfg.mtp] * cfg.batch))
    for name, new in plan:
        s = layer.step(torch.randn(sum(new), cfg.hidden, generator=g).bfloat16(), new)
        summary["steps"].append({"step": name, "tokens": sum(new), **check(layer, s, name)})
    if verbose:
        for entry in summary["steps"]:
            print(f"{entry['step']}: {entry['tokens']} tokens; {describe(entry)}")
    return summary


def run(cfg: Config, verbose: bool = True) -> dict:
    return run_steps(cfg, Layer, check_step, lambda entry: (
        f"NZ == ND bit for bit; max relative deviation from the float64 layer: attention {entry['attention']:.2e}, "
        f"output {entry['out']:.2e}"), verbose)


def main(argv: list[str] | None = None) -> dict:
    return dsa_layer.cli(argv, Config, run, __doc__)


if __name__ == "__main__":
    main()
