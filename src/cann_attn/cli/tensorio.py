"""Tensor files of ``cann-attn golden`` / ``compare``: ``.npy``, raw little-endian ``.bin``, ``manifest.json``,
and directories written all-or-nothing.

- ``.npy``: numpy's format. bfloat16 and float8_e4m3fn have no numpy dtype: their ``.npy`` holds the exact values
  as float32 (the manifest's ``npy_dtype`` says so, and readers cast back to the manifest's ``dtype``).
- ``.bin``: the elements in row-major order, little-endian, no header (what Ascend's C++ examples read with
  ``ReadFile``): float16 2 bytes, bfloat16 its raw 16-bit pattern (read it as uint16 and reinterpret),
  float8_e4m3fn its raw byte, float32 4, int8 / uint8 / bool 1 (bool as 0 / 1), int32 4, int64 8.
- ``manifest.json``: per tensor its name, role (input / output), shape, dtype and files, plus the operator, its
  parameters, the seed and the cann_attn version (see ``golden.py``).

Every file is read through `open_regular`: only a regular file (a device, FIFO or directory is refused without
reading it: ``/dev/zero`` would never end), of at most a given size, checked before reading. A manifest's tensor
names and files name files of its own directory only (`inside`). An input loaded in another dtype than its file's
converts only when every value converts exactly (`convert_exactly`, ``exact=True``). docs/guides/golden.md states
these rules.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import UsageError

__all__ = [
    "DTYPES",
    "MANIFEST",
    "NAIVE_ROLE",
    "NAIVE_SUFFIX",
    "NPU_ROLE",
    "NPU_SUFFIX",
    "Staged",
    "bin_dtype_name",
    "canonical_dtype",
    "check_output",
    "convert_exactly",
    "entry_files",
    "exact_conversion_problem",
    "find_entry",
    "inside",
    "load_json",
    "open_regular",
    "parse_dtype",
    "read_bin",
    "read_entry",
    "read_file_of_entry",
    "read_manifest",
    "read_npy",
    "write_manifest",
    "write_tensor",
]

MANIFEST = "manifest.json"
# `golden` writes, beside output NAME, the naive reference of the secondary precision rule as tensor NAME.naive.
NAIVE_ROLE = "naive"
NAIVE_SUFFIX = ".naive"
# `golden --precision npu` writes, beside output NAME, its NPU-pipeline golden as tensor NAME.npu
# (docs/semantics/precision.md).
NPU_ROLE = "npu_output"
NPU_SUFFIX = ".npu"
# Size bounds checked before a file is read: JSON (case files, manifests) and tensor files (compare; golden --inputs
# takes its --max-bytes instead).
MAX_JSON_BYTES = 64 * 2**20
MAX_TENSOR_FILE_BYTES = 16 * 2**30

# Canonical dtype names (torch's, without the prefix) and the aliases accepted in case files and on the command line.
DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32",
            "fp64": "float64", "double": "float64", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}
# Dtypes numpy lacks: their .npy holds float32 values, their .bin the raw bits (numpy's unsigned type of that width,
# torch's integer type of that width to reinterpret through).
_RAW_BITS = {torch.bfloat16: (np.uint16, torch.int16), torch.float8_e4m3fn: (np.uint8, torch.uint8)}
_NUMPY = {
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.bool: np.bool_,
}
_FROM_NUMPY = {np.dtype(v): k for k, v in _NUMPY.items()}


def parse_dtype(name: Any) -> torch.dtype | None:
    """The dtype of a name ('bf16', 'bfloat16', 'float32', ...), None if unknown."""
    if not isinstance(name, str):
        return None
    key = name.strip().lower().removeprefix("torch.")
    return DTYPES.get(_ALIASES.get(key, key))


def canonical_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def bin_dtype_name(dtype: torch.dtype) -> str:
    """How the .bin file stores `dtype`, in words, for the manifest."""
    if dtype == torch.bfloat16:
        return "bfloat16 as its raw 16-bit pattern (read as little-endian uint16, reinterpret as bfloat16)"
    if dtype == torch.float8_e4m3fn:
        return "float8_e4m3fn as its raw byte (read as uint8, reinterpret as float8_e4m3fn)"
    if dtype == torch.bool:
        return "bool, 1 byte per element (0 or 1)"
    return f"{canonical_dtype(dtype)}, little-endian"


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().to("cpu").contiguous()
    return (t.float() if t.dtype in _RAW_BITS else t).numpy()


def _bin_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    if t.dtype in _RAW_BITS:
        unsigned, same_width = _RAW_BITS[t.dtype]
        arr = t.view(same_width).numpy().view(unsigned)
    elif t.dtype in _NUMPY:
        arr = t.numpy()
    else:
        raise ValueError(f"cannot write a {t.dtype} tensor")
    return arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()


def write_tensor(directory: Path, name: str, t: torch.Tensor, role: str, **extra: Any) -> dict[str, Any]:
    """Write NAME.npy and NAME.bin into `directory`; returns the tensor's manifest entry."""
    np.save(directory / f"{name}.npy", _to_numpy(t), allow_pickle=False)
    data = _bin_bytes(t)
    (directory / f"{name}.bin").write_bytes(data)
    entry: dict[str, Any] = {
        "name": name,
        "role": role,
        "shape": list(t.shape),
        "dtype": canonical_dtype(t.dtype),
        "files": {"npy": f"{name}.npy", "bin": f"{name}.bin"},
        "npy_dtype": "float32" if t.dtype in _RAW_BITS else canonical_dtype(t.dtype),
        "bin_dtype": bin_dtype_name(t.dtype),
        "bin_bytes": len(data),
    }
    entry.update(extra)
    return entry


# ----------------------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------------------
@contextmanager
def open_regular(path: Path, max_bytes: int, what: str = "file") -> Iterator[Any]:
    """`path` opened for binary reading, refused (UsageError) unless it is a regular file of at most `max_bytes`
    bytes. Checked on the opened descriptor (no blocking open: a FIFO is refused, not waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise UsageError(f"cannot read {path} ({exc.strerror or exc})") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UsageError(f"{path}: not a regular file")
        if info.st_size > max_bytes:
            raise UsageError(f"{path}: {info.st_size} bytes, more than the {max_bytes} a {what} may take")
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


def exact_conversion_problem(t: torch.Tensor, dtype: torch.dtype) -> str:
    """'' when every element of `t` converts to `dtype` and back unchanged (NaN stays NaN), else the first that
    does not, e.g. '4294967333 becomes 37'."""
    if t.dtype == dtype:
        return ""
    converted = t.to(dtype)
    back = converted.to(t.dtype)
    same = back == t
    if t.dtype.is_floating_point:
        same |= t.isnan() & back.isnan()
    if bool(same.all()):
        return ""
    first = tuple((~same).nonzero()[0].tolist())
    return f"{t[first].item()!r} becomes {converted[first].item()!r}"


def convert_exactly(t: torch.Tensor, dtype: torch.dtype | None, where: str) -> torch.Tensor:
    """`t` in `dtype`, or UsageError naming `where` and both dtypes when a value would change."""
    if dtype is None or t.dtype == dtype:
        return t
    problem = exact_conversion_problem(t, dtype)
    if problem:
        src, dst = canonical_dtype(t.dtype), canonical_dtype(dtype)
        raise UsageError(f"{where}: its values are not exactly {dst} ({src} to {dst}: {problem}); nothing written")
    return t.to(dtype)


def read_npy(path: Path, dtype: torch.dtype | None = None, max_bytes: int = MAX_TENSOR_FILE_BYTES,
             exact: bool = False) -> torch.Tensor:
    """A .npy file as a tensor, cast to `dtype` when given (bfloat16 .npy files hold float32 values; `exact`: only
    when every value converts exactly, else UsageError, as golden --inputs loads). A regular file of at most
    `max_bytes`; the header is checked against the file's size before anything
    is allocated: a header claiming more elements than the file holds (or a truncated, empty or non-.npy file) is
    a one-line error."""
    with open_regular(path, max_bytes, "tensor file") as f:
        try:
            version = np.lib.format.read_magic(f)
            read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in read_header:
                raise ValueError(f"unsupported .npy format version {version}")
            shape, fortran_order, np_dtype = read_header[version](f)
            offset = f.tell()
        except (OSError, ValueError, EOFError, SyntaxError, TypeError) as exc:
            raise UsageError(f"{path}: not a readable .npy file ({_one_line(exc)})") from exc
        if np_dtype.hasobject or np_dtype.newbyteorder("=") not in _FROM_NUMPY:
            raise UsageError(f"{path}: unsupported numpy dtype {np_dtype}")
        numel = 1
        for n in shape:
            numel *= int(n)
        data_bytes = os.fstat(f.fileno()).st_size - offset
        if data_bytes != numel * np_dtype.itemsize:
            raise UsageError(f"{path}: the header says {np_dtype} {list(shape)} ({numel * np_dtype.itemsize} bytes) "
                             f"but the file holds {data_bytes} bytes of data")
        try:
            arr = np.fromfile(f, dtype=np_dtype, count=numel)
        except (OSError, ValueError) as exc:
            raise UsageError(f"{path}: not a readable .npy file ({_one_line(exc)})") from exc
    order = "F" if fortran_order else "C"
    arr = arr.reshape(tuple(int(n) for n in shape), order=order)
    t = torch.from_numpy(np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder("="), copy=False)))
    if exact:
        return convert_exactly(t, dtype, str(path))
    return t if dtype is None else t.to(dtype)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def read_bin(path: Path, dtype: torch.dtype, shape: list[int] | tuple[int, ...],
             max_bytes: int = MAX_TENSOR_FILE_BYTES) -> torch.Tensor:
    """A raw little-endian .bin file of `dtype` and `shape` (bfloat16: raw 16-bit patterns); a regular file of at
    most `max_bytes`."""
    numel = 1
    for s in shape:
        numel *= int(s)
    np_dtype = np.dtype(_RAW_BITS[dtype][0] if dtype in _RAW_BITS else _NUMPY[dtype]).newbyteorder("<")
    with open_regular(path, max_bytes, "tensor file") as f:
        size = os.fstat(f.fileno()).st_size
        if size != numel * np_dtype.itemsize:
            raise UsageError(
                f"{path}: {size} bytes, expected {numel * np_dtype.itemsize} for {canonical_dtype(dtype)} "
                f"{list(shape)}"
            )
        arr = np.fromfile(f, dtype=np_dtype, count=numel).astype(np_dtype.newbyteorder("="))
    if dtype in _RAW_BITS:
        same_width = _RAW_BITS[dtype][1]
        return torch.from_numpy(arr).view(same_width).view(dtype).reshape(tuple(shape))
    return torch.from_numpy(arr).reshape(tuple(shape))


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The directory's manifest.json (None if it has none), its tensor entries checked (`_check_entry`)."""
    path = directory / MANIFEST
    if not os.path.lexists(path):
        return None
    inside(directory, MANIFEST, path)
    try:
        manifest = load_json(read_json_text(path))
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise UsageError(f"{path}: not a readable manifest ({_one_line(exc)})") from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("tensors"), list):
        raise UsageError(f"{path}: not a cann-attn manifest (no 'tensors' list)")
    for i, entry in enumerate(manifest["tensors"]):
        problem = _check_entry(entry)
        if problem:
            raise UsageError(f"{path}: tensors[{i}]: {problem}")
    return manifest


def _check_entry(entry: Any) -> str:
    """What is wrong with a manifest's tensor entry ('' if nothing): an object with a name, a known dtype, files
    (npy and / or bin: file names) and, if given, a shape (a list of non-negative integers) and a role."""
    if not isinstance(entry, dict):
        return f"expected an object (name, role, shape, dtype, files), got {json.dumps(entry)}"
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        return "name: missing or not a string"
    if not is_file_name(name):  # compare reads ACTUAL/NAME.npy: a name is never a path
        return f"name: {json.dumps(name)} is not a file name (no '/', '\\', '..' or absolute path)"
    if "role" in entry and not isinstance(entry["role"], str):
        return f"{name}: role: expected a string, got {json.dumps(entry['role'])}"
    if "shape" in entry:
        shape = entry["shape"]
        if not isinstance(shape, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                  for x in shape):
            return f"{name}: shape: expected a list of non-negative integers, got {json.dumps(shape)}"
    if parse_dtype(entry.get("dtype")) is None:
        return f"{name}: dtype: missing or unknown ({json.dumps(entry.get('dtype'))})"
    files = entry.get("files")
    if (not isinstance(files, dict) or not any(k in files for k in ("npy", "bin"))
            or not all(isinstance(v, str) and v for v in files.values())):
        return f"{name}: files: expected an object of file names with 'npy' and / or 'bin', got {json.dumps(files)}"
    for kind, file in files.items():
        if Path(file).is_absolute() or ".." in Path(file).parts or "\\" in file:
            return f"{name}: files.{kind}: {json.dumps(file)} is not a name inside the manifest's directory"
    if "bin" in files and "shape" not in entry:
        return f"{name}: shape: missing (needed to read {files['bin']})"
    return ""


def is_file_name(name: str) -> bool:
    """A name that stays in the directory it is joined to: no separator, not '.' or '..', not absolute."""
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..") and not Path(
        name).is_absolute()


def find_entry(manifest: dict[str, Any] | None, *, name: str | None = None, file: str | None = None):
    """The manifest entry of tensor `name`, or of the tensor stored in file `file` (None if absent)."""
    for entry in (manifest or {}).get("tensors", []):
        if name is not None and entry.get("name") == name:
            return entry
        if file is not None and file in (entry.get("files") or {}).values():
            return entry
    return None


def entry_files(directory: Path, entry: dict[str, Any]) -> dict[str, Path]:
    """The .npy / .bin files a (checked) manifest entry lists, by kind ('npy', 'bin'), in that order."""
    files = entry.get("files") or {}
    return {kind: inside(directory, files[kind]) for kind in ("npy", "bin") if kind in files}


def inside(directory: Path, name: str, path: Path | None = None, named_by: Path | None = None) -> Path:
    """`directory / name`, refused (UsageError) when it leads outside `directory`, through ``..``, an absolute
    name or a symbolic link: a manifest only ever names files of its own directory (`named_by`: what named the
    file, default the directory's manifest)."""
    path = directory / name if path is None else path
    try:
        path.resolve().relative_to(directory.resolve())
    except (ValueError, OSError, RuntimeError):  # RuntimeError: a symbolic link loop (Python < 3.13)
        raise UsageError(f"{named_by or directory / MANIFEST}: {name!r} leads outside {directory}") from None
    return path


# json.loads recurses once per nesting level: a deeply nested file would exhaust the stack (RecursionError).
MAX_JSON_DEPTH = 64


def read_json_text(path: Path) -> str:
    """The text of a JSON file (case file, manifest): a regular file of at most MAX_JSON_BYTES, UTF-8."""
    with open_regular(path, MAX_JSON_BYTES, "JSON file") as f:
        return f.read().decode()


def load_json(text: str) -> Any:
    """json.loads, refusing (ValueError) nesting deeper than MAX_JSON_DEPTH before parsing."""
    depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        elif ch in "]}":
            depth -= 1
    return json.loads(text)


def read_file_of_entry(path: Path, kind: str, entry: dict[str, Any], max_bytes: int = MAX_TENSOR_FILE_BYTES,
                       exact: bool = False) -> torch.Tensor:
    """One listed file ('npy' or 'bin') of a checked manifest entry, in the entry's dtype (`exact`: see read_npy)."""
    dtype = parse_dtype(entry["dtype"])
    if kind == "npy":
        return read_npy(path, dtype, max_bytes, exact)
    return read_bin(path, dtype, entry.get("shape", []), max_bytes)


def read_entry(directory: Path, entry: dict[str, Any], prefer: str = "npy", max_bytes: int = MAX_TENSOR_FILE_BYTES,
               exact: bool = False) -> torch.Tensor:
    """The tensor of a manifest entry, from its .npy (or .bin) file, in the manifest's dtype."""
    dtype = parse_dtype(entry.get("dtype"))
    if dtype is None:
        raise UsageError(f"{directory / MANIFEST}: tensor {entry.get('name')!r}: unknown dtype {entry.get('dtype')!r}")
    files = entry_files(directory, entry)
    for kind in ("npy", "bin") if prefer == "npy" else ("bin", "npy"):
        if kind in files and os.path.lexists(files[kind]):
            return read_file_of_entry(files[kind], kind, entry, max_bytes, exact)
    raise UsageError(f"{directory}: the files of tensor {entry.get('name')!r} are missing")


# ----------------------------------------------------------------------------------------------------------
# All-or-nothing directories
# ----------------------------------------------------------------------------------------------------------
class Staged:
    """A directory built in a temporary sibling of `target` and renamed onto it by `commit()`; `abort()` (or a
    commit that fails) removes the temporary directory. Nothing is created before `open()`."""

    def __init__(self, target: Path, force: bool = False):
        self.target = Path(target)
        self.force = force
        self.option = "--out"
        self.tmp: Path | None = None

    def check(self, option: str) -> None:
        """Refuse an existing non-empty target unless forced, and a target whose parent cannot be created or
        written in (before any work is done)."""
        self.option = option
        # A symbolic link is written through: its target is replaced, the link itself stays as it was.
        if self.target.is_symlink():
            try:
                self.target = self.target.resolve()
            except (OSError, RuntimeError) as exc:  # a link loop
                raise UsageError(f"{option}: cannot follow the symbolic link {self.target} ({exc})") from None
        t = self.target
        if t.exists() and not t.is_dir():
            raise UsageError(f"{option}: {t} exists and is not a directory")
        if t.is_dir() and any(t.iterdir()) and not self.force:
            raise UsageError(f"{option}: {t} exists and is not empty (--force replaces it)")
        check_output(t.parent, option, shown=t)

    def open(self) -> Path:
        try:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=f".{self.target.name}.", suffix=".tmp", dir=self.target.parent)
        except OSError as exc:
            raise UsageError(f"{self.option}: cannot create {self.target} ({exc.strerror or exc})") from exc
        self.tmp = Path(tmp)
        umask = os.umask(0)
        os.umask(umask)
        self.tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary directory
        return self.tmp

    def commit(self) -> None:
        assert self.tmp is not None
        old = None
        if self.target.exists():
            old = self.target.with_name(f".{self.target.name}.{os.getpid()}.old")
            self.target.rename(old)
        try:
            self.tmp.rename(self.target)
        except OSError:
            if old is not None:
                old.rename(self.target)
            raise
        self.tmp = None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


def check_output(directory: Path, option: str, shown: Path | None = None) -> None:
    """Raise a UsageError unless files can be written in `directory` (created if missing): its nearest existing
    ancestor must be a directory in which a directory can be created (probed with a temporary one, removed
    at once). `shown`: the path named in the message (default `directory`)."""
    shown = directory if shown is None else shown
    existing = Path(directory)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{option}: cannot write {shown} ({existing} is not a directory)")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".cann-attn-probe.", dir=existing))
    except OSError as exc:
        raise UsageError(f"{option}: cannot write {shown} (cannot write in {existing}: {exc.strerror or exc})") from exc


def _dumps(value: Any, indent: int = 0) -> str:
    """JSON with objects and lists of objects one item per line, lists of scalars (shapes) on one line."""
    pad, inner = " " * indent, " " * (indent + 2)
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(str(k))}: {_dumps(v, indent + 2)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        return "[\n" + ",\n".join(f"{inner}{_dumps(v, indent + 2)}" for v in value) + f"\n{pad}]"
    return json.dumps(value)


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    (directory / MANIFEST).write_text(_dumps(manifest) + "\n")
