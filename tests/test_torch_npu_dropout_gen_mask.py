"""torch_npu._npu_dropout_gen_mask: the keep bits npu_fusion_attention draws, so that a golden built the way
op-plugin's and Ascend/pytorch's flash-attention tests build theirs matches the attention (docs/guides/torch_npu.md,
"Random numbers")."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import cann_attn.torch_npu as torch_npu
from cann_attn.errors import ParamInvalidError
from patience import HANG_SECONDS


def _peer_drop_mask(q, numel: int, seed: int, gen_p: float) -> torch.Tensor:
    """The peer tests' get_drop_mask: seed the NPU generator, draw with _npu_dropout_gen_mask at (seed, 0),
    unpack little-endian."""
    torch_npu.npu.manual_seed(seed)
    packed = torch_npu._npu_dropout_gen_mask(q, [numel], p=gen_p, seed=seed, offset=0, parallel=True, sync=False)
    return torch.from_numpy(np.unpackbits(packed.numpy(), count=numel, bitorder="little")).to(torch.float64)


def _golden(q, k, v, scale, keep, keep_prob):
    """[B, N, S, D] float64: softmax(q k^T * scale) * keep / keep_prob @ v, the peer tests' formula."""
    probs = torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1)
    return (probs * keep / keep_prob) @ v


def test_peer_golden_with_the_gen_mask_equals_fusion_attention_bsh():
    """test_npu_flash_attention_with_dropmask, op-plugin: BNSD golden with the mask, BSH operator call."""
    b, n, s, d, keep_prob = 1, 4, 24, 16, 0.9
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d, generator=gen) for _ in range(3))
    keep = _peer_drop_mask(q, b * n * s * s, seed=2, gen_p=1 - keep_prob).reshape(b, n, s, s)
    golden = _golden(q.double(), k.double(), v.double(), 0.125, keep, keep_prob)
    bsh = [t.transpose(1, 2).reshape(b, s, n * d) for t in (q, k, v)]
    out = torch_npu.npu_fusion_attention(*bsh, head_num=n, input_layout="BSH", scale=0.125, keep_prob=keep_prob)[0]
    assert 0 < keep.mean() < 1
    torch.testing.assert_close(out.double(), golden.transpose(1, 2).reshape(b, s, n * d), rtol=2e-5, atol=2e-5)


def test_peer_golden_with_the_gen_mask_equals_fusion_attention_tnd_gqa():
    """test_npu_flash_attention_tnd_with_dropmask: one mask of N1 * sum(Sq_b * Skv_b) bits, sequence b's block
    [N1, Sq_b, Skv_b] after the previous ones; GQA keys broadcast to the query heads."""
    n1, n2, d, keep_prob = 4, 2, 8, 0.8
    seq_q, seq_kv = [1, 2, 3], [3, 4, 5]
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(sum(seq_q), n1, d, generator=gen)
    k, v = (torch.randn(sum(seq_kv), n2, d, generator=gen) for _ in range(2))
    sizes = [a * c for a, c in zip(seq_q, seq_kv, strict=True)]
    keep = _peer_drop_mask(q, n1 * sum(sizes), seed=2, gen_p=1 - keep_prob)
    scale = d ** -0.5
    golden, q0, k0, base = [], 0, 0, 0
    for sq, skv in zip(seq_q, seq_kv, strict=True):
        qi = q[q0:q0 + sq].double().permute(1, 0, 2)
        ki, vi = (t[k0:k0 + skv].double().permute(1, 0, 2).repeat_interleave(n1 // n2, 0) for t in (k, v))
        keep_i = keep[base:base + n1 * sq * skv].reshape(n1, sq, skv)
        golden.append(_golden(qi, ki, vi, scale, keep_i, keep_prob).permute(1, 0, 2))
        q0, k0, base = q0 + sq, k0 + skv, base + n1 * sq * skv
    cum_q, cum_kv = np.cumsum(seq_q).tolist(), np.cumsum(seq_kv).tolist()
    out = torch_npu.npu_fusion_attention(q, k, v, n1, "TND", scale=scale, keep_prob=keep_prob,
                                         actual_seq_qlen=cum_q, actual_seq_kvlen=cum_kv)[0]
    torch.testing.assert_close(out.double(), torch.cat(golden), rtol=2e-5, atol=2e-5)


def test_the_bits_depend_on_seed_and_offset_as_the_attention_draw_does():
    """The mask at (seed, offset) is the attention's mask at the same pair and no other: a golden drawn at another
    offset would not match (so the peer test above can fail)."""
    x = torch.zeros(1)
    numel = 4 * 8 * 8
    at = {pair: torch_npu._npu_dropout_gen_mask(x, [numel], 0.3, *pair) for pair in [(5, 0), (5, 64), (6, 0)]}
    assert not torch.equal(at[(5, 0)], at[(5, 64)]) and not torch.equal(at[(5, 0)], at[(6, 0)])
    torch_npu.npu.manual_seed(5)
    state = torch_npu.get_rng_state()
    assert state.tolist() == [5, 0]
    from cann_attn.library import dropout_mask
    assert torch.equal(at[(5, 64)][: numel // 8], dropout_mask(5, 64, numel, 0.7))


@pytest.mark.parametrize("size", [[17, 19], [32, 16], [1], [0], [3, 0, 5]])
def test_length_is_rounded_to_128_bits_and_padding_bits_are_zero(size):
    numel = math.prod(size)
    mask = torch_npu._npu_dropout_gen_mask(torch.zeros(2, dtype=torch.float16), size, 0.0, 1, 0)
    assert mask.dtype == torch.uint8 and mask.shape == (math.ceil(numel / 128) * 16,)
    bits = np.unpackbits(mask.numpy(), bitorder="little")
    assert bits[:numel].all() and not bits[numel:].any()  # p = 0 keeps everything


def test_p_one_keeps_nothing_and_tensor_seeds_are_read():
    mask = torch_npu._npu_dropout_gen_mask(torch.zeros(1), [40], 1.0, torch.tensor([3]), torch.tensor(8))
    assert not mask.any()
    drawn = torch_npu._npu_dropout_gen_mask(torch.zeros(1), [40], 0.5, torch.tensor([3])[0], 8)
    assert torch.equal(drawn, torch_npu._npu_dropout_gen_mask(torch.zeros(1), [40], 0.5, 3, 8))


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"p": 1.5}, "p"), ({"p": -0.1}, "p"), ({"size": [2, -1]}, "size"), ({"size": 8}, "size"),
    ({"seed": 1.5}, "seed"), ({"self": None}, "self"),
])
def test_bad_arguments_name_the_parameter(kwargs, param):
    args = {"self": torch.zeros(1), "size": [8], "p": 0.1, "seed": 1, "offset": 0} | kwargs
    with pytest.raises(ParamInvalidError, match=rf"\] {param}:"):
        torch_npu._npu_dropout_gen_mask(**args)


def test_peer_test_runs_unchanged_after_install():
    """A peer golden as op-plugin's flash-attention tests write it: import torch_npu, torch.npu.manual_seed, the
    mask drawn on an .npu() tensor, the attention on .npu() inputs; after install(device="cpu") it runs as
    written and matches."""
    script = """
        import cann_attn.torch_npu
        cann_attn.torch_npu.install(device="cpu")
        import numpy as np
        import torch
        import torch_npu

        def peer_mask(q, count, seed, p):
            torch.npu.manual_seed(seed)
            packed = torch_npu._npu_dropout_gen_mask(q.npu(), [count], p=p, seed=seed, offset=0, parallel=True,
                                                     sync=False)
            return torch.from_numpy(np.unpackbits(packed.cpu().numpy(), count=count, bitorder="little"))

        q, k, v = (torch.randn(1, 4, 32, 16, dtype=torch.float16) for _ in range(3))
        keep_prob, scale = 0.9, 0.125
        keep = peer_mask(q, 4 * 32 * 32, 2, 1 - keep_prob).reshape(1, 4, 32, 32)
        probs = torch.softmax((q.float() @ k.float().transpose(2, 3)) * scale, dim=-1)
        golden = ((probs * keep / keep_prob) @ v.float()).transpose(1, 2).reshape(1, 32, 64)
        bsh = [t.transpose(1, 2).reshape(1, 32, 64).npu() for t in (q, k, v)]
        out = torch_npu.npu_fusion_attention(*bsh, head_num=4, input_layout="BSH", scale=scale,
                                             keep_prob=keep_prob)[0]
        assert (out.cpu().float() - golden).abs().max() < 2e-3
        print("ok")
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in ("src", os.environ.get("PYTHONPATH")) if p))
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                            timeout=HANG_SECONDS)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok"]
