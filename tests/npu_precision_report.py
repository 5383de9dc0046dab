"""How far "npu" mode lies from the independent recipes (cann_attn.testing.npu_recipes) at production lengths: per
case, the share of output elements beyond 2 ulps and the largest distance in ulps, the figures
docs/semantics/precision.md ("How close "npu" mode is to the NPU's recipe") reports; and the scale-128 case (the
float64 formula, "exact" and "npu" mode against op-plugin's PFA golden recipe).

The recipes are always this checkout's (loaded from its file), the library is whichever `cann_attn` is imported, so
one command measures an older library against today's recipes:

    PYTHONPATH=src python tests/npu_precision_report.py [OUT.json]
    git worktree add /tmp/before <commit>
    PYTHONPATH=/tmp/before/src python tests/npu_precision_report.py before.json

A report, not a test (tests/test_precision_npu_shapes.py holds the assertions); a few minutes on one core.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

import cann_attn

_RECIPES = Path(__file__).resolve().parents[1] / "src" / "cann_attn" / "testing" / "npu_recipes.py"
_spec = importlib.util.spec_from_file_location("npu_recipes_of_this_checkout", _RECIPES)
recipes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipes)
torch.set_num_threads(1)
SCALE = 128**-0.5
rows = []


def inputs(dtype, sq, skv, heads=2, heads_kv=1, d=128, amp=1.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, heads, sq, d, generator=g) * amp).to(dtype)
    k = (torch.randn(1, heads_kv, skv, d, generator=g) * amp).to(dtype)
    v = torch.randn(1, heads_kv, skv, d, generator=g).to(dtype)
    return q, k, v


def record(name, actual, recipe, dtype=None):
    passed, fig = recipes.ulp_verdict(actual, recipe, dtype)
    fig.update(case=name, passed=passed)
    rows.append(fig)
    print(f"{name:45s} beyond2={100 * fig['tail_fraction']:7.3f}% max_ulps={fig['max_ulps']:9.1f} "
          f"{'pass' if passed else 'FAIL'}", flush=True)


def pfa(q, k, v, scale):
    with cann_attn.precision("npu"):
        return cann_attn.prompt_flash_attention(q, k, v, num_heads=q.shape[1], num_key_value_heads=k.shape[1],
                                                input_layout="BNSD", scale_value=scale)


for dtype in (torch.float16, torch.bfloat16):
    for sq in (8, 257, 1024):
        for skv in (700, 1100, 1500, 2100, 4096):
            q, k, v = inputs(dtype, sq, skv)
            record(f"PFA {str(dtype)[6:]} Sq {sq} Skv {skv}", pfa(q, k, v, SCALE),
                   recipes.pfa_recipe(q, k, v, SCALE, 1))

for s2 in (700, 1100, 2100):
    for causal in (False, True):
        for dtype in (torch.bfloat16, torch.float16):
            q, k, v = inputs(dtype, s2, s2)
            dy = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
            mask = torch.ones(s2, s2, dtype=torch.bool).triu(1) if causal else None
            with cann_attn.precision("npu"):
                fwd = cann_attn.flash_attention_score(q, k, v, 2, "BNSD", atten_mask=mask, scale_value=SCALE)
                grads = cann_attn.flash_attention_score_grad(q, k, v, dy, 2, "BNSD", atten_mask=mask,
                                                             attention_in=fwd.attention_out,
                                                             softmax_max=fwd.softmax_max,
                                                             softmax_sum=fwd.softmax_sum, scale_value=SCALE)
            tag = f"{str(dtype)[6:]} S2 {s2} {'causal' if causal else 'none'}"
            out, _, _ = recipes.fa_recipe(q, k, v, SCALE, mask=mask)
            record(f"FA fwd {tag}", fwd.attention_out, out)
            exp = recipes.fa_grad_recipe(q, k, v, dy, fwd.attention_out, fwd.softmax_max[..., 0],
                                   fwd.softmax_sum[..., 0], SCALE, mask=mask)
            for n, a, r in zip(("dq", "dk", "dv"), grads[:3], exp, strict=True):
                record(f"FA grad {n} {tag}", a, r)

lengths = [700, 1100, 300]
g = torch.Generator().manual_seed(4)
total = sum(lengths)
q = (torch.randn(total, 2, 128, generator=g) * 1.5).bfloat16()
k = (torch.randn(total, 1, 128, generator=g) * 1.5).bfloat16()
v = torch.randn(total, 1, 128, generator=g).bfloat16()
cum = torch.tensor(lengths).cumsum(0).tolist()
with cann_attn.precision("npu"):
    fwd = cann_attn.flash_attention_score(q, k, v, 2, "TND", scale_value=SCALE, actual_seq_qlen=cum,
                                          actual_seq_kvlen=cum)
start = 0
for n in lengths:
    r = slice(start, start + n)
    qs, ks, vs = (t[r].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out, _, _ = recipes.fa_recipe(qs, ks, vs, SCALE, layout="TND")
    record(f"FA fwd TND seq {n} of {lengths}", fwd.attention_out[r].transpose(0, 1).unsqueeze(0), out)
    start += n

for top_k in (512, 2048):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, 16, 576, generator=g).bfloat16()
    kv = torch.randn(1, 4096, 1, 576, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(4096, generator=g)[:top_k] for _ in range(8)]).view(1, 8, 1, top_k).int()
    with cann_attn.precision("npu"):
        o = cann_attn.sparse_flash_attention(q[..., :512], kv[..., :512], kv[..., :512], idx, 576**-0.5,
                                             query_rope=q[..., 512:], key_rope=kv[..., 512:],
                                             sparse_block_size=1, layout="BSND", sparse_mode=0).attention_out
    exp, _, _ = recipes.sfa_recipe(q, kv, kv[..., :512], idx, 576**-0.5)
    record(f"SFA block 1 top-k {top_k} of 4096, D 512+64", o, exp)

q, k, v = inputs(torch.bfloat16, 1, 2 * 2048 + 300, heads=20, heads_kv=2)
with cann_attn.precision("npu"):
    o, _ = cann_attn.fused_infer_attention_score(q, k, v, num_heads=20, num_key_value_heads=2,
                                                 input_layout="BNSD", scale=SCALE)
record("FIA decode bf16 Skv 4396 group 10", o, recipes.ifa_recipe(q, k, v, SCALE))

g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 4, 2048, 128, generator=g).half() for _ in range(3))
golden = recipes.op_plugin_pfa_golden(q, k, v, 128.0)
exact = cann_attn.prompt_flash_attention(q, k, v, num_heads=4, input_layout="BNSD", scale_value=128.0)
npu = pfa(q, k, v, 128.0)
s = (q.double() @ k.double().transpose(-1, -2)) * 128.0
f64 = torch.softmax(s, -1) @ v.double()
scale128 = {name: float((t.double() - golden.double()).abs().max()) for name, t in
            (("float64", f64), ("exact", exact), ("npu", npu))}
print("scale-128 max |x - op-plugin golden|:", scale128)
if len(sys.argv) > 1:
    Path(sys.argv[1]).write_text(json.dumps({"rows": rows, "scale128": scale128}, indent=1))
