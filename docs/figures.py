"""The documentation's figures, drawn from the library's own rules (``make docs`` runs this first).

    python docs/figures.py                 # writes docs/images/*.png
    python docs/figures.py --out /tmp/f    # elsewhere (tests/test_docs.py compares the two)

Each figure evaluates the rule it shows through the code that applies it, so a figure cannot drift from the
behaviour: the masks of ``sparse_mode`` 0..8 (``cann_attn.problem.mask.sequence_mask``), TND packing and its
cumulative lengths (``cann_attn.problem.lengths``), a paged KV cache's block table
(``cann_attn.problem.page_table.PageTable``), head-tail sharding and the ring's steps
(``cann_attn.distributed.plan.chunk_ids``), and the log-sum-exp merge of partial results
(``cann_attn.problem.merge.merge_lse``). The PNGs are committed so that the site builds without running this.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from matplotlib.colors import ListedColormap
from matplotlib.patches import Rectangle

from cann_attn.distributed.plan import chunk_ids
from cann_attn.problem.lengths import cumulative_lengths, starts_of
from cann_attn.problem.mask import INT_MAX, band_batch_index, sequence_mask
from cann_attn.problem.merge import merge_lse
from cann_attn.problem.page_table import PageTable

IMAGES = Path(__file__).resolve().parent / "images"
VISIBLE, MASKED = "#3f51b5", "#e8eaf0"
SEQUENCE_COLOURS = ("#3f51b5", "#e57373", "#81c784", "#ffb74d", "#9575cd", "#4db6ac", "#f06292", "#a1887f")
PACKED = ([3, 2, 3], [4, 2, 4])  # the query and key lengths of the TND examples of modes 7 and 8
STYLE = {"font.family": "DejaVu Sans", "font.size": 10, "axes.titlesize": 10, "svg.hashsalt": "cann_attn"}


def _grid(ax, masked: torch.Tensor, title: str) -> None:
    """One boolean matrix (True = masked) as cells, query rows down, key columns across."""
    ax.imshow(masked.int().numpy(), cmap=ListedColormap([VISIBLE, MASKED]), vmin=0, vmax=1)
    rows, cols = masked.shape
    ax.set_xticks(range(cols))
    ax.set_yticks(range(rows))
    ax.tick_params(length=0, labelsize=7)
    ax.set_xticks([x - 0.5 for x in range(1, cols)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, rows)], minor=True)
    ax.grid(which="minor", color="white", linewidth=1)
    ax.tick_params(which="minor", length=0)
    ax.set_title(title)


def _mode_mask(mode: int, seq_q: int, seq_kv: int, **options) -> torch.Tensor:
    pre, nxt = options.pop("pre_tokens", INT_MAX), options.pop("next_tokens", INT_MAX)
    mask = sequence_mask(mode, seq_q, seq_kv, pre_tokens=pre, next_tokens=nxt, explicit=options.pop("explicit", None),
                         **options)
    return mask.masked_tile(0, seq_q, 0, seq_kv, torch.device("cpu"))


def _packed_mask(mode: int, q_lengths: list[int], kv_lengths: list[int], next_tokens: int) -> torch.Tensor:
    """Modes 7 and 8 on TND sequences: one block per sequence on the diagonal, the rest masked."""
    band = band_batch_index(mode, q_lengths)
    masked = torch.ones(sum(q_lengths), sum(kv_lengths), dtype=torch.bool)
    for b, (q0, kv0) in enumerate(zip(starts_of(q_lengths), starts_of(kv_lengths), strict=True)):
        block = sequence_mask(mode, q_lengths[b], kv_lengths[b], pre_tokens=INT_MAX, next_tokens=next_tokens,
                              explicit=None, is_band_batch=b == band)
        masked[q0 : q0 + q_lengths[b], kv0 : kv0 + kv_lengths[b]] = block.masked_tile(
            0, q_lengths[b], 0, kv_lengths[b], torch.device("cpu"))
    return masked


def mask_modes(out: Path) -> None:
    seq_q, seq_kv, prefix = 6, 8, 5
    user_mask = (torch.arange(seq_q).view(-1, 1) + 2 * torch.arange(seq_kv)) % 5 == 0  # any pattern the caller gives
    prefix_rule = _mode_mask(6, seq_q, seq_kv, prefix=prefix)  # what Ascend expects mode 5's full mask to hold
    panels = [
        ("0: band from the top-left\npre_tokens=2, next_tokens=1", _mode_mask(0, seq_q, seq_kv, pre_tokens=2,
                                                                               next_tokens=1)),
        ("1: the given mask, as it is", _mode_mask(1, seq_q, seq_kv, explicit=user_mask)),
        ("2: causal from the top-left\nj <= i", _mode_mask(2, seq_q, seq_kv)),
        ("3: causal from the bottom-right\nj <= i + (Skv - Sq)", _mode_mask(3, seq_q, seq_kv)),
        ("4: band from the bottom-right\npre_tokens=2, next_tokens=1", _mode_mask(4, seq_q, seq_kv, pre_tokens=2,
                                                                                   next_tokens=1)),
        (f"5: prefix, full mask given\nprefix={prefix}", _mode_mask(5, seq_q, seq_kv, explicit=prefix_rule)),
        (f"6: prefix, compressed mask\nprefix={prefix}", _mode_mask(6, seq_q, seq_kv, prefix=prefix)),
        ("7 (TND): causal bottom-right;\nlast sequence a band, next_tokens=1", _packed_mask(7, *PACKED, 1)),
        ("8 (TND): causal top-left;\nfirst sequence a band, next_tokens=1", _packed_mask(8, *PACKED, 1)),
    ]
    fig, axes = plt.subplots(3, 3, figsize=(10.5, 9.6))
    for ax, (title, masked) in zip(axes.flat, panels, strict=True):
        _grid(ax, masked, f"sparse_mode {title}")
    for ax in axes[-1]:
        ax.set_xlabel("key position j")
    for ax in axes[:, 0]:
        ax.set_ylabel("query position i")
    fig.suptitle(f"Visible (dark) and masked (light) scores, Sq = {seq_q}, Skv = {seq_kv}; modes 7 and 8 on three "
                 "packed sequences (Sq 3, 2, 3; Skv 4, 2, 4)", fontsize=10)
    fig.tight_layout()
    _save(fig, out / "mask_modes.png")


def tnd_packing(out: Path) -> None:
    ends, total = [5, 8, 8, 14], 16
    lengths = cumulative_lengths(ends, total, "actual_seq_qlen", eod_padding=True)
    fig, ax = plt.subplots(figsize=(10.5, 2.6))
    for b, (start, length) in enumerate(zip(starts_of(lengths), lengths, strict=True)):
        for t in range(start, start + length):
            ax.add_patch(Rectangle((t, 0), 0.92, 1, color=SEQUENCE_COLOURS[b]))
        if length:
            ax.text(start + length / 2, 1.25, f"sequence {b}: {length} tokens", ha="center", fontsize=9)
        ax.annotate(f"end {ends[b]}", (start + length - 0.04, 0), (start + length - 0.04, -0.75), ha="center",
                    fontsize=9, arrowprops={"arrowstyle": "-", "color": "black"})
    for t in range(sum(lengths), total):
        ax.add_patch(Rectangle((t, 0), 0.92, 1, facecolor="white", edgecolor="grey", hatch="//"))
    ax.text((sum(lengths) + total) / 2, 1.25, "padding", ha="center", fontsize=9, color="grey")
    ax.text(0, -1.45, f"actual_seq_qlen = {ends}: cumulative ends, no leading 0; sequence 2 is empty (8 again); "
            f"T = {total} > {ends[-1]}: the last {total - ends[-1]} tokens are end-of-document padding",
            fontsize=9)
    for t in range(total):
        ax.text(t + 0.46, 0.5, str(t), ha="center", va="center", fontsize=8, color="white" if t < 14 else "grey")
    ax.set_xlim(-0.3, total + 0.3)
    ax.set_ylim(-1.7, 1.6)
    ax.axis("off")
    ax.set_title("TND: sequences packed one after another along T, delimited by their cumulative ends")
    fig.tight_layout()
    _save(fig, out / "tnd_packing.png")


def paged_block_table(out: Path) -> None:
    block_size, lengths = 4, (10, 5)
    table = torch.tensor([[5, 1, 6], [3, 7, -1]], dtype=torch.int32)
    pages = PageTable(table=table, block_size=block_size, block_count=8, kv_lengths=lengths)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 4.2), gridspec_kw={"width_ratios": [1.25, 1]})
    for b, length in enumerate(lengths):
        blocks, slots = pages.locate(b, torch.arange(length))
        y = 3.2 - 2.2 * b
        left.text(-0.6, y + 0.45, f"sequence {b}\n{length} keys", ha="right", va="center", fontsize=9)
        for p in range(length):
            left.add_patch(Rectangle((p, y), 0.92, 0.9, color=SEQUENCE_COLOURS[b]))
            left.text(p + 0.46, y + 0.45, str(p), ha="center", va="center", fontsize=8, color="white")
            right.add_patch(Rectangle((slots[p].item(), 7 - blocks[p].item()), 0.92, 0.9,
                                      color=SEQUENCE_COLOURS[b]))
            right.text(slots[p].item() + 0.46, 7 - blocks[p].item() + 0.45, f"{b}:{p}", ha="center", va="center",
                       fontsize=7, color="white")
        row = ", ".join(str(v) for v in table[b].tolist())
        left.text(0, y - 0.45, f"block_table[{b}] = [{row}]: logical block k is physical block block_table[{b}, k]",
                  fontsize=8)
    for block in range(8):
        for slot in range(block_size):
            right.add_patch(Rectangle((slot, 7 - block), 0.92, 0.9, fill=False, edgecolor="#bbbbbb"))
        right.text(-0.2, 7 - block + 0.45, f"block {block}", ha="right", va="center", fontsize=8)
    left.set_xlim(-3, 11)
    left.set_ylim(0, 4.6)
    left.axis("off")
    left.set_title(f"logical keys (block_size = {block_size})")
    right.set_xlim(-1.8, block_size + 0.2)
    right.set_ylim(-0.2, 8.2)
    right.axis("off")
    right.set_title("the cache: 8 physical blocks of 4 slots (sequence:position)")
    fig.suptitle("A paged KV cache: position p of sequence b is slot p % block_size of block "
                 "block_table[b, p // block_size]; unused entries (-1) are never read", fontsize=10)
    fig.tight_layout()
    _save(fig, out / "paged_block_table.png")


def head_tail_ring(out: Path) -> None:
    world = 4
    chunks = 2 * world
    owner = {chunk: rank for rank in range(world) for chunk in chunk_ids(rank, world, "head_tail")}
    fig, (top, grid) = plt.subplots(1, 2, figsize=(10.5, 4.6), gridspec_kw={"width_ratios": [1, 1.1]})
    for chunk in range(chunks):
        top.add_patch(Rectangle((chunk, 0), 0.94, 1, color=SEQUENCE_COLOURS[owner[chunk]]))
        top.text(chunk + 0.47, 0.5, f"chunk {chunk}\nrank {owner[chunk]}", ha="center", va="center", fontsize=8,
                 color="white")
    for rank in range(world):
        ids = chunk_ids(rank, world, "head_tail")
        top.text(0, -0.5 - 0.45 * rank, f"rank {rank} holds chunks {ids[0]} and {ids[1]} (one from the head, "
                 "one from the tail)", fontsize=8, color=SEQUENCE_COLOURS[rank])
    top.set_xlim(-0.1, chunks + 0.1)
    top.set_ylim(-2.4, 1.4)
    top.axis("off")
    top.set_title(f"head-tail sharding of one sequence over {world} ranks ({chunks} chunks)")
    work = [[0.0] * world for _ in range(world)]
    for q_chunk in range(chunks):
        for kv_chunk in range(chunks):
            if kv_chunk > q_chunk:  # causal: masked block
                continue
            step = (owner[q_chunk] - owner[kv_chunk]) % world  # the ring step at which the kv chunk arrives
            work[owner[q_chunk]][step] += 0.5 if kv_chunk == q_chunk else 1.0
            grid.add_patch(Rectangle((kv_chunk, chunks - 1 - q_chunk), 0.94, 0.94,
                                     color=SEQUENCE_COLOURS[owner[q_chunk]],
                                     alpha=0.55 if kv_chunk == q_chunk else 1.0))
            grid.text(kv_chunk + 0.47, chunks - 1 - q_chunk + 0.47, str(step), ha="center", va="center",
                      fontsize=8, color="white")
    grid.set_xlim(-0.1, chunks + 0.1)
    grid.set_ylim(-0.1, chunks + 0.1)
    grid.set_xticks([c + 0.47 for c in range(chunks)], range(chunks))
    grid.set_yticks([chunks - 1 - c + 0.47 for c in range(chunks)], range(chunks))
    grid.tick_params(length=0, labelsize=8)
    grid.set_xlabel("key chunk")
    grid.set_ylabel("query chunk")
    for spine in grid.spines.values():
        spine.set_visible(False)
    per_step = {amount for row in work for amount in row}
    balance = (f"every rank computes {per_step.pop():g} blocks at every step ({sum(work[0]):g} in all)"
               if len(per_step) == 1 else
               f"blocks per rank and step: {work}")
    # load_balance=None: rank r holds chunk r of P, here chunks 2r and 2r + 1 of the 2P drawn.
    contiguous = [sum(q - 0.5 for q in (2 * rank + 1, 2 * rank + 2)) for rank in range(world)]
    grid.set_title("causal blocks: colour = the rank that computes it, number = the ring step\n"
                   f"(a diagonal block counts half): {balance};\nwithout head-tail (chunk r of {world} on rank r) "
                   f"the ranks compute {', '.join(f'{w:g}' for w in contiguous)} blocks", fontsize=9)
    fig.tight_layout()
    _save(fig, out / "head_tail_ring.png")


def lse_merge(out: Path) -> None:
    scores = torch.tensor([0.3, 1.9, -0.4, 0.8, 2.4, -1.0, 0.1, 1.2, 0.6, -0.2], dtype=torch.float64)
    split = 6
    values = torch.eye(len(scores), dtype=torch.float64)  # one-hot values: an output row is its probabilities
    parts = [(scores[:split], values[:split]), (scores[split:], values[split:])]
    lses = [torch.logsumexp(s, 0) for s, _ in parts]
    outs = [torch.softmax(s, 0) @ v for s, v in parts]
    merged, merged_lse = merge_lse(lses, outs)
    full = torch.softmax(scores, 0)
    assert torch.allclose(merged, full) and torch.allclose(merged_lse, torch.logsumexp(scores, 0))
    fig, axes = plt.subplots(1, 3, figsize=(10.5, 3.3), sharey=True)
    keys = range(len(scores))
    for k, (ax, out_k, lse_k) in enumerate(zip(axes[:2], outs, lses, strict=True)):
        ax.bar(keys, out_k.numpy(), color=SEQUENCE_COLOURS[k])
        ax.set_title(f"block {k + 1}: softmax over its own keys\nlse{k + 1} = {lse_k.item():.3f}")
        ax.set_xlabel("key")
    weights = [torch.exp(lse_k - merged_lse) for lse_k in lses]
    axes[2].bar(keys, (outs[0] * weights[0]).numpy(), color=SEQUENCE_COLOURS[0], label="block 1 x exp(lse1 - lse)")
    axes[2].bar(keys, (outs[1] * weights[1]).numpy(), color=SEQUENCE_COLOURS[1], label="block 2 x exp(lse2 - lse)")
    axes[2].plot(keys, full.numpy(), "k_", markersize=14, label="softmax over all keys")
    axes[2].set_title(f"merged: lse = log(e^lse1 + e^lse2) = {merged_lse.item():.3f}\nequals the softmax over all keys")
    axes[2].set_xlabel("key")
    axes[2].legend(fontsize=7, loc="upper left")
    axes[0].set_ylabel("probability (the output with one-hot values)")
    fig.tight_layout()
    _save(fig, out / "lse_merge.png")


FIGURES: dict[str, Callable[[Path], None]] = {
    "mask_modes": mask_modes,
    "tnd_packing": tnd_packing,
    "paged_block_table": paged_block_table,
    "head_tail_ring": head_tail_ring,
    "lse_merge": lse_merge,
}


def _save(fig, path: Path) -> None:
    # No software version or date in the file: the same figure gives the same bytes on every run.
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=IMAGES)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with plt.rc_context(STYLE):
        for draw in FIGURES.values():
            draw(args.out)
    return [args.out / f"{name}.png" for name in FIGURES]


if __name__ == "__main__":
    for written in main():
        print(written)
