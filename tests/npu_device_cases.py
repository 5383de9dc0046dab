"""An Ascend-style script (``.npu()``, ``device="npu"``, ``torch.npu.*``, ``torch_npu.npu_fusion_attention`` forward
and backward) run in a subprocess after ``install(device=...)``, and the same computation written for the target
device, for tests/test_npu_device.py (CPU) and tests/test_gpu_npu_device.py (CUDA)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import cann_attn.torch_npu as torch_npu
from patience import HANG_SECONDS

ROOT = Path(__file__).resolve().parents[1]
SEED, SHAPE, HEADS, SCALE = 3, (2, 8, 2, 16), 2, 0.25

# Written as for an NPU; argv: target device, output file.
NPU_SCRIPT = f"""
import sys
import cann_attn.torch_npu
cann_attn.torch_npu.install(device=sys.argv[1])

import torch
import torch_npu

torch.npu.set_device(0)
torch.npu.manual_seed({SEED})
assert torch.npu.is_available() and torch.npu.device_count() >= 1 and torch.npu.current_device() == 0
q = torch.randn({SHAPE}, device="npu").requires_grad_()
k = torch.randn({SHAPE}, device=torch.device("npu:0")).to("npu:0").requires_grad_()
v = torch.randn({SHAPE}, device="npu", requires_grad=True)
mask = torch.triu(torch.ones(8, 8, dtype=torch.bool), 1).npu()
dy = torch.ones({SHAPE}).npu() * torch.arange(16, device="npu")
assert q.is_npu and mask.is_npu and dy.is_npu and torch.zeros_like(q).is_npu and q.new_zeros(1).is_npu
stream = torch.npu.Stream()
start, end = torch.npu.Event(enable_timing=True), torch.npu.Event(enable_timing=True)
with torch.npu.stream(stream):
    start.record()
    out = torch_npu.npu_fusion_attention(q, k, v, {HEADS}, "BSND", atten_mask=mask, scale={SCALE})[0]
    out.backward(dy)
    end.record()
torch.npu.synchronize()
assert start.elapsed_time(end) >= 0 and torch.npu.memory_allocated() >= 0 and torch.npu.max_memory_allocated() >= 0
torch.npu.reset_peak_memory_stats()
torch.npu.empty_cache()
results = {{"device": str(out.device), "out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}}
torch.save({{name: value.cpu() if torch.is_tensor(value) else value for name, value in results.items()}},
           sys.argv[2])
print("ok")
"""


def run_python(script: str, *args: str) -> subprocess.CompletedProcess:
    """``python -c script args`` with src on the path, from the repository root."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=HANG_SECONDS)


def run_npu_script(device: str, out_file: Path) -> dict:
    result = run_python(NPU_SCRIPT, device, str(out_file))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok"]
    return torch.load(out_file)


def plain_call(device: str) -> dict:
    """The same computation written for ``device``, without install()."""
    generator = torch.Generator(device).manual_seed(SEED)
    q, k, v = (torch.randn(SHAPE, device=device, generator=generator).requires_grad_() for _ in range(3))
    mask = torch.triu(torch.ones(8, 8, dtype=torch.bool), 1).to(device)
    dy = torch.ones(SHAPE, device=device) * torch.arange(16, device=device)
    out = torch_npu.npu_fusion_attention(q, k, v, HEADS, "BSND", atten_mask=mask, scale=SCALE)[0]
    out.backward(dy)
    return {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}


def assert_same_as_plain_call(mapped: dict, device: str) -> None:
    """Bitwise on the CPU; on CUDA the Triton autotuner of each process may pick other tile sizes (another
    summation order), so to fp32 rounding there."""
    plain = plain_call(device)
    assert mapped["device"].split(":")[0] == device
    for name in ("out", "dq", "dk", "dv"):
        if device == "cpu":
            assert torch.equal(mapped[name], plain[name].cpu()), name
        else:
            torch.testing.assert_close(mapped[name], plain[name].cpu(), rtol=1e-5, atol=1e-5, msg=name)
