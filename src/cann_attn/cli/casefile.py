"""Case files of ``cann-attn golden``: one operator call described in JSON, and its inputs built from it.

::

    {
      "op": "flash_attention_score",           # an operator of cann_attn (or --op)
      "seed": 0,                                # seed of the torch.Generator drawing the inputs (default 0;
                                                #   an integer in [0, 2**63 - 1])
      "description": "free text",               # optional
      "inputs": {                               # tensor arguments, by the operator's parameter names
        "query": {"shape": [1, 256, 4, 64], "dtype": "bfloat16"},                  # normal(0, 1) by default
        "key":   {"shape": [1, 256, 4, 64], "dtype": "bfloat16", "generator": "uniform", "low": -2, "high": 2},
        "atten_mask": {"generator": "compressed_mask"}                             # mode = params.sparse_mode
      },
      "params": {"head_num": 4, "input_layout": "BSND", "scale_value": 0.125, "sparse_mode": 3}
    }

Generators (``"generator"``; the default is ``normal`` for float dtypes, ``randint`` in [-127, 127] for int8,
``bernoulli`` for bool / uint8 and ``sparse_indices`` for a tensor named sparse_indices):

- ``normal`` (mean 0, std 1), ``uniform`` (low -1, high 1), ``randint`` (low, high, both included),
  ``bernoulli`` (p 0.5: True / 1 with probability p; for masks True = masked): need shape and dtype;
- ``values``: the given nested list ``values`` (dtype default float32; shape optional, checked if given);
- ``trans_quant_param``: fp32 ``values`` encoded as Ascend's UINT64 deq-scale words (an int64 tensor);
- ``compressed_mask``: the 2048 x 2048 mask of sparse ``mode`` (default params.sparse_mode; [3072, 2048] for 6);
- ``triu``: shape [..., Sq, Skv], element (i, j) True where j > i + ``diagonal`` - 1 (``diagonal`` default 1:
  a causal mask, True = masked);
- ``drop_mask``: ``cann_attn.gen_drop_mask`` for params.keep_prob over the problem's B x N1 x Sq x Skv;
- ``sparse_indices``: shape [B, S1, 1, K] / [T1, 1, K]: for each row up to K distinct blocks it may see
  (sparse_mode, sparse_block_size, actual lengths from params), in random order, then -1;
- ``block_table``: shape [B, W], int32: for a paged key cache (FIA / IFA ``block_size`` + BnBsH or BnNBsD caches,
  SFA / LI ``"PA_BSND"``), sequence b's first ceil(L_b / block_size) entries name distinct cache blocks in random
  order, the rest -1 (L_b from the operator's key-length parameter; docs/semantics/paged-kv.md);
- ``lightning_indexer``: the top-K indices of the float64 LightningIndexer oracle on query_index, key_index and
  weights (K = shape[-1]).

The inputs a grad operator takes from its forward (softmax statistics, forward output) are computed with the
float64 forward oracle unless they are listed here or loaded with ``--inputs``. Every generator draws from one
``torch.Generator().manual_seed(seed)``: first the plain generators in the operator's parameter order, then
those that depend on other inputs (drop_mask, sparse_indices, lightning_indexer). A tensor loaded with
``--inputs`` replaces the generated one, which is still drawn, so the other tensors are those of the seeded case.

Every tensor the case generates is checked before anything is allocated: its element count, and the bytes of all
generated tensors together, counted at 8 bytes per element (the generators draw in float64 / int64 before the cast
to the tensor's dtype), must stay within ``--max-bytes`` (default `MAX_GENERATED_BYTES`, 4 GiB); a case naming a
huge shape is one line naming the input, exit 2, not an allocation failure.

``values`` must mean what they say in the tensor's dtype: for an integer or bool dtype every value must be exactly
representable (37.9 or 2**31 for int32, 2 for bool are refused, not truncated or wrapped); for a float dtype a
value is rounded to the nearest representable one, as a decimal literal means, but one beyond the dtype's range
(70000 for float16) is refused rather than made infinite.

Numbers are JSON numbers; NaN and Infinity (which Python's json module accepts) are refused for the float
parameters and generator options (the operators would take e.g. scale_value NaN and return NaN everywhere).
Every problem raises `CaseError` (exit status 2) with one line naming the field, e.g.
``case.json: inputs.query.shape: expected a list of non-negative integers, got [2, -1]``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import cann_attn

from ..problem.layout import BATCH_SEQ_DIMS
from . import UsageError
from . import cases as registry
from .tensorio import (
    DTYPES,
    canonical_dtype,
    convert_exactly,
    entry_files,
    exact_conversion_problem,
    find_entry,
    inside,
    load_json,
    parse_dtype,
    read_entry,
    read_json_text,
    read_manifest,
    read_npy,
)

__all__ = [
    "MAX_GENERATED_BYTES",
    "CaseError",
    "CaseFile",
    "TensorSpec",
    "build_inputs",
    "check_sizes",
    "load_case",
    "load_inputs",
]

TOP_LEVEL = ("op", "seed", "description", "inputs", "params")
GENERATORS: dict[str, tuple[str, ...]] = {  # generator -> its options
    "normal": ("mean", "std", "repeat_last"),
    "uniform": ("low", "high", "repeat_last"),
    "randint": ("low", "high"),
    "bernoulli": ("p",),
    "values": ("values",),
    "trans_quant_param": ("values",),
    "compressed_mask": ("mode",),
    "triu": ("diagonal",),
    "drop_mask": (),
    "sparse_indices": (),
    "lightning_indexer": (),
    "block_table": (),
    "kv_quant_rows": (),
}
DEPENDENT = ("drop_mask", "sparse_indices", "lightning_indexer", "block_table", "kv_quant_rows")
# Paged caches (docs/semantics/paged-kv.md): the operator's per-sequence key lengths and its cache tensor.
PAGED_LENGTHS = {
    "fused_infer_attention_score": ("actual_seq_lengths_kv", "key"),
    "fused_infer_attention_score_v2": ("actual_seq_kvlen", "key"),
    "incre_flash_attention": ("actual_seq_lengths", "key"),
    "sparse_flash_attention": ("actual_seq_lengths_kv", "key"),
    "lightning_indexer": ("actual_seq_lengths_key", "key_index"),
    "atb_paged_attention": ("context_lens", "key_cache"),
    "atb_paged_attention_splitfuse": ("context_lens", "key_cache"),
}
_FIXED_SHAPE = ("values", "trans_quant_param", "compressed_mask", "drop_mask")
_INTEGER = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes 64-bit seeds
MAX_GENERATED_BYTES = 4 * 2**30  # default of golden --max-bytes: all generated inputs together, as drawn
DRAW_BYTES = 8  # bytes per element while drawn: float64 / int64, whatever the tensor's dtype


class CaseError(UsageError):
    """A bad case file or input file: one line naming the field; exit status 2."""


@dataclass
class TensorSpec:
    name: str
    generator: str
    dtype: torch.dtype | None
    shape: tuple[int, ...] | None
    options: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        opts = ", ".join(f"{k} {v}" for k, v in self.options.items() if k != "values")
        return f"generated: {self.generator}" + (f" ({opts})" if opts else "")


@dataclass
class CaseFile:
    path: str
    op: str
    seed: int
    params: dict[str, Any]
    tensors: dict[str, TensorSpec]
    raw: dict[str, Any]
    max_bytes: int = MAX_GENERATED_BYTES


# ----------------------------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------------------------
def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    """A finite JSON number (json.loads accepts NaN, Infinity and -Infinity, which no parameter means)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _known_ops() -> list[str]:
    return sorted(op for op in registry.OPERATORS if hasattr(cann_attn, op))


def load_case(path: str | Path, op: str | None = None, max_bytes: int = MAX_GENERATED_BYTES) -> CaseFile:
    """Parse and check a case file (`op`: the --op option, which must agree with the file's op; `max_bytes`: the
    --max-bytes option, checked by `check_sizes` against every tensor whose shape the case gives)."""
    where = str(path)

    def fail(message: str) -> CaseError:
        return CaseError(f"{where}: {message}")

    try:
        text = read_json_text(Path(path))
    except UsageError as exc:
        raise CaseError(f"--case: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise fail("not a JSON case file (not UTF-8 text)") from exc
    try:
        raw = load_json(text)
    except json.JSONDecodeError as exc:
        raise fail(f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from exc
    except ValueError as exc:
        raise fail(f"not a case file: {exc}") from exc
    if not isinstance(raw, dict):
        raise fail("expected a JSON object at the top level")
    unknown = [k for k in raw if k not in TOP_LEVEL]
    if unknown:
        raise fail(f"{unknown[0]}: unknown field (expected: {', '.join(TOP_LEVEL)})")

    file_op = raw.get("op")
    if file_op is not None and not isinstance(file_op, str):
        raise fail(f"op: expected an operator name, got {file_op!r}")
    if op is not None and file_op is not None and registry.canonical_op(op) != registry.canonical_op(file_op):
        raise fail(f"op: the case is for {file_op!r} but --op is {op!r}")
    name = registry.canonical_op(op or file_op) if (op or file_op) else None
    if name is None:
        raise fail("op: missing (name the operator in the case file or with --op)")
    if name not in _known_ops():
        raise fail(f"op: unknown operator {name!r} (known: {', '.join(_known_ops())}, or their torch_npu names)")

    seed = raw.get("seed", 0)
    if not _is_int(seed) or not 0 <= seed <= MAX_SEED:
        raise fail(f"seed: expected an integer in [0, 2**63 - 1], got {json.dumps(seed)}")
    if "description" in raw and not isinstance(raw["description"], str):
        raise fail("description: expected a string")

    inputs = raw.get("inputs", {})
    if not isinstance(inputs, dict):
        raise fail(f"inputs: expected an object of tensor descriptions, got {type(inputs).__name__}")
    tensor_names = registry.tensor_parameters(name)
    for tname in inputs:
        if tname not in tensor_names:
            hint = " (a scalar: give it under params)" if tname in registry.op_signature(name).parameters else ""
            raise fail(f"inputs.{tname}: not a tensor input of {name}{hint} (tensor inputs: {', '.join(tensor_names)})")

    params = raw.get("params", {})
    if not isinstance(params, dict):
        raise fail(f"params: expected an object of parameter values, got {type(params).__name__}")
    _check_params(name, params, fail)

    specs = {tname: _tensor_spec(tname, spec, fail) for tname, spec in inputs.items()}
    case = CaseFile(where, name, seed, dict(params), specs, raw, max_bytes)
    check_sizes(case)
    return case


def _drawn_bytes(numel: int) -> int:
    return numel * DRAW_BYTES


def _check_budget(case: CaseFile, field_: str, what: str, numel: int, before: int) -> int:
    """`before` plus this tensor's drawn bytes, or CaseError naming it when the total exceeds case.max_bytes."""
    total = before + _drawn_bytes(numel)
    if total > case.max_bytes:
        others = f" (with {before} bytes of other inputs)" if before else ""
        raise CaseError(
            f"{field_}: {what} is {numel} elements, {_drawn_bytes(numel)} bytes as drawn{others}; the "
            f"generated inputs may total {case.max_bytes} bytes (--max-bytes)"
        )
    return total


def check_sizes(case: CaseFile) -> int:
    """The bytes, as drawn, of every generated tensor whose shape the case gives (CaseError naming the first input
    that takes the total past case.max_bytes); nothing is allocated."""
    total = 0
    for name, spec in case.tensors.items():
        if spec.shape is not None:
            try:
                total = _check_budget(case, f"inputs.{name}.shape", str(list(spec.shape)), math.prod(spec.shape),
                                      total)
            except CaseError as exc:
                raise CaseError(f"{case.path}: {exc}") from None
    return total


def _check_params(op: str, params: dict[str, Any], fail) -> None:
    sig = registry.op_signature(op).parameters
    tensors = registry.tensor_parameters(op)
    scalars = [n for n in sig if n not in tensors and n != "backend"]
    for key, value in params.items():
        if key in tensors:
            raise fail(f"params.{key}: a tensor input; describe it under inputs")
        if key not in scalars:
            raise fail(f"params.{key}: not a parameter of {op} (parameters: {', '.join(scalars)})")
        annotation = str(sig[key].annotation)
        optional = annotation.endswith(" | None")
        annotation = annotation.removesuffix(" | None")
        ok = {
            "int": _is_int(value),
            "float": _is_number(value),
            "str": isinstance(value, str),
            "bool": isinstance(value, bool),
        }.get(annotation)
        if optional and value is None:
            ok = True
        elif ok is None:  # lengths, prefix, start indices: an integer, a list of integers or null
            ok = value is None or _is_int(value) or (isinstance(value, list) and all(_is_int(v) for v in value))
            annotation = "an integer or a list of integers"
        elif annotation == "float":
            annotation = "a finite number"
        else:
            annotation = {"int": "an integer", "str": "a string", "bool": "true or false"}[annotation]
        if not ok:
            raise fail(f"params.{key}: expected {annotation}{' or null' * optional}, got {json.dumps(value)}")
    for key in scalars:
        p = sig[key]
        if p.default is p.empty and key not in params:
            raise fail(f"params.{key}: missing (required by {op})")


def _tensor_spec(name: str, spec: Any, fail) -> TensorSpec:
    field_ = f"inputs.{name}"
    if not isinstance(spec, dict):
        raise fail(f"{field_}: expected an object with shape, dtype (and generator), got {json.dumps(spec)}")
    dtype = None
    if "dtype" in spec:
        dtype = parse_dtype(spec["dtype"])
        if dtype is None:
            raise fail(
                f"{field_}.dtype: unknown dtype {json.dumps(spec['dtype'])} (expected one of {', '.join(DTYPES)})"
            )
    generator = spec.get("generator")
    if generator is None:
        if name == "sparse_indices":
            generator = "sparse_indices"
        elif dtype is None:
            raise fail(f"{field_}.dtype: missing")
        elif dtype.is_floating_point:
            generator = "normal"
        elif dtype == torch.int8:
            generator = "randint"
        elif dtype in (torch.bool, torch.uint8):
            generator = "bernoulli"
        else:
            raise fail(f"{field_}.generator: missing (an {canonical_dtype(dtype)} tensor needs one, e.g. randint)")
    if generator not in GENERATORS:
        raise fail(f"{field_}.generator: unknown generator {json.dumps(generator)} (known: {', '.join(GENERATORS)})")
    allowed = ("shape", "dtype", "generator", *GENERATORS[generator])
    for key in spec:
        if key not in allowed:
            raise fail(f"{field_}.{key}: unknown field for generator {generator} (fields: {', '.join(allowed)})")
    defaults = {"compressed_mask": torch.bool, "triu": torch.bool, "drop_mask": torch.uint8,
                "sparse_indices": torch.int32, "lightning_indexer": torch.int32, "values": torch.float32,
                "block_table": torch.int32, "kv_quant_rows": torch.int8,
                "trans_quant_param": torch.int64}
    if dtype is None:
        if generator not in defaults:
            raise fail(f"{field_}.dtype: missing")
        dtype = defaults[generator]
    shape = None
    if "shape" in spec:
        s = spec["shape"]
        if not isinstance(s, list) or not all(_is_int(x) and x >= 0 for x in s):
            raise fail(f"{field_}.shape: expected a list of non-negative integers, got {json.dumps(s)}")
        shape = tuple(s)
    elif generator not in _FIXED_SHAPE:
        raise fail(f"{field_}.shape: missing")
    options = {k: spec[k] for k in GENERATORS[generator] if k in spec}
    _check_options(field_, generator, dtype, options, fail)
    return TensorSpec(name, generator, dtype, shape, options)


def _check_options(field_: str, generator: str, dtype: torch.dtype, options: dict[str, Any], fail) -> None:
    for key in ("mean", "std", "low", "high", "p"):
        if key in options and not _is_number(options[key]):
            raise fail(f"{field_}.{key}: expected a finite number, got {json.dumps(options[key])}")
    if "repeat_last" in options and not isinstance(options["repeat_last"], bool):
        raise fail(f"{field_}.repeat_last: expected true or false, got {json.dumps(options['repeat_last'])}")
    for key in ("mode", "diagonal"):
        if key in options and not _is_int(options[key]):
            raise fail(f"{field_}.{key}: expected an integer, got {json.dumps(options[key])}")
    if generator in ("normal", "uniform") and not dtype.is_floating_point:
        raise fail(f"{field_}.dtype: generator {generator} needs a float dtype, got {canonical_dtype(dtype)}")
    if generator == "randint":
        if dtype not in _INTEGER:
            raise fail(f"{field_}.dtype: generator randint needs an integer dtype, got {canonical_dtype(dtype)}")
        if dtype != torch.int8 and ("low" not in options or "high" not in options):
            raise fail(f"{field_}.{'high' if 'low' in options else 'low'}: missing (randint needs low and high)")
        for key in ("low", "high"):
            if key in options and not _is_int(options[key]):
                raise fail(f"{field_}.{key}: expected an integer, got {json.dumps(options[key])}")
        if options.get("low", -127) > options.get("high", 127):
            raise fail(f"{field_}.high: {options.get('high', 127)} < low {options.get('low', -127)}")
    if generator == "uniform" and options.get("low", -1.0) > options.get("high", 1.0):
        raise fail(f"{field_}.high: {options.get('high', 1.0)} < low {options.get('low', -1.0)}")
    if "p" in options and not 0.0 <= options["p"] <= 1.0:
        raise fail(f"{field_}.p: expected a probability in [0, 1], got {options['p']}")
    if "std" in options and options["std"] < 0:
        raise fail(f"{field_}.std: expected a non-negative number, got {options['std']}")
    if generator in ("values", "trans_quant_param"):
        if "values" not in options:
            raise fail(f"{field_}.values: missing (generator {generator})")
        try:
            values = values_tensor(options["values"])
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise fail(f"{field_}.values: expected a (nested) list of numbers ({exc})") from exc
        target = torch.float32 if generator == "trans_quant_param" else dtype
        problem = _values_problem(values, target)
        if problem:
            raise fail(f"{field_}.values: not representable in {canonical_dtype(target)} ({problem})")
    if generator in ("compressed_mask", "triu", "bernoulli") and dtype not in (torch.bool, torch.uint8):
        raise fail(f"{field_}.dtype: generator {generator} gives bool or uint8, got {canonical_dtype(dtype)}")
    if generator in ("sparse_indices", "lightning_indexer") and dtype not in (torch.int32, torch.int64):
        raise fail(f"{field_}.dtype: generator {generator} gives int32 or int64, got {canonical_dtype(dtype)}")


def _leaves(values: Any) -> Iterator[Any]:
    if isinstance(values, list):
        for v in values:
            yield from _leaves(v)
    else:
        yield values


def values_tensor(values: Any) -> torch.Tensor:
    """A ``values`` list as a tensor that holds every number exactly: int64 when all are integers (beyond int64:
    OverflowError), else float64 (an integer float64 cannot hold exactly: ValueError)."""
    leaves = list(_leaves(values))
    if all(isinstance(v, int) for v in leaves):
        return torch.tensor(values, dtype=torch.int64)
    inexact = next((v for v in leaves if isinstance(v, int) and float(v) != v), None)
    if inexact is not None:
        raise ValueError(f"{inexact} is not exactly a float64 beside the other, non-integer values")
    return torch.tensor(values, dtype=torch.float64)


def _values_problem(t: torch.Tensor, dtype: torch.dtype) -> str:
    """Why `t` (a case's values) cannot be `dtype` ('' if it can): integers and bools must be exact; floats round
    to the nearest, but a finite value must stay finite."""
    if not dtype.is_floating_point:
        return exact_conversion_problem(t, dtype)
    converted = t.to(dtype)
    overflow = torch.isfinite(t) & ~torch.isfinite(converted)
    if bool(overflow.any()):
        first = tuple(overflow.nonzero()[0].tolist())
        return f"{t[first].item()!r} becomes {converted[first].item()!r}, beyond its range"
    return ""


# ----------------------------------------------------------------------------------------------------------
# Inputs given as .npy files
# ----------------------------------------------------------------------------------------------------------
def load_inputs(paths: list[str], case: CaseFile) -> dict[str, tuple[torch.Tensor, str]]:
    """Tensors from --inputs: directories (a golden directory: its role-input tensors, by its manifest; any
    other directory: its NAME.npy files named after inputs of the operator) and NAME.npy files (or NAME=FILE.npy).
    Returns {name: (tensor, where it came from)}; dtypes follow the case file, else the manifest, else the file."""
    inputs = registry.tensor_parameters(case.op)
    found: dict[str, tuple[torch.Tensor, str]] = {}
    limit = case.max_bytes

    def add(name: str, t: torch.Tensor, where: str) -> None:
        spec = case.tensors.get(name)
        if spec is not None:
            if spec.shape is not None and tuple(t.shape) != spec.shape:
                raise CaseError(
                    f"--inputs {where}: shape {list(t.shape)} differs from inputs.{name}.shape {list(spec.shape)} "
                    f"in {case.path}"
                )
            t = convert_exactly(t, spec.dtype, f"--inputs {where}")
        found[name] = (t, f"loaded from {where}")

    for raw in paths:
        name, _, file = raw.rpartition("=") if "=" in raw else ("", "", raw)
        path = Path(file)
        if path.is_dir():
            manifest = read_manifest(path)
            if manifest is not None:
                entries = [e for e in manifest["tensors"] if e.get("role") == "input" and e.get("name") in inputs]
                for entry in entries:
                    files = [f for f in entry_files(path, entry).values() if f.exists()]
                    t = read_entry(path, entry, max_bytes=limit, exact=True)
                    add(entry["name"], t, str(files[0] if files else path))
                matched = len(entries)
            else:
                files = [p for p in sorted(path.glob("*.npy")) if p.stem in inputs]
                for p in files:
                    add(p.stem, read_npy(inside(path, p.name, named_by=path), max_bytes=limit), str(p))
                matched = len(files)
            if not matched:
                raise CaseError(f"--inputs {raw}: no input of {case.op} there (inputs: {', '.join(inputs)})")
        elif os.path.lexists(path):
            name = name or path.stem
            if path.suffix != ".npy":
                raise CaseError(f"--inputs {raw}: expected a .npy file or a directory")
            if name not in inputs:
                raise CaseError(f"--inputs {raw}: {name!r} is not an input of {case.op} (inputs: {', '.join(inputs)})")
            entry = find_entry(read_manifest(path.parent), file=path.name)
            dtype = parse_dtype(entry.get("dtype")) if entry else None
            add(name, read_npy(path, dtype, limit, exact=True), str(path))
        else:
            raise CaseError(f"--inputs {raw}: no such file or directory")
    return found


# ----------------------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------------------
def build_inputs(case: CaseFile, loaded: Mapping[str, tuple[torch.Tensor, str]]):
    """All arguments of the call by name (params, loaded and generated tensors, derived state) and, per tensor,
    where it came from."""
    op = registry.OPERATORS[case.op]
    named: dict[str, Any] = dict(case.params)
    sources: dict[str, str] = {}
    for name, (t, where) in loaded.items():
        named[name], sources[name] = t, where
    drawn = check_sizes(case)
    gen = torch.Generator().manual_seed(case.seed)
    order = [n for n in registry.tensor_parameters(case.op) if n in case.tensors]
    for dependent in (False, True):
        for name in order:
            spec = case.tensors[name]
            if (spec.generator in DEPENDENT) != dependent:
                continue
            try:
                if spec.generator == "drop_mask":  # its size follows query, key and head_num
                    numel = _drop_mask_numel(f"inputs.{name}", named)
                    drawn = _check_budget(case, f"inputs.{name}", "the dropout mask", numel, drawn)
                t = _generate(spec, gen, named, case.params, case.op)
                if name in loaded:  # drawn all the same: the other tensors stay those of the seeded case
                    continue
                named[name] = t
            except CaseError as exc:
                raise CaseError(f"{case.path}: {exc}") from None
            except Exception as exc:
                message = f"{type(exc).__name__}: {exc}".splitlines()[0]
                raise CaseError(f"{case.path}: inputs.{name}: generator {spec.generator} failed ({message})") from exc
            sources[name] = spec.describe()
    missing_state = [n for n in op.state if n not in named]
    if missing_state and op.derive is not None:
        _require_tensors(case, named, exclude=op.state)
        try:
            derived = op.derive(named)
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}".splitlines()[0]
            raise CaseError(
                f"{case.path}: cannot compute {', '.join(missing_state)} with the forward oracle ({message}); "
                "check the input shapes and parameters"
            ) from exc
        for name in missing_state:
            named[name], sources[name] = derived[name], "derived: float64 forward oracle"
    _require_tensors(case, named)
    return named, sources


def _require_tensors(case: CaseFile, named: Mapping[str, Any], exclude: tuple[str, ...] = ()) -> None:
    for name, p in registry.op_signature(case.op).parameters.items():
        if name in exclude or p.default is not p.empty:
            continue
        if name not in named:
            raise CaseError(f"{case.path}: inputs.{name}: missing (required by {case.op})")


def _generate(spec: TensorSpec, gen: torch.Generator, named: Mapping[str, Any], params: Mapping[str, Any], op: str):
    field_ = f"inputs.{spec.name}"
    o, g, dtype, shape = spec.options, spec.generator, spec.dtype, spec.shape
    # repeat_last: one value per row, repeated along the last dimension (the 8 lanes of softmax statistics).
    drawn = (*shape[:-1], 1) if o.get("repeat_last") and shape else shape
    if g == "normal":
        t = torch.randn(drawn, generator=gen, dtype=torch.float64) * o.get("std", 1.0) + o.get("mean", 0.0)
    elif g == "uniform":
        low, high = o.get("low", -1.0), o.get("high", 1.0)
        t = low + (high - low) * torch.rand(drawn, generator=gen, dtype=torch.float64)
    elif g == "randint":
        t = torch.randint(o.get("low", -127), o.get("high", 127) + 1, shape, generator=gen, dtype=torch.int64)
    elif g == "bernoulli":
        t = torch.rand(shape, generator=gen, dtype=torch.float64) < o.get("p", 0.5)
    elif g in ("values", "trans_quant_param"):
        t = values_tensor(o["values"])
        if shape is not None and tuple(t.shape) != shape:
            raise CaseError(f"{field_}.shape: {list(shape)} but values have shape {list(t.shape)}")
        if g == "trans_quant_param":
            t = cann_attn.trans_quant_param(t.to(torch.float32))
    elif g == "compressed_mask":
        mode = o.get("mode", params.get("sparse_mode"))
        if mode not in (2, 3, 4, 6, 7, 8):
            raise CaseError(f"{field_}.mode: a compressed mask exists for sparse modes 2, 3, 4, 6, 7, 8, got {mode}")
        t = cann_attn.compressed_mask(mode)
    elif g == "triu":
        if len(shape) < 2:
            raise CaseError(f"{field_}.shape: triu needs at least 2 dimensions, got {list(shape)}")
        t = torch.ones(shape[-2:], dtype=torch.bool).triu(o.get("diagonal", 1)).expand(shape).contiguous()
    elif g == "drop_mask":
        t = _drop_mask(field_, gen, named, params)
    elif g == "sparse_indices":
        t = _sparse_indices(spec, gen, named, params)
    elif g == "block_table":
        t = _block_table(spec, gen, named, params, op)
    elif g == "kv_quant_rows":
        t = _kv_quant_rows(spec, gen, named)
    else:  # lightning_indexer
        t = _indexer_topk(spec, named, params)
    if drawn is not shape:
        t = t.expand(shape).contiguous()
    if shape is not None and g not in ("values", "trans_quant_param") and tuple(t.shape) != shape:
        raise CaseError(f"{field_}.shape: {list(shape)}, but generator {g} gives {list(t.shape)}")
    return t.to(dtype)


def _need(field_: str, named: Mapping[str, Any], *names: str) -> list[Any]:
    out = []
    for n in names:
        if n not in named:
            raise CaseError(f"{field_}: its generator needs {n!r} (an input or parameter)")
        out.append(named[n])
    return out


def _drop_mask(field_: str, gen: torch.Generator, named: Mapping[str, Any], params: Mapping[str, Any]):
    return cann_attn.gen_drop_mask(_drop_mask_numel(field_, named), params.get("keep_prob", 1.0), generator=gen)


def _drop_mask_numel(field_: str, named: Mapping[str, Any]) -> int:
    query, key, head_num, layout = _need(field_, named, "query", "key", "head_num", "input_layout")
    if layout == "TND":
        qlen, kvlen = _need(field_, named, "actual_seq_qlen", "actual_seq_kvlen")
        numel = cann_attn.drop_mask_numel(head_num, actual_seq_qlen=qlen, actual_seq_kvlen=kvlen)
    else:
        dims = BATCH_SEQ_DIMS.get(layout)
        if dims is None:
            raise CaseError(f"params.input_layout: unknown layout {layout!r}")
        b, s = dims
        numel = cann_attn.drop_mask_numel(head_num, batch=query.shape[b], seq_q=query.shape[s], seq_kv=key.shape[s])
    return numel


def _sparse_indices(spec: TensorSpec, gen: torch.Generator, named: Mapping[str, Any], params: Mapping[str, Any]):
    field_ = f"inputs.{spec.name}"
    query, key = _need(field_, named, "query", "key")
    shape = spec.shape
    if len(shape) != query.dim() or shape[:-2] != tuple(query.shape[:-2]) or shape[-2] != 1:
        expected = ", ".join(str(x) for x in (*query.shape[:-2], 1, "K"))
        raise CaseError(f"{field_}.shape: expected [{expected}] (query's leading dims), got {list(shape)}")
    return registry.random_sparse_indices(
        gen,
        query.shape,
        key.shape,
        shape[-1],
        layout=params.get("layout", "BSND"),
        sparse_block_size=params.get("sparse_block_size", 1),
        sparse_mode=params.get("sparse_mode", 3),
        actual_seq_lengths_query=params.get("actual_seq_lengths_query"),
        actual_seq_lengths_kv=params.get("actual_seq_lengths_kv", params.get("actual_seq_lengths_key")),
        dtype=spec.dtype,
    )


def _indexer_topk(spec: TensorSpec, named: Mapping[str, Any], params: Mapping[str, Any]):
    from ..testing.dsa_oracle import lightning_indexer_oracle

    field_ = f"inputs.{spec.name}"
    qi, ki, w = _need(field_, named, "query_index", "key_index", "weights")
    shape = spec.shape
    if len(shape) != qi.dim() or shape[:-2] != tuple(qi.shape[:-2]) or shape[-2] != 1:
        expected = ", ".join(str(x) for x in (*qi.shape[:-2], 1, "K"))
        raise CaseError(f"{field_}.shape: expected [{expected}] (query_index's leading dims), got {list(shape)}")
    kwargs = {k: params[k] for k in ("actual_seq_lengths_query", "actual_seq_lengths_key", "layout") if k in params}
    return lightning_indexer_oracle(qi, ki, w, sparse_count=shape[-1], sparse_mode=params.get("sparse_mode", 3),
                                    **kwargs)[0]


def _kv_quant_rows(spec: TensorSpec, gen: torch.Generator, named: Mapping[str, Any]) -> torch.Tensor:
    """KvQuantSparseFlashAttention's combined cache rows [..., 656] (docs/operators/quant_dsa.md): 512 quantised
    latent values (int8 in [-127, 127], or float8_e4m3fn of N(0, 1)), the 64 rope values in the query's dtype as
    bytes, and 4 fp32 tile scales in (0, 1/64) as bytes."""
    field_ = f"inputs.{spec.name}"
    (query,) = _need(field_, named, "query")
    if spec.dtype not in (torch.int8, torch.float8_e4m3fn) or not spec.shape or spec.shape[-1] != 656:
        raise CaseError(f"{field_}: generator kv_quant_rows gives int8 or float8_e4m3fn rows [..., 656], got "
                        f"{canonical_dtype(spec.dtype)} {list(spec.shape or ())}")
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise CaseError(f"{field_}: generator kv_quant_rows stores the rope in the query's dtype, fp16 or bf16; "
                        f"the query is {canonical_dtype(query.dtype)}")
    lead = spec.shape[:-1]
    if spec.dtype == torch.int8:
        latent = torch.randint(-127, 128, (*lead, 512), generator=gen).to(torch.int8).view(torch.uint8)
    else:
        latent = torch.randn((*lead, 512), generator=gen).to(torch.float8_e4m3fn).view(torch.uint8)
    rope = torch.randn((*lead, 64), generator=gen).to(query.dtype).view(torch.uint8)
    scales = (torch.rand((*lead, 4), generator=gen) / 64).float().view(torch.uint8)
    return torch.cat([latent, rope, scales], -1).view(spec.dtype)


def _block_table(spec: TensorSpec, gen: torch.Generator, named: Mapping[str, Any], params: Mapping[str, Any],
                 op: str) -> torch.Tensor:
    """[B, W]: sequence b's first ceil(L_b / block_size) entries name distinct physical blocks of the cache, drawn
    in random order; the rest -1 (docs/semantics/paged-kv.md)."""
    field_ = f"inputs.{spec.name}"
    if op not in PAGED_LENGTHS:
        raise CaseError(f"{field_}: {op} takes no paged cache")
    lengths_name, cache_name = PAGED_LENGTHS[op]
    (cache,) = _need(field_, named, cache_name)
    (lengths,) = _need(field_, named, lengths_name)
    lengths = [lengths] if _is_int(lengths) else list(lengths)
    block_size = params.get("block_size") or (cache.shape[1] if cache.dim() >= 2 else 0)
    if not _is_int(block_size) or block_size <= 0:
        raise CaseError(f"{field_}: no block size (params.block_size or the cache's second dimension)")
    shape = spec.shape
    if shape is None or len(shape) != 2:
        raise CaseError(f"{field_}.shape: expected [B, W] (sequences, table width)")
    if len(lengths) != shape[0]:
        raise CaseError(f"{field_}.shape: {shape[0]} rows but params.{lengths_name} has {len(lengths)} lengths")
    needed = [-(-int(n) // block_size) for n in lengths]
    if max(needed, default=0) > shape[1]:
        raise CaseError(f"{field_}.shape: {shape[1]} columns, but a sequence needs {max(needed)} blocks of "
                        f"{block_size}")
    if sum(needed) > cache.shape[0]:
        raise CaseError(f"inputs.{cache_name}.shape: {cache.shape[0]} blocks, but the sequences need {sum(needed)}")
    perm = torch.randperm(cache.shape[0], generator=gen).tolist()
    table = torch.full(tuple(shape), -1, dtype=torch.int64)
    used = iter(perm)
    for b, n in enumerate(needed):
        for j in range(n):
            table[b, j] = next(used)
    return table
