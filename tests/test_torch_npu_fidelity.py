"""torch_npu fidelity beyond signatures: TND end-of-document padding against the float64 oracle, lengths with other
layouts, the dropout protocols (v1/v2/v3 seed/offset/numels round trips, external dropout_mask, explicit seed), the
generator seeded from torch.initial_seed() across processes, and install() (import torch_npu, torch.ops.npu)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import cann_attn
import cann_attn.torch_npu as torch_npu
from cann_attn import library
from cann_attn.testing.oracle import fa_forward_oracle
from cann_attn.testing.precision import assert_close_to_oracle
from patience import HANG_SECONDS

F32, F64 = torch.float32, torch.float64
FLT_MAX = 3.4028234663852886e38
N, D = 2, 8
Q_LENS, KV_LENS = [3, 0, 4], [4, 2, 5]  # a middle sequence with no query tokens
Q_PAD, KV_PAD = 5, 3  # end-of-document padding tokens after the last sequence


def _ends(lengths):
    out, acc = [], 0
    for n in lengths:
        acc += n
        out.append(acc)
    return out


def _eod_inputs(rng, form: str):
    """(q, k, v, dy, q_ends, kv_ends): TND tensors with padding rows full of NaN (a kernel reading them as keys, or
    their dy, would poison the real results). form "zeros": lists padded with zeros (torch_npu's documented form);
    "short": the last end simply below T."""
    tq, tk = sum(Q_LENS), sum(KV_LENS)
    q = torch.randn(tq + Q_PAD, N, D, generator=rng)
    k, v = (torch.randn(tk + KV_PAD, N, D, generator=rng) for _ in range(2))
    dy = torch.randn(tq + Q_PAD, N, D, generator=rng)
    for t, real in ((q, tq), (k, tk), (v, tk), (dy, tq)):
        t[real:] = float("nan")
    q_ends, kv_ends = _ends(Q_LENS), _ends(KV_LENS)
    if form == "zeros":
        q_ends, kv_ends = [*q_ends, 0, 0], [*kv_ends, 0, 0]
    return q, k, v, dy, q_ends, kv_ends


def _oracle(q, k, v, dy, mode, softmax_layout):
    """Float64 outputs, statistics and gradients of the real tokens only."""
    tq, tk = sum(Q_LENS), sum(KV_LENS)
    leaves = [t[:n].to(F64).requires_grad_() for t, n in ((q, tq), (k, tk), (v, tk))]
    mask = cann_attn.compressed_mask(mode) if mode else None
    out, smax, ssum = fa_forward_oracle(*leaves, N, "TND", atten_mask=mask, sparse_mode=mode, scale_value=0.3,
                                        actual_seq_qlen=_ends(Q_LENS), actual_seq_kvlen=_ends(KV_LENS),
                                        softmax_layout=softmax_layout)
    out.backward(dy[:tq].to(F64))
    return out.detach(), smax, ssum, [t.grad for t in leaves]


def _check_eod(out, smax, ssum, grads, golden, softmax_layout):
    tq, tk = sum(Q_LENS), sum(KV_LENS)
    g_out, g_max, g_sum, g_grads = golden
    assert_close_to_oracle(out[:tq], g_out, dtype=F32, name="attention_out")
    assert torch.equal(out[tq:], torch.zeros_like(out[tq:]))
    for name, stat, g_stat, invalid in (("softmax_max", smax, g_max, -FLT_MAX), ("softmax_sum", ssum, g_sum, FLT_MAX)):
        # Either layout: the real rows' statistics are the first tq*N*8 elements (docs/semantics/softmax-stats.md).
        real = stat.reshape(-1)[: tq * N * 8].reshape(tq, N, 8)
        torch.testing.assert_close(real.to(F64), g_stat, rtol=2e-6, atol=1e-6, msg=name)
        assert (stat.reshape(-1)[tq * N * 8:] == invalid).all(), name
    for name, grad, g_grad, real in zip(("dq", "dk", "dv"), grads, g_grads, (tq, tk, tk), strict=True):
        assert_close_to_oracle(grad[:real], g_grad, dtype=F32, name=name)
        assert torch.equal(grad[real:], torch.zeros_like(grad[real:])), name


EOD_CASES = [("zeros", 0, "", "reference"), ("short", 3, "TND", "reference"), ("zeros", 3, "", "reference"),
             ("short", 0, "", "triton")]


@pytest.mark.parametrize(("form", "mode", "softmax_layout", "backend"), EOD_CASES)
def test_eod_padded_tnd_matches_the_oracle_on_real_tokens(form, mode, softmax_layout, backend, rng):
    """cann_attn.flash_attention_score / _grad: the real tokens match float64, the padding gives 0 output,
    invalid-row statistics and zero gradients, and its NaN keys, values and dy are never read."""
    q, k, v, dy, q_ends, kv_ends = _eod_inputs(rng, form)
    mask = cann_attn.compressed_mask(mode) if mode else None
    kw = dict(actual_seq_qlen=q_ends, actual_seq_kvlen=kv_ends, scale_value=0.3, atten_mask=mask, sparse_mode=mode,
              softmax_layout=softmax_layout, backend=backend)
    fwd = cann_attn.flash_attention_score(q, k, v, N, "TND", **kw)
    grads = cann_attn.flash_attention_score_grad(q, k, v, dy, N, "TND", softmax_max=fwd.softmax_max,
                                                 softmax_sum=fwd.softmax_sum, attention_in=fwd.attention_out, **kw)
    golden = _oracle(q, k, v, dy, mode, softmax_layout)
    _check_eod(fwd.attention_out, fwd.softmax_max, fwd.softmax_sum, grads[:3], golden, softmax_layout)


@pytest.mark.parametrize("spelling", ["v1", "v2", "v3"])
def test_eod_padded_tnd_through_the_torch_npu_spellings(spelling, rng):
    """The same through npu_fusion_attention(_v2/_v3) and their grads, and through autograd of the forward."""
    q, k, v, dy, q_ends, kv_ends = _eod_inputs(rng, "zeros")
    golden = _oracle(q, k, v, dy, 3, "")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    common = dict(atten_mask=cann_attn.compressed_mask(3), sparse_mode=3)
    if spelling == "v1":
        fwd = torch_npu.npu_fusion_attention(*leaves, N, "TND", scale=0.3, actual_seq_qlen=q_ends,
                                             actual_seq_kvlen=kv_ends, **common)
        grads = torch_npu.npu_fusion_attention_grad(q, k, v, dy, N, "TND", softmax_max=fwd[1], softmax_sum=fwd[2],
                                                    attention_in=fwd[0].detach(), scale_value=0.3,
                                                    actual_seq_qlen=q_ends, actual_seq_kvlen=kv_ends, **common)
    elif spelling == "v2":
        fwd = torch_npu.npu_fusion_attention_v2(*leaves, N, "TND", scale=0.3, actual_seq_qlen=q_ends,
                                                actual_seq_kvlen=kv_ends, **common)
        grads = torch_npu.npu_fusion_attention_grad_v2(q, k, v, dy, N, "TND", softmax_max=fwd[1],
                                                       softmax_sum=fwd[2], attention_in=fwd[0].detach(),
                                                       scale_value=0.3, actual_seq_qlen=q_ends,
                                                       actual_seq_kvlen=kv_ends, **common)
    else:
        q_len, kv_len = torch.tensor(q_ends), torch.tensor(kv_ends)  # v3 takes length tensors
        fwd = torch_npu.npu_fusion_attention_v3(*leaves, N, "TND", scale=0.3, actual_seq_qlen=q_len,
                                                actual_seq_kvlen=kv_len, **common)
        grads = torch_npu.npu_fusion_attention_grad_v3(q, k, v, dy, N, "TND", softmax_max=fwd[1],
                                                       softmax_sum=fwd[2], attention_in=fwd[0].detach(),
                                                       scale_value=0.3, actual_seq_qlen=q_len,
                                                       actual_seq_kvlen=kv_len, **common)
    _check_eod(fwd[0].detach(), fwd[1], fwd[2], grads[:3], golden, "")
    fwd[0].backward(torch.nan_to_num(dy, nan=0.0))  # autograd: the same gradients as the grad spelling
    for leaf, grad in zip(leaves, grads[:3], strict=True):
        torch.testing.assert_close(leaf.grad, grad, rtol=1e-5, atol=1e-6)


def test_eod_padded_tnd_with_dropout(rng):
    """numels counts the real sequences only (N1 * sum(Sq_b * Skv_b)); the mask regenerated from (seed, offset)
    gives the oracle's output, and the grad spelling autograd's gradients."""
    q, k, v, dy, q_ends, kv_ends = _eod_inputs(rng, "zeros")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch_npu.npu.manual_seed(31)
    out, smax, ssum, _, seed, offset, numels = torch_npu.npu_fusion_attention(
        *leaves, N, "TND", scale=0.3, keep_prob=0.8, actual_seq_qlen=q_ends, actual_seq_kvlen=kv_ends)
    assert (seed, offset, numels) == (31, 0, N * sum(a * b for a, b in zip(Q_LENS, KV_LENS, strict=True)))
    tq, tk = sum(Q_LENS), sum(KV_LENS)
    golden = fa_forward_oracle(q[:tq].to(F64), k[:tk].to(F64), v[:tk].to(F64), N, "TND", scale_value=0.3,
                               keep_prob=0.8, drop_mask=library.dropout_mask(seed, offset, numels, 0.8),
                               actual_seq_qlen=_ends(Q_LENS), actual_seq_kvlen=_ends(KV_LENS))[0]
    assert_close_to_oracle(out[:tq].detach(), golden, dtype=F32, name="attention_out")
    assert torch.equal(out[tq:], torch.zeros_like(out[tq:]))
    grads = torch_npu.npu_fusion_attention_grad(q, k, v, dy, N, "TND", softmax_max=smax, softmax_sum=ssum,
                                                attention_in=out.detach(), scale_value=0.3, keep_prob=0.8,
                                                seed=seed, offset=offset, numels=numels, actual_seq_qlen=q_ends,
                                                actual_seq_kvlen=kv_ends)
    out.backward(torch.nan_to_num(dy, nan=0.0))
    for leaf, grad in zip(leaves, grads[:3], strict=True):
        torch.testing.assert_close(leaf.grad, grad, rtol=1e-5, atol=1e-6)


def test_eod_padding_beyond_t_and_no_padding_for_other_layouts_stay_errors(rng):
    q = torch.randn(6, N, D, generator=rng)
    with pytest.raises(cann_attn.ParamInvalidError, match="actual_seq_kvlen"):
        cann_attn.flash_attention_score(q, q, q, N, "TND", actual_seq_qlen=[6], actual_seq_kvlen=[7])
    with pytest.raises(cann_attn.ParamInvalidError, match="actual_seq_qlen"):
        cann_attn.flash_attention_score(q, q, q, N, "TND", actual_seq_qlen=[4, 2, 0], actual_seq_kvlen=[4, 6, 6])


# ------------------------------------------------------------------------------------ lengths with other layouts
@pytest.mark.parametrize("layout", ["BSND", "BNSD", "BSH", "SBH"])
def test_lengths_with_a_non_tnd_layout_are_ignored_with_one_warning(layout, rng):
    """FlashAttentionScore's tiling reads actual_seq_qlen/kvlen only for TND: the call equals the one without them,
    with exactly one UserWarning naming each length given (forward and grad)."""
    shape = {"BSND": (1, 4, N, D), "BNSD": (1, N, 4, D), "BSH": (1, 4, N * D), "SBH": (4, 1, N * D)}[layout]
    q = torch.randn(shape, generator=rng)
    plain = torch_npu.npu_fusion_attention(q, q, q, N, layout, scale=0.3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        given = torch_npu.npu_fusion_attention(q, q, q, N, layout, scale=0.3, actual_seq_qlen=[2])
    assert [str(w.message).split(":")[0] for w in caught] == ["actual_seq_qlen"]
    assert caught[0].category is UserWarning and caught[0].filename == __file__
    assert torch.equal(given[0], plain[0]) and given[6] == plain[6]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch_npu.npu_fusion_attention_grad(q, q, q, q, N, layout, scale_value=0.3, actual_seq_kvlen=[3])
    assert [str(w.message).split(":")[0] for w in caught] == ["actual_seq_kvlen"]


# ------------------------------------------------------------------------------------------------- dropout
def _bsh(rng):
    return [torch.randn(2, 5, N * D, generator=rng).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("spelling", ["v1", "v2", "v3"])
def test_forward_grad_round_trip_regenerates_the_mask(spelling, rng):
    """The grad spelling given the forward's seed/offset (and numels) equals autograd, which reuses the mask the
    forward drew: the regenerated mask is the same. A second forward draws a different mask."""
    q, k, v = _bsh(rng)
    dy = torch.randn(2, 5, N * D, generator=rng)
    torch_npu.manual_seed(11)
    kw = dict(scale=0.3, keep_prob=0.7)
    if spelling == "v3":
        fwd = torch_npu.npu_fusion_attention_v3(q, k, v, N, "BSH", **kw)
        assert fwd[4].shape == (1,) and fwd[4].dtype == torch.int64 and int(fwd[4]) == 11 and int(fwd[5]) == 0
        dropout = dict(seed=fwd[4], offset=fwd[5])
    else:
        forward = torch_npu.npu_fusion_attention if spelling == "v1" else torch_npu.npu_fusion_attention_v2
        fwd = forward(q, k, v, N, "BSH", **kw)
        assert fwd[4:] == (11, 0, 2 * N * 5 * 5)
        dropout = dict(seed=fwd[4], offset=fwd[5], numels=fwd[6])
    grad = {"v1": torch_npu.npu_fusion_attention_grad, "v2": torch_npu.npu_fusion_attention_grad_v2,
            "v3": torch_npu.npu_fusion_attention_grad_v3}[spelling]
    grads = grad(q, k, v, dy, N, "BSH", softmax_max=fwd[1], softmax_sum=fwd[2], attention_in=fwd[0].detach(),
                 scale_value=0.3, keep_prob=0.7, **dropout)
    fwd[0].backward(dy)
    for leaf, g in zip((q, k, v), grads[:3], strict=True):
        assert torch.equal(leaf.grad, g)
    again = torch_npu.npu_fusion_attention(q, k, v, N, "BSH", **kw)
    assert again[5] == 2 * N * 5 * 5 and not torch.equal(again[0], fwd[0])


def test_external_dropout_mask_and_explicit_seed(rng):
    """dropout_mask= is used as given and seed/offset come back as passed; a non-zero seed without a mask draws at
    (seed, offset) ("若seed非0，则使用指定的种子值生成dropout mask"); neither advances the generator."""
    q, k, v = _bsh(rng)
    numels = 2 * N * 5 * 5
    torch_npu.manual_seed(3)
    before = torch_npu.get_rng_state()
    mask = library.dropout_mask(77, 40, numels, 0.6)
    ext = torch_npu.npu_fusion_attention(q, k, v, N, "BSH", scale=0.3, keep_prob=0.6, dropout_mask=mask, seed=77,
                                         offset=40)
    seeded = torch_npu.npu_fusion_attention(q, k, v, N, "BSH", scale=0.3, keep_prob=0.6, seed=77, offset=40)
    v2 = torch_npu.npu_fusion_attention_v2(q, k, v, N, "BSH", scale=0.3, keep_prob=0.6, seed=77, offset=40)
    direct = cann_attn.flash_attention_score(q, k, v, N, "BSH", scale_value=0.3, keep_prob=0.6, drop_mask=mask)
    assert torch.equal(torch_npu.get_rng_state(), before)
    for out in (ext, seeded, v2):
        assert out[4:] == (77, 40, numels) and torch.equal(out[0], direct.attention_out)
    other = library.dropout_mask(78, 40, numels, 0.6)
    assert not torch.equal(torch_npu.npu_fusion_attention(q, k, v, N, "BSH", scale=0.3, keep_prob=0.6,
                                                          dropout_mask=other, seed=78, offset=40)[0], ext[0])
    with pytest.raises(cann_attn.ParamInvalidError, match=r"\] dropout_mask:"):
        torch_npu.npu_fusion_attention(q, k, v, N, "BSH", keep_prob=0.6, dropout_mask=mask[:4])
    with pytest.raises(cann_attn.ParamInvalidError, match=r"\] dropout_mask:"):
        torch_npu.npu_fusion_attention(q, k, v, N, "BSH", keep_prob=0.6, dropout_mask=mask.to(torch.int32))
    with pytest.raises(cann_attn.ParamInvalidError, match=r"\] seed/offset:"):
        torch_npu.npu_fusion_attention_grad_v3(q, k, v, q, N, "BSH", keep_prob=0.6)
    assert torch.equal(torch_npu.get_rng_state(), before)


# ---------------------------------------------------------------------------------------------------- RNG
def test_generator_follows_torch_seed_and_the_npu_api():
    torch.manual_seed(1234)
    assert torch_npu.npu.initial_seed() == 1234 and torch_npu.get_rng_state().tolist() == [1234, 0]
    torch_npu.npu.manual_seed(5)
    state = torch_npu.npu.get_rng_state()
    assert state.dtype == torch.uint8 and state.shape == (16,) and torch_npu.npu.initial_seed() == 5
    torch_npu.npu.set_rng_state(torch.tensor([9, 64], dtype=torch.int64).view(torch.uint8))
    assert torch_npu.get_rng_state().tolist() == [9, 64]
    torch_npu.npu.set_rng_state(state)
    assert torch_npu.get_rng_state().tolist() == [5, 0]
    torch_npu.npu.manual_seed_all(6)
    assert torch_npu.npu.initial_seed() == 6
    torch_npu.npu.seed()
    assert torch_npu.get_rng_state()[1] == 0
    torch.manual_seed(77)  # a new torch seed reseeds it, as torch_npu's NPU generator
    assert torch_npu.get_rng_state().tolist() == [77, 0]


def _draw_in_process(rank: int, seeds: list[int], out_dir: str) -> None:
    """Spawned worker: seed torch only, draw one dropout forward, save its output and (seed, offset)."""
    import torch as _torch

    import cann_attn.torch_npu as _torch_npu

    _torch.manual_seed(seeds[rank])
    gen = _torch.Generator().manual_seed(0)  # the same inputs everywhere
    q = _torch.randn(1, 6, 8, generator=gen)
    out = _torch_npu.npu_fusion_attention(q, q, q, 1, "BSH", scale=0.3, keep_prob=0.5)
    _torch.save({"out": out[0], "seed": out[4], "offset": out[5]}, os.path.join(out_dir, f"{rank}.pt"))


def test_processes_seeded_differently_draw_different_masks(tmp_path):
    """torch.multiprocessing (spawn, no process group): rank 0 seeds torch with 1, rank 1 with 2; this process,
    seeded with 1 as well, draws rank 0's mask again."""
    seeds = [1, 2]
    torch.multiprocessing.spawn(_draw_in_process, args=(seeds, str(tmp_path)), nprocs=len(seeds))
    r0, r1 = (torch.load(tmp_path / f"{r}.pt") for r in range(2))
    assert (r0["seed"], r1["seed"]) == (1, 2)
    assert not torch.equal(r0["out"], r1["out"])
    (tmp_path / "here").mkdir()
    _draw_in_process(0, seeds, str(tmp_path / "here"))
    here = torch.load(tmp_path / "here" / "0.pt")
    assert here["seed"] == 1 and torch.equal(here["out"], r0["out"])


# -------------------------------------------------------------------------------------------------- install
def _run(script: str, extra_path: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    paths = [p for p in (extra_path, "src", env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                          timeout=HANG_SECONDS)


def test_install_then_import_torch_npu_and_call_torch_ops_npu():
    script = """
        import cann_attn.torch_npu
        cann_attn.torch_npu.install()
        cann_attn.torch_npu.install()  # again: nothing to redefine

        import torch
        import torch_npu  # resolves to cann_attn.torch_npu
        from torch_npu.npu import manual_seed

        assert torch_npu is cann_attn.torch_npu and callable(manual_seed)
        q = torch.randn(1, 4, 16, requires_grad=True)
        torch.manual_seed(21)  # seeds the dropout generator too, as torch_npu's NPU generator
        out = torch.ops.npu.npu_fusion_attention(q, q, q, 2, "BSH", scale=0.3, keep_prob=0.9)
        assert len(out) == 7 and out[4:6] == (21, 0)
        ref = torch_npu.npu_fusion_attention(q, q, q, 2, "BSH", scale=0.3, keep_prob=0.9, seed=21, offset=0)
        assert torch.equal(out[0], ref[0])
        out[0].sum().backward()  # differentiable through torch.ops.npu
        assert q.grad is not None and q.grad.abs().sum() > 0
        grads = torch.ops.npu.npu_fusion_attention_grad(q, q, q, torch.ones_like(out[0]), 2, "BSH",
                                                        softmax_max=out[1], softmax_sum=out[2],
                                                        attention_in=out[0], scale_value=0.3)
        assert len(grads) == 5 and grads[3] is None and grads[4].shape == (0,)
        for name, op in cann_attn.torch_npu.OPS.items():  # "name.overload" lives on the packet "name"
            packet, _, overload = op.schema("current").name.partition(".")
            assert hasattr(getattr(getattr(torch.ops, op.namespace), packet), overload or "default"), name
        assert {op.namespace for op in cann_attn.torch_npu.OPS.values()} == {"npu", "atb"}
        x16 = torch.randn(3, 2, 8).half()
        out16 = torch.empty_like(x16)
        assert torch.ops.atb._npu_flash_attention_unpad(x16, x16, x16, torch.tensor([1, 2], dtype=torch.int32), 0.3,
                                                        2, 2, out16) is None
        ref16 = torch.empty_like(x16)
        torch_npu._npu_flash_attention_unpad(x16, x16, x16, torch.tensor([1, 2], dtype=torch.int32), 0.3, 2, 2, ref16)
        assert torch.equal(out16, ref16)
        mask = torch.ops.npu._npu_dropout_gen_mask(x16, [40], 0.5, 3, 0)
        assert torch.equal(mask, torch_npu._npu_dropout_gen_mask(x16, [40], 0.5, 3, 0)) and mask.shape == (16,)
        pfa = lambda q: torch.ops.npu.npu_prompt_flash_attention(q, q, q, num_heads=2, scale_value=0.3)
        x = q.detach()
        assert torch.equal(torch.compile(pfa, fullgraph=True, backend="aot_eager")(x), pfa(x))
        print("ok")
    """
    result = _run(script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok"]


def test_install_refuses_a_real_torch_npu(tmp_path):
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text("")
    script = """
        import cann_attn.torch_npu
        try:
            cann_attn.torch_npu.install()
        except cann_attn.torch_npu.TorchNpuPresentError as error:
            print("refused", "torch_npu" in str(error))
    """
    result = _run(script, extra_path=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["refused", "True"]


def test_kl_loss_sinks_are_in_the_signature_but_refused():
    """`sinks` (current schema of npu_sparse_lightning_indexer_grad_kl_loss) is accepted as None; a tensor raises
    before any work (npu_sparse_flash_attention's sinks are supported: tests/test_sinks.py)."""
    t = torch.zeros(1, 1, 1, 8)
    with pytest.raises(cann_attn.ParamInvalidError, match=r"\] sinks: not supported"):
        torch_npu.npu_sparse_lightning_indexer_grad_kl_loss(t, t, t, t, t, t.int(), t, t, 1.0, sinks=torch.zeros(1))
