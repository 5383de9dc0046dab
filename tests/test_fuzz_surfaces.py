"""A seeded fuzz corpus over the surfaces that must refuse bad input cleanly (docs/semantics/errors.md,
docs/guides/golden.md): output tensors, non-finite scales and sinks, KvQuantSparseFlashAttention's heads and
lengths, values near the float maximum, and the golden / compare files.

Every case ends one of two ways: a result that passes its check, or a typed refusal (an AclnnError; exit status 2
for the CLI) that leaves every caller tensor and directory as it was. Never a raw exception, never a silently wrong
or non-finite answer. `python tests/test_fuzz_surfaces.py [CASES]` runs the corpus and prints the outcome counts
per family (the same cases; this is how it is run under the sanitizer build of the native loops).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import cann_attn
import cann_attn.torch_npu as torch_npu
from cann_attn.errors import AclnnError
from cann_attn.testing.dsa_oracle import sparse_attention_oracle
from cann_attn.testing.precision import assert_close_to_oracle

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paged_utils import paginate
from test_kv_quant_sfa import KvQuantCase

CASES = int(os.environ.get("CANN_ATTN_FUZZ_CASES", "12"))
KV_QUANT_HEADS = (1, 2, 4, 8, 16, 32, 48, 64, 128)


def _snapshot(tensors: list[torch.Tensor]) -> list[bytes]:
    return [bytes(t.detach().contiguous().view(torch.uint8).reshape(-1).numpy()) for t in tensors
            if t.device.type == "cpu"]


def _refused_cleanly(call: Callable[[], object], tensors: list[torch.Tensor]) -> tuple[str, object]:
    """('ok', result) or ('refused', error), checking that a refusal wrote into none of `tensors`."""
    before = _snapshot(tensors)
    try:
        return "ok", call()
    except AclnnError as error:
        assert _snapshot(tensors) == before, f"refused ({error}) but a caller tensor was written"
        return "refused", error


# ------------------------------------------------------------------------------------------------- families
def atb_out(gen: torch.Generator) -> str:
    """ATB paged decode / flash attention with a random out (fresh, expanded, inside an input, wrong dtype) and a
    random scale (finite or not)."""
    r = random.Random(gen.initial_seed()).randrange
    heads, heads_kv, dim = 4, (1, 2, 4)[r(3)], 16
    scale = (0.25, 0.25, 0.25, math.nan, math.inf)[r(5)]
    lens = [int(x) for x in torch.randint(0, 40, (2,), generator=gen)]
    if r(2):
        keys = [torch.randn(n, heads_kv, dim, generator=gen).half() for n in lens]
        caches, table = paginate({"k": keys, "v": [k.clone() for k in keys]}, 16, gen)
        query = torch.randn(2, heads, dim, generator=gen).half()
        args = dict(query=query, key_cache=caches["k"], value_cache=caches["v"], num_kv_heads=heads_kv,
                    num_heads=heads, scale_value=scale, block_table=table,
                    context_lens=torch.tensor(lens, dtype=torch.int32))
        op, shape = torch_npu._npu_paged_attention, (2, heads, dim)
    else:
        tokens = sum(lens)
        query = torch.randn(tokens, heads, dim, generator=gen).half()
        key = torch.randn(tokens, heads_kv, dim, generator=gen).half()
        args = dict(query=query, key=key, value=key.clone(), seq_len=torch.tensor(lens, dtype=torch.int32),
                    scale_value=scale, num_heads=heads, num_kv_heads=heads_kv)
        op, shape = torch_npu._npu_flash_attention_unpad, (tokens, heads, dim)
    fresh = torch.full(shape, 7.0, dtype=torch.float16)
    variant = max(r(8) - 3, 0)  # half the cases a fresh out
    out = [fresh, fresh[:1].expand(shape) if shape[0] else fresh, query.flatten()[: fresh.numel()].view(shape),
           fresh.float(), fresh[..., :8]][variant]
    tensors = [t for t in args.values() if isinstance(t, torch.Tensor)] + [out]
    outcome, _ = _refused_cleanly(lambda: op(**args, out=out), tensors)
    if outcome == "ok":
        assert math.isfinite(scale) and (variant == 0 or out.numel() == 0 or not shape[0])
        assert bool(out.isfinite().all())
    return outcome


def fia_out(gen: torch.Generator) -> str:
    """FusedInferAttentionScore .out with random attention_out / softmax_lse placements and the lse flag."""
    r = random.Random(gen.initial_seed()).randrange
    query, key = torch.randn(2, 4, 1, 16, generator=gen).half(), torch.randn(2, 2, 9, 16, generator=gen).half()
    value = torch.randn(2, 2, 9, 16, generator=gen).half()
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout="BNSD", scale=0.25, softmax_lse_flag=bool(r(2)))
    expected, lse = torch_npu.npu_fused_infer_attention_score(query, key, value, **kw)
    attention_out, softmax_lse = torch.full_like(expected, 7.0), torch.full((2, 4, 1, 1), 7.0)
    variant = max(r(8) - 3, 0)
    if variant == 1:
        attention_out = attention_out[:1].expand(expected.shape)
    elif variant == 2:
        softmax_lse = attention_out.view(-1).view(torch.float32)[:8].view(2, 4, 1, 1)
    elif variant == 3:
        attention_out = query.flatten()[: expected.numel()].view(expected.shape)
    elif variant == 4:
        attention_out = key.flatten()[: expected.numel()].view(expected.shape)
    outs = [attention_out, softmax_lse]
    outcome, _ = _refused_cleanly(
        lambda: torch_npu.npu_fused_infer_attention_score.out(query, key, value, out=outs, **kw),
        [query, key, value, *outs])
    if outcome == "ok":
        assert variant == 0 or (variant == 2 and not kw["softmax_lse_flag"])
        assert torch.equal(attention_out, expected)
        if kw["softmax_lse_flag"]:
            assert torch.equal(softmax_lse, lse)
    return outcome


def scales_and_sinks(gen: torch.Generator) -> str:
    """FlashAttentionScore / SparseFlashAttention with sinks of finite, -inf, +inf or NaN logits and any scale."""
    r = random.Random(gen.initial_seed()).randrange
    pool = (0.5, -1.0, -math.inf, math.inf, math.nan)
    sinks = torch.tensor([pool[r(5)], pool[r(5)]])
    scale = (0.25, 0.25, math.nan, -math.inf)[r(4)]
    q = torch.randn(1, 6, 2, 8, generator=gen)
    kv = torch.randn(1, 9, 1, 8, generator=gen)
    if r(2):
        call = lambda: cann_attn.flash_attention_score(q, kv, kv, 2, "BSND", scale_value=scale, sink=sinks)[0]  # noqa: E731
    else:
        indices = torch.randint(-1, 9, (1, 6, 1, 4), generator=gen, dtype=torch.int32)
        call = lambda: cann_attn.sparse_flash_attention(q, kv, kv, indices, scale, sparse_mode=0, sinks=sinks)[0]  # noqa: E731
    outcome, out = _refused_cleanly(call, [q, kv, sinks])
    bad = not math.isfinite(scale) or bool((sinks.isnan() | (sinks == math.inf)).any())
    assert (outcome == "refused") == bad, (scale, sinks)
    if outcome == "ok":
        assert bool(out.isfinite().all())
    return outcome


def kv_quant_sfa(gen: torch.Generator) -> str:
    """KvQuantSparseFlashAttention with random heads (in the documented list or not) and TND / BSND lengths that
    include sequences without queries or without keys."""
    r = random.Random(gen.initial_seed()).randrange
    layout = ("BSND", "TND")[r(2)]
    case = KvQuantCase(layout, gen, n1=(1, 2, 3, 4, 5, 8)[r(6)])
    if layout == "TND":
        q_lens = [r(4) for _ in range(3)]
        kv_lens = [r(12) if r(3) else 0 for _ in range(3)]
        ends = lambda lens: [sum(lens[: i + 1]) for i in range(len(lens))]  # noqa: E731
        case.query = case.query[:1].expand(sum(q_lens), *case.query.shape[1:]).contiguous()
        case.key = case.key[:1].expand(max(sum(kv_lens), 1), *case.key.shape[1:]).contiguous()
        case.sparse_indices = case.sparse_indices[:1].expand(sum(q_lens), *case.sparse_indices.shape[1:]).contiguous()
        case.kw = dict(layout="TND", actual_seq_lengths_query=ends(q_lens), actual_seq_lengths_kv=ends(kv_lens))
    outcome, out = _refused_cleanly(case.run, [case.query, case.key, case.sparse_indices])
    assert (outcome == "refused") == (case.query.shape[-2] not in KV_QUANT_HEADS)
    if outcome == "ok":
        assert_close_to_oracle(out, case.oracle(), name="attention_out")
    return outcome


def near_max_values(gen: torch.Generator) -> str:
    """SparseFlashAttention whose values reach up to ~3e38: a finite answer stays finite and matches the float64
    oracle relative to each value column's magnitude."""
    r = random.Random(gen.initial_seed()).randrange
    dtype = (torch.float32, torch.bfloat16)[r(2)]
    s2, k = 8 + r(40), 1 + r(16)
    q = torch.randn(1, 5, 2, 16, generator=gen)
    key = torch.randn(1, s2, 1, 16, generator=gen)
    value = ((torch.rand(1, s2, 1, 16, generator=gen, dtype=torch.float64) - 0.5) * (1.0, 1e30, 6e38)[r(3)]).float()
    indices = torch.randint(-1, s2, (1, 5, 1, k), generator=gen, dtype=torch.int32)
    q, key, value = q.to(dtype), key.to(dtype), value.to(dtype)
    out = cann_attn.sparse_flash_attention(q, key, value, indices, 0.25, sparse_mode=0)[0]
    assert bool(out.isfinite().all())
    want = sparse_attention_oracle(q, key, value, indices, 0.25, sparse_mode=0)[0]
    column = value.double().abs().amax(dim=(0, 1, 2)).clamp(min=1e-30)
    error = ((out.double() - want.double()).abs() / column).max().item()
    assert error <= (1e-5 if dtype == torch.float32 else 1e-2), error
    return "ok"


def cli_files(gen: torch.Generator) -> str:
    """golden with loaded inputs of random dtypes and case values, then compare against a golden whose tensor name
    may be a path: exit status 0 / 1 or 2, never an exception; a refusal leaves no output directory."""
    from cann_attn.cli import main as cli_main

    r = random.Random(gen.initial_seed()).randrange
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        case = {"op": "sparse_flash_attention", "seed": r(100),
                "inputs": {"query": {"shape": [1, 2, 2, 16], "dtype": "float16"},
                           "key": {"shape": [1, 8, 1, 16], "dtype": "float16"},
                           "value": {"shape": [1, 8, 1, 16], "dtype": "float16"},
                           "sparse_indices": {"generator": "values", "dtype": "int32",
                                              "values": [[[[(3, 5, 6, 7, 37.5, 2**31)[r(6)], 1]], [[2, 0]]]]}},
                "params": {"scale_value": 0.25, "layout": "BSND", "sparse_mode": 0, "sparse_block_size": 1}}
        (tmp / "case.json").write_text(json.dumps(case))
        array = [np.full((1, 2, 2, 16), 0.5, np.float64), np.full((1, 2, 2, 16), -2.0, np.float32),
                 np.full((1, 2, 2, 16), 1e6, np.float64), np.full((1, 2, 2, 16), 0.1, np.float32)][r(4)]
        np.save(tmp / "query.npy", array)
        rc = cli_main.main(["golden", "--case", str(tmp / "case.json"), "--out", str(tmp / "g"), "--inputs",
                            str(tmp / "query.npy")])
        assert rc in (0, 2) and (rc == 0) == (tmp / "g").exists()
        if rc == 2:
            return "refused"
        manifest = json.loads((tmp / "g" / "manifest.json").read_text())
        output = next(e for e in manifest["tensors"] if e["name"] == "attention_out")
        output["name"] = ("attention_out", "attention_out", "../g/attention_out", "/etc/passwd", "a/b")[r(5)]
        (tmp / "g" / "manifest.json").write_text(json.dumps(manifest))
        (tmp / "actual").mkdir()
        rc = cli_main.main(["compare", str(tmp / "actual"), str(tmp / "g")])
        assert rc in (1, 2)  # nothing in ACTUAL: missing (1), or a name that is not a file name (2), never a pass
        return "ok" if rc == 1 else "refused"


FAMILIES = {f.__name__: f for f in (atb_out, fia_out, scales_and_sinks, kv_quant_sfa, near_max_values, cli_files)}


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fuzz_corpus(family: str) -> None:
    outcomes = Counter(FAMILIES[family](torch.Generator().manual_seed(1000 * i + 7)) for i in range(CASES))
    assert sum(outcomes.values()) == CASES


def main(cases: int) -> None:
    counts: Counter = Counter()
    for name, family in FAMILIES.items():
        for i in range(cases):
            counts[(name, family(torch.Generator().manual_seed(1000 * i + 7)))] += 1
    for (name, outcome), n in sorted(counts.items()):
        print(f"{name:18s} {outcome:8s} {n}")
    print(f"total {sum(counts.values())} cases, {len(FAMILIES)} families, no failure")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(int(sys.argv[1]) if len(sys.argv) > 1 else CASES)
