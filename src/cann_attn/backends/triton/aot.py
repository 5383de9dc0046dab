"""Ahead-of-time sm_90 compilation of the Triton kernels, without a GPU.

Two steps, each in its own process because `triton.jit` decides at import time whether it builds interpreted or
real kernels (TRITON_INTERPRET):

1. `record()` (TRITON_INTERPRET=1): runs a representative set of op calls with the host code switched to its GPU
   decisions (dtypes, block sizes, autotuners, UPCAST off: the module flags below) and captures every launch at
   Triton's interpreter entry point (`InterpretedFunction.run`, plus `Autotuner.run` for the config lists). So the
   recorded specializations are the ones a GPU run would compile, not the interpreter's small fp32 tiles. Dense
   launches are recorded without running (nothing later depends on their results); DSA launches run in the
   interpreter with the first autotune config, because the deterministic backward's second kernel is launched
   only for the keys the first one wrote.
2. `compile_specs()` (TRITON_INTERPRET=0): compiles each distinct specialization with `triton.compile` for
   GPUTarget("cuda", 90, 32) under each GPU config (the autotune list, or the launch's fixed tiles), and reads
   registers, spills and shared memory from the cubin (bundled cuobjdump) and the metadata.

`python -m cann_attn.backends.triton.aot` prints a one-line summary per compile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

# Hopper: 228 KB of shared memory per SM, of which one block may use 227 KB (cudaDevAttrMaxSharedMemoryPerBlockOptin).
SMEM_LIMIT_BYTES = 227 * 1024
TARGET_ARCH = 90
_PACKAGE = "cann_attn.backends.triton"


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Tile constexprs and launch options of one compile (an autotune config or a fixed launch)."""

    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int

    def label(self) -> str:
        tiles = ",".join(f"{k}={v}" for k, v in sorted(self.constexprs.items()))
        return f"{tiles} w{self.num_warps} s{self.num_stages}".strip()


@dataclasses.dataclass
class KernelSpec:
    """One distinct kernel specialization: argument types, constexprs, 16-divisible args, and its configs (the
    first is what a launch without autotuning, or the autotuner's first candidate, uses)."""

    module: str  # module under cann_attn.backends.triton
    kernel: str  # the jit function's name
    signature: dict[str, str]  # arg name -> Triton type ("*bf16", "i32", ...) or "constexpr"
    constexprs: dict[str, Any]
    divisible: list[str]
    configs: list[LaunchConfig]
    autotuned: bool
    variants: list[str] = dataclasses.field(default_factory=list)  # labels of the op calls that launch it

    def key(self) -> str:
        return json.dumps([self.module, self.kernel, self.signature, self.constexprs, self.divisible,
                           [dataclasses.asdict(c) for c in self.configs]], sort_keys=True, default=str)

    def name(self) -> str:
        """Short human label of the specialization: kernel plus the constexprs that are not tiles."""
        ptrs = sorted({t for t in self.signature.values() if t.startswith("*") and t[1:] in ("bf16", "fp16", "fp32")})
        flags = ",".join(f"{k}={v}" for k, v in self.constexprs.items())
        return f"{self.kernel}[{'/'.join(ptrs)}]({flags})"

    @staticmethod
    def from_json(d: dict[str, Any]) -> KernelSpec:
        d = dict(d)
        d["configs"] = [LaunchConfig(**c) for c in d["configs"]]
        return KernelSpec(**d)


@dataclasses.dataclass
class CompileResult:
    """Outcome of one (spec, config) compile."""

    spec: str
    kernel: str
    variants: list[str]
    config: str
    default: bool  # the spec's first config
    ok: bool
    error: str = ""
    regs: int = -1
    spill_bytes: int = -1  # the cubin's per-thread stack frame: local memory ptxas spilled to
    smem: int = -1
    seconds: float = 0.0

    @property
    def over_smem(self) -> bool:
        return self.ok and self.smem > SMEM_LIMIT_BYTES


# ------------------------------------------------------------------------------------------------------------
# Recording (interpreter process)
# ------------------------------------------------------------------------------------------------------------
_TORCH_PTR = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32", "float64": "*fp64", "int64": "*i64",
              "int32": "*i32", "int16": "*i16", "int8": "*i8", "uint8": "*u8", "bool": "*i1"}


def _arg_kind(value: Any) -> tuple[str, Any, bool]:
    """(Triton type or "constexpr", constexpr value, 16-divisible) of a runtime argument, the way Triton's launcher
    specializes it on CUDA: pointers by dtype and 16-byte alignment, ints by range (the value 1 becomes a
    constexpr, multiples of 16 get a divisibility hint), floats as fp32."""
    if hasattr(value, "data_ptr"):
        dtype = str(value.dtype).removeprefix("torch.")
        return _TORCH_PTR[dtype], None, value.data_ptr() % 16 == 0
    if value is None:
        return "constexpr", None, False
    if isinstance(value, bool):
        return "i1", None, False
    if isinstance(value, int):
        if value == 1:
            return "constexpr", 1, False
        kind = "i32" if -(2**31) <= value < 2**31 else "i64" if -(2**63) <= value < 2**63 else "u64"
        return kind, None, value % 16 == 0
    if isinstance(value, float):
        return "fp32", None, False
    raise TypeError(f"unsupported kernel argument {type(value).__name__}")


def _plain(value: Any) -> Any:
    """A JSON-friendly constexpr value (tl.constexpr unwrapped)."""
    value = getattr(value, "value", value)
    return value if isinstance(value, (bool, int, float, str, type(None))) else str(value)


class Recorder:
    """Captures kernel launches while patched in (see `recording`)."""

    def __init__(self) -> None:
        self.specs: dict[str, KernelSpec] = {}
        self.variant = ""
        self.execute = True
        self._pending_configs: list[LaunchConfig] | None = None

    def on_launch(self, fn: Callable, arg_names: list[str], args: tuple, kwargs: dict[str, Any]) -> None:
        annotations = inspect.get_annotations(fn)
        const_names = {n for n in arg_names if "constexpr" in str(annotations.get(n, ""))}
        bound = dict(zip(arg_names, args, strict=False))
        bound.update({k: v for k, v in kwargs.items() if k in arg_names})
        signature: dict[str, str] = {}
        constexprs: dict[str, Any] = {}
        divisible: list[str] = []
        for name in arg_names:
            value = bound[name]
            if name in const_names:
                signature[name] = "constexpr"
                constexprs[name] = _plain(value)
                continue
            kind, const, div = _arg_kind(value)
            signature[name] = kind
            if kind == "constexpr":
                constexprs[name] = const
            if div:
                divisible.append(name)
        configs = self._pending_configs
        self._pending_configs = None
        autotuned = configs is not None
        if configs is None:
            configs = [LaunchConfig({}, int(kwargs.get("num_warps", 4)), int(kwargs.get("num_stages", 3)))]
        else:
            # The autotuner supplies the tile constexprs: record the spec without them.
            tuned = set().union(*(c.constexprs for c in configs))
            constexprs = {k: v for k, v in constexprs.items() if k not in tuned}
        spec = KernelSpec(fn.__module__.removeprefix(_PACKAGE + "."), fn.__name__, signature, constexprs,
                          divisible, configs, autotuned)
        found = self.specs.setdefault(spec.key(), spec)
        if self.variant not in found.variants:
            found.variants.append(self.variant)

    def on_autotune(self, configs: list[Any]) -> None:
        self._pending_configs = [LaunchConfig({k: _plain(v) for k, v in c.kwargs.items()}, int(c.num_warps),
                                              int(c.num_stages)) for c in configs]


@contextlib.contextmanager
def recording(recorder: Recorder) -> Iterator[None]:
    """Patch the interpreter entry points to report launches, and the kernel modules' interpreter switches to
    their GPU decisions. Requires TRITON_INTERPRET=1 before the kernel modules were imported."""
    from triton.runtime import autotuner, interpreter

    from . import dense_backward, dense_forward, indexer, sparse_attention

    orig_run = interpreter.InterpretedFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        recorder.on_launch(self.fn, self.arg_names, args, kwargs)
        if not recorder.execute:
            return None
        return orig_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    def tune(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Record the candidate list; run (in the interpreter) only the first candidate, no benchmarking.
        recorder.on_autotune(self.configs)
        return self.fn.run(*args, **kwargs, **self.configs[0].all_kwargs())

    patches = [(dense_forward, "INTERPRET", False), (dense_backward, "INTERPRET", False),
               (sparse_attention, "interpreting", lambda: False), (indexer, "interpreting", lambda: False),
               (interpreter.InterpretedFunction, "run", run), (autotuner.Autotuner, "run", tune)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    dense_forward._tuned.clear()
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        dense_forward._tuned.clear()  # autotuners built around interpreted kernels must not outlive the patch


def _dense_calls() -> Iterator[tuple[str, bool, Callable[[], None]]]:
    """(label, execute, call) of the dense ops: every kernel flag combination a real call can produce."""
    import torch

    import cann_attn

    gen = torch.Generator().manual_seed(0)

    def call(dtype: torch.dtype, *, n1: int = 4, n2: int = 4, sq: int = 48, skv: int = 64, d: int = 128,
             dv: int | None = None, grad: bool = True, **kw: Any) -> Callable[[], None]:
        dv = d if dv is None else dv

        def run() -> None:
            q = torch.randn(1, n1, sq, d, generator=gen).to(dtype)
            k = torch.randn(1, n2, skv, d, generator=gen).to(dtype)
            v = torch.randn(1, n2, skv, dv, generator=gen).to(dtype)
            opts = {"scale_value": d**-0.5, "backend": "triton", **kw}
            fwd = cann_attn.flash_attention_score(q, k, v, n1, "BNSD", **opts)
            if grad:
                dy = torch.randn(1, n1, sq, dv, generator=gen).to(dtype)
                cann_attn.flash_attention_score_grad(q, k, v, dy, n1, "BNSD", softmax_max=fwd.softmax_max,
                                                     softmax_sum=fwd.softmax_sum, attention_in=fwd.attention_out,
                                                     **opts)
        return run

    def causal(s: int) -> torch.Tensor:
        return torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1) if s else torch.zeros(0)

    full_mask = torch.rand(48, 64, generator=gen) < 0.2
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32")):
        yield f"{name} d128", False, call(dtype)
        yield f"{name} d64 causal", False, call(dtype, d=64, sparse_mode=3, atten_mask=causal(1))
        yield f"{name} d128 gqa causal", False, call(dtype, n2=1, sparse_mode=2, atten_mask=causal(1))
    bf16 = torch.bfloat16
    yield "bf16 d128 explicit mask", False, call(bf16, atten_mask=full_mask, sparse_mode=0)
    yield "bf16 d128 band", False, call(bf16, sparse_mode=4, atten_mask=causal(1), pre_tokens=20, next_tokens=5)
    yield "bf16 d192/128 (Dv<Dqk) gqa", False, call(bf16, n2=2, d=192, dv=128)
    yield "fp16 d40/24 mqa", False, call(torch.float16, n2=1, d=40, dv=24)
    for pse_type in (0, 1):
        pse = torch.randn(1, 4, 48, 64, generator=gen).to(bf16)
        yield f"bf16 pse_type {pse_type} tensor", False, call(bf16, pse=pse, pse_type=pse_type, sparse_mode=3,
                                                              atten_mask=causal(1))
    for pse_type in (2, 3):
        slopes = 2.0 ** (-torch.arange(1, 5, dtype=torch.float32))
        yield f"bf16 alibi pse_type {pse_type}", False, call(bf16, pse=slopes, pse_type=pse_type)
    comp = torch.randn(1, 1, 1024, 1040, generator=gen).to(bf16)
    yield "bf16 compressed pse (1024 rows)", False, call(bf16, n1=1, n2=1, sq=1040, skv=1040, pse=comp, pse_type=1,
                                                         sparse_mode=2, atten_mask=causal(1))
    keep = (torch.rand(4 * 48 * 64 // 8, generator=gen) * 255).to(torch.uint8)
    yield "bf16 dropout causal", False, call(bf16, keep_prob=0.8, drop_mask=keep, sparse_mode=2, atten_mask=causal(1))
    yield "bf16 forward only (no stats)", False, call(bf16, grad=False)


def _dsa_calls() -> Iterator[tuple[str, bool, Callable[[], None]]]:
    """(label, execute, call) of the DSA ops at DeepSeek-V3.2 head shapes (N1 128, latent 512, rope 64, index
    heads 64 x 128) on few tokens: the compiled code depends on the shapes, not on the token counts."""
    import torch

    import cann_attn

    gen = torch.Generator().manual_seed(1)

    def rnd(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    def indices(s1: int, s2: int, k: int) -> torch.Tensor:
        return torch.stack([torch.randperm(s2, generator=gen)[:k] for _ in range(s1)]).view(1, s1, 1, k).int()

    def sfa(dtype: torch.dtype, rope: bool, same_kv: bool, det: bool, n1: int = 128, d: int = 512,
            block: int = 1) -> Callable[[], None]:
        def run() -> None:
            s1, s2 = 3, 32
            q, k = rnd(1, s1, n1, d, dtype=dtype), rnd(1, s2, 1, d, dtype=dtype)
            v = k if same_kv else rnd(1, s2, 1, d, dtype=dtype)
            qr = rnd(1, s1, n1, 64, dtype=dtype) if rope else None
            kr = rnd(1, s2, 1, 64, dtype=dtype) if rope else None
            idx = indices(s1, s2 // block, 4)
            kw: dict[str, Any] = {"query_rope": qr, "key_rope": kr, "sparse_block_size": block, "backend": "triton"}
            fwd = cann_attn.sparse_flash_attention(q, k, v, idx, d**-0.5, **kw)
            cann_attn.sparse_flash_attention_grad(q, k, v, idx, rnd(1, s1, n1, d, dtype=dtype), fwd.attention_out,
                                                  fwd.softmax_max, fwd.softmax_sum, d**-0.5, deterministic=det, **kw)
        return run

    def lightning(dtype: torch.dtype, rope: bool, det: bool) -> Callable[[], None]:
        def run() -> None:
            s1, s2, n1, d = 3, 24, 128, 512
            qi, ki, w = rnd(1, s1, 64, 128, dtype=dtype), rnd(1, s2, 1, 128, dtype=dtype), rnd(1, s1, 64, dtype=dtype)
            got = cann_attn.lightning_indexer(qi, ki, w, sparse_count=8, backend="triton")
            q, k = rnd(1, s1, n1, d, dtype=dtype), rnd(1, s2, 1, d, dtype=dtype)
            qr = rnd(1, s1, n1, 64, dtype=dtype) if rope else None
            kr = rnd(1, s2, 1, 64, dtype=dtype) if rope else None
            idx = got.sparse_indices
            fwd = cann_attn.sparse_flash_attention(q, k, k, idx, d**-0.5, query_rope=qr, key_rope=kr,
                                                   backend="triton")
            cann_attn.sparse_lightning_indexer_grad_kl_loss(q, k, qi, ki, w, idx, fwd.softmax_max, fwd.softmax_sum,
                                                           d**-0.5, query_rope=qr, key_rope=kr, deterministic=det,
                                                           backend="triton")
        return run

    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        for det in (False, True):
            mode = "deterministic" if det else "atomic"
            yield f"sfa {name} kv-shared rope {mode}", True, sfa(dtype, True, True, det)
        yield f"indexer+kl {name} rope atomic", True, lightning(dtype, True, False)
    bf16 = torch.bfloat16
    yield "sfa bf16 no rope separate V atomic", True, sfa(bf16, False, False, False)
    yield "sfa bf16 no rope separate V deterministic", True, sfa(bf16, False, False, True)
    yield "sfa bf16 block_size 8 n1 16 d 128", True, sfa(bf16, True, True, False, n1=16, d=128, block=8)
    yield "indexer+kl bf16 no rope deterministic", True, lightning(bf16, False, True)
    yield "indexer+kl fp32 rope deterministic", True, lightning(torch.float32, True, True)
    yield "sfa fp32 rope atomic", True, sfa(torch.float32, True, True, False, n1=16, d=128)


def record() -> list[KernelSpec]:
    """Run the representative op calls in this (interpreter) process and return the distinct specializations."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("record() needs TRITON_INTERPRET=1 (set before importing triton); use record_subprocess()")
    import torch

    torch.set_num_threads(1)
    recorder = Recorder()
    with recording(recorder):
        for calls in (_dense_calls(), _dsa_calls()):
            for label, execute, run in calls:
                recorder.variant, recorder.execute = label, execute
                run()
    return list(recorder.specs.values())


def _subprocess(args: list[str], interpret: bool, timeout: float) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0")
    src = str(Path(__file__).resolve().parents[3])  # .../src: works from a checkout without installing
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-m", f"{_PACKAGE}.aot", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"aot {args[0]} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


def record_subprocess(timeout: float = 600) -> list[KernelSpec]:
    """`record()` in a fresh interpreter process (the caller may have imported real or interpreted kernels)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "specs.json"
        _subprocess(["record", str(out)], interpret=True, timeout=timeout)
        return [KernelSpec.from_json(d) for d in json.loads(out.read_text())]


# ------------------------------------------------------------------------------------------------------------
# Compiling (TRITON_INTERPRET=0 process)
# ------------------------------------------------------------------------------------------------------------
def toolchain_missing() -> str | None:
    """Why sm_90 AOT compilation is impossible here (None: the nvidia backend and its ptxas are available)."""
    try:
        from triton.backends import backends

        if "nvidia" not in backends:
            return "triton has no nvidia backend"
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(TARGET_ARCH).path
    except Exception as e:  # any import/lookup failure means "cannot compile"
        return f"triton nvidia toolchain unavailable: {e!r}"
    if not ptxas or not os.path.exists(ptxas):
        return "ptxas not found"
    return None


@functools.cache
def _cuobjdump() -> str | None:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(path) if path.exists() else None


def _cubin_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, stack frame bytes) of the cubin's kernel from `cuobjdump --dump-resource-usage`; the stack
    frame of these kernels (no local arrays, no calls after inlining) is where ptxas puts spilled registers."""
    tool = _cuobjdump()
    if tool is None:
        return -1, -1
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=False).stdout
    regs = re.search(r"REG:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    return (int(regs.group(1)) if regs else -1), (int(stack.group(1)) if stack else -1)


def compile_one(spec: KernelSpec, config_index: int) -> CompileResult:
    """Compile `spec` with its config `config_index` for sm_90 (in a TRITON_INTERPRET=0 process)."""
    import time

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    config = spec.configs[config_index]
    result = CompileResult(spec.name(), spec.kernel, spec.variants, config.label(), config_index == 0, False)
    fn = getattr(importlib.import_module(f"{_PACKAGE}.{spec.module}"), spec.kernel)
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        result.error = f"{spec.kernel} is not a JITFunction (TRITON_INTERPRET set?)"
        return result
    constexprs = {**spec.constexprs, **config.constexprs}
    signature = {n: ("constexpr" if n in constexprs else t) for n, t in spec.signature.items()}
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in spec.divisible if n not in constexprs}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                    attrs=attrs)
    start = time.perf_counter()
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", TARGET_ARCH, 32),
                                  options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    except Exception as e:  # reported per config, never fatal
        result.error = f"{type(e).__name__}: {e}"[:4000]
        result.seconds = time.perf_counter() - start
        return result
    result.seconds = time.perf_counter() - start
    result.ok = True
    result.smem = int(compiled.metadata.shared)
    result.regs, result.spill_bytes = _cubin_usage(compiled.asm["cubin"])
    return result


def _compile_task(task: tuple[dict[str, Any], int]) -> dict[str, Any]:
    return dataclasses.asdict(compile_one(KernelSpec.from_json(task[0]), task[1]))


def compile_specs(specs: list[KernelSpec], all_configs: bool = True, workers: int = 2) -> list[CompileResult]:
    """Compile every spec with its first config (and every other config with `all_configs`), in this process
    (which must have TRITON_INTERPRET=0) with `workers` processes."""
    tasks = [(dataclasses.asdict(s), i) for s in specs for i in range(len(s.configs) if all_configs else 1)]
    if workers <= 1:
        return [CompileResult(**_compile_task(t)) for t in tasks]
    with ProcessPoolExecutor(workers) as pool:
        return [CompileResult(**r) for r in pool.map(_compile_task, tasks)]


def compile_subprocess(specs: list[KernelSpec], all_configs: bool = True, workers: int = 2,
                       timeout: float = 1800) -> list[CompileResult]:
    """`compile_specs` in a fresh TRITON_INTERPRET=0 process."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_file, out = Path(tmp) / "specs.json", Path(tmp) / "results.json"
        spec_file.write_text(json.dumps([dataclasses.asdict(s) for s in specs]))
        _subprocess(["compile", str(spec_file), str(out), "all" if all_configs else "first", str(workers)],
                    interpret=False, timeout=timeout)
        return [CompileResult(**d) for d in json.loads(out.read_text())]


def select_configs(specs: list[KernelSpec], per_kernel_all: bool = True) -> list[KernelSpec]:
    """The compile plan of the test: every spec with its first config, plus, per kernel, all configs once (on the
    spec recorded first for it), so every config of every autotune list is compiled once."""
    seen: set[str] = set()
    out = []
    for spec in specs:
        configs = spec.configs
        if per_kernel_all and spec.kernel in seen:
            configs = configs[:1]
        seen.add(spec.kernel)
        out.append(dataclasses.replace(spec, configs=configs))
    return out


# Constexprs that switch code paths on or off: the richest specialization of a kernel exercises the most code.
_FEATURE_FLAGS = ("HAS_MASK", "PSE_KIND", "COMPRESSED", "HAS_DROP", "WRITE_DPSE", "DPSE_ATOMIC", "HAS_ROPE",
                  "WRITE_STATS")


def representative(specs: list[KernelSpec]) -> list[KernelSpec]:
    """One spec per kernel (two for kernels with a DETERMINISTIC switch), the one with the most feature flags set
    and then the widest head dims, each with its default config only: the CI test's compile plan, a few dozen
    seconds of ptxas on 2 cores where the full plan takes minutes."""
    def score(spec: KernelSpec) -> tuple:
        flags = sum(bool(spec.constexprs.get(f)) for f in _FEATURE_FLAGS)
        widths = sum(v for k, v in spec.constexprs.items() if k.startswith("BLOCK_D") and isinstance(v, int))
        return flags, widths

    best: dict[tuple[str, bool], KernelSpec] = {}
    for spec in specs:
        key = (spec.kernel, bool(spec.constexprs.get("DETERMINISTIC")))
        if key not in best or score(spec) > score(best[key]):
            best[key] = spec
    return [dataclasses.replace(spec, configs=spec.configs[:1]) for spec in best.values()]


def _main(argv: list[str]) -> None:
    command = argv[0] if argv else "summary"
    if command == "record":
        Path(argv[1]).write_text(json.dumps([dataclasses.asdict(s) for s in record()]))
    elif command == "compile":
        specs = [KernelSpec.from_json(d) for d in json.loads(Path(argv[1]).read_text())]
        results = compile_specs(specs, all_configs=argv[3] == "all", workers=int(argv[4]))
        Path(argv[2]).write_text(json.dumps([dataclasses.asdict(r) for r in results]))
    elif command == "summary":
        specs = select_configs(record_subprocess())
        for r in compile_subprocess(specs):
            state = "ok" if r.ok else "FAILED"
            print(f"{state:6} regs={r.regs:4} stack={r.spill_bytes:5} smem={r.smem:7} {r.spec} | {r.config}"
                  + (f"\n  {r.error}" if r.error else ""))
    else:
        raise SystemExit(f"unknown command {command!r} (record OUT | compile SPECS OUT all|first WORKERS | summary)")


if __name__ == "__main__":
    _main(sys.argv[1:])
