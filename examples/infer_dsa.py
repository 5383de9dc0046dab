"""DeepSeek-V3.2-style DSA inference over a paged KV cache: prefill, then token-by-token decode.

A tiny byte-level model (embedding, one DSA attention layer, tied LM head) with random weights: the layer is
MLA-absorbed (per token one shared latent that is both key and value, N2 = 1, plus a decoupled rope key; the N1
query heads are projected straight into the latent space) and has a lightning indexer (a few ReLU-scored heads with
per-token weights) that picks the top-k keys of every query. The latent, the rope key and the indexer key of every
token go into three paged caches ([block_num, block_size, 1, D], "PA_BSND") that grow as tokens arrive: a sequence
takes a new physical block from a shuffled free list whenever it crosses a block boundary, so the sequences'
blocks interleave in the pool, and the block table holds -1 in the entries not used yet. Each step calls

    cann_attn.lightning_indexer(..., block_table=table, layout_key="PA_BSND")    -> top-k key positions
    cann_attn.sparse_flash_attention(..., block_table=table, layout_kv="PA_BSND") -> attention over them

with a TND query (prefill: every prompt token of every sequence; decode: one token per sequence) and per-sequence
key counts, as the DeepSeek-V3.2 inference recipes call the NPU operators. Every step is checked against the same
layer computed without paging (contiguous BSND caches with actual lengths): the indices must be equal and, on the
reference backend, the attention outputs bit for bit (docs/semantics/paged-kv.md).

    python examples/infer_dsa.py                        # 20-60 s on a 2-core CPU
    python examples/infer_dsa.py --batch 2 --steps 8 --out /tmp/infer
    python examples/infer_dsa.py --quant --d-latent 512  # int8 caches (docs/operators/quant_dsa.md)

With --quant the caches hold what DeepSeek-V3.2's int8 inference stores: one 656-byte row per token for the latent
(512 int8 values with one fp32 scale per 128, and the bf16 rope key beside them) and an int8 indexer key with an fp16
per-token scale; the indexer query is quantised per token and head. Each step then calls

    cann_attn.quant_lightning_indexer(...)            -> top-k over the int8 indexer cache
    cann_attn.kv_quant_sparse_flash_attention(...)    -> attention over the int8 latent cache

and is checked against the dequantised float computation without paging: lightning_indexer on the dequantised
indexer tensors in float64 (equal indices) and sparse_flash_attention on the dequantised bf16 latent (equal
attention, bit for bit on the reference backend).

Prints tokens/s of the paged decode (and of the unpaged one), writes <out>/infer_dsa.png (per-step decode latency;
needs matplotlib, the `examples` extra: pip install '.[examples]') and <out>/infer_dsa.json.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

import cann_attn

HERE = Path(__file__).resolve().parent


@dataclass
class Config:
    batch: int = 4
    prompt: int = 192  # longest prompt; the others are shorter (see prompt_lengths)
    steps: int = 48  # decode steps (one new token per sequence each)
    d_model: int = 256
    n_heads: int = 16  # N1 query heads over one latent (N2 = 1)
    d_latent: int = 256  # shared latent key/value dim (DeepSeek-V3.2: 512)
    d_rope: int = 64  # decoupled rope dim (DeepSeek-V3.2: 64)
    idx_heads: int = 8  # indexer heads (DeepSeek-V3.2: 64)
    idx_dim: int = 128  # indexer head dim (DeepSeek-V3.2: 128; the quantised indexer takes only 128)
    top_k: int = 128  # keys each query attends to (DeepSeek-V3.2: 2048)
    block_size: int = 64  # tokens per cache block (a multiple of 16, at most 1024)
    seed: int = 0
    device: str = "cpu"  # "cuda": the cann_attn ops pick their Triton kernels, which read the pages in place
    quant: bool = False  # int8 latent and indexer caches (needs d_latent 512, d_rope 64, idx_dim 128)

    def prompt_lengths(self) -> list[int]:
        """Different prompt lengths per sequence: partially filled last blocks, sequences of several blocks."""
        return [max(1, self.prompt - (b * self.prompt) // (self.batch + 1)) for b in range(self.batch)]


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x [T, ..., D] at integer positions [T] (rotate-half form)."""
    d = x.shape[-1] // 2
    freq = 10000.0 ** (-torch.arange(d, dtype=torch.float32, device=x.device) / d)
    angle = positions.to(torch.float32).view(-1, *([1] * (x.dim() - 2)), 1) * freq
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def quantize_int8(x: torch.Tensor, groups: int, scale_dtype: torch.dtype = torch.float32
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantisation of x [..., D] in `groups` groups along D: (int8 values, scales [..., groups] in
    `scale_dtype`) with values = round(x / scale) and scale = max |x| / 127 of the group (as stored)."""
    t = x.float().unflatten(-1, (groups, -1))
    scale = (t.abs().amax(-1).clamp_min(1e-6) / 127).to(scale_dtype)
    values = torch.round(t / scale.float().unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return values.flatten(-2), scale


def pack_latent_rows(latent: torch.Tensor, rope_bf16: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """KvQuantSparseFlashAttention's combined cache rows [T, 1, 656]: 512 int8 latent values, the 64 bf16 rope values
    and the 4 fp32 tile scales, as bytes."""
    parts = [latent.view(torch.uint8), rope_bf16.contiguous().view(torch.uint8), scales.contiguous().view(torch.uint8)]
    return torch.cat(parts, -1).view(torch.int8)


class DSALayer(nn.Module):
    """MLA-absorbed attention with a lightning indexer, projections only: the attention is the cann_attn ops."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        c = cfg
        self.embed = nn.Embedding(256, c.d_model)
        self.q_latent = nn.Linear(c.d_model, c.n_heads * c.d_latent, bias=False)  # W_q absorbed with W_uk
        self.q_rope = nn.Linear(c.d_model, c.n_heads * c.d_rope, bias=False)
        self.kv_latent = nn.Linear(c.d_model, c.d_latent, bias=False)
        self.k_rope = nn.Linear(c.d_model, c.d_rope, bias=False)
        self.out = nn.Linear(c.n_heads * c.d_latent, c.d_model, bias=False)  # W_uv absorbed with W_o
        self.idx_q = nn.Linear(c.d_model, c.idx_heads * c.idx_dim, bias=False)
        self.idx_k = nn.Linear(c.d_model, c.idx_dim, bias=False)
        self.idx_w = nn.Linear(c.d_model, c.idx_heads, bias=False)
        self.scale = (c.d_latent + c.d_rope) ** -0.5

    def project(self, tokens: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """Everything a step needs from its new tokens [T]: query side [T, N, D] and the keys to cache [T, 1, D]."""
        c = self.cfg
        x = self.embed(tokens)
        idx_q = self.idx_q(x).view(-1, c.idx_heads, c.idx_dim)
        return {
            "x": x,
            "query": self.q_latent(x).view(-1, c.n_heads, c.d_latent),
            "query_rope": rope(self.q_rope(x).view(-1, c.n_heads, c.d_rope), positions),
            "latent": F.rms_norm(self.kv_latent(x), (c.d_latent,)).unsqueeze(1),
            "key_rope": rope(self.k_rope(x).unsqueeze(1), positions),
            "idx_query": rope(idx_q, positions),
            "idx_key": rope(self.idx_k(x).unsqueeze(1), positions),
            "idx_weights": self.idx_w(x) * (c.idx_heads ** -0.5 * c.idx_dim ** -0.5),
        }

    def quantize(self, proj: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The int8 forms an int8 inference stack caches and feeds the quantised operators, and the dequantised
        values the float reference computes with (the rule of docs/operators/quant_dsa.md)."""
        latent, latent_scale = quantize_int8(proj["latent"], groups=4)  # one fp32 scale per 128 channels
        rope_bf16 = proj["key_rope"].bfloat16()
        idx_key, idx_key_scale = quantize_int8(proj["idx_key"], groups=1, scale_dtype=torch.float16)
        idx_query, idx_query_scale = quantize_int8(proj["idx_query"], groups=1, scale_dtype=torch.float16)
        return {
            "kv": pack_latent_rows(latent, rope_bf16, latent_scale),
            "idx_key_q": idx_key, "idx_scale": idx_key_scale[..., 0], "idx_query_q": idx_query,
            "idx_query_scale": idx_query_scale[..., 0], "idx_weights_h": proj["idx_weights"].half(),
            "query_cat": torch.cat([proj["query"], proj["query_rope"]], -1).bfloat16(),
            # dequantised: latent x scale in fp32 rounded to bf16; int8 x fp16 scale is exact in fp32
            "latent_deq": (latent.float() * latent_scale.repeat_interleave(128, -1)).bfloat16().float(),
            "key_rope_q": rope_bf16.float(),
            "idx_key_deq": idx_key.float() * idx_key_scale.float(),
            "idx_query_deq": idx_query.float() * idx_query_scale.float(),
        }

    def logits(self, attention: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        hidden = x + self.out(attention.flatten(1))
        return hidden @ self.embed.weight.T


class PagedCache:
    """The latent, rope-key and indexer-key caches of every sequence in one pool of blocks, and the block table."""

    NAMES = ("latent", "key_rope", "idx_key")
    SOURCES: ClassVar[dict[str, str]] = {"latent": "latent", "key_rope": "key_rope", "idx_key": "idx_key"}

    def __init__(self, cfg: Config, capacity: int, generator: torch.Generator):
        dims = {"latent": cfg.d_latent, "key_rope": cfg.d_rope, "idx_key": cfg.idx_dim}
        self.block_size = cfg.block_size
        blocks_per_seq = -(-capacity // cfg.block_size)
        n_blocks = cfg.batch * blocks_per_seq + 2  # two spare blocks nobody owns
        # Unwritten slots hold NaN: reading one would poison the outputs (the reference check would fail).
        self.caches = {n: torch.full((n_blocks, cfg.block_size, 1, d), float("nan"), device=cfg.device)
                       for n, d in dims.items()}
        self.table = torch.full((cfg.batch, blocks_per_seq), -1, dtype=torch.int32)
        self.free = torch.randperm(n_blocks, generator=generator).tolist()
        self.lengths = [0] * cfg.batch

    def append(self, b: int, values: dict[str, torch.Tensor]) -> None:
        """Write sequence b's new tokens ([n, 1, D] per cache), taking a new block at each block boundary."""
        n = next(iter(values.values())).shape[0]
        for i in range(n):
            p = self.lengths[b] + i
            if p % self.block_size == 0:
                self.table[b, p // self.block_size] = self.free.pop()
            block, slot = int(self.table[b, p // self.block_size]), p % self.block_size
            for name in self.NAMES:
                self.caches[name][block, slot] = values[name][i]
        self.lengths[b] += n


class QuantPagedCache(PagedCache):
    """The int8 caches in the same pool of blocks: combined latent rows [block_num, block_size, 1, 656], the int8
    indexer key and its fp16 per-token scale [block_num, block_size, 1]. Unwritten bytes are 0xFF: NaN scales, NaN
    rope values and an NaN indexer scale, so a read of one poisons the step."""

    NAMES = ("kv", "idx_key", "idx_scale")
    SOURCES: ClassVar[dict[str, str]] = {"kv": "kv", "idx_key": "idx_key_q", "idx_scale": "idx_scale"}

    def __init__(self, cfg: Config, capacity: int, generator: torch.Generator):
        super().__init__(cfg, capacity, generator)
        n_blocks, bs = self.caches["latent"].shape[:2]
        self.caches = {
            "kv": torch.full((n_blocks, bs, 1, 656), -1, dtype=torch.int8, device=cfg.device),
            "idx_key": torch.full((n_blocks, bs, 1, cfg.idx_dim), -1, dtype=torch.int8, device=cfg.device),
            "idx_scale": torch.full((n_blocks, bs, 1), float("nan"), dtype=torch.float16, device=cfg.device),
        }


class ContiguousCache:
    """The same keys without paging: [B, capacity, 1, D] per cache plus the actual lengths."""

    def __init__(self, cfg: Config, capacity: int):
        dims = {"latent": cfg.d_latent, "key_rope": cfg.d_rope, "idx_key": cfg.idx_dim}
        self.caches = {n: torch.zeros((cfg.batch, capacity, 1, d), device=cfg.device) for n, d in dims.items()}
        self.lengths = [0] * cfg.batch
        # With --quant this holds the dequantised values: the float computation the int8 one is checked against.
        self.quant = cfg.quant
        self.SOURCES = ({"latent": "latent_deq", "key_rope": "key_rope_q", "idx_key": "idx_key_deq"} if cfg.quant
                        else PagedCache.SOURCES)

    def append(self, b: int, values: dict[str, torch.Tensor]) -> None:
        n = next(iter(values.values())).shape[0]
        for name in self.SOURCES:
            self.caches[name][b, self.lengths[b] : self.lengths[b] + n] = values[name]
        self.lengths[b] += n


def cumulative(lengths: list[int]) -> list[int]:
    out, total = [], 0
    for n in lengths:
        total += n
        out.append(total)
    return out


def attend(layer: DSALayer, proj: dict, q_lens: list[int], cache: PagedCache | ContiguousCache
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sparse_indices, attention_out) of the step's new tokens (TND rows) against everything cached so far."""
    cfg = layer.cfg
    kv_lens = list(cache.lengths)
    c = cache.caches
    q_cum = cumulative(q_lens)
    if isinstance(cache, QuantPagedCache):
        lens = dict(actual_seq_lengths_query=q_cum, block_table=cache.table.to(cfg.device), layout="TND")
        indices = cann_attn.quant_lightning_indexer(
            proj["idx_query_q"], c["idx_key"], proj["idx_weights_h"], proj["idx_query_scale"], c["idx_scale"],
            actual_seq_lengths_key=kv_lens, layout_key="PA_BSND", sparse_count=cfg.top_k, sparse_mode=3, **lens)
        out = cann_attn.kv_quant_sparse_flash_attention(
            proj["query_cat"], c["kv"], c["kv"], indices, layer.scale, actual_seq_lengths_kv=kv_lens,
            layout_kv="PA_BSND", sparse_mode=3, attention_mode=2, **lens)
        return indices, out.float()
    if isinstance(cache, PagedCache):
        table = cache.table.to(cfg.device)
        paged = {"block_table": table}
    else:
        paged = {}
    if paged:
        indices = cann_attn.lightning_indexer(
            proj["idx_query"], c["idx_key"], proj["idx_weights"], actual_seq_lengths_query=q_cum,
            actual_seq_lengths_key=kv_lens, layout="TND", layout_key="PA_BSND", sparse_count=cfg.top_k,
            sparse_mode=3, **paged).sparse_indices
        out = cann_attn.sparse_flash_attention(
            proj["query"], c["latent"], c["latent"], indices, layer.scale, query_rope=proj["query_rope"],
            key_rope=c["key_rope"], actual_seq_lengths_query=q_cum, actual_seq_lengths_kv=kv_lens, layout="TND",
            layout_kv="PA_BSND", sparse_mode=3, **paged).attention_out
        return indices, out
    # Without paging the key layout must be the query's: BSND with actual lengths, the query padded to BSND too.
    batch, width = len(q_lens), max(q_lens)
    rows = torch.cat([torch.arange(n) + b * width for b, n in enumerate(q_lens)]).to(cfg.device)

    def padded(t: torch.Tensor) -> torch.Tensor:
        out = t.new_zeros((batch * width, *t.shape[1:]))
        out[rows] = t
        return out.view(batch, width, *t.shape[1:])

    if cache.quant:
        # The dequantised float computation: the index scores in float64, the attention on the bf16 latent.
        lens = dict(actual_seq_lengths_query=q_lens, actual_seq_lengths_kv=kv_lens, layout="BSND", sparse_mode=3)
        indices = cann_attn.lightning_indexer(
            padded(proj["idx_query_deq"]).double(), c["idx_key"].double(), padded(proj["idx_weights_h"]).double(),
            actual_seq_lengths_query=q_lens, actual_seq_lengths_key=kv_lens, layout="BSND", sparse_count=cfg.top_k,
            sparse_mode=3).sparse_indices
        query = padded(proj["query_cat"])
        out = cann_attn.sparse_flash_attention(
            query[..., : cfg.d_latent], c["latent"].bfloat16(), c["latent"].bfloat16(), indices, layer.scale,
            query_rope=query[..., cfg.d_latent :], key_rope=c["key_rope"].bfloat16(), **lens).attention_out
        return indices.flatten(0, 1)[rows], out.flatten(0, 1)[rows].float()
    # Right-aligned causality needs each sequence's own query count: pass it as the actual query length.
    indices = cann_attn.lightning_indexer(
        padded(proj["idx_query"]), c["idx_key"], padded(proj["idx_weights"]), actual_seq_lengths_query=q_lens,
        actual_seq_lengths_key=kv_lens, layout="BSND", sparse_count=cfg.top_k, sparse_mode=3).sparse_indices
    out = cann_attn.sparse_flash_attention(
        padded(proj["query"]), c["latent"], c["latent"], indices, layer.scale, query_rope=padded(proj["query_rope"]),
        key_rope=c["key_rope"], actual_seq_lengths_query=q_lens, actual_seq_lengths_kv=kv_lens, layout="BSND",
        sparse_mode=3).attention_out
    return indices.flatten(0, 1)[rows], out.flatten(0, 1)[rows]


def step(layer: DSALayer, tokens: list[torch.Tensor], cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Append the new tokens of every sequence (tokens[b]: [n_b]) to `cache` and attend: (indices, attention,
    next token of each sequence)."""
    positions = torch.cat([torch.arange(cache.lengths[b], cache.lengths[b] + len(t)) for b, t in enumerate(tokens)])
    proj = layer.project(torch.cat(tokens).to(layer.cfg.device), positions.to(layer.cfg.device))
    if layer.cfg.quant:
        proj.update(layer.quantize(proj))
    start = 0
    for b, t in enumerate(tokens):
        cache.append(b, {n: proj[source][start : start + len(t)] for n, source in cache.SOURCES.items()})
        start += len(t)
    q_lens = [len(t) for t in tokens]
    indices, attention = attend(layer, proj, q_lens, cache)
    last = torch.tensor(cumulative(q_lens)) - 1
    next_tokens = layer.logits(attention[last], proj["x"][last]).argmax(-1).cpu()
    return indices, attention, next_tokens


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def run(cfg: Config, out_dir: Path | None, verbose: bool = True) -> dict:
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    layer = DSALayer(cfg).to(cfg.device)
    prompt_lengths = cfg.prompt_lengths()
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in prompt_lengths]
    capacity = max(prompt_lengths) + cfg.steps
    paged = (QuantPagedCache if cfg.quant else PagedCache)(cfg, capacity, gen)
    plain = ContiguousCache(cfg, capacity)
    exact = cfg.device == "cpu"  # the reference backend: bit for bit; Triton: the same kernel reads both caches

    def check(name: str, a: tuple, b: tuple) -> None:
        assert torch.equal(a[0], b[0]), f"{name}: paged and unpaged top-k indices differ"
        assert torch.equal(a[2], b[2]), f"{name}: paged and unpaged next tokens differ"
        if exact:
            assert torch.equal(a[1], b[1]), f"{name}: paged and unpaged attention differ"
        else:
            torch.testing.assert_close(a[1], b[1], msg=name)

    timings = {"paged": [], "unpaged": []}
    results = {}
    for kind, cache in (("paged", paged), ("unpaged", plain)):
        _sync(cfg.device)
        t0 = time.perf_counter()
        results[kind] = step(layer, prompts, cache)
        _sync(cfg.device)
        timings[f"{kind}_prefill"] = time.perf_counter() - t0
    check("prefill", results["paged"], results["unpaged"])
    generated = [results["paged"][2]]
    for i in range(cfg.steps):
        tokens = [t.view(1) for t in generated[-1]]
        for kind, cache in (("paged", paged), ("unpaged", plain)):
            _sync(cfg.device)
            t0 = time.perf_counter()
            results[kind] = step(layer, tokens, cache)
            _sync(cfg.device)
            timings[kind].append(time.perf_counter() - t0)
        check(f"decode step {i}", results["paged"], results["unpaged"])
        generated.append(results["paged"][2])
    assert paged.lengths == plain.lengths == [n + cfg.steps for n in prompt_lengths]
    summary = {
        "config": asdict(cfg),
        "prompt_lengths": prompt_lengths,
        "blocks_used": int((paged.table >= 0).sum()),
        "blocks_in_pool": next(iter(paged.caches.values())).shape[0],
        "cache_bytes_per_token": sum(t[0, 0].numel() * t.element_size() for t in paged.caches.values()),
        "prefill_tokens_per_s": {k: sum(prompt_lengths) / timings[f"{k}_prefill"] for k in ("paged", "unpaged")},
        "decode_tokens_per_s": {k: cfg.batch * cfg.steps / max(sum(timings[k]), 1e-9) for k in ("paged", "unpaged")},
        "decode_step_ms": {k: [1e3 * t for t in timings[k]] for k in ("paged", "unpaged")},
        "checked_steps": cfg.steps + 1,
        "bitwise": exact,
    }
    if verbose:
        tps = summary["decode_tokens_per_s"]
        print(f"prefill {sum(prompt_lengths)} tokens ({prompt_lengths}) + {cfg.steps} decode steps x {cfg.batch} "
              f"sequences, block_size {cfg.block_size}, top-k {cfg.top_k}, on {cfg.device}")
        print(f"decode: paged {tps['paged']:.1f} tokens/s, unpaged {tps['unpaged']:.1f} tokens/s; every step equal "
              f"to the unpaged layer{' bit for bit' if exact else ''}")
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "infer_dsa.json").write_text(json.dumps(summary, indent=1))
        plot(summary, out_dir / "infer_dsa.png")
    return summary


def plot(summary: dict, path: Path) -> None:
    try:  # optional: pip install '.[examples]' (or matplotlib); the JSON summary is written either way
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed (pip install '.[examples]'): {path.name} is not drawn")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for kind, style in (("paged", "-"), ("unpaged", "--")):
        ms = summary["decode_step_ms"][kind]
        ax.plot(range(1, len(ms) + 1), ms, style, label=f"{kind} ({summary['decode_tokens_per_s'][kind]:.0f} tok/s)")
    cfg = summary["config"]
    ax.set_xlabel("decode step (one token per sequence)")
    ax.set_ylabel("latency per step (ms)")
    ax.set_title(f"DSA decode over a paged cache: B={cfg['batch']}, block {cfg['block_size']}, top-k {cfg['top_k']}")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    defaults = Config()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, value in asdict(defaults).items():
        if isinstance(value, bool):
            parser.add_argument(f"--{name.replace('_', '-')}", action="store_true")
        else:
            parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--out", type=Path, default=HERE)
    args = vars(parser.parse_args(argv))
    out = args.pop("out")
    cfg = Config(**args)
    if math.gcd(cfg.block_size, 16) != 16:
        parser.error("--block-size must be a multiple of 16")
    if cfg.quant and (cfg.d_latent, cfg.d_rope) != (512, 64):
        parser.error("--quant needs --d-latent 512 and --d-rope 64 (the combined int8 cache row of 656 bytes)")
    if cfg.quant and cfg.idx_dim != 128:
        parser.error("--quant needs --idx-dim 128 (the quantised indexer's only head dim)")
    return run(cfg, out)


if __name__ == "__main__":
    main()
