"""install(device=...) maps the npu device onto the CPU (docs/guides/torch_npu.md, "The npu device"): an
Ascend-style script equals the plain CPU call, the example training script runs, programs that do not call
install() see torch untouched, and uninstall() puts it back. Each in a subprocess: the mapping is process-wide."""

from __future__ import annotations

import torch

from npu_device_cases import ROOT, assert_same_as_plain_call, run_npu_script, run_python

UNTOUCHED = """
import sys
import torch
import torch._dynamo  # install() imports it first thing (it wraps torch.manual_seed when imported)
import cann_attn, cann_attn.torch_npu, cann_attn.library

def check_untouched(when):
    assert torch._C._get_privateuse1_backend_name() == "privateuseone" and torch.device is DEVICE, when
    assert type(torch.zeros).__name__ == "builtin_function_or_method", when
    assert "to" not in vars(torch.Tensor) and "npu" not in vars(torch.Tensor), when
    assert not hasattr(torch.Tensor, "is_npu") and not hasattr(torch.nn.Module, "npu"), when
    assert torch.nn.Module.to is MODULE_TO and torch.load is LOAD and torch.manual_seed is MANUAL_SEED, when
    assert torch.distributed.init_process_group is INIT_PROCESS_GROUP, when
    assert not hasattr(torch, "npu") and "torch.npu" not in sys.modules and "torch_npu" not in sys.modules, when

MODULE_TO, LOAD, MANUAL_SEED, DEVICE = torch.nn.Module.to, torch.load, torch.manual_seed, torch.device
INIT_PROCESS_GROUP = torch.distributed.init_process_group
check_untouched("imported, not installed")
try:
    torch.zeros(1, device="npu")
except RuntimeError:
    pass
else:
    raise AssertionError("the npu device exists without install()")

cann_attn.torch_npu.install(device="cpu")
assert torch.zeros(2, device="npu").device.type == "cpu" and torch.npu is cann_attn.torch_npu.npu
assert torch.device("npu:1") == torch.device("cpu") and isinstance(torch.device("npu"), DEVICE)
assert isinstance(DEVICE("cpu"), torch.device) and torch.device(type="cpu").type == "cpu"
cann_attn.torch_npu.uninstall()
check_untouched("after uninstall()")

with cann_attn.torch_npu.installed("cpu"):
    import torch_npu
    assert torch.ones(1).npu().is_npu and torch_npu is cann_attn.torch_npu
check_untouched("after installed()")
print("ok")
"""


def test_torch_is_untouched_without_install_and_after_uninstall():
    result = run_python(UNTOUCHED)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok"]


def test_npu_script_after_install_cpu_equals_the_plain_cpu_call(tmp_path):
    assert_same_as_plain_call(run_npu_script("cpu", tmp_path / "npu.pt"), "cpu")


def test_ascend_training_example_runs_after_install_cpu(tmp_path):
    script = f"""
        import runpy, sys
        import cann_attn.torch_npu
        cann_attn.torch_npu.install(device="cpu")
        sys.argv = ["ascend_train.py", "--steps", "3", "--out", {str(tmp_path / "train.pt")!r}]
        runpy.run_path({str(ROOT / "examples" / "ascend_train.py")!r}, run_name="__main__")
    """
    result = run_python(script)
    assert result.returncode == 0, result.stderr
    assert "on npu (mapped to cpu)" in result.stdout
    saved = torch.load(tmp_path / "train.pt")
    assert len(saved["losses"]) == 3 and saved["losses"][-1] < saved["losses"][0]
    assert all(w.device.type == "cpu" for w in saved["weights"].values())
