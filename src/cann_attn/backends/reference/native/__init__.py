"""Optional compiled loops for the CPU reference backend (`attention_loops.c`, which includes one file per kernel
family: gathered (DSA) attention rows, the KL target, the fused dense forward and backward, decode rows).

At DeepSeek-V3.2 shapes (block size 1, 512 scattered keys per row, 16 heads) the PyTorch formulation gathers every
row's keys through memory and runs batched GEMMs with M = 16; the fused C loops read the selected rows in place and
measured ~1.6x faster (benchmarks/bench_sparse_attention.py). They compute only sums over the entries the Python
code marks valid; every rule (selection, statistics conventions, normalisation) stays in Python.

The C sources are compiled on first use with the system C compiler (`$CC`, a command with arguments, else `cc`)
into a per-user cache (`$CANN_ATTN_CACHE_DIR`, an absolute path, else `$XDG_CACHE_HOME/cann_attn` or
`~/.cache/cann_attn`), named by a hash of every source file, the compiler and the flags, and loaded with ctypes: no
build step at install time and no dependency beyond a compiler; a cached file that does not load is rebuilt. Without a
compiler, on a CPU without AVX2/FMA, or with `CANN_ATTN_NATIVE=0`, `library()` is None (with one warning when a
compile or load failed) and the kernels take their PyTorch path, which gives the same results up to rounding.

The fused dense forward calls the BLAS sgemm inside PyTorch's own CPU library (MKL in the x86 wheels; found by
name, never bundled) on each thread for whole row blocks; where none is found it is off and the forward runs its
PyTorch loop of torch.bmm calls. With bf16 inputs on a CPU with AVX512-BF16 the products of two inputs (the scores
QK^T and the backward's dO V^T) use AVX512-BF16 dot products instead (`Bf16Scores`; exact products, fp32 sums).

The loops split rows (or, for the scatters, disjoint column ranges) over OpenMP threads. The library is linked
with -fopenmp and so needs libgomp.so.1, which resolves to the libgomp PyTorch has already loaded: the loops run on
PyTorch's thread pool and follow torch.set_num_threads. No result depends on the number of threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from ..softmax_exp import EXP2_FLOOR, LOG2E

SOURCE = Path(__file__).with_name("attention_loops.c")
# SOURCE is the one translation unit; it includes the other files of the directory, so all of them key the cache.
SOURCE_PATTERNS = ("*.c", "*.h")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno")
ENV_SWITCH = "CANN_ATTN_NATIVE"
BLAS_SWITCH = "CANN_ATTN_NATIVE_BLAS"
BF16_SWITCH = "CANN_ATTN_NATIVE_BF16"
VNNI_SWITCH = "CANN_ATTN_NATIVE_VNNI"
AVX512_SWITCH = "CANN_ATTN_NATIVE_AVX512"
ORDERED_GEMM_SWITCH = "CANN_ATTN_NATIVE_ORDERED_GEMM"

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "cann_attn_cpu_supported": [],
    "sfa_forward_rows": [_P, _I, _I, _I, _P, _I, _I, _I, _F, _I, _P, _I, _P, _I, _I, _P, _P, _I, _I, _I, _F, _F, _P,
                         _P, _P],
    "sfa_backward_rows": [_P, _P, _P, _P, _P, _I, _I, _I, _P, _I, _P, _I, _P, _P, _I, _I, _I, _F, _F, _F, _P, _P,
                          _P, _P, _P],
    "sfa_scatter": [_P, _P, _I, _P, _I, _P, _P, _I, _P, _I, _I, _I, _P, _P, _I],
    "kl_target_rows": [_P, _I, _I, _P, _I, _P, _P, _I, _P, _I, _I, _F, _F, _P],
    "cann_attn_exp2_flushed": [_P, _P, _I, _F],
    "rows_dot": [_P, _I, _I, _P, _I, _P, _I, _I, _P],
    "rows_combine": [_P, _I, _I, _P, _I, _P, _I, _I, _F, _P],
    "rows_scatter": [_P, _P, _I, _I, _I, _P, _I, _P, _I],
    "fa_softmax_step": [_P, _I, _I, _I, _P, _P, _P, _F, _F],
    "fa_exp_rows": [_P, _I, _I, _P, _P, _F, _F],
    "fa_ds_rows": [_P, _P, _I, _I, _P],
    "npu_round": [_P, _P, _I, _I, _I],
    "npu_round_wide_fp16": [_P, _P, _I, _I, _I, _F, _I],
    "npu_fp16_softmax_step": [_P, _P, _I, _I, _I, _F, _I, _I, _P, _P, _P, _F, _F],
    "npu_fp16_accumulate": [_P, _P, _P, _I, _I, _I, _I, _I],
    "npu_grad_scores": [_P, _P, _I, _I, _I, _I, _P, _P, _P, _F, _P, _P, _I, _P, _I, _I, _I, _P, _P, _I, _I, _F, _F],
    "cann_attn_set_sgemm": [_P],
    "cann_attn_has_sgemm": [],
    "cann_attn_set_sgemm_pack": [_P, _P, _P],
    "cann_attn_set_blas_threads": [_P],
    "cann_attn_has_sgemm_pack": [],
    "fa_forward_blocks": [_P, _I, _I, _I, _P, _I, _I, _P, _I, _I, _I, _I, _P, _P, _P, _I, _I, _P, _P, _I, _I, _I,
                          _F, _F, _P, _P, _P, _P, _P, _P],
    "fa_backward_blocks": [_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _P, _I, _I, _P, _I, _I, _I, _P, _P, _P, _I, _I, _P,
                           _P, _F, _I, _I, _I, _F, _F, _P, _P, _P, _I, _I, _P, _I, _I, _P, _I, _I],
    "cann_attn_has_bf16_dot": [],
    "cann_attn_alibi_skipped_terms": [],
    "cann_attn_forward_packed_gemms": [],
    "cann_attn_ordered_gemms": [],
    "cann_attn_ordered_probes": [],
    "cann_attn_set_ordered_gemm": [ctypes.c_int],
    "cann_attn_loops_gemm": [_I, _I, _I, _I, _P, _I, _P, _I, _P, _I],
    "cann_attn_has_f16c": [],
    "cann_attn_has_avx512": [],
    "cann_attn_set_avx512": [ctypes.c_int],
    "fia_decode_rows": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _I, _I, _P,
                        _P, _I, _I, _I, _I, _P, _I, _I, _I, _I, _I, _I, _I, _F, _F, _P, _F, _P, _P, _P, _P],
    "cann_attn_set_bf16_dot": [ctypes.c_int],
    "cann_attn_decode_dots": [_P, _P, _I, _I, _I, _F, ctypes.c_int, _P],
    "cann_attn_set_int8_dot": [ctypes.c_int],
    "cann_attn_int8_dots": [_P, _P, _I, _I, _I, ctypes.c_int, _P],
}
_INT_RESULTS = ("cann_attn_cpu_supported", "cann_attn_has_sgemm", "cann_attn_has_sgemm_pack", "cann_attn_has_bf16_dot",
                "cann_attn_has_f16c", "cann_attn_has_avx512", "cann_attn_set_avx512", "cann_attn_set_ordered_gemm",
                "cann_attn_set_bf16_dot", "cann_attn_decode_dots", "cann_attn_set_int8_dot", "cann_attn_int8_dots")
_INT64_RESULTS = ("cann_attn_alibi_skipped_terms", "cann_attn_forward_packed_gemms", "cann_attn_ordered_gemms",
                  "cann_attn_ordered_probes", "npu_fp16_softmax_step")

_lock = threading.Lock()
_state: dict[str, object] = {}


def enabled_by_environment() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


CACHE_DIR_VARIABLE = "CANN_ATTN_CACHE_DIR"


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cann_attn"


def cache_dir() -> Path:
    """$CANN_ATTN_CACHE_DIR (`~` expanded), else the per-user default. A relative path would name a different
    directory from every working directory (a fresh build in each), so it is refused with a warning and the
    default is used (docs/guides/backends.md)."""
    explicit = os.environ.get(CACHE_DIR_VARIABLE)
    if not explicit:
        return default_cache_dir()
    path = Path(explicit).expanduser()
    if not path.is_absolute():
        warnings.warn(f"cann_attn: {CACHE_DIR_VARIABLE}={explicit!r} is not an absolute path and is ignored; the "
                      f"native loops are cached in {default_cache_dir()}", RuntimeWarning, stacklevel=4)
        return default_cache_dir()
    return path


# A compile takes ~15 s on an idle 2-core machine and several minutes on a loaded one (or with sanitizers); the
# limit only reports a compiler that hangs, so no slow machine may reach it.
COMPILE_HANG_SECONDS = 1800


def _compiler() -> list[str]:
    """$CC split like a shell would (`CC="gcc -O0"` or `CC="ccache cc"` is a command with arguments), else cc."""
    return shlex.split(os.environ.get("CC") or "") or ["cc"]


def _build(target: Path) -> None:
    """Compile SOURCE into `target` atomically (a temporary file renamed into place: concurrent test workers
    compiling the same library never load a half-written file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([*_compiler(), *FLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True, text=True,
                       timeout=COMPILE_HANG_SECONDS)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _open(target: Path) -> ctypes.CDLL:
    """The cached library, built first where it is missing, and rebuilt once where the cached file does not load
    (a 0-byte or truncated file left by a crash or a full disk would otherwise send every later process to the
    PyTorch path). The rebuild replaces the file atomically, so a process loading it meanwhile sees either file."""
    if not target.exists():
        _build(target)
        return ctypes.CDLL(str(target))
    try:
        return ctypes.CDLL(str(target))
    except OSError:
        _build(target)
        return ctypes.CDLL(str(target))


def sources() -> list[Path]:
    """Every C source file of the library: SOURCE and the files it includes, in a fixed order."""
    return sorted({path for pattern in SOURCE_PATTERNS for path in SOURCE.parent.glob(pattern)})


def library_path() -> Path:
    """Where the library built from the sources with the current compiler command and FLAGS is cached: the key
    hashes each file's name and content, so an edit to any included file builds a new library."""
    digest = hashlib.sha256()
    for path in sources():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join((*_compiler(), *FLAGS)).encode())
    return cache_dir() / f"attention_loops-{digest.hexdigest()[:16]}.so"


def _load() -> ctypes.CDLL | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        lib = _open(library_path())
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int if name in _INT_RESULTS else ctypes.c_int64 if name in _INT64_RESULTS else None
    except (OSError, AttributeError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        warnings.warn(f"cann_attn: the native CPU loops could not be built or loaded ({detail.strip()[:300]}); "
                      f"the reference backend uses its PyTorch path (set {ENV_SWITCH}=0 to silence this)",
                      RuntimeWarning, stacklevel=3)
        return None
    if not lib.cann_attn_cpu_supported():
        return None
    sgemm = _torch_sgemm()
    if sgemm is not None:
        lib.cann_attn_set_sgemm(sgemm)
        lib.cann_attn_set_sgemm_pack(*(_torch_cpu_symbol((name,)) for name in SGEMM_PACK_NAMES))
        lib.cann_attn_set_blas_threads(_torch_cpu_symbol(BLAS_THREADS_NAMES))
    lib.cann_attn_set_avx512(0 if _switched_off(AVX512_SWITCH) else 1)
    lib.cann_attn_set_ordered_gemm(0 if _switched_off(ORDERED_GEMM_SWITCH) else 1)
    lib.cann_attn_set_bf16_dot(0 if _switched_off(BF16_SWITCH) else 1)
    lib.cann_attn_set_int8_dot(0 if _switched_off(VNNI_SWITCH) else 1)
    return lib


# Fortran-interface sgemm names, LP64 (32-bit integers): OpenBLAS and reference BLAS export `sgemm_`; the MKL that
# PyTorch's x86 wheels link statically exports `SGEMM`.
SGEMM_NAMES = ("sgemm_", "SGEMM")


# MKL's packed-operand GEMM (LP64 Fortran interface), which the fused backward uses where all three are exported
# (attention_loops.c, pack_rows_t); other BLAS builds lack it and the loops call sgemm alone.
SGEMM_PACK_NAMES = ("SGEMM_PACK_GET_SIZE", "SGEMM_PACK", "SGEMM_COMPUTE")


# MKL's per-thread thread count, C interface (by value; MKL's lower-case `mkl_set_num_threads_local` is the Fortran
# one, by reference): the loops set it to 1 around each BLAS call so that MKL gives the same bits whatever the
# OpenMP team size (attention_loops.c, ON_ONE_THREAD). Absent from other BLAS builds, which then run as they are.
BLAS_THREADS_NAMES = ("MKL_Set_Num_Threads_Local",)


def _torch_sgemm() -> int | None:
    """The address of the sgemm inside PyTorch's CPU library (the BLAS torch.mm itself uses), or None."""
    return _torch_cpu_symbol(SGEMM_NAMES)


def _torch_cpu_symbol(names: tuple[str, ...]) -> int | None:
    """The address of the first of `names` that PyTorch's CPU library exports, or None."""
    lib_dir = Path(torch.__file__).resolve().parent / "lib"
    for candidate in sorted(lib_dir.glob("libtorch_cpu*")):
        try:
            torch_cpu = ctypes.CDLL(str(candidate))
        except OSError:
            continue
        for name in names:
            fn = getattr(torch_cpu, name, None)
            if fn is not None:
                return ctypes.cast(fn, ctypes.c_void_p).value
    return None


def library() -> ctypes.CDLL | None:
    """The loaded library, or None where the native loops are unavailable or switched off."""
    if not enabled_by_environment():
        return None
    with _lock:
        if "lib" not in _state:
            _state["lib"] = _load()
        return _state["lib"]  # type: ignore[return-value]


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the native loops can run on these tensors: CPU, float32, library available."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and library() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _unit_columns(k: torch.Tensor) -> torch.Tensor:
    """A 2-D float32 tensor with unit column stride (rows may be strided): `k` itself when it has one."""
    assert k.dim() == 2 and k.dtype == torch.float32
    return k if k.stride(1) == 1 or k.shape[1] <= 1 else k.contiguous()


def _rows(k: torch.Tensor) -> tuple[int, int]:
    """(pointer, row stride) of a 2-D float32 tensor with unit column stride."""
    return k.data_ptr(), k.stride(0)


def _entries(tokens: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    tokens = tokens.to(torch.int64).contiguous()
    return tokens, None if valid is None else valid.contiguous().view(torch.uint8)


def _check_rows(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.is_contiguous() and t.dtype == torch.float32, (t.shape, t.stride(), t.dtype)


def sfa_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor | None,
                log2e: float, floor2: float, out: torch.Tensor, row_max: torch.Tensor, row_sum: torch.Tensor,
                q_rope: torch.Tensor | None = None, scale: float = 1.0) -> None:
    """Unnormalised out [R, H, Dv], the largest logit row_max [R, H] and row_sum [R, H] of the exponentials, from
    the queries scale * (q [R, H, Dq] ++ q_rope [R, H, Dr]) over each row's valid entries (see attention_loops.c).
    q and q_rope are fp32 with unit column stride (any row and head strides); scale multiplies each element once,
    in fp32, as PyTorch's multiply by a Python float does."""
    lib = library()
    _check_rows(out, row_max, row_sum)
    for t in (q,) if q_rope is None else (q, q_rope):
        assert t.dtype == torch.float32 and t.stride(-1) == 1 and t.shape[:2] == q.shape[:2], (t.shape, t.stride())
    rows, heads, dq = q.shape
    rope = (0, 0, 0, 0) if q_rope is None else (q_rope.data_ptr(), q_rope.stride(0), q_rope.stride(1), q_rope.shape[2])
    tokens, valid_bytes = _entries(tokens, valid)
    width = tokens.shape[1]
    k, v = _unit_columns(k), _unit_columns(v)
    (kp, ldk), (vp, ldv) = _rows(k), _rows(v)

    lib.sfa_forward_rows(q.data_ptr(), q.stride(0), q.stride(1), dq, rope[0] or None, *rope[1:], scale, heads, kp, ldk,
                         vp, ldv, out.shape[-1], tokens.data_ptr(), _ptr(valid_bytes), width, 0, rows, log2e, floor2,
                         out.data_ptr(), row_max.data_ptr(), row_sum.data_ptr())


def sfa_backward(q: torch.Tensor, d_out: torch.Tensor, d_sum: torch.Tensor, shift: torch.Tensor,
                 inv_sum: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: torch.Tensor,
                 valid: torch.Tensor | None, log2e: float, floor2: float, scale: float, dq: torch.Tensor,
                 dk: torch.Tensor, dv: torch.Tensor) -> None:
    """dq [R, H, Dqk] written; dk [Skv, Dqk] and dv [Skv, Dv] accumulated (rows in order, entries in order)."""
    lib = library()
    _check_rows(q, d_out, d_sum, shift, inv_sum, dq)
    rows, heads, dqk = q.shape
    dim_v = d_out.shape[-1]
    tokens, valid_bytes = _entries(tokens, valid)
    width = tokens.shape[1]
    k, v = _unit_columns(k), _unit_columns(v)
    (kp, ldk), (vp, ldv) = _rows(k), _rows(v)
    count = torch.empty(rows, dtype=torch.int64)
    selected = torch.empty(rows, width, dtype=torch.int64)
    p = torch.empty(rows, heads, width)
    ds = torch.empty(rows, heads, width)

    lib.sfa_backward_rows(q.data_ptr(), d_out.data_ptr(), d_sum.data_ptr(), shift.data_ptr(), inv_sum.data_ptr(),
                          heads, dqk, dim_v, kp, ldk, vp, ldv, tokens.data_ptr(), _ptr(valid_bytes), width, 0, rows,
                          log2e, floor2, scale, dq.data_ptr(), count.data_ptr(), selected.data_ptr(), p.data_ptr(),
                          ds.data_ptr())
    (dkp, lddk), (dvp, lddv) = _rows(dk), _rows(dv)
    lib.sfa_scatter(ds.data_ptr(), q.data_ptr(), dqk, dkp, lddk, p.data_ptr(), d_out.data_ptr(), dim_v, dvp, lddv,
                    heads, width, count.data_ptr(), selected.data_ptr(), rows)


def kl_target(q: torch.Tensor, k: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor | None,
              shift: torch.Tensor, floor2: float, out: torch.Tensor) -> None:
    """out [R, W] = mean over heads of 2^(q_h . K_j - shift_h) (flushed) on valid entries, 0 elsewhere; q [R, H, Dqk]
    carries scale * log2(e), shift [R, H] is (max + ln sum) * log2(e)."""
    lib = library()
    _check_rows(q, shift, out)
    rows, heads, dqk = q.shape
    tokens, valid_bytes = _entries(tokens, valid)
    width = tokens.shape[1]
    k = _unit_columns(k)
    kp, ldk = _rows(k)

    lib.kl_target_rows(q.data_ptr(), heads, dqk, kp, ldk, tokens.data_ptr(), _ptr(valid_bytes), width,
                       shift.data_ptr(), 0, rows, floor2, 1.0 / heads, out.data_ptr())


def rows_dot(a: torch.Tensor, b: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [R, H, W] = a[r, h] . b[tokens[r, j]] for a [R, H, D], b [S, D], every entry (tokens must be in range)."""
    lib = library()
    _check_rows(a, out)
    rows, heads, dim = a.shape
    tokens, _ = _entries(tokens, None)
    b = _unit_columns(b)
    lib.rows_dot(a.data_ptr(), heads, dim, *_rows(b), tokens.data_ptr(), tokens.shape[1], rows, out.data_ptr())
    return out


def rows_combine(weights: torch.Tensor, b: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor,
                 alpha: float = 1.0) -> torch.Tensor:
    """out [R, H, D] = alpha * sum_j weights[r, h, j] b[tokens[r, j]] for weights [R, H, W], b [S, D]."""
    lib = library()
    _check_rows(weights, out)
    rows, heads, width = weights.shape
    tokens, _ = _entries(tokens, None)
    b = _unit_columns(b)
    lib.rows_combine(weights.data_ptr(), heads, width, *_rows(b), tokens.data_ptr(), out.shape[-1], rows, alpha,
                     out.data_ptr())
    return out


def rows_scatter(weights: torch.Tensor, a: torch.Tensor, tokens: torch.Tensor, target: torch.Tensor) -> None:
    """target[tokens[r, j]] += sum_h weights[r, h, j] a[r, h] for weights [R, H, W], a [R, H, D], target [S, D]
    (rows, then entries, in order: duplicated tokens add up, deterministically)."""
    lib = library()
    _check_rows(weights, a)
    rows, heads, width = weights.shape
    tokens, _ = _entries(tokens, None)
    assert target.dtype == torch.float32 and target.stride(-1) == 1
    lib.rows_scatter(weights.data_ptr(), a.data_ptr(), heads, a.shape[-1], width, tokens.data_ptr(), rows,
                     *_rows(target))


def fa_softmax_step(s: torch.Tensor, row_max: torch.Tensor, row_sum: torch.Tensor, correction: torch.Tensor,
                    log2e: float, floor2: float) -> None:
    """One online-softmax step over score rows s [..., cols] (contiguous) in place: s becomes the flushed
    exponentials, row_max / row_sum [...] (contiguous) are updated, correction [...] receives e^(old max - shift)."""
    lib = library()
    _check_rows(s, row_max, row_sum, correction)
    cols = s.shape[-1]
    rows = s.numel() // max(cols, 1)
    assert row_max.numel() == rows == row_sum.numel() == correction.numel()
    lib.fa_softmax_step(s.data_ptr(), rows, cols, cols, row_max.data_ptr(), row_sum.data_ptr(), correction.data_ptr(),
                        log2e, floor2)


def npu_round(x: torch.Tensor, half: bool, away: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 `x` rounded once to the float16 (`half`) or bfloat16 grid, ties away from zero or to even, as fp32 (the
    "npu" precision mode's `Cast`; docs/semantics/precision.md), into `out` (contiguous, x's shape; x itself
    allowed) or a new tensor."""
    lib = library()
    x = x.contiguous()
    if out is None:
        out = torch.empty_like(x)
    assert out.is_contiguous() and out.shape == x.shape and out.dtype == torch.float32
    lib.npu_round(x.data_ptr(), out.data_ptr(), x.numel(), int(half), int(away))
    return out


def npu_round_wide_fp16(x: torch.Tensor, away: bool, scale: float | None = None,
                        scaled_away: bool = False) -> torch.Tensor:
    """float64 `x` (an exact GEMM sum) rounded once to the float16 grid, ties away from zero or to even, as fp32
    (the "npu" precision mode's `Cast` of a float64 value; docs/semantics/precision.md); with `scale` (an fp32
    value) that result times `scale` rounded to float16 again (ties away when `scaled_away`)."""
    lib = library()
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    lib.npu_round_wide_fp16(x.data_ptr(), out.data_ptr(), x.numel(), int(away), int(scale is not None),
                            0.0 if scale is None else scale, int(scaled_away))
    return out


def npu_fp16_softmax_step(s: torch.Tensor, logits: torch.Tensor | None, row_max: torch.Tensor,
                          row_sum: torch.Tensor, correction: torch.Tensor, log2e: float, floor2: float, *,
                          scores_away: bool = False, scale: float = 1.0, logits_away: bool = False,
                          p_away: bool = False) -> None:
    """One online-softmax step of an fp16 pipeline over a key tile (npu_tiles.c), in place: s [..., cols] (float64,
    contiguous) holds the scores GEMM's sums and receives the probabilities rounded to fp16 (ties away when
    `p_away`), as float64. The logits are `logits` (fp32, same shape, rounded and masked; overwritten) or, when it
    is None, s rounded to fp16 (`scores_away`), times the fp32 `scale`, rounded again (`logits_away`). row_max /
    row_sum [...] are updated as `fa_softmax_step` does and correction [...] receives e^(old max - shift)."""
    lib = library()
    assert s.dtype == torch.float64 and s.is_contiguous(), (s.dtype, s.stride())
    _check_rows(row_max, row_sum, correction)
    if logits is not None:
        _check_rows(logits)
        assert logits.numel() == s.numel()
    cols = s.shape[-1]
    rows = s.numel() // max(cols, 1)
    assert row_max.numel() == rows == row_sum.numel() == correction.numel()
    if lib.npu_fp16_softmax_step(s.data_ptr(), _ptr(logits), rows, cols, int(scores_away), scale, int(logits_away),
                                 int(p_away), row_max.data_ptr(), row_sum.data_ptr(), correction.data_ptr(), log2e,
                                 floor2) != 0:
        raise MemoryError("npu_fp16_softmax_step: no memory for its row buffers")


def npu_fp16_accumulate(acc: torch.Tensor, products: torch.Tensor, correction: torch.Tensor, *,
                        products_away: bool = False, rescale_away: bool = False, acc_away: bool = False) -> None:
    """The fp16 running output after one key tile (npu_tiles.c), in place: acc [..., D] (fp32 holding fp16 values)
    <- fp16(fp16(acc * fp16(correction)) + fp16(products)), products [..., D] the tile's float64 P V sums and
    correction [...] the step's e^(old max - new max); each fp16 rounding ties away where its flag says."""
    lib = library()
    _check_rows(acc, correction)
    assert products.dtype == torch.float64 and products.is_contiguous() and products.numel() == acc.numel()
    dim = acc.shape[-1]
    rows = acc.numel() // max(dim, 1)
    assert correction.numel() == rows
    lib.npu_fp16_accumulate(acc.data_ptr(), products.data_ptr(), correction.data_ptr(), rows, dim,
                            int(products_away), int(rescale_away), int(acc_away))
def npu_cast_kind(dtype: torch.dtype, away: bool) -> int:
    """`npu_grad_scores`' code of a cast: 0 keeps fp32, else 1 | fp16 << 1 | half away << 2 (bf16 without fp16)."""
    if dtype == torch.float32:
        return 0
    return 1 | (2 if dtype == torch.float16 else 0) | (4 if away else 0)


def npu_grad_scores(s: torch.Tensor, dp: torch.Tensor, row_max: torch.Tensor, row_sum: torch.Tensor,
                    d_sum: torch.Tensor, scale: float, heads: int, tile_rows: int, p: torch.Tensor, ds: torch.Tensor,
                    p_kind: int, ds_kind: int, bounds: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                    mask: torch.Tensor | None = None) -> None:
    """The "npu" mode gradient's cast P and dS of one key tile in one pass (npu_grad.c): float64 sums s and dp
    [E, G * tile_rows, cols] (contiguous; their rows ordered as [c, heads, tile_rows]), the statistics row_max,
    row_sum and rowsum(dY * O) d_sum [c * heads * tile_rows] (fp32, contiguous), into p and ds (fp32, s's shape,
    contiguous), cast as `npu_cast_kind` says. `bounds` (lo, hi, j0): tile row i sees the columns j with
    lo[i] <= j0 + j < hi[i] (lo, hi int64 [tile_rows]); `mask` [1 or c, 1 or heads, tile_rows, cols] (bool or uint8,
    unit column stride): nonzero hides a column."""
    lib = library()
    for t in (s, dp):
        assert t.dtype == torch.float64 and t.is_contiguous() and t.shape == s.shape
    _check_rows(row_max, row_sum, d_sum, p, ds)
    cols = s.shape[-1]
    n_rows = s.numel() // max(cols, 1)
    assert row_max.numel() == row_sum.numel() == d_sum.numel() == n_rows and n_rows % (heads * tile_rows) == 0
    assert p.shape == ds.shape == s.shape
    lo = hi = None
    j0 = 0
    if bounds is not None:
        lo, hi, j0 = bounds
        assert lo.dtype == hi.dtype == torch.int64 and lo.is_contiguous() and hi.is_contiguous()
        assert lo.numel() == hi.numel() == tile_rows
    strides = (0, 0, 0)
    if mask is not None:
        assert mask.dim() == 4 and mask.shape[2:] == (tile_rows, cols) and mask.dtype in (torch.bool, torch.uint8)
        assert mask.stride(-1) == 1 or cols <= 1
        strides = tuple(0 if mask.shape[k] == 1 else mask.stride(k) for k in range(3))
        mask = mask.view(torch.uint8)
    lib.npu_grad_scores(s.data_ptr(), dp.data_ptr(), n_rows, cols, tile_rows, heads, row_max.data_ptr(),
                        row_sum.data_ptr(), d_sum.data_ptr(), scale, _ptr(lo), _ptr(hi), j0, _ptr(mask), *strides,
                        p.data_ptr(), ds.data_ptr(), p_kind, ds_kind, LOG2E, EXP2_FLOOR)


def fa_exp_rows(s: torch.Tensor, shift: torch.Tensor, factor: torch.Tensor, log2e: float, floor2: float) -> None:
    """s [..., cols] (contiguous) <- 2^((s - shift) log2e) * factor per row, flushed at floor2; shift and factor
    [...] contiguous."""
    lib = library()
    _check_rows(s, shift, factor)
    cols = s.shape[-1]
    rows = s.numel() // max(cols, 1)
    assert shift.numel() == rows == factor.numel()
    lib.fa_exp_rows(s.data_ptr(), rows, cols, shift.data_ptr(), factor.data_ptr(), log2e, floor2)


def fa_ds_rows(dp: torch.Tensor, p: torch.Tensor, d_sum: torch.Tensor) -> torch.Tensor:
    """dp [..., cols] <- p * (dp - d_sum) per row, in place (all contiguous, d_sum [...])."""
    lib = library()
    _check_rows(dp, p, d_sum)
    cols = dp.shape[-1]
    rows = dp.numel() // max(cols, 1)
    assert p.numel() == dp.numel() and d_sum.numel() == rows
    lib.fa_ds_rows(dp.data_ptr(), p.data_ptr(), rows, cols, d_sum.data_ptr())
    return dp


def exp2_flushed(x: torch.Tensor, floor2: float) -> torch.Tensor:
    """The loops' 2^x (0 at or below floor2) on a float32 tensor: for tests against softmax_exp.exp2_flushed_."""
    lib = library()
    x = x.contiguous()
    out = torch.empty_like(x)
    lib.cann_attn_exp2_flushed(x.data_ptr(), out.data_ptr(), x.numel(), floor2)
    return out


def has_sgemm() -> bool:
    """Whether the fused dense loops (`fa_forward_blocks`, `fa_backward_blocks`) can run: library loaded, a BLAS
    sgemm found, and not switched off with CANN_ATTN_NATIVE_BLAS=0 (the dense kernels then run their PyTorch loops
    with the native softmax passes)."""
    if _switched_off(BLAS_SWITCH):
        return False
    lib = library()
    return lib is not None and bool(lib.cann_attn_has_sgemm())


def _switched_off(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "off", "no")


def has_bf16_dot() -> bool:
    """Whether the fused dense loops can form the scores of bf16 inputs with AVX512-BF16 dot products (exact products,
    fp32 sums; `Bf16Scores`): has_sgemm(), a CPU with AVX512-BF16, and not switched off with CANN_ATTN_NATIVE_BF16=0."""
    if _switched_off(BF16_SWITCH) or not has_sgemm():
        return False
    return bool(library().cann_attn_has_bf16_dot())


def has_f16c() -> bool:
    """Whether the loaded loops can convert fp16 (a CPU with F16C)."""
    lib = library()
    return lib is not None and bool(lib.cann_attn_has_f16c())


def set_avx512(on: bool) -> bool:
    """Whether the exponential pass takes AVX-512 steps (where the CPU has AVX-512F; CANN_ATTN_NATIVE_AVX512=0 turns
    them off at load): bit for bit the AVX2 loop's results, only faster. Returns the setting now in force."""
    lib = library()
    return lib is not None and bool(lib.cann_attn_set_avx512(int(on)))


def set_ordered_gemm(on: bool) -> bool:
    """Whether the fused dense loops' GEMMs may take the AVX-512 loops of blas_order.c, which serve a shape only where
    they gave the BLAS's own floats on it (docs/guides/backends.md); off, the BLAS runs every GEMM.
    CANN_ATTN_NATIVE_ORDERED_GEMM=0 turns them off at load. Returns the setting now in force (needs AVX-512 steps
    on, `set_avx512`, to take effect)."""
    lib = library()
    return lib is not None and bool(lib.cann_attn_set_ordered_gemm(int(on)))


def ordered_gemms() -> int:
    """GEMM calls of the fused loops that the ordered AVX-512 loops served since the last call (0 without the
    library)."""
    lib = library()
    return 0 if lib is None else int(lib.cann_attn_ordered_gemms())


def ordered_probes() -> int:
    """Shape classes whose check (the BLAS against the ordered AVX-512 loops on shapes of the class) ran since the last
    call: at most one per class, however many shapes a workload meets (docs/performance.md; 0 without the
    library)."""
    lib = library()
    return 0 if lib is None else int(lib.cann_attn_ordered_probes())


# The operations of `loops_gemm` (blas_order.c, enum ordered_op).
GEMM_NT, GEMM_NN, GEMM_TN = 0, 1, 2


def loops_gemm(op: int, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    """One GEMM as the fused loops run it, in place in c [m, n] (2-D fp32 tensors with unit column stride):
    GEMM_NT c = a b^T (a [m, k], b [n, k]); GEMM_NN c += a b (a [m, k], b [k, n]); GEMM_TN c += a^T b (a [k, m],
    b [k, n]). For tests of the ordered loops against the BLAS."""
    lib = library()
    assert lib is not None and all(t.dtype == torch.float32 and t.dim() == 2 and t.stride(1) == 1 for t in (a, b, c))
    m, n = c.shape
    k = a.shape[0] if op == GEMM_TN else a.shape[1]
    lib.cann_attn_loops_gemm(op, m, n, k, a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), c.data_ptr(),
                             c.stride(0))


def set_bf16_dot(on: bool) -> bool:
    """Whether the decode loop's scores of bf16 query rows and keys take AVX512-BF16 dot products (where the CPU has
    them; CANN_ATTN_NATIVE_BF16=0 turns them off at load) or their emulation: the same bits either way
    (docs/guides/backends.md, "Decode"). Returns the setting now in force."""
    lib = library()
    return lib is not None and bool(lib.cann_attn_set_bf16_dot(int(on)))


def decode_dots(q: torch.Tensor, k: torch.Tensor, scale: float, emulate: bool) -> torch.Tensor:
    """scale * q k^T [H, n] of bf16 rows q [H, D] and k [n, D] by the decode loop's bf16 score kernel (its order of
    the sums), through AVX512-BF16 dot products or (`emulate`) their emulation: for tests."""
    lib = library()
    assert q.dtype == k.dtype == torch.bfloat16 and q.dim() == k.dim() == 2 and q.shape[1] == k.shape[1]
    q, k = q.contiguous(), k.contiguous()
    out = torch.empty(q.shape[0], k.shape[0], dtype=torch.float32)
    if lib.cann_attn_decode_dots(q.data_ptr(), k.data_ptr(), q.shape[0], k.shape[0], q.shape[1], scale, int(emulate),
                                 out.data_ptr()) != 0:
        raise RuntimeError("no AVX512-BF16 on this CPU")
    return out


def set_int8_dot(on: bool) -> bool:
    """Whether the decode loop's scores of an int8 MLA query take AVX512-VNNI dot products (where the CPU has them;
    CANN_ATTN_NATIVE_VNNI=0 turns them off at load) or an integer loop: the same bits either way
    (docs/guides/backends.md, "Decode"). Returns the setting now in force."""
    lib = library()
    return lib is not None and bool(lib.cann_attn_set_int8_dot(int(on)))


def int8_dots(q: torch.Tensor, k: torch.Tensor, emulate: bool) -> torch.Tensor:
    """q k^T [H, n] in int32 of int8 rows q [H, D] and k [n, D] by the decode loop's int8 score kernel, through
    AVX512-VNNI dot products or (`emulate`) the integer loop: for tests."""
    lib = library()
    assert q.dtype == k.dtype == torch.int8 and q.dim() == k.dim() == 2 and q.shape[1] == k.shape[1]
    q, k = q.contiguous(), k.contiguous()
    out = torch.empty(q.shape[0], k.shape[0], dtype=torch.int32)
    if lib.cann_attn_int8_dots(q.data_ptr(), k.data_ptr(), q.shape[0], k.shape[0], q.shape[1], int(emulate),
                               out.data_ptr()) != 0:
        raise RuntimeError("no AVX512-VNNI on this CPU")
    return out


class _Bf16Struct(ctypes.Structure):
    _fields_ = [("q", _P), ("k", _P), ("dy", _P), ("v", _P), ("ske", _I), ("ldk", _I), ("sve", _I), ("ldv", _I),
                ("d16", _I), ("scale", _F)]


class Bf16Scores:
    """bf16 operands of the fused loops' score products (attention_loops.c, struct bf16_scores): S = scale * q k^T
    from the query rows q [E, R, Dk] (unscaled, contiguous) and keys k [E, Skv, Dk] (unit column stride), and for the
    backward dP = dy v^T from dy [E, R, Dv] (contiguous) and values v [E, Skv, Dv]. The fp32 operands the call also
    takes (scaled q, k, v, dy) still feed every other product; columns of the fp32 q and k past Dk (ALiBi's rank-2
    features) are added to the scores in fp32."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, scale: float, dy: torch.Tensor | None = None,
                 v: torch.Tensor | None = None) -> None:
        for t in (q, k, dy, v):
            assert t is None or (t.dtype == torch.bfloat16 and t.dim() == 3 and t.stride(-1) == 1), t
        assert q.is_contiguous() and (dy is None or dy.is_contiguous())
        self.q, self.k, self.dy, self.v, self.scale = q, k, dy, v, scale

    def take(self, entries: slice) -> Bf16Scores:
        """The operands of the GEMM batch entries `entries` (a per-tile call)."""
        return Bf16Scores(self.q[entries], self.k[entries], self.scale,
                          None if self.dy is None else self.dy[entries], None if self.v is None else self.v[entries])

    def struct(self) -> _Bf16Struct:
        dy, v = self.dy, self.v
        return _Bf16Struct(self.q.data_ptr(), self.k.data_ptr(), 0 if dy is None else dy.data_ptr(),
                           0 if v is None else v.data_ptr(), self.k.stride(0), self.k.stride(1),
                           0 if v is None else v.stride(0), 0 if v is None else v.stride(1), self.q.shape[-1],
                           self.scale)


def _bf16_pointer(bf16: Bf16Scores | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None,
                  dy: torch.Tensor | None = None) -> tuple[_Bf16Struct | None, int]:
    """The C struct (kept alive by the caller) and its address, or (None, 0): the operands must match the call's."""
    if bf16 is None:
        return None, 0
    features = q.shape[-1] - bf16.q.shape[-1]
    assert bf16.q.shape[:-1] == q.shape[:-1] and bf16.k.shape[:-1] == k.shape[:-1] and 0 <= features <= 2 \
        and bf16.k.shape[-1] + features == k.shape[-1], (bf16.q.shape, q.shape, bf16.k.shape, k.shape)
    if dy is not None:
        assert bf16.dy is not None and bf16.dy.shape == dy.shape and bf16.v.shape == v.shape
    struct = bf16.struct()
    return struct, ctypes.addressof(struct)


class BiasTiles:
    """The additive bias of each key tile for the fused dense loops, or None: tile t's bias is a row-major block
    [.., width] read at row r % `rows` of entry e's block at offset e * `entry_stride` (a mask shared by the entries
    and heads: rows = one head's query rows, stride 0; a per-head tile: rows = an entry's rows, stride = its size)."""

    def __init__(self, tiles: list[torch.Tensor | None], rows: int, entry_stride: int = 0) -> None:
        self.tiles, self.rows, self.entry_stride = tiles, rows, entry_stride


class _AlibiStruct(ctypes.Structure):
    _fields_ = [("slope", _P), ("pos", _P), ("q_norm", _P), ("k_norm", _P), ("sqrt_dist", _I), ("sk_norm", _I),
                ("slack", _F)]


class AlibiRows:
    """Generated ALiBi for the fused dense loops (attention_loops.c, struct alibi_rows). For every query row of a call,
    [E, R] like its q: `slope` and `pos` (its query index plus q_start - kv_start), giving the bias
    -slope * f(|j - pos|) at key column j, f the identity or (`sqrt_dist`) sqrt. With `q_norm` [E, R] (|scale| |q|)
    and `k_norm` [E, Skv] (|k| per key, unit column stride), row blocks skip the pieces whose every term provably
    flushes to 0 (`slack`: the margin, natural-log units)."""

    def __init__(self, slope: torch.Tensor, pos: torch.Tensor, sqrt_dist: bool, q_norm: torch.Tensor | None = None,
                 k_norm: torch.Tensor | None = None, slack: float = 1.0) -> None:
        for t in (slope, pos, q_norm):
            assert t is None or (t.dtype == torch.float32 and t.is_contiguous() and t.shape == slope.shape), t
        assert (q_norm is None) == (k_norm is None)
        assert k_norm is None or (k_norm.dtype == torch.float32 and k_norm.stride(-1) == 1), k_norm
        self.slope, self.pos, self.sqrt_dist, self.q_norm, self.k_norm, self.slack = \
            slope, pos, sqrt_dist, q_norm, k_norm, slack

    def take(self, entries: slice) -> AlibiRows:
        """The rows of the GEMM batch entries `entries` (a per-tile call)."""
        q_norm, k_norm = self.q_norm, self.k_norm
        return AlibiRows(self.slope[entries], self.pos[entries], self.sqrt_dist,
                         None if q_norm is None else q_norm[entries], None if k_norm is None else k_norm[entries],
                         self.slack)

    def struct(self, q: torch.Tensor, k: torch.Tensor) -> _AlibiStruct:
        assert self.slope.shape == q.shape[:2], (self.slope.shape, q.shape)
        kn = self.k_norm
        assert kn is None or kn.shape == k.shape[:2], (kn.shape, k.shape)
        return _AlibiStruct(self.slope.data_ptr(), self.pos.data_ptr(),
                            0 if self.q_norm is None else self.q_norm.data_ptr(), 0 if kn is None else kn.data_ptr(),
                            int(self.sqrt_dist), 0 if kn is None else kn.stride(0), self.slack)


def alibi_skipped_terms() -> int:
    """Score terms (rows x key columns) the fused loops skipped as provably flushing to 0 under generated ALiBi since
    the last call (0 without the library)."""
    lib = library()
    return 0 if lib is None else int(lib.cann_attn_alibi_skipped_terms())


def _alibi_pointer(alibi: AlibiRows | None, q: torch.Tensor, k: torch.Tensor) -> tuple[_AlibiStruct | None, int]:
    """The C struct (kept alive by the caller) and its address, or (None, 0)."""
    if alibi is None:
        return None, 0
    struct = alibi.struct(q, k)
    return struct, ctypes.addressof(struct)


def fa_forward_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: list[tuple[int, int]],
                      bias: BiasTiles, block_rows: int, sub_cols: int, log2e: float, floor2: float,
                      row_max: torch.Tensor, row_sum: torch.Tensor, acc: torch.Tensor, init: bool = True,
                      keep: KeepBits | None = None, bf16: Bf16Scores | None = None,
                      alibi: AlibiRows | None = None, io: ForwardIo | None = None) -> None:
    """Online softmax of q [E, R, Dk] (contiguous, scaled) over the key tiles `tiles` of k [E, Skv, Dk] and v [E, Skv,
    Dv] (unit column stride), each with its optional additive bias tile (`BiasTiles`): row_max / row_sum [E, R] and the
    unnormalised acc [E, R, Dv] are updated, after being reset when `init` is set. `keep`: the dropout of a single key
    tile (`KeepBits`); dropped terms count in row_sum but not in acc. `bf16`: the scores from bf16 operands instead
    (`Bf16Scores`; q and k still give the shapes). `alibi`: generated ALiBi added to the scores (`AlibiRows`), with
    its tile skipping; the tiles then go nearest the diagonal first. `io` (`ForwardIo`): the query rows read and scaled
    from the query tile itself (q only gives the shape), and / or the rows finished into the output and statistics
    (acc is then not written)."""
    lib = library()
    _check_rows(q, row_max, row_sum, acc)
    _unit_rows(k, v)
    entries, rows, dk = q.shape
    tj0, tj1, pointers = _tile_arrays(tiles, bias, entries)
    keep_mask, keep_first = _keep_pointers(keep, tiles, entries, rows)
    _struct, bf16_address = _bf16_pointer(bf16, q, k)
    _alibi, alibi_address = _alibi_pointer(alibi, q, k)
    assert io is None or (init and io.fits(entries, rows, dk, v.shape[-1])), "ForwardIo: init and the call's shape"
    _io = None if io is None else io.struct()
    lib.fa_forward_blocks(q.data_ptr(), entries, rows, dk, k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(),
                          v.stride(0), v.stride(1), v.shape[-1], len(tiles), tj0.data_ptr(), tj1.data_ptr(),
                          pointers.data_ptr(), bias.rows, bias.entry_stride, keep_mask, keep_first, block_rows,
                          sub_cols, int(init), log2e, floor2, bf16_address, alibi_address,
                          0 if _io is None else ctypes.addressof(_io), row_max.data_ptr(), row_sum.data_ptr(),
                          acc.data_ptr())


_STRIDES = ctypes.c_int64 * 3


class _ForwardIoStruct(ctypes.Structure):
    _fields_ = [("q", _P), ("q_dtype", _I), ("qs", _STRIDES), ("scale", _F), ("heads_kv", _I), ("group", _I),
                ("head_rows", _I), ("out", _P), ("out_dtype", _I), ("os", _STRIDES), ("keep_prob", _F),
                ("smax", _P), ("ssum", _P), ("ms", _STRIDES), ("ss", _STRIDES), ("non_finite", _P)]


_Q_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class ForwardIo:
    """The ends of a fused forward call over a query tile (attention_loops.c, struct forward_io): `query`, the tile's
    unscaled rows [c, N1, rows, Dk] (fp32, fp16 or bf16, unit column stride; None: the call's q is read), scaled by
    `scale` in the loops; `out` [c, N1, rows, Dv] (fp32 or fp16, unit column stride; None: acc is left unnormalised),
    the finished rows acc / (row_sum * keep_prob) rounded once to its dtype, with the statistics `softmax_max` /
    `softmax_sum` [c, N1, rows, 8] (optional). Entry e of the call is sequence e // heads_kv, kv head e % heads_kv,
    its rows the group's heads' rows one after the other (`group_rows`)."""

    def __init__(self, query: torch.Tensor | None, scale: float, heads_kv: int, out: torch.Tensor | None = None,
                 keep_prob: float = 1.0, softmax_max: torch.Tensor | None = None,
                 softmax_sum: torch.Tensor | None = None) -> None:
        shape = (query if query is not None else out).shape
        for t in (query, out, softmax_max, softmax_sum):
            assert t is None or (t.dim() == 4 and t.shape[:3] == shape[:3] and t.stride(-1) == 1), t
        assert query is None or query.dtype in _Q_DTYPES, query.dtype
        assert out is None or out.dtype in (torch.float32, torch.float16), out.dtype
        assert all(t is None or t.dtype == torch.float32 for t in (softmax_max, softmax_sum))
        assert (softmax_max is None) == (softmax_sum is None) and (out is not None or softmax_max is None)
        self.query, self.scale, self.heads_kv, self.out, self.keep_prob = query, scale, heads_kv, out, keep_prob
        self.softmax_max, self.softmax_sum = softmax_max, softmax_sum
        self.flag = torch.zeros(1, dtype=torch.int32)
        self.count, self.heads, self.head_rows = shape[:3]

    def fits(self, entries: int, rows: int, dk: int, dv: int) -> bool:
        group = self.heads // self.heads_kv
        return entries == self.count * self.heads_kv and rows == group * self.head_rows \
            and (self.query is None or self.query.shape[-1] == dk) and (self.out is None or self.out.shape[-1] == dv)

    def non_finite(self) -> bool:
        """Whether some accumulated (unnormalised) output was not finite in the last call."""
        return bool(self.flag.item())

    def without_out(self) -> ForwardIo:
        return ForwardIo(self.query, self.scale, self.heads_kv)

    def struct(self) -> _ForwardIoStruct:
        def strides(t):
            return _STRIDES(*t.stride()[:3]) if t is not None else _STRIDES(0, 0, 0)

        def ptr(t):
            return 0 if t is None else t.data_ptr()

        q = self.query
        self.flag.zero_()
        return _ForwardIoStruct(ptr(q), 0 if q is None else _Q_DTYPES[q.dtype], strides(q), self.scale,
                                self.heads_kv, self.heads // self.heads_kv, self.head_rows, ptr(self.out),
                                int(self.out is not None and self.out.dtype == torch.float16), strides(self.out),
                                self.keep_prob, ptr(self.softmax_max), ptr(self.softmax_sum),
                                strides(self.softmax_max), strides(self.softmax_sum), self.flag.data_ptr())


class KeepBits:
    """Dropout for a fused call with one key tile: the bit-packed keep mask (flat uint8, LSB first) and, for every row
    of the call, the index of the bit of its first column (int64 [E, R]); a row's next columns are the next bits."""

    def __init__(self, mask: torch.Tensor, first: torch.Tensor) -> None:
        assert mask.dtype == torch.uint8 and mask.is_contiguous() and mask.device.type == "cpu"
        self.mask, self.first = mask, first.to(torch.int64).contiguous()


def _keep_pointers(keep: KeepBits | None, tiles: list[tuple[int, int]], entries: int,
                   rows: int) -> tuple[int | None, int | None]:
    if keep is None:
        return None, None
    assert len(tiles) == 1 and keep.first.shape == (entries, rows), keep.first.shape
    last_bit = int(keep.first.max()) + tiles[0][1] - tiles[0][0] - 1
    assert int(keep.first.min()) >= 0 and last_bit < 8 * keep.mask.numel(), "keep bits beyond the mask"
    return keep.mask.data_ptr(), keep.first.data_ptr()


def _tile_arrays(tiles: list[tuple[int, int]], bias: BiasTiles,
                 entries: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first columns, end columns, bias tile addresses or 0) of the key tiles, as int64 arrays for the C loops."""
    for b, (j0, j1) in zip(bias.tiles, tiles, strict=True):
        blocks = 1 if bias.entry_stride == 0 else entries
        assert b is None or (b.is_contiguous() and b.dtype == torch.float32
                             and b.numel() == bias.rows * (j1 - j0) * blocks
                             and bias.entry_stride in (0, bias.rows * (j1 - j0))), (b.shape, bias.rows, j1 - j0)
    return (torch.tensor([t[0] for t in tiles], dtype=torch.int64),
            torch.tensor([t[1] for t in tiles], dtype=torch.int64),
            torch.tensor([0 if b is None else b.data_ptr() for b in bias.tiles], dtype=torch.int64))


def _unit_rows(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.dtype == torch.float32 and t.dim() == 3 and t.stride(-1) == 1, (t.shape, t.stride(), t.dtype)


def fa_backward_blocks(q: torch.Tensor, dy: torch.Tensor, d_sum: torch.Tensor, shift: torch.Tensor,
                       factor: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: list[tuple[int, int]],
                       bias: BiasTiles, block_rows: int, sub_cols: int, min_items: int, log2e: float, floor2: float,
                       dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, keep: KeepBits | None = None,
                       keep_prob: float = 1.0, bf16: Bf16Scores | None = None,
                       alibi: AlibiRows | None = None) -> None:
    """Backward of one query tile: q [E, R, Dk] (scaled) and dy [E, R, Dv], d_sum / shift / factor [E, R] (all
    contiguous), k / v [E, Skv, D] and dq [E, R, Dg], dk [E, Skv, Dg], dv [E, Skv, Dv] (unit column stride), Dg <= Dk
    (q's and k's further columns enter only the scores); dq, dk and dv are accumulated into. Each entry's key pieces
    are split into ceil(min_items / E) work items (see attention_loops.c). `keep`: the dropout of a single key tile
    (`KeepBits`), applied with 1 / keep_prob. `bf16`: S and dP from bf16 operands (`Bf16Scores`, with dy and v).
    `alibi`: generated ALiBi in S (`AlibiRows`), skipping where every P flushes to 0 against `shift`."""
    lib = library()
    _check_rows(q, dy, d_sum, shift, factor)
    _unit_rows(k, v, dq, dk, dv)
    entries, rows, d_qk = q.shape
    tj0, tj1, pointers = _tile_arrays(tiles, bias, entries)
    keep_mask, keep_first = _keep_pointers(keep, tiles, entries, rows)
    _struct, bf16_address = _bf16_pointer(bf16, q, k, v, dy)
    _alibi, alibi_address = _alibi_pointer(alibi, q, k)
    lib.fa_backward_blocks(q.data_ptr(), dy.data_ptr(), d_sum.data_ptr(), shift.data_ptr(), factor.data_ptr(), entries,
                           rows, d_qk, dq.shape[-1], dy.shape[-1], k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(),
                           v.stride(0), v.stride(1), len(tiles), tj0.data_ptr(), tj1.data_ptr(), pointers.data_ptr(),
                           bias.rows, bias.entry_stride, keep_mask, keep_first, 1.0 / keep_prob, block_rows, sub_cols,
                           min_items, log2e, floor2, bf16_address, alibi_address, dq.data_ptr(), dq.stride(0),
                           dq.stride(1), dk.data_ptr(), dk.stride(0), dk.stride(1), dv.data_ptr(), dv.stride(0),
                           dv.stride(1))


DECODE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# int8 caches anti-quantised in the loop, by the dtype the values are rounded to (the query's); int4 packed caches
# (given as their bytes) take the code + INT4_CODE_SHIFT.
DEQUANT_DTYPES = {torch.bfloat16: 3, torch.float16: 4, torch.float32: 5}
INT4_CODE_SHIFT = 3


def decode_usable(key: torch.Tensor, value: torch.Tensor, dequant_to: torch.dtype | None = None,
                  key_rope: torch.Tensor | None = None) -> bool:
    """Whether `decode_rows` can read these [B, N2, S, D] caches in place: CPU, fp32/fp16/bf16 (fp16 needs F16C)
    or, with `dequant_to`, int8 anti-quantised to that dtype, unit stride along D, library available. `key_rope`
    (MLA's rope keys): of the key's layout, and of its dtype, or with `dequant_to` (an int8 latent: the rope is not
    quantised) fp32/fp16/bf16."""
    readable = DECODE_DTYPES if dequant_to is None else {torch.int8: 0}
    if key.device.type != "cpu" or key.dtype != value.dtype or key.dtype not in readable:
        return False
    rope_dtypes = (key.dtype,) if dequant_to is None else tuple(DECODE_DTYPES)
    if key_rope is not None and (key_rope.dtype not in rope_dtypes or key_rope.dim() != key.dim()
                                 or key_rope.stride(-1) != 1):
        return False
    if dequant_to is not None and dequant_to not in DEQUANT_DTYPES:
        return False
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        return False
    lib = library()
    halves = torch.float16 in (key.dtype, dequant_to, None if key_rope is None else key_rope.dtype)
    return lib is not None and (not halves or bool(lib.cann_attn_has_f16c()))


def decode_rows(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor,
                row_max: torch.Tensor, row_sum: torch.Tensor, block_table: torch.Tensor | None = None,
                kv_scales: tuple[torch.Tensor, torch.Tensor, torch.dtype] | None = None, packed_int4: bool = False,
                key_rope: torch.Tensor | None = None, scale: float = 1.0,
                int8_query: tuple[torch.Tensor, ...] | None = None) -> None:
    """Unnormalised out [B*N2, G, Dv], row_max and row_sum [B*N2, G] of the grouped query rows q [B*N2, G, D]
    (contiguous: fp32, already scaled; or bf16, unscaled, beside bf16 keys and rope keys, each score then the bf16
    dot product times `scale`) over the first lengths[b] rows of key / value [B, N2, S, D] (read in place; decode.c;
    the order of its sums is docs/guides/backends.md's "Decode", its exponentials softmax_exp's rule).
    Pairs whose length is 0 are left untouched. With `block_table` (int32 [B, W]) key and value are paged caches
    seen as [block_num, N2, block_size, D]: row p of sequence b is block
    block_table[b, p // block_size], slot p % block_size (docs/semantics/paged-kv.md), read in place too. With
    `kv_scales` = (key scale [N2, D], value scale [N2, Dv], dtype), int8 key / value are anti-quantised as they are
    read: x * scale in fp32, rounded once to dtype (problem/antiquant.py); `packed_int4`: key / value are the bytes
    of int4 values packed two to a byte (value 2k in the low nibble), D/2 bytes a row. `key_rope` (MLA): a cache of
    the key's layout whose rows follow each key's (q's D is the key's plus the rope's), in the key's float dtype, or
    a float dtype of its own beside an int8 key (read as it is, never scaled). `int8_query` (an int8 MLA query over
    an int8 key with `key_rope`: problem/antiquant.py's Int8QueryRows.loop_rows, contiguous [pairs, G, ..]): the
    scores come from its rows instead of q's (decode.c's order), the key scale left out of them (it is in the rows'
    factors)."""
    lib = library()
    q16 = q.dtype == torch.bfloat16
    if q16:
        assert q.is_contiguous() and key.dtype == torch.bfloat16 and kv_scales is None \
            and (key_rope is None or key_rope.dtype == torch.bfloat16), "bf16 query rows need bf16 keys"
        _check_rows(out, row_max, row_sum)
    else:
        assert scale == 1.0, "fp32 query rows come scaled"
        _check_rows(q, out, row_max, row_sum)
    pairs, group, dim = q.shape
    lengths = lengths.to(torch.int64).contiguous()
    scales = None if kv_scales is None else [t.to(torch.float32).contiguous() for t in kv_scales[:2]]
    table = None if block_table is None else block_table.to(torch.int32)
    if table is not None and table.stride(-1) != 1:
        table = table.contiguous()
    code = DECODE_DTYPES[key.dtype] if kv_scales is None else DEQUANT_DTYPES[kv_scales[2]] + (
        INT4_CODE_SHIFT if packed_int4 else 0)
    kg, vg = _cache_geometry(key), _cache_geometry(value)
    rope = (None, 0, 0, 0, 0, 0, 0, 0)
    if key_rope is not None:
        rg = _cache_geometry(key_rope)
        width = key_rope.shape[2] * key_rope.shape[4] if key_rope.dim() == 5 else key_rope.shape[-1]
        rope = (key_rope.data_ptr(), DECODE_DTYPES[key_rope.dtype], width, *rg[:3], *rg[3:5])
    lib.fia_decode_rows(None if q16 else q.data_ptr(), pairs, key.shape[1], group, dim, out.shape[-1], key.data_ptr(),
                        value.data_ptr(), code, *kg[:3], *vg[:3], lengths.data_ptr(), out.data_ptr(),
                        row_max.data_ptr(), row_sum.data_ptr(), None if table is None else table.data_ptr(),
                        0 if table is None else table.stride(0), 0 if table is None else kg[5],
                        None if kv_scales is None else scales[0].data_ptr(),
                        None if kv_scales is None else scales[1].data_ptr(), *kg[3:5], *vg[3:5], *rope, LOG2E,
                        EXP2_FLOOR, q.data_ptr() if q16 else None, scale,
                        *((None,) * 4 if int8_query is None else (t.data_ptr() for t in int8_query)))


def _cache_geometry(cache: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """(batch or block stride, head stride, token stride, chunk width, chunk stride, tokens per block) of a
    [B or block_num, N2, S, D] cache, or of an NZ cache [block_num, N2, D/c0, block_size, c0] (chunk width c0)."""
    if cache.dim() == 5:
        return cache.stride(0), cache.stride(1), cache.stride(3), cache.shape[4], cache.stride(2), cache.shape[3]
    return cache.stride(0), cache.stride(1), cache.stride(2), 0, 0, cache.shape[2]
