"""DeepSeek-R1's C8 MLA decode: int8 weights and activations, an int8 latent cache quantised per tensor and an int8
query, written the way cann-recipes-infer's deepseek_r1 writes it, checked against the same layer in plain
PyTorch float64.

Each step runs ``forward_page_attention_mla_prolog`` with ``kv_cache_quant_mode == "int8"`` and a8w8 weights through
the torch_npu spellings:

    x8, x_scale = npu_dynamic_quant(x)                               # per token: max |x| / 127
    npu_mla_prolog_v3(x8, w_dq8, w_uq_qr8, w_uk, w_dkv_kr8, ..., nope_cache (int8), rope_cache (bf16),
        cache_index=slots, dequant_scale_x=x_scale, dequant_scale_w_*=per-column scales,
        quant_scale_ckv=1 / ckv_scale, cache_mode="PA_NZ", weight_quant_mode=2, kv_cache_quant_mode=1,
        query_quant_mode=1)
        -> q_nope int8 [T, N, 512], q_pe [T, N, 64] (times quant_scale_ckv / dequant_scale_q_nope),
           dequant_scale_q_nope [T, N, 1]
    k_nope = nope_cache.view(block_num, 1, 512 // 32, block_size, 32)    # int8 NZ: 32 channels a group
    k_rope = rope_cache.view(block_num, 1, 64 // 16, block_size, 16)
    npu_fused_infer_attention_score_v2(q_nope, k_nope, k_nope, query_rope=q_pe, key_rope=k_rope,
        dequant_scale_query=dequant_scale_q_nope.view(T, -1), dequant_scale_key=ckv_scale,
        dequant_scale_value=ckv_scale, query_quant_mode=3, input_layout="TND_NTD", ...) -> [N, T, 512]
    out = (attention W_uv) W_o

The float64 layer takes the int8 weights and activations as the values they stand for (times their scales) and
computes every stage from the pages' formulas without any further quantisation: the query, latent and rope key, the
softmax attention over every cached token's float64 latent and rope key, the output projections. The int8 query and
cache then cost about one int8 step each (under 1% of a value's range): the step's attention and output are
compared by their largest deviation relative to the float64 values' largest magnitude.

    python examples/infer_mla_c8.py                 # a few seconds on a 2-core CPU
    python examples/infer_mla_c8.py --batch 3 --steps 4 --mtp 2
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

import cann_attn.torch_npu as torch_npu

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import infer_dsa_layer as dsa_layer  # noqa: E402  (prolog formulas, rotary tables, CLI)
import infer_mla_nz as mla_nz  # noqa: E402  (the bf16 layer: weights, paged bookkeeping, FIA call)

LATENT, ROPE = mla_nz.LATENT, mla_nz.ROPE
INT8_NZ = 32  # an int8 NZ group: 32 bytes of channels (the recipes' KV_CACHE_NZ_DIM * 2)
# largest deviation relative to the float64 values' largest magnitude: from the attention of the step's own int8
# outputs (each its value times its scale; only the bf16 output rounds), and from the unquantised float64 layer (the
# int8 query and latent move a score by up to about 1%, which softmax over a few dozen keys can double)
OWN_TOLERANCE, LAYER_TOLERANCE = 1e-2, 1e-1


@dataclass
class Config(mla_nz.Config):
    latent_range: float = 6.0  # the calibration: |latent| values up to this map onto the int8 range


def quantize_columns(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-column int8 weights as W8A8 checkpoints hold them: (int8 [K, C], float32 scales [1, C])."""
    scale = w.float().abs().amax(0, keepdim=True) / 127
    return torch.round(w.float() / scale).to(torch.int8), scale


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """npu_dynamic_quant's per-token int8: (int8 [T, H], float32 scales [T])."""
    scale = x.float().abs().amax(-1) / 127
    return torch.round(x.float() / scale[:, None]).to(torch.int8), scale


class Layer(mla_nz.Layer):
    """The bf16 layer's weights quantised per column (w_dq, w_uq_qr, w_dkv_kr), an int8 latent pool and a bf16 rope
    pool (NaN where unwritten), the calibrated per-tensor latent scale."""

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.int8_w, self.w_scales = {}, {}
        for name in ("weight_dq", "weight_uq_qr", "weight_dkv_kr"):
            self.int8_w[name], self.w_scales[name] = quantize_columns(self.w[name])
        self.ckv_scale = torch.tensor([cfg.latent_range / 127])  # dequantisation; the prolog takes its reciprocal
        self.kv_cache = torch.zeros(self.kv_cache.shape, dtype=torch.int8)
        self.rows64: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # slot -> float64 (latent, rope key)

    def weights64(self) -> dict[str, torch.Tensor]:
        """The weights as the values the int8 ones stand for."""
        w = {k: v.double() for k, v in self.w.items()}
        w.update({k: q.double() * self.w_scales[k].double() for k, q in self.int8_w.items()})
        return w

    def step(self, x: torch.Tensor, new: list[int]) -> dict:
        c = self.cfg
        positions = torch.cat([torch.arange(self.lengths[b], self.lengths[b] + n) for b, n in enumerate(new)])
        slots = self.slots(new)
        cos, sin = dsa_layer.rotary(positions, ROPE)
        x8, x_scale = quantize_tokens(x)
        w = self.w
        q_nope, q_pe, q_scale, _, _ = torch_npu.npu_mla_prolog_v3(
            x8, self.int8_w["weight_dq"], self.int8_w["weight_uq_qr"], w["weight_uk"], self.int8_w["weight_dkv_kr"],
            w["rmsnorm_gamma_cq"], w["rmsnorm_gamma_ckv"], sin.bfloat16(), cos.bfloat16(), self.kv_cache,
            self.kr_cache, cache_index=slots, dequant_scale_x=x_scale.view(-1, 1),
            dequant_scale_w_dq=self.w_scales["weight_dq"], dequant_scale_w_uq_qr=self.w_scales["weight_uq_qr"],
            dequant_scale_w_dkv_kr=self.w_scales["weight_dkv_kr"], quant_scale_ckv=torch.reciprocal(self.ckv_scale),
            cache_mode="PA_NZ", weight_quant_mode=2, kv_cache_quant_mode=1, query_quant_mode=1)
        blocks = self.kv_cache.shape[0]
        k_nope = self.kv_cache.view(blocks, 1, LATENT // INT8_NZ, c.block_size, INT8_NZ)
        k_rope = self.kr_cache.view(blocks, 1, ROPE // mla_nz.NZ, c.block_size, mla_nz.NZ)
        several = max(new) > 1
        attention, _ = torch_npu.npu_fused_infer_attention_score_v2(
            q_nope, k_nope, k_nope, query_rope=q_pe, key_rope=k_rope,
            atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1) if several else None,
            actual_seq_kvlen=list(self.lengths), actual_seq_qlen=torch.tensor(new).cumsum(0).tolist(),
            block_table=self.table, dequant_scale_query=q_scale.view(sum(new), -1), dequant_scale_key=self.ckv_scale,
            dequant_scale_value=self.ckv_scale, num_query_heads=c.heads, num_key_value_heads=1,
            softmax_scale=self.scale, input_layout="TND_NTD", sparse_mode=3 if several else 0,
            block_size=c.block_size, query_quant_mode=3, key_quant_mode=0, value_quant_mode=0)
        value = torch.einsum("ntc,ncd->tnd", attention.float(), self.w_uv.float()).bfloat16()
        return {"x": x8.double() * x_scale.double()[:, None], "new": list(new), "positions": positions,
                "slots": slots, "attention": attention, "out": value.flatten(1) @ self.w_o,
                "kv_lens": list(self.lengths), "q_nope": q_nope, "q_pe": q_pe, "q_scale": q_scale}

    def cached_rows(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence b's cached latent and rope key as the values they stand for (float64): the int8 latent read by
        the int8 NZ element rule [block, 0, d // 32, slot, d % 32] times ckv_scale, the bf16 rope key."""
        slots = self.cached_slots(b)
        blocks, block_size = self.kv_cache.shape[:2]
        view = self.kv_cache.view(blocks, 1, LATENT // INT8_NZ, block_size, INT8_NZ)
        latent = view[slots // block_size, 0, :, slots % block_size, :].flatten(1)
        return latent.double() * self.ckv_scale.double(), mla_nz.nz_rows(self.kr_cache, slots).double()


def attention64(layer: Layer, s: dict, q_nope, q_pe, rows) -> torch.Tensor:
    """[N, T, 512]: softmax over each new token's visible keys (right-aligned causality); rows(b) -> sequence b's
    cached (latent, rope key)."""
    t0, outputs = 0, []
    for b, n in enumerate(s["new"]):
        latent, rope = rows(b)
        for i in range(n):
            visible = s["kv_lens"][b] - n + i + 1
            logits = q_nope[t0 + i] @ latent[:visible].T + q_pe[t0 + i] @ rope[:visible].T
            outputs.append(torch.softmax(layer.scale * logits, -1) @ latent[:visible])
        t0 += n
    return torch.stack(outputs).transpose(0, 1)


def deviation(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def check_step(layer: Layer, s: dict, name: str) -> dict:
    """The step against (a) the attention of its own int8 outputs taken as the values they stand for (the scales
    compose: query * dequant_scale_q_nope, query_rope * dequant_scale_q_nope * ckv_scale, latent * ckv_scale) and
    (b) the float64 layer of the step's tokens, whose rows join its float64 cache."""
    scale = s["q_scale"].double()
    own = attention64(layer, s, s["q_nope"].double() * scale, s["q_pe"].double() * scale * layer.ckv_scale.double(),
                      layer.cached_rows)
    assert deviation(s["attention"], own) < OWN_TOLERANCE, f"{name}: the attention of the int8 outputs differs"
    ref = dsa_layer.prolog(SimpleNamespace(cfg=layer.cfg, w=layer.weights64()), s, torch.float64)
    for slot, latent, rope in zip(s["slots"].tolist(), ref["latent"], ref["key_rope"], strict=True):
        layer.rows64[slot] = (latent, rope)

    def rows64(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [layer.rows64[int(slot)] for slot in layer.cached_slots(b)]
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])

    attention = attention64(layer, s, ref["q_nope"], ref["q_pe"], rows64)
    out = torch.einsum("ntc,ncd->tnd", attention, layer.w_uv.double()).flatten(1) @ layer.w_o.double()
    deviations = {"own": deviation(s["attention"], own), "attention": deviation(s["attention"], attention),
                  "out": deviation(s["out"], out)}
    for key in ("attention", "out"):
        assert deviations[key] < LAYER_TOLERANCE, f"{name}: {key} deviates {deviations[key]:.3g} from the layer"
    return deviations


def run(cfg: Config, verbose: bool = True) -> dict:
    """The steps of the bf16 NZ example's plan (prefill, decode, MTP), each checked by `check_step`."""
    return mla_nz.run_steps(cfg, Layer, check_step, lambda entry: (
        f"max deviation relative to the largest value: attention from its own int8 outputs {entry['own']:.2e}; "
        f"from the float64 layer: attention {entry['attention']:.2e}, output {entry['out']:.2e}"), verbose)


def main(argv: list[str] | None = None) -> dict:
    """The command line: one --option per Config field (and --json)."""
    return dsa_layer.cli(argv, Config, run, __doc__)


if __name__ == "__main__":
    main()
