"""Tiling rules of the reference FlashAttention kernels: memory bound, merged key tiles, reusable mask tiles."""

from __future__ import annotations

import pytest
import torch

from cann_attn.backends.reference.flash_forward import TILE_ELEMENTS, key_tiles, tile_shape
from cann_attn.problem.attention import Run
from cann_attn.problem.mask import SequenceMask, TileState


@pytest.mark.parametrize("heads", [1, 8, 64, 512, 4096])
@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize("seq", [(1, 1), (97, 2048), (2048, 2048), (32768, 32768)])
def test_tile_shape_stays_within_budget(heads: int, dense: bool, seq: tuple[int, int]) -> None:
    seq_q, seq_kv = seq
    rows, block_k, width = tile_shape(heads, seq_q, seq_kv, dense)
    assert 1 <= rows <= seq_q and 1 <= block_k <= width
    assert block_k <= seq_kv and width <= max(block_k, seq_kv)
    # Within the budget, or at the smallest tile the rules allow (16 rows x 128 columns) for huge head counts.
    assert heads * rows * width <= max(TILE_ELEMENTS, heads * 16 * 128)


def _run(mask: SequenceMask) -> Run:
    return Run(b0=0, count=1, seq_q=mask.seq_q, seq_kv=mask.seq_kv, q_token0=0, kv_token0=0, mask=mask)


def _visible(mask: SequenceMask, i0: int, i1: int) -> torch.Tensor:
    return ~mask.masked_tile(i0, i1, 0, mask.seq_kv, torch.device("cpu"))


MASKS = [
    SequenceMask(700, 900),  # no mask
    SequenceMask(700, 900, upper=200),  # causal, bottom-right
    SequenceMask(700, 700, lower=-300, upper=40),  # band
    SequenceMask(700, 900, upper=0, prefix=333),  # prefix
]


@pytest.mark.parametrize("mask", MASKS, ids=["dense", "causal", "band", "prefix"])
@pytest.mark.parametrize("block_k,max_width", [(128, 128), (128, 512), (256, 1024)])
def test_merged_key_tiles_cover_exactly_the_visible_columns(mask: SequenceMask, block_k: int, max_width: int):
    run = _run(mask)
    for i0 in range(0, mask.seq_q, 256):
        i1 = min(i0 + 256, mask.seq_q)
        covered = torch.zeros(mask.seq_kv, dtype=torch.bool)
        previous_end = -1
        for j0, j1, state in key_tiles(run, i0, i1, block_k, max_width):
            assert j0 >= previous_end and j1 - j0 <= max_width  # in order, disjoint, within the width
            previous_end = j1
            tile_visible = _visible(mask, i0, i1)[:, j0:j1]
            if state is TileState.FULL:
                assert bool(tile_visible.all())  # merging never hides a mask
            covered[j0:j1] = True
        # Every visible column of these rows lies in some tile.
        assert bool(covered[_visible(mask, i0, i1).any(0)].all())


@pytest.mark.parametrize("mask", MASKS[:3], ids=["dense", "causal", "band"])
def test_equal_tile_keys_mean_equal_mask_tiles(mask: SequenceMask):
    seen: dict[tuple, torch.Tensor] = {}
    for i0 in range(0, mask.seq_q, 128):
        for j0 in range(0, mask.seq_kv, 128):
            i1, j1 = min(i0 + 128, mask.seq_q), min(j0 + 128, mask.seq_kv)
            tile = mask.masked_tile(i0, i1, j0, j1, torch.device("cpu"))
            key = mask.tile_key(i0, i1, j0, j1)
            assert key is not None
            if key in seen:
                assert torch.equal(seen[key], tile)
            seen[key] = tile


def test_prefix_and_explicit_masks_have_no_tile_key():
    assert SequenceMask(64, 64, upper=0, prefix=10).tile_key(0, 16, 0, 16) is None
    explicit = torch.zeros(64, 64, dtype=torch.bool)
    assert SequenceMask(64, 64, explicit=explicit).tile_key(0, 16, 0, 16) is None


# ----------------------------------------------------------------------------------------------------------
# DSA reference: the per-tile union widths that choose between the gather and union paths
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("row_tile", [1, 8, 32])
@pytest.mark.parametrize("table_elements", [1, 64, 1 << 24])
def test_union_block_counts_match_each_tiles_distinct_blocks(block_size: int, row_tile: int, table_elements: int,
                                                             monkeypatch) -> None:
    from cann_attn.backends.reference import sparse_attention
    from cann_attn.problem.sparse import row_selection

    monkeypatch.setattr(sparse_attention, "UNION_TABLE_ELEMENTS", table_elements)  # 1 and 64 force chunking
    gen = torch.Generator().manual_seed(block_size * 100 + row_tile)
    seq_q, seq_kv, k = 75, 300, 12
    n_blocks = -(-seq_kv // block_size)
    indices = torch.randint(-1, n_blocks, (seq_q, k), generator=gen)
    selection = row_selection(indices, torch.arange(seq_q), sparse_mode=3, seq_q=seq_q, seq_kv=seq_kv,
                              block_size=block_size)
    counts = sparse_attention._union_block_counts(selection, row_tile, n_blocks)
    expected = [selection.blocks[t0:t0 + row_tile].unique().numel() for t0 in range(0, seq_q, row_tile)]
    assert counts == expected


# ----------------------------------------------------------------------------------------------------------
# FA reference: query tiles may be views of the caller's query (the scale rides on the key copy), so the kernels
# must treat every input as read-only
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("layout", "heads_kv"), [("BNSD", 4), ("BSND", 4), ("BNSD", 2), ("TND", 4)])
@pytest.mark.parametrize("pse_type", [None, 1, 2])
def test_fa_reference_never_writes_its_inputs(layout: str, heads_kv: int, pse_type: int | None) -> None:
    import cann_attn

    gen = torch.Generator().manual_seed(7)
    b, n, s, d = 1, 4, 40, 16
    shapes = {"BNSD": (b, n, s, d), "BSND": (b, s, n, d), "TND": (b * s, n, d)}
    kv_shapes = {"BNSD": (b, heads_kv, s, d), "BSND": (b, s, heads_kv, d), "TND": (b * s, heads_kv, d)}
    q = torch.randn(shapes[layout], generator=gen)
    k, v = (torch.randn(kv_shapes[layout], generator=gen) for _ in range(2))
    dy = torch.randn(shapes[layout], generator=gen)
    kw = {"scale_value": d**-0.5, "backend": "reference", "sparse_mode": 3,
          "atten_mask": cann_attn.compressed_mask(3)}
    if layout == "TND":
        kw.update(actual_seq_qlen=[s], actual_seq_kvlen=[s])
    if pse_type == 1:
        kw.update(pse=torch.randn(b, n, s, s, generator=gen), pse_type=1)
    elif pse_type == 2:
        kw.update(pse=torch.tensor([2.0**-1, 2.0**-2, 2.0**-3, 2.0**-4]), pse_type=2)
    inputs = {"query": q, "key": k, "value": v, "dy": dy, **({"pse": kw["pse"]} if "pse" in kw else {})}
    before = {name: t.clone() for name, t in inputs.items()}
    fwd = cann_attn.flash_attention_score(q, k, v, n, layout, **kw)
    cann_attn.flash_attention_score_grad(q, k, v, dy, n, layout, softmax_max=fwd.softmax_max,
                                         softmax_sum=fwd.softmax_sum, attention_in=fwd.attention_out, **kw)
    for name, t in inputs.items():
        assert torch.equal(t, before[name]), f"{name} was modified"


# ------------------------------------------------------------------------------- ALiBi tiles that underflow
ALIBI_CASES = {
    # slopes per query head (one head that never underflows keeps a partial set of entries), q/kv start, mask
    "type2": (2, [4.0, 2.0, 1.0, 0.01], 0, 0, {}),
    "type3_gqa_offsets": (3, [8.0, 6.0, 4.0, 0.001], 5, 17, {}),
    "type2_negative_slope_causal": (2, [4.0, -0.5, 2.0, 1.0], 0, 0, {"sparse_mode": 3}),
    # two sequences, one run each (fa_problem.ALIBI_PER_SEQUENCE_MIN_KV), per-sequence slopes [B, N1]
    "type2_batch2": (2, [[4.0, 2.0, 1.0, 0.01], [0.01, 1.0, 2.0, 4.0]], 0, 0, {}),
}


def _alibi_inputs(case: str, gen: torch.Generator):
    pse_type, slopes, q_start, kv_start, mask_kw = ALIBI_CASES[case]
    heads_kv = 2 if "gqa" in case else 4
    batch = 2 if "batch2" in case else 1
    q = torch.randn(batch, 1100, 4, 32, generator=gen)
    k, v = (torch.randn(batch, 1300, heads_kv, 32, generator=gen) for _ in range(2))
    kwargs = dict(pse=torch.tensor(slopes), pse_type=pse_type, scale_value=32**-0.5, q_start_idx=[q_start],
                  kv_start_idx=[kv_start], **mask_kw)
    if mask_kw:
        from cann_attn import compressed_mask

        kwargs["atten_mask"] = compressed_mask(3)
    return q, k, v, kwargs


@pytest.fixture(params=["pytorch_loop", "native_loops"])
def alibi_path(request, monkeypatch) -> str:
    """Where the ALiBi skipping runs: the PyTorch tile loop (per head and tile, `RunKernel.entries`; the fused loops
    off) or the fused native loops (per 32-row block and key piece, `alibi_reaches` in attention_loops.c)."""
    from cann_attn.backends.reference import native

    if request.param == "pytorch_loop":
        monkeypatch.setenv(native.BLAS_SWITCH, "0")
    elif not native.has_sgemm():
        pytest.skip("the fused native loops are not available here")
    return request.param


@pytest.mark.parametrize("case", list(ALIBI_CASES))
def test_alibi_tiles_that_underflow_are_skipped_without_changing_a_bit(case: str, alibi_path: str,
                                                                       monkeypatch) -> None:
    """Skipping a head's tile (or a row block's key piece) whose every term exp(s - max) would flush to 0 gives
    bitwise the outputs and gradients of computing it (tiles are visited in the same order either way), and does
    skip."""
    import cann_attn
    from cann_attn.backends.reference import flash_forward, native

    q, k, v, kwargs = _alibi_inputs(case, torch.Generator().manual_seed(7))
    dy = torch.randn(q.shape, generator=torch.Generator().manual_seed(8))
    skipped = []
    bounded, generated = flash_forward.RunKernel.entries, flash_forward.RunKernel.alibi_rows

    def spy(self, *args):
        entries = bounded(self, *args)
        skipped.append(self.skipped_head_tiles)
        return entries

    def unbounded(self, *args):  # the generated ALiBi without the norms that its skipping needs
        rows = generated(self, *args)
        return None if rows is None else native.AlibiRows(rows.slope, rows.pos, rows.sqrt_dist)

    def run(entries, alibi_rows):
        monkeypatch.setattr(flash_forward.RunKernel, "entries", entries)
        monkeypatch.setattr(flash_forward.RunKernel, "alibi_rows", alibi_rows)
        fwd = cann_attn.flash_attention_score(q, k, v, 4, "BSND", backend="reference", **kwargs)
        grad = cann_attn.flash_attention_score_grad(
            q, k, v, dy, 4, "BSND", softmax_max=fwd.softmax_max, softmax_sum=fwd.softmax_sum,
            attention_in=fwd.attention_out, backend="reference", **kwargs)
        return [*fwd[:3], *grad[:3]]

    native.alibi_skipped_terms()
    skipping = run(spy, generated)
    if alibi_path == "pytorch_loop":
        assert max(skipped) > 0, "no head tile was skipped: the case does not exercise the bound"
    else:
        assert native.alibi_skipped_terms() > 0, "no block was skipped: the case does not exercise the bound"
    computing = run(lambda self, *args: slice(0, self.run.count * self.problem.heads_kv), unbounded)
    assert native.alibi_skipped_terms() == 0
    for got, want in zip(skipping, computing, strict=True):
        assert torch.equal(got, want)


def test_alibi_with_skipped_tiles_matches_the_oracle(alibi_path: str, monkeypatch) -> None:
    import cann_attn
    from cann_attn.backends.reference import flash_forward, native
    from oracle import check_fa_result

    kernels = []
    monkeypatch.setattr(flash_forward.RunKernel, "forward",
                        lambda self, *a, _f=flash_forward.RunKernel.forward: (kernels.append(self), _f(self, *a)))
    q, k, v, kwargs = _alibi_inputs("type3_gqa_offsets", torch.Generator().manual_seed(3))
    native.alibi_skipped_terms()
    result = cann_attn.flash_attention_score(q, k, v, 4, "BSND", backend="reference", **kwargs)
    if alibi_path == "pytorch_loop":
        assert kernels and kernels[0].skipped_head_tiles > 0
    else:
        assert native.alibi_skipped_terms() > 0
    check_fa_result(result, q, k, v, 4, "BSND", **kwargs)


@pytest.mark.parametrize("start", [0, 2**17, 2**20])
def test_alibi_folded_into_the_gemm_keeps_fp32_precision_at_large_positions(start: int) -> None:
    """ALiBi type 2 folded into the Q K^T GEMM (tiles that do not straddle the diagonal) with large q/kv start
    indices, as context-parallel attention passes them: the fold works with positions relative to kv_start, so the
    error does not grow with the absolute position (it reached 5.8e-4 at start 2^17 with absolute positions; the
    oracle check's fp32 threshold is 1e-4)."""
    import cann_attn
    from oracle import check_fa_result

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 768, 3, 16, generator=gen) for _ in range(3))
    kwargs = dict(pse=torch.tensor([2**-8, 2**-5, 2**-2]), pse_type=2, q_start_idx=[start], kv_start_idx=[start],
                  scale_value=0.25, atten_mask=cann_attn.compressed_mask(3), sparse_mode=3)
    result = cann_attn.flash_attention_score(q, k, v, 3, "BSND", backend="reference", **kwargs)
    check_fa_result(result, q, k, v, 3, "BSND", **kwargs)
