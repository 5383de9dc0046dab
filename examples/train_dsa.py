"""Train a tiny DeepSeek-V3.2-style decoder with DSA (lightning indexer + top-k sparse MLA attention) on the CPU.

The model is byte-level (vocabulary 256) with MLA-absorbed latent attention: per layer, every token writes one
shared latent (N2 = 1) that serves as both key and value, plus a small decoupled rope key; the N1 query heads are
projected straight into the latent space (the absorbed form of MLA). Each layer also has a lightning indexer
(a few ReLU-scored heads with per-token weights) that picks the top-k keys for every query.

Training follows DeepSeek-V3.2's recipe in three phases (two optimizers: AdamW for the main model, AdamW for the
indexers, each with its own learning-rate schedule):

1. dense LM (`--steps-dense`): the language model trains with causal dense attention through
   `cann_attn.flash_attention` (rope dims concatenated to Q and K, the latent as an MQA key/value); the indexer is
   not trained. (DeepSeek starts from a dense checkpoint, DeepSeek-V3.1-Terminus: this phase stands in for it.)
   The untrained indexer's KL is still computed and logged, for information only: it climbs as the main attention
   sharpens away from the near-uniform attention of the initialisation;
2. dense indexer warm-up (`--steps-warmup`): the main model is frozen and only the lightning indexers train, with a
   KL loss computed here in plain torch, to match the head-averaged main attention distribution over all causal
   keys (the frozen model's LM loss is logged for information only);
3. sparse training (`--steps-sparse`): `cann_attn.lightning_indexer` picks K keys per query,
   `cann_attn.sparse_attention` attends over them and the main model trains again (at a lower learning rate) on the
   LM loss, while `cann_attn.indexer_kl_loss` (with the softmax statistics of a no-grad `sparse_flash_attention`)
   trains the indexer on the selected set.

The indexer always sees detached inputs, and the KL losses see detached main-attention tensors, so the language
model is trained only by the LM loss and the indexer only by the KL loss (as DeepSeek does).

    python examples/train_dsa.py                       # ~2 minutes on a 2-core CPU (one thread)
    python examples/train_dsa.py --steps-dense 20 --steps-warmup 10 --steps-sparse 10 --out /tmp/dsa

Writes <out>/train_dsa.png (both loss curves across the three phases; needs matplotlib, the `examples` extra:
pip install '.[examples]', else the plot is skipped with a message) and <out>/train_dsa.json (summary: per phase,
the LM loss and the KL loss where each is trained, as the mean of the first/last 10 steps, and the time spent).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch import nn

import cann_attn

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "data" / "corpus.txt"


@dataclass
class Config:
    seq_len: int = 128
    batch_size: int = 8
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4  # N1 query heads (MQA over one latent: N2 = 1)
    d_latent: int = 64  # shared latent key/value dim per token
    d_rope: int = 16  # decoupled rope dim
    d_ff: int = 384
    idx_heads: int = 2
    idx_dim: int = 16
    top_k: int = 32
    lr: float = 3e-3  # main model, phase 1 peak (cosine to 10 %)
    lr_sparse: float = 3e-4  # main model, phase 3 (cosine to 10 %): continued training at a low rate
    indexer_lr: float = 3e-3  # indexer, phase 2 peak (cosine to 10 %)
    indexer_lr_sparse: float = 1e-3  # indexer, phase 3 (cosine to 10 %)
    weight_decay: float = 0.01
    warmup_steps: int = 10  # linear lr warm-up at the start of phases 1 and 2
    steps_dense: int = 500  # phase 1: dense LM
    steps_warmup: int = 150  # phase 2: dense indexer warm-up, main model frozen
    steps_sparse: int = 160  # phase 3: sparse (DSA) training
    seed: int = 0
    avg_window: int = 10
    device: str = "cpu"  # "cuda": the cann_attn ops pick their Triton kernels (backend="auto")


# ----------------------------------------------------------------------------------------------------- model


@cache
def causal_mask(device: torch.device) -> torch.Tensor:
    """Ascend's compressed 2048x2048 mask for sparse_mode 3 (right-down causal), built once per device (~4 MB)."""
    return cann_attn.compressed_mask(3, device)


def rope_tables(seq_len: int, dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [S, 1, dim/2] for the rotate-pairs form of rotary embedding."""
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.arange(seq_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x [B, S, N, D] by the position angle."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Indexer(nn.Module):
    """Lightning indexer: I[t, s] = sum_h w[t, h] * ReLU(q_idx[t, h] . k_idx[s]); rope on half of the dims."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.heads, self.dim = cfg.idx_heads, cfg.idx_dim
        self.wq = nn.Linear(cfg.d_model, cfg.idx_heads * cfg.idx_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.idx_dim, bias=False)
        self.k_norm = nn.LayerNorm(cfg.idx_dim)
        self.ww = nn.Linear(cfg.d_model, cfg.idx_heads, bias=False)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, s, _ = h.shape
        half = self.dim // 2
        q = self.wq(h).view(b, s, self.heads, self.dim)
        k = self.k_norm(self.wk(h)).view(b, s, 1, self.dim)
        q = torch.cat((apply_rope(q[..., :half], cos, sin), q[..., half:]), dim=-1)
        k = torch.cat((apply_rope(k[..., :half], cos, sin), k[..., half:]), dim=-1)
        # scale folded into the weights (docs/operators/lightning_indexer.md)
        w = self.ww(h) * (self.heads**-0.5 * self.dim**-0.5)
        return q, k, w


class MLAAttention(nn.Module):
    """MLA in absorbed form: queries live in the latent space; the latent is both key and value (N2 = 1)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * (cfg.d_latent + cfg.d_rope), bias=False)
        self.wkv = nn.Linear(cfg.d_model, cfg.d_latent + cfg.d_rope, bias=False)
        self.kv_norm = nn.RMSNorm(cfg.d_latent)
        self.wo = nn.Linear(cfg.n_heads * cfg.d_latent, cfg.d_model, bias=False)
        self.scale = (cfg.d_latent + cfg.d_rope) ** -0.5

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """query [B,S,N1,Dl], query_rope [B,S,N1,Dr], latent [B,S,1,Dl], key_rope [B,S,1,Dr] (BSND)."""
        cfg, (b, s, _) = self.cfg, h.shape
        q = self.wq(h).view(b, s, cfg.n_heads, cfg.d_latent + cfg.d_rope)
        query, query_rope = q.split([cfg.d_latent, cfg.d_rope], dim=-1)
        latent, key_rope = self.wkv(h).split([cfg.d_latent, cfg.d_rope], dim=-1)
        latent = self.kv_norm(latent).unsqueeze(2)
        return query, apply_rope(query_rope, cos, sin), latent, apply_rope(key_rope.unsqueeze(2), cos, sin)


@dataclass
class Rope:
    """cos/sin tables of the main rope part and of the indexer's rope half, cut to the sequence length."""

    cos: torch.Tensor
    sin: torch.Tensor
    cos_idx: torch.Tensor
    sin_idx: torch.Tensor


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.norm1, self.norm2 = nn.RMSNorm(cfg.d_model), nn.RMSNorm(cfg.d_model)
        self.attn, self.indexer = MLAAttention(cfg), Indexer(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(), nn.Linear(cfg.d_ff, cfg.d_model))

    def forward(self, x: torch.Tensor, rope: Rope, sparse: bool) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm1(x)
        query, query_rope, latent, key_rope = self.attn.project(h, rope.cos, rope.sin)
        # The indexer sees a detached input: it is trained by its KL loss only (DeepSeek-V3.2).
        q_idx, k_idx, w_idx = self.indexer(h.detach(), rope.cos_idx, rope.sin_idx)
        scale = self.attn.scale
        if sparse:
            out, kl = sparse_mla(query, query_rope, latent, key_rope, q_idx, k_idx, w_idx, scale, self.cfg.top_k)
        else:
            # Dense causal MQA: Q = [query ; query_rope], K = [latent ; key_rope], V = latent: the same logits as the
            # sparse op's (docs/operators/sparse_flash_attention.md), over every causal key instead of the selected
            # ones.
            out = cann_attn.flash_attention(
                torch.cat((query, query_rope), dim=-1), torch.cat((latent, key_rope), dim=-1), latent,
                self.cfg.n_heads, "BSND", atten_mask=causal_mask(query.device), sparse_mode=3, scale_value=scale,
            )
            kl = dense_indexer_kl(query, query_rope, latent, key_rope, q_idx, k_idx, w_idx, scale)
        x = x + self.attn.wo(out.flatten(2))
        return x + self.mlp(self.norm2(x)), kl


def sparse_mla(query, query_rope, latent, key_rope, q_idx, k_idx, w_idx, scale: float, top_k: int):
    """DSA: top-k selection by the lightning indexer, sparse MLA attention, indexer KL on the selected set."""
    with torch.no_grad():
        indices = cann_attn.lightning_indexer(q_idx, k_idx, w_idx, sparse_count=top_k, sparse_mode=3).sparse_indices
    out = cann_attn.sparse_attention(query, latent, latent, indices, scale, query_rope=query_rope, key_rope=key_rope)
    q_d, qr_d, kv_d, kr_d = (t.detach() for t in (query, query_rope, latent, key_rope))
    with torch.no_grad():  # main-attention statistics over the selected set, for the KL target
        stats = cann_attn.sparse_flash_attention(q_d, kv_d, kv_d, indices, scale, query_rope=qr_d, key_rope=kr_d)
    kl = cann_attn.indexer_kl_loss(
        q_d, kv_d, q_idx, k_idx, w_idx, indices, stats.softmax_max, stats.softmax_sum, scale,
        query_rope=qr_d, key_rope=kr_d, reduction="mean",
    )
    return out, kl


def dense_indexer_kl(query, query_rope, latent, key_rope, q_idx, k_idx, w_idx, scale: float) -> torch.Tensor:
    """Dense warm-up target: KL(p || softmax(I)) over all causal keys, p = head-averaged main attention.

    Same clamping and per-token mean as `indexer_kl_loss` (docs/operators/lightning_indexer.md), so the phases' curves
    compare."""
    s = query.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=query.device).tril()
    with torch.no_grad():
        logits = torch.einsum("bthd,bsd->bhts", query, latent[:, :, 0]) + torch.einsum(
            "bthd,bsd->bhts", query_rope, key_rope[:, :, 0])
        p = (logits * scale).masked_fill(~causal, float("-inf")).softmax(dim=-1).mean(dim=1)  # [B, S, S]
    relu = torch.einsum("bthd,bsd->bths", q_idx, k_idx[:, :, 0]).relu()
    scores = torch.einsum("bth,bths->bts", w_idx, relu).masked_fill(~causal, float("-inf"))
    q = scores.softmax(dim=-1)
    p_c, q_c = p.clamp_min(1e-8), q.clamp_min(1e-8)
    kl = (p_c * (p_c.log() - q_c.log())).masked_fill(~causal, 0.0).sum(dim=-1)
    return kl.mean()


class TinyDSA(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(256, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        tables = (*rope_tables(cfg.seq_len, cfg.d_rope), *rope_tables(cfg.seq_len, cfg.idx_dim // 2))
        self.rope = Rope(*(t.to(cfg.device) for t in tables))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, sparse: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (LM cross-entropy in nats per byte, indexer KL averaged over layers)."""
        s = tokens.shape[1]
        r = self.rope
        rope = Rope(r.cos[:s], r.sin[:s], r.cos_idx[:s], r.sin_idx[:s])
        x = self.embed(tokens)
        kls = []
        for block in self.blocks:
            x, kl = block(x, rope, sparse)
            kls.append(kl)
        logits = self.norm(x) @ self.embed.weight.T  # tied output embedding
        lm = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return lm, torch.stack(kls).mean()


# ------------------------------------------------------------------------------------------------------ data


def load_corpus(path: Path = CORPUS, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
    split = int(len(data) * (1 - val_fraction))
    return data[:split], data[split:]


def get_batch(data: torch.Tensor, cfg: Config, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(data) - cfg.seq_len - 1, (cfg.batch_size,), generator=generator)
    window = torch.stack([data[s : s + cfg.seq_len + 1] for s in starts.tolist()]).to(cfg.device)
    return window[:, :-1], window[:, 1:]


# ------------------------------------------------------------------------------------------------ evaluation


@torch.no_grad()
def evaluate(model: TinyDSA, val: torch.Tensor, cfg: Config, seed: int) -> dict:
    """Validation LM loss with dense and with sparse attention; per layer, how much of the dense attention mass
    (head average) the indexer's top-k keeps, against a sliding window of the K most recent keys (rows with more
    than K causal keys only), and the dense KL of the trained indexer against a freshly initialised one."""
    tokens, targets = get_batch(val, cfg, torch.Generator().manual_seed(seed + 1))
    lm_dense, _ = model(tokens, targets, sparse=False)
    lm_sparse, _ = model(tokens, targets, sparse=True)
    s, k = tokens.shape[1], cfg.top_k
    rope = model.rope
    causal = torch.ones(s, s, dtype=torch.bool, device=tokens.device).tril()
    x = model.embed(tokens)
    recall, window, kl_trained, kl_fresh = [], [], [], []
    with torch.random.fork_rng():
        torch.manual_seed(seed + 2)
        fresh = Indexer(cfg).to(cfg.device)
    for block in model.blocks:
        h = block.norm1(x)
        query, query_rope, latent, key_rope = block.attn.project(h, rope.cos[:s], rope.sin[:s])
        q_idx, k_idx, w_idx = block.indexer(h, rope.cos_idx[:s], rope.sin_idx[:s])
        logits = torch.einsum("bthd,bsd->bhts", query, latent[:, :, 0]) + torch.einsum(
            "bthd,bsd->bhts", query_rope, key_rope[:, :, 0])
        p = (logits * block.attn.scale).masked_fill(~causal, float("-inf")).softmax(dim=-1).mean(dim=1)
        indices = cann_attn.lightning_indexer(q_idx, k_idx, w_idx, sparse_count=k, sparse_mode=3).sparse_indices
        rows = slice(k, s)  # rows with more than K causal keys
        kept = p.gather(2, indices[:, :, 0].long().clamp_min(0))[:, rows].sum(-1)
        recent = torch.stack([p[:, t, t - k + 1 : t + 1].sum(-1) for t in range(k, s)], dim=1)
        recall.append(kept.mean().item())
        window.append(recent.mean().item())
        main = (query, query_rope, latent, key_rope)
        kl_trained.append(dense_indexer_kl(*main, q_idx, k_idx, w_idx, block.attn.scale).item())
        kl_fresh.append(dense_indexer_kl(*main, *fresh(h, rope.cos_idx[:s], rope.sin_idx[:s]), block.attn.scale).item())
        x, _ = block(x, Rope(rope.cos[:s], rope.sin[:s], rope.cos_idx[:s], rope.sin_idx[:s]), sparse=False)
    return {"val_lm_dense": lm_dense.item(), "val_lm_sparse": lm_sparse.item(),
            "topk_attention_recall": recall, "recent_window_attention_recall": window,
            "dense_kl_trained_indexer": kl_trained, "dense_kl_fresh_indexer": kl_fresh}


# -------------------------------------------------------------------------------------------------- training

PHASES = ("dense", "warmup", "sparse")
PHASE_LABELS = {"dense": "1: dense LM", "warmup": "2: indexer warm-up (model frozen)", "sparse": "3: sparse (DSA)"}


def schedule(step: int, steps: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay from `peak` to `floor * peak` at the last step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def learning_rates(phase: str, step: int, cfg: Config) -> tuple[float, float]:
    """(main-model lr, indexer lr) of one step; 0 for the part that the phase does not train."""
    if phase == "dense":
        return schedule(step, cfg.steps_dense, cfg.lr, cfg.warmup_steps), 0.0
    if phase == "warmup":
        return 0.0, schedule(step, cfg.steps_warmup, cfg.indexer_lr, cfg.warmup_steps)
    return (schedule(step, cfg.steps_sparse, cfg.lr_sparse, 0),
            schedule(step, cfg.steps_sparse, cfg.indexer_lr_sparse, 0))


def average(values: list[float], first: bool, window: int) -> float | None:
    part = values[:window] if first else values[-window:]
    return sum(part) / len(part) if part else None


def first_last(values: list[float], window: int) -> dict:
    return {"initial": average(values, True, window), "final": average(values, False, window)}


def split_parameters(model: TinyDSA) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(main-model parameters, lightning-indexer parameters)."""
    indexer = [p for block in model.blocks for p in block.indexer.parameters()]
    ids = {id(p) for p in indexer}
    return [p for p in model.parameters() if id(p) not in ids], indexer


def train(cfg: Config, out_dir: Path | None = None, progress: bool = True, threads: int | None = 1) -> dict:
    """Runs the three phases and returns the summary (also written to out_dir with the plot when out_dir is given).

    `threads` sets torch's CPU threads for the run (restored afterwards; None leaves them alone): one thread is the
    fastest for these tiny ops and keeps the timing sane when other processes compete for the cores."""
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _train(cfg, out_dir, progress)
    finally:
        torch.set_num_threads(previous_threads)


def _train(cfg: Config, out_dir: Path | None, progress: bool) -> dict:
    torch.manual_seed(cfg.seed)
    train_data, val_data = load_corpus()
    model = TinyDSA(cfg).to(cfg.device)
    main_params, indexer_params = split_parameters(model)
    # Two optimizers: the LM loss trains the main model, the KL loss the indexers, each with its own schedule and
    # gradient clipping (the main optimizer's state carries over from phase 1 to phase 3).
    adamw = dict(weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    main_opt = torch.optim.AdamW(main_params, lr=cfg.lr, **adamw)
    indexer_opt = torch.optim.AdamW(indexer_params, lr=cfg.indexer_lr, **adamw)
    generator = torch.Generator().manual_seed(cfg.seed)
    steps = {"dense": cfg.steps_dense, "warmup": cfg.steps_warmup, "sparse": cfg.steps_sparse}
    history = {phase: {"lm": [], "kl": []} for phase in PHASES}
    seconds = dict.fromkeys(PHASES, 0.0)
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("lm {task.fields[lm]:.3f}  kl {task.fields[kl]:.3f}"), TimeElapsedColumn(),
               TimeRemainingColumn())
    start = time.perf_counter()
    with Progress(*columns, disable=not progress) as bar:
        task = bar.add_task(PHASE_LABELS["dense"], total=sum(steps.values()), lm=float("nan"), kl=float("nan"))
        for phase in PHASES:
            train_main, train_indexer = phase != "warmup", phase != "dense"
            # Frozen parts get requires_grad=False: no graph is built for them (phase 1 still evaluates the untrained
            # indexer's KL, and phase 2 the frozen model's LM loss, for information).
            for p in main_params:
                p.requires_grad_(train_main)
            for p in indexer_params:
                p.requires_grad_(train_indexer)
            parts = ((main_opt, main_params, train_main), (indexer_opt, indexer_params, train_indexer))
            for step in range(steps[phase]):
                t0 = time.perf_counter()
                tokens, targets = get_batch(train_data, cfg, generator)
                lm, kl = model(tokens, targets, sparse=phase == "sparse")
                # Disjoint graphs: the LM loss reaches only the main model, the KL loss only the indexers.
                ((lm if train_main else 0) + (kl if train_indexer else 0)).backward()
                for (optimizer, params, trained), lr in zip(parts, learning_rates(phase, step, cfg), strict=True):
                    if trained:
                        for group in optimizer.param_groups:
                            group["lr"] = lr
                        torch.nn.utils.clip_grad_norm_(params, 1.0)
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                seconds[phase] += time.perf_counter() - t0
                history[phase]["lm"].append(lm.item())
                history[phase]["kl"].append(kl.item())
                bar.update(task, advance=1, lm=lm.item(), kl=kl.item(), description=PHASE_LABELS[phase])
    for p in model.parameters():
        p.requires_grad_(True)
    train_seconds = time.perf_counter() - start
    t0 = time.perf_counter()
    model.eval()
    evaluation = evaluate(model, val_data, cfg, cfg.seed)
    eval_seconds = time.perf_counter() - t0

    w = cfg.avg_window
    lm, kl = ({phase: history[phase][key] for phase in PHASES} for key in ("lm", "kl"))
    summary = {
        "config": asdict(cfg),
        "parameters": sum(p.numel() for p in model.parameters()),
        "corpus_bytes": len(train_data) + len(val_data),
        "steps": {**steps, "total": sum(steps.values())},
        "time_seconds": {**{phase: round(seconds[phase], 2) for phase in PHASES},
                         "train": round(train_seconds, 2), "eval": round(eval_seconds, 2),
                         **{f"per_step_{phase}": round(seconds[phase] / max(1, steps[phase]), 3) for phase in PHASES}},
        # Trained losses, per phase where each is trained.
        "lm_loss": {"dense": first_last(lm["dense"], w), "sparse": first_last(lm["sparse"], w)},
        "kl_loss": {"warmup": first_last(kl["warmup"], w), "sparse": first_last(kl["sparse"], w)},
        # Logged for information only: the losses of the frozen part.
        "untrained": {"lm_warmup_frozen_model": first_last(lm["warmup"], w),
                      "kl_dense_untrained_indexer": first_last(kl["dense"], w)},
        "loss_note": f"initial/final: mean over the first/last {w} steps of the phase; LM loss in nats per byte, "
                     "trained in phases 1 and 3; indexer KL per token, averaged over layers, trained in phases 2 and 3 "
                     "(phases 1-2: over all causal keys against the dense attention; phase 3: over the top-k set "
                     "against the sparse attention). Phase 1's KL (untrained indexer) and phase 2's LM loss (frozen "
                     "model) are logged for information only.",
        "evaluation": evaluation,
        "history": history,
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "train_dsa.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot(history, cfg, out_dir / "train_dsa.png")
    return summary


def plot(history: dict, cfg: Config, path: Path) -> None:
    try:  # optional: pip install '.[examples]' (or matplotlib); the JSON summary is written either way
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed (pip install '.[examples]'): {path.name} is not drawn")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = cfg.avg_window
    trained = {"lm": ("dense", "sparse"), "kl": ("warmup", "sparse")}
    shades = {"dense": "tab:blue", "warmup": "tab:green", "sparse": "tab:red"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in ((axes[0], "lm", "language-model loss (nats/byte)"),
                           (axes[1], "kl", "indexer KL loss (per token, layer mean)")):
        first = 1
        for phase in PHASES:
            values = history[phase][key]
            if not values:
                continue
            steps = list(range(first, first + len(values)))
            smooth = [sum(values[max(0, i - w + 1) : i + 1]) / len(values[max(0, i - w + 1) : i + 1])
                      for i in range(len(values))]
            color, style = ("tab:blue", "-") if phase in trained[key] else ("0.45", "--")
            ax.plot(steps, values, lw=0.8, alpha=0.35, color=color)
            ax.plot(steps, smooth, lw=1.8, color=color, ls=style)
            ax.axvspan(first - 0.5, first + len(values) - 0.5, color=shades[phase], alpha=0.07, lw=0)
            ax.text(first + len(values) / 2, 0.98, PHASE_LABELS[phase].replace(" (", "\n("), ha="center", va="top",
                    fontsize=8, transform=ax.get_xaxis_transform())
            first += len(values)
        ax.plot([], [], color="tab:blue", label=f"trained (mean of last {w})")
        ax.plot([], [], color="0.45", ls="--", label="not trained: information only")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(loc="center right", fontsize=8)
    axes[0].set_ylim(top=axes[0].get_ylim()[1] * 1.12)
    axes[1].set_ylim(bottom=0, top=axes[1].get_ylim()[1] * 1.15)
    fig.suptitle(f"Tiny DSA on {CORPUS.name}: dense LM {cfg.steps_dense} steps, indexer warm-up {cfg.steps_warmup} "
                 f"steps, sparse top-{cfg.top_k} {cfg.steps_sparse} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(summary: dict, cfg: Config) -> None:
    def f(value) -> str:
        if isinstance(value, list):
            return "[" + ", ".join(f(v) for v in value) + "]"
        return "n/a" if value is None else f"{value:.3f}"

    def arrow(d: dict) -> str:
        return f"{f(d['initial'])} -> {f(d['final'])}"

    lm, kl, info = summary["lm_loss"], summary["kl_loss"], summary["untrained"]
    t, ev, steps = summary["time_seconds"], summary["evaluation"], summary["steps"]
    print(f"trained {steps['total']} steps in {t['train']:.1f} s (+ eval {t['eval']:.1f} s); "
          f"mean of the first/last {cfg.avg_window} steps of each phase:")
    print(f"  1 dense LM        {steps['dense']:4d} steps {t['dense']:6.1f} s: LM {arrow(lm['dense'])}  "
          f"(untrained indexer's KL, info: {arrow(info['kl_dense_untrained_indexer'])})")
    print(f"  2 indexer warm-up {steps['warmup']:4d} steps {t['warmup']:6.1f} s: KL {arrow(kl['warmup'])}  "
          f"(frozen model's LM, info: {arrow(info['lm_warmup_frozen_model'])})")
    print(f"  3 sparse (DSA)    {steps['sparse']:4d} steps {t['sparse']:6.1f} s: LM {arrow(lm['sparse'])}  "
          f"KL (top-{cfg.top_k} set) {arrow(kl['sparse'])}")
    print(f"validation LM loss: dense {f(ev['val_lm_dense'])}, sparse {f(ev['val_lm_sparse'])}")
    print(f"per layer: top-{cfg.top_k} attention recall {f(ev['topk_attention_recall'])} vs the {cfg.top_k} most "
          f"recent keys {f(ev['recent_window_attention_recall'])}; dense KL trained indexer "
          f"{f(ev['dense_kl_trained_indexer'])} vs fresh indexer {f(ev['dense_kl_fresh_indexer'])}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps-dense", type=int, default=Config.steps_dense,
                        help="phase 1: dense-attention LM steps (indexer not trained)")
    parser.add_argument("--steps-warmup", type=int, default=Config.steps_warmup,
                        help="phase 2: dense indexer warm-up steps (main model frozen, indexer trained on dense KL)")
    parser.add_argument("--steps-sparse", type=int, default=Config.steps_sparse,
                        help="phase 3: sparse (DSA) steps (LM loss and top-k indexer KL, both trained)")
    parser.add_argument("--seed", type=int, default=Config.seed)
    parser.add_argument("--out", type=Path, default=HERE, help="folder for train_dsa.png and train_dsa.json")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: fastest for these tiny ops, robust on a busy machine)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--device", default="cpu",
                        help="cpu, or cuda to train through the Triton kernels (backend auto)")
    args = parser.parse_args(argv)
    cfg = Config(steps_dense=args.steps_dense, steps_warmup=args.steps_warmup, steps_sparse=args.steps_sparse,
                 seed=args.seed, device=args.device)
    summary = train(cfg, args.out, progress=not args.no_progress, threads=args.threads)
    report(summary, cfg)
    print(f"wrote {args.out / 'train_dsa.png'} and {args.out / 'train_dsa.json'}")
    return summary


if __name__ == "__main__":
    main()
