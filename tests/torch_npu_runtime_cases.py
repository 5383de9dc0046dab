"""Scripts for the torch_npu runtime surface after ``install(device=TARGET)`` (docs/guides/torch_npu.md), each run
in a fresh interpreter (the mapping is process-wide) by tests/test_torch_npu_runtime.py on the CPU and
tests/test_gpu_torch_npu_runtime.py on CUDA. argv[1] is the install target; a script prints "ok" at its end."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from npu_device_cases import ROOT

PROGRAMS = ROOT / "tests" / "programs"

# Item: TorchScript and tooling see through install(); install() is all or nothing; uninstall() restores.
SCRIPTING_AND_METADATA = f"""
import importlib.metadata, importlib.util, sys
import torch
import torch._dynamo  # install() imports it (it wraps torch.manual_seed on import): the references below are final
import cann_attn.torch_npu as shim
from cann_attn import ParamInvalidError

TARGET = sys.argv[1]
ZEROS, DEVICE, GENERATOR, MANUAL_SEED, TRY_ANN = (torch.zeros, torch.device, torch.Generator, torch.manual_seed,
                                                 torch.jit.annotations.try_ann_to_type)

def untouched(when):
    assert torch.zeros is ZEROS and torch.device is DEVICE and torch.Generator is GENERATOR, when
    assert torch.manual_seed is MANUAL_SEED and torch.jit.annotations.try_ann_to_type is TRY_ANN, when
    assert not hasattr(torch, "npu") and "torch_npu" not in sys.modules and "torch.npu" not in sys.modules, when
    assert importlib.util.find_spec("torch_npu") is None, when
    try:
        importlib.metadata.version("torch_npu")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        raise AssertionError("torch_npu metadata " + when)

def annotated_before(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.zeros(x.shape, dtype=x.dtype, device=device) + x

# Bad input, and a failing step, leave torch untouched.
for bad, named in (({{"device": "npu"}}, "device"), ({{"device": "npu:0"}}, "device"),
                   ({{"device": "tpu"}}, "device"), ({{"device_name": ""}}, "device_name")):
    try:
        shim.install(**{{"device": TARGET, **bad}})
    except ParamInvalidError as error:
        assert named in str(error), error
    else:
        raise AssertionError(bad)
    untouched(f"after install({{bad}})")
real_add_finder = shim._metadata.add_finder
def failing_step():
    raise OSError("planted failure")
shim._metadata.add_finder = failing_step
try:
    shim.install(TARGET)
except OSError:
    pass
else:
    raise AssertionError("the planted failure did not propagate")
shim._metadata.add_finder = real_add_finder
untouched("after a failed install()")

shim.install(TARGET)
name_before = torch.npu.get_device_name()
shim._metadata.add_finder = failing_step                      # a failed second call keeps the first one's state
try:
    shim.install(device_name="Ascend910B1")
except OSError:
    pass
else:
    raise AssertionError("the planted failure did not propagate")
shim._metadata.add_finder = real_add_finder
assert torch.npu.get_device_name() == name_before and torch.zeros(1, device="npu").device.type == TARGET.split(":")[0]
sys.path.insert(0, {str(PROGRAMS)!r})
import ring_helpers  # compiles its @torch.jit.script helpers at import

for name in ("merge_block", "padded_lse", "empty_lse", "causal_block_mask", "chunk_weights"):
    assert isinstance(getattr(ring_helpers, name), torch.jit.ScriptFunction), name
device = torch.device("npu")
assert str(device).split(":")[0] == TARGET.split(":")[0]
x = torch.randn(3, 5, device="npu")
on_target = x.device  # a tensor's device: cuda:0 where torch.device("npu") is the index-less cuda
expected = torch.linspace(0, 1, 5).expand(3, 5) + torch.eye(3, 5)
torch.testing.assert_close(ring_helpers.chunk_weights(x).cpu(), expected)   # CUDA's linspace may round otherwise
mask = ring_helpers.causal_block_mask(4, 6, 1, device)
assert mask.device == on_target and torch.equal(mask.cpu(), torch.ones(4, 6, dtype=torch.bool).triu(2))
assert ring_helpers.causal_block_mask(2, 2, 0, device, torch.float16).dtype == torch.float16
lse = ring_helpers.empty_lse(torch.ones(2, 3, 4, 8, device="npu"), torch.device("npu:0"))
assert lse.shape == (2, 3, 4, 1) and lse.device == on_target and bool((lse == float("-inf")).all())
packed = torch.arange(10.0, device="npu").reshape(2, 5)
padded = ring_helpers.padded_lse(packed, [0, 2, 5], 3)
assert padded.device == on_target and padded[0, 1, :2].tolist() == [5.0, 6.0] and padded[0, 0, 2] == float("-inf")
out, block_out = torch.randn(1, 4, 2, 8, device="npu"), torch.randn(1, 4, 2, 8, device="npu")
old_lse, block_lse = torch.randn(1, 4, 2, 1, device="npu"), torch.randn(1, 2, 4, device="npu")
merged, merged_lse = ring_helpers.merge_block(out, old_lse, block_out, block_lse)
new_lse = torch.logaddexp(old_lse, block_lse.transpose(-2, -1).unsqueeze(-1))
torch.testing.assert_close(merged_lse, new_lse)
torch.testing.assert_close(merged, torch.exp(old_lse - new_lse) * out + torch.exp(
    block_lse.transpose(-2, -1).unsqueeze(-1) - new_lse) * block_out)
assert torch.equal(torch.jit.script(annotated_before)(x, x.device), x)   # torch's own class as annotation

# Distribution metadata, as diffusers and accelerate look for torch_npu.
version = torch.__version__.split("+")[0]
assert importlib.util.find_spec("torch_npu") is not None
assert importlib.metadata.version("torch_npu") == importlib.metadata.version("torch-npu") == version
assert [d.metadata["Name"] for d in importlib.metadata.distributions() if "npu" in d.metadata["Name"]] == ["torch_npu"]
assert "torch_npu" in importlib.metadata.packages_distributions()

# Device strings torch would refuse as it refuses "cuda:-1".
for bad in ("npu:-1", " npu", "npu :0", "npu:x", "npu:"):
    for make in (lambda: torch.zeros(1, device=bad), lambda: torch.device(bad), lambda: torch.ones(1).to(bad)):
        try:
            make()
        except ValueError as error:
            assert "device" in str(error)
        else:
            raise AssertionError(bad)
try:
    torch.device("npu", -1)
except ValueError:
    pass
else:
    raise AssertionError("torch.device('npu', -1)")

shim.uninstall()
untouched("after uninstall()")
assert torch.equal(torch.jit.script(annotated_before)(x.cpu(), torch.device("cpu")), x.cpu())
print("ok")
"""


# Item: torch_npu.npu's runtime names, mapped onto the target.
RUNTIME_NAMES = """
import datetime, os, platform, socket, sys
import torch
import cann_attn.torch_npu as shim
from cann_attn import ParamInvalidError

TARGET = sys.argv[1]
queued = []
shim.npu._lazy_call(lambda: queued.append("before"))          # the shim is imported, nothing initialised yet
assert queued == [] and not shim.npu.is_initialized()
shim.install(TARGET)
import torch_npu
assert queued == ["before"]                                   # install() initialises the npu runtime
torch_npu.npu._lazy_call(lambda: queued.append("after"))
assert queued == ["before", "after"] and torch.npu.is_initialized()
import torch_npu.npu.utils, torch.npu.amp
assert torch_npu.npu.utils.is_bf16_supported() is torch.npu.is_bf16_supported() is True or TARGET != "cpu"
assert torch_npu.npu.utils.is_support_inf_nan()

# Device name and properties: the target's own, settable for code gated on an Ascend SoC name.
own = torch.cuda.get_device_name(0) if TARGET.startswith("cuda") else (platform.processor() or "cpu")
assert torch.npu.get_device_name() == torch.npu.get_device_name(0) == torch.npu.get_device_properties(0).name == own
properties = torch.npu.get_device_properties("npu:0")
assert properties.total_memory > 0 and properties.cube_core_num > 0 and "name='" in repr(properties)
os.environ["CANN_ATTN_NPU_DEVICE_NAME"] = "Ascend910B3"
assert torch.npu.get_device_name().startswith("Ascend910B") and torch.npu.get_device_properties().name == "Ascend910B3"
shim.install(device_name="Ascend910B4")                     # the argument wins over the environment
assert torch_npu.npu.get_device_name(0) == "Ascend910B4"
del os.environ["CANN_ATTN_NPU_DEVICE_NAME"]
for bad in (99, "npu:99", -2, "npu:-1", 1.5):
    for call in (torch.npu.get_device_name, torch.npu.get_device_properties, torch_npu.npu.device):
        try:
            call(bad)
        except ValueError as error:
            assert "device" in str(error), error
        else:
            raise AssertionError((call, bad))

# torch_npu.npu.device(i): the index current inside the block, the previous one after it.
before = torch.npu.current_device()
with torch_npu.npu.device(0):
    assert torch.npu.current_device() == 0
with torch.npu.device("npu:0"), torch.npu.device(None), torch.npu.device(-1):
    assert torch.npu.current_device() == 0
assert torch.npu.current_device() == before

# Generators of the npu device: reproducible, independent of the default generator.
first = torch.Generator(device="npu")
first.manual_seed(11)
assert isinstance(first, torch.Generator) and first.device.type == torch.zeros(1, device="npu").device.type
a = torch.randn(5, generator=first, device="npu")
torch.manual_seed(0)
torch.randn(100, device="npu")                                 # the default generator moves, not ours
second = torch.Generator("npu:0").manual_seed(11)
b = torch.randn(5, generator=second, device="npu")
c = torch.randn(5, generator=second, device="npu")
assert torch.equal(a, b) and not torch.equal(b, c)
torch.manual_seed(0)
d = torch.randn(100, device="npu")
torch.manual_seed(0)
torch.randn(5, generator=torch.Generator(device="npu").manual_seed(3), device="npu")
assert torch.equal(torch.randn(100, device="npu"), d)

# torch.compile traces x.device and the mapped factories (torch._dynamo, first imported here by install(), records
# torch's own torch.device).
def compiled_body(q):
    mask = torch.zeros(q.shape[1], q.shape[1], dtype=torch.bool, device=q.device)
    return torch_npu.npu_fusion_attention(q, q, q, 2, "BSND", atten_mask=mask, scale=0.25)[0] + torch.ones(
        1, device="npu")

q = torch.randn(1, 8, 2, 16, device="npu")
torch.testing.assert_close(torch.compile(compiled_body, fullgraph=True)(q), compiled_body(q))

# Streams and events.
stream = torch.npu.Stream()
with torch.npu.stream(stream):
    y = torch.ones(4, device="npu") * 2
stream.synchronize()
torch.npu.current_stream().synchronize()
torch.npu.default_stream().synchronize()
assert stream.query() and torch.npu.current_stream().query()
event = torch.npu.Event()
event.record()
event.synchronize()

# Mixed backend strings and hccl.
import torch.distributed as dist
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
dist.init_process_group(backend="cpu:gloo,npu:hccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
total = torch.ones(3, device="npu")
dist.all_reduce(total)
assert total.tolist() == [1.0, 1.0, 1.0]
assert dist.get_backend() == "cpu:gloo" if TARGET == "cpu" else "cuda:nccl" in dist.get_backend(), dist.get_backend()
dist.destroy_process_group()
try:
    dist.init_process_group(backend="npu:hccl,gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
except ValueError as error:
    assert "backend" in str(error)
else:
    raise AssertionError("a half-mixed backend string was accepted")
print("ok")
"""

# Item: torch.npu.amp with torch_npu's defaults: autocast float16, GradScaler stepping, skipping and backing off.
AMP = """
import sys
import torch
import cann_attn.torch_npu
cann_attn.torch_npu.install(device=sys.argv[1])
import torch_npu

torch.manual_seed(0)
model = torch.nn.Linear(8, 4).npu()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
with torch.npu.amp.autocast():
    assert torch.is_autocast_enabled(model.weight.device.type)
    assert torch.get_autocast_dtype(model.weight.device.type) == torch.float16
    assert model(torch.randn(2, 8).npu()).dtype == torch.float16
with torch.autocast("npu"), torch.autocast(device_type="npu", enabled=True):
    assert model(torch.randn(2, 8).npu()).dtype == torch.float16
with torch_npu.npu.amp.autocast(dtype=torch.bfloat16):
    assert model(torch.randn(2, 8).npu()).dtype == torch.bfloat16
with torch.npu.amp.autocast(enabled=False):
    assert model(torch.randn(2, 8).npu()).dtype == torch.float32

scaler = torch.npu.amp.GradScaler()
assert (scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor(),
        scaler.get_growth_interval()) == (2.0 ** 16, 2.0, 0.5, 2000)
scaler = torch.npu.amp.GradScaler(init_scale=256.0, growth_interval=2)

def step(poison):
    optimizer.zero_grad()
    with torch.npu.amp.autocast():
        loss = model(torch.randn(3, 8).npu()).float().square().mean()
    scaler.scale(loss).backward()
    if poison:
        model.weight.grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(optimizer)
    scaler.update()
    return not all(torch.equal(b, p) for b, p in zip(before, model.parameters()))

assert step(False) and scaler.get_scale() == 256.0            # stepped; 1 of growth_interval 2
assert step(False) and scaler.get_scale() == 512.0            # stepped; grown
assert not step(True) and scaler.get_scale() == 256.0         # inf: skipped, backed off
assert step(False) and scaler.get_scale() == 256.0
state = scaler.state_dict()
assert state["scale"] == 256.0 and state["dynamic"] is True

static = torch.npu.amp.GradScaler(init_scale=128.0, dynamic=False)
scaler = static
assert step(False) and step(False) and scaler.get_scale() == 128.0   # static: never grows
for bad in ({"growth_factor": 1.0}, {"backoff_factor": 1.0}):
    try:
        torch.npu.amp.GradScaler(**bad)
    except ValueError as error:
        assert next(iter(bad)) in str(error)
    else:
        raise AssertionError(bad)

# custom_fwd / custom_bwd: an autograd.Function under npu autocast gets its inputs cast and runs without autocast.
class Doubled(torch.autograd.Function):
    @staticmethod
    @torch.npu.amp.custom_fwd(cast_inputs=torch.float16)
    def forward(ctx, x):
        ctx.seen = (x.dtype, torch.is_autocast_enabled(x.device.type))
        return x * 2

    @staticmethod
    @torch_npu.npu.amp.custom_bwd
    def backward(ctx, grad):
        ctx.seen_backward = torch.is_autocast_enabled(grad.device.type)
        return grad * 2

x = torch.randn(4).npu().requires_grad_()
with torch.npu.amp.autocast():
    y = Doubled.apply(x)
    y.float().sum().backward()
ctx = y.grad_fn
assert y.dtype == torch.float16 and ctx.seen == (torch.float16, False) and ctx.seen_backward is False
assert torch.equal(x.grad, torch.full((4,), 2.0, device=x.device))
print("ok")
"""

# Item: MindSpeed-style CUDA code after `from torch_npu.contrib import transfer_to_npu`: cuda -> npu -> target.
TRANSFER_TO_NPU = """
import sys
import cann_attn.torch_npu
cann_attn.torch_npu.install(device=sys.argv[1])

import torch
import torch_npu
from torch_npu.contrib import transfer_to_npu

target = torch.zeros(1, device="npu").device
assert torch.cuda.is_available() and torch.cuda.device_count() >= 1
torch.cuda.set_device(0)
torch.cuda.manual_seed(1)
tensors = [torch.ones(2).cuda(), torch.ones(2).cuda(0), torch.ones(2).cuda("cuda:0"), torch.zeros(2, device="cuda"),
           torch.zeros(2, device="cuda:0"), torch.zeros(2, device=0), torch.empty(2, device=torch.device("cuda", 0)),
           torch.ones(2).to("cuda"), torch.ones(2).to(0), torch.ones(2).to(torch.device("cuda:0")),
           torch.arange(3, device="cuda"), torch.ones(2).new_zeros(3, device="cuda")]
assert all(t.device == target for t in tensors), [t.device for t in tensors]
model = torch.nn.Linear(4, 2).cuda()
assert model.weight.device == target and torch.nn.Linear(4, 2).to("cuda:0").weight.device == target
assert torch.device("cuda:0") == target and torch.Generator("cuda").device.type == target.type
assert torch.Generator(device="cuda").manual_seed(2).initial_seed() == 2
assert torch.cuda.get_device_name() == torch.npu.get_device_name()
torch.cuda.synchronize()
assert torch.cuda.memory_allocated() >= 0 and torch.cuda.current_device() == 0
with torch.autocast("cuda", dtype=torch.bfloat16):
    assert model(torch.randn(3, 4).cuda()).dtype == torch.bfloat16
with torch.cuda.amp.autocast():
    assert model(torch.randn(3, 4).cuda()).dtype == torch.float16
scaler = torch.cuda.amp.GradScaler(init_scale=64.0)
loss = model(torch.randn(3, 4).cuda()).sum()
scaler.scale(loss).backward()
scaler.step(torch.optim.SGD(model.parameters(), lr=0.1))
scaler.update()
stream = torch.cuda.Stream()
with torch.cuda.stream(stream):
    pass
stream.synchronize()
from cann_attn.torch_npu import _device
expected = "nccl" if target.type == "cuda" else "gloo"
assert _device._backend_name("nccl", expected) == expected
assert _device._backend_name("cpu:gloo,cuda:nccl", expected) == ("cpu:gloo" if expected == "gloo" else
                                                                 "cpu:gloo,cuda:nccl")
out = torch_npu.npu_fusion_attention(*(torch.randn(1, 4, 2, 8).cuda() for _ in range(3)), 2, "BSND")[0]
assert out.device == target

is_cuda_before = torch.ones(1).is_cuda
cann_attn.torch_npu.uninstall()
assert torch.Tensor.cuda is torch._C.TensorBase.cuda
assert torch.cuda.amp.GradScaler.__module__ == "torch.cuda.amp.grad_scaler"
assert "torch_npu" not in sys.modules and "torch_npu.contrib.transfer_to_npu" not in sys.modules
if target.type == "cpu":
    assert not torch.cuda.is_available() and not is_cuda_before
    try:
        torch.zeros(1, device="cuda")
    except (RuntimeError, AssertionError):
        pass
    else:
        raise AssertionError("cuda still mapped after uninstall()")
print("ok")
"""


def run_case(script: str, target: str, folder: Path, *args: str) -> str:
    """Run ``script`` from a file (TorchScript reads its functions' source) in a fresh interpreter; its stdout."""
    path = folder / "case.py"
    path.write_text(textwrap.dedent(script))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    env.pop("CANN_ATTN_NPU_DEVICE_NAME", None)
    result = subprocess.run([sys.executable, str(path), target, *args], env=env, cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split()[-1:] == ["ok"], result.stdout[-2000:]
    return result.stdout


def run_program(name: str, processes: int) -> str:
    """``torchrun --nproc-per-node processes tests/programs/<name>`` (the program's own install() line picks the
    target: CUDA when there is a GPU, else the CPU); its stdout."""
    from cann_attn.testing.distributed import free_port, one_group_at_a_time

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    with one_group_at_a_time():  # a process group of its own: queue with the other tests' groups
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
                                 "--master-port", str(free_port()), str(PROGRAMS / name)], env=env, cwd=ROOT,
                                capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])
    return result.stdout


def run_example(path: Path, *args: str) -> str:
    """``python path args`` with src on the path, no GPU visible (its install() line then picks the CPU)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    result = subprocess.run([sys.executable, str(path), *args], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout
