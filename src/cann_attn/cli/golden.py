"""``cann-attn golden``: inputs and golden outputs of one operator call, as files an Ascend test can read.

From a case file (``casefile.py``: the operator, tensor shapes / dtypes / generators, parameters, seed) it
builds the inputs (seeded ``torch.Generator``; or ``.npy`` files given with ``--inputs``), checks the call with
the operator itself (a call the operator rejects is a bad case: exit status 2 with the operator's message),
computes the golden outputs with the float64 oracle (``cases.OPERATORS``: the oracles of ``cann_attn.testing``;
for grad operators the gradients, by autograd through the forward oracle or the documented gradient), casts
them to each output's dtype and writes, in ``--out``:

- every input and output tensor (and the naive reference ``NAME.naive`` of the secondary precision rule) as
  ``NAME.npy`` and ``NAME.bin`` (``tensorio.py``: raw little-endian,
  bfloat16 as its raw 16-bit pattern);
- ``manifest.json``: per tensor its name, role (input / output), shape, dtype, files and source; the operator,
  its parameters, the seed, the case, and the cann_attn / torch versions.

``--precision npu`` also writes, per output NAME, the NPU-pipeline golden ``NAME.npu`` (role ``npu_output``): the
reference backend in the "npu" precision mode, which rounds where the Ascend kernels round
(docs/semantics/precision.md); ``compare`` then measures against both.

``--actual DIR`` also writes the operator's own outputs for the same inputs (same names, same manifest format),
ready for ``cann-attn compare DIR OUT``. Directories are written to a temporary sibling and renamed at the
end: on any failure nothing is left behind.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from rich.markup import escape

import cann_attn

from . import UsageError
from . import cases as registry
from .casefile import MAX_GENERATED_BYTES, CaseError, build_inputs, load_case, load_inputs
from .output import Column, console, print_table
from .tensorio import (
    NAIVE_ROLE,
    NAIVE_SUFFIX,
    NPU_ROLE,
    NPU_SUFFIX,
    Staged,
    canonical_dtype,
    write_manifest,
    write_tensor,
)

FORMAT = "cann-attn golden 1"
NAIVE_SOURCE = "naive: the same computation in the input dtype (the flash-attn rule's reference)"
FILES_NOTE = (
    "NAME.npy: numpy (bfloat16 tensors hold their exact values as float32); NAME.bin: raw row-major "
    "little-endian elements, no header (bfloat16: the raw 16-bit pattern; bool: one byte 0/1)"
)
GOLDEN_NOTE = (
    "float64 oracle (cann_attn.testing) of the rules in docs/semantics/, cast to each output's dtype; gradients "
    "of grad operators by torch.autograd through the forward oracle (SparseLightningIndexerGradKLLoss: the "
    "documented gradient dI = q - p)"
)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "golden",
        help="write seeded inputs and float64-oracle golden outputs of one case (.npy, .bin, manifest.json)",
        description="Generate the inputs of one operator call described by a JSON case file (or load them from "
        ".npy files), compute its golden outputs with the float64 oracle, and write every tensor as .npy and raw "
        "little-endian .bin plus manifest.json. Example case files, one per operator: examples/cases/ of the source "
        "checkout (not installed with the package; docs/guides/golden.md shows the format).",
    )
    p.add_argument("--op", help="the operator, by its cann_attn or torch_npu name (e.g. npu_fusion_attention; default: "
                   "the case file's 'op'; if both are given they must agree)")
    p.add_argument("--case", required=True, metavar="CASE.json", help="the case file")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (created; written atomically)")
    p.add_argument(
        "--inputs",
        nargs="+",
        metavar="PATH",
        help="input tensors instead of generated ones: NAME.npy files, NAME=FILE.npy, or directories (a golden "
        "directory's inputs, or NAME.npy files named after the operator's inputs)",
    )
    p.add_argument(
        "--actual",
        metavar="DIR",
        help="also run the cann_attn operator on the same inputs and write its outputs to DIR (for compare)",
    )
    p.add_argument("--device", default="cpu", help="device of the operator run (the golden is computed on the CPU)")
    p.add_argument(
        "--precision",
        choices=("exact", "npu"),
        default="exact",
        help="npu: also write each output's NPU-pipeline golden NAME.npu (the reference backend rounding where the "
        "Ascend kernels round, docs/semantics/precision.md); compare then reports against both",
    )
    p.add_argument("--force", action="store_true", help="replace existing non-empty output directories")
    p.add_argument(
        "--max-bytes",
        type=_positive_int,
        default=MAX_GENERATED_BYTES,
        metavar="N",
        help=f"most bytes the generated inputs may take together, counted at 8 bytes per element as drawn, checked "
        f"before anything is allocated (default {MAX_GENERATED_BYTES}: 4 GiB)",
    )
    p.set_defaults(func=run)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _run_operator(case, call: registry.Call, device: torch.device) -> tuple[dict[str, torch.Tensor], float]:
    """The operator's outputs on `device` (moved back to the CPU) and its time; a rejection is a bad case."""
    op = registry.OPERATORS[case.op]
    dev_call = call.map_tensors(lambda t: t.to(device))
    start = time.perf_counter()
    try:
        outputs = registry.outputs_of(case.op, op.outputs, op.written)(dev_call)
    except cann_attn.AclnnError as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CaseError(f"{case.path}: cann_attn.{case.op} rejects this case: {message}") from exc
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    return {n: t.detach().to("cpu") for n, t in outputs.items() if isinstance(t, torch.Tensor)}, elapsed


def _check_parameters(case, named: dict[str, Any], sources: dict[str, str]) -> None:
    """Every argument reaches the golden or is refused here (exit status 2): a golden that silently left one out
    would fail a correct NPU kernel. Forward state derived by the oracle is not checked against itself."""
    given = {k: v for k, v in named.items() if not sources.get(k, "").startswith("derived")}
    try:
        registry.OPERATORS[case.op].check(given)
    except registry.UnsupportedParameter as exc:
        where = "inputs" if exc.name in registry.tensor_parameters(case.op) else "params"
        raise CaseError(f"{case.path}: {where}.{exc}") from None


def _goldens(case, call: registry.Call, named: dict[str, Any], actual: dict[str, torch.Tensor]):
    """The golden outputs, and the naive references of the secondary rule (NAME.naive), in each output's dtype."""
    op = registry.OPERATORS[case.op]
    dtypes = op.output_dtypes(named)
    out, naive = {}, {}
    for name, t in op.golden(call).items():
        dtype = dtypes.get(name) or (actual[name].dtype if name in actual else t.dtype)
        out[name] = t.detach().to("cpu").to(dtype)
    references = op.naive(call) if op.naive is not None else {}
    for name, t in references.items():
        if name in out and t is not None and out[name].dtype.is_floating_point:
            naive[f"{name}{NAIVE_SUFFIX}"] = t.detach().to("cpu").to(out[name].dtype)
    return out, naive


NPU_SOURCE = "cann_attn reference backend, precision 'npu'"
NPU_NOTE = (
    "NAME.npu: the output as the Ascend A2/A3 kernel's pipeline rounds it (cann_attn reference backend in the 'npu' "
    "precision mode, docs/semantics/precision.md), cast to the output's dtype"
)


def _npu_goldens(case, call: registry.Call, golden: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The operator's outputs on the CPU reference backend in the "npu" precision mode, in the golden's dtypes."""
    with cann_attn.precision("npu"):
        outputs, _ = _run_operator(case, call, torch.device("cpu"))
    return {name: outputs[name].to(t.dtype) for name, t in golden.items() if name in outputs}


def _manifest(parsed, kind: str, **extra: Any) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "kind": kind,
        "op": parsed.op,
        "cann_attn_version": cann_attn.__version__,
        "torch_version": torch.__version__,
        "seed": parsed.seed,
        "params": parsed.params,
        **extra,
        "byte_order": "little-endian",
        "files": FILES_NOTE,
        "tensors": [],
    }


def _write(staged: Staged, manifest: dict[str, Any], tensors: list[tuple[str, torch.Tensor, str, str]]) -> int:
    directory = staged.open()
    total = 0
    for name, t, role, source in tensors:
        entry = write_tensor(directory, name, t, role, source=source)
        total += entry["bin_bytes"]
        manifest["tensors"].append(entry)
    write_manifest(directory, manifest)
    return total


def run(args: argparse.Namespace) -> int:
    from .verify import _device

    start = time.perf_counter()
    out = Staged(Path(args.out), args.force)
    out.check("--out")
    actual_dir = None
    if args.actual:
        if Path(args.actual).resolve() == Path(args.out).resolve():
            raise UsageError("--actual: must differ from --out")
        actual_dir = Staged(Path(args.actual), args.force)
        actual_dir.check("--actual")
    device = _device(args.device)

    case = load_case(args.case, args.op, args.max_bytes)
    loaded = load_inputs(args.inputs, case) if args.inputs else {}
    named, sources = build_inputs(case, loaded)
    _check_parameters(case, named, sources)
    call = registry.bind(case.op, named)
    actual, op_seconds = _run_operator(case, call, device)
    golden, naive = _goldens(case, call, named, actual)

    inputs = [
        (name, named[name], "input", sources[name])
        for name in registry.tensor_parameters(case.op)
        if isinstance(named.get(name), torch.Tensor)
    ]
    outputs = [(name, t, "output", "golden") for name, t in golden.items()]
    references = [(name, t, NAIVE_ROLE, NAIVE_SOURCE) for name, t in naive.items()]
    extra = {}
    if args.precision == "npu":
        references += [(f"{name}{NPU_SUFFIX}", t, NPU_ROLE, NPU_SOURCE)
                       for name, t in _npu_goldens(case, call, golden).items()]
        extra = {"precision": "npu", "npu_golden": NPU_NOTE}
    manifest = _manifest(
        case,
        "golden",
        description=case.raw.get("description", ""),
        case_file=str(args.case),
        case=case.raw,
        inputs_from=list(args.inputs or []),
        golden=GOLDEN_NOTE,
        **extra,
    )
    try:
        nbytes = _write(out, manifest, inputs + outputs + references)
        if actual_dir is not None:
            missing = [n for n in golden if n not in actual]
            if missing:
                raise UsageError(f"cann_attn.{case.op} returned no {', '.join(missing)}")
            source = f"cann_attn.{case.op} (backend auto, device {device})"
            actual_manifest = _manifest(case, "actual", operator=source, operator_seconds=round(op_seconds, 4))
            _write(actual_dir, actual_manifest, [(n, actual[n], "output", source) for n in golden])
        out.commit()
        if actual_dir is not None:
            actual_dir.commit()
    finally:
        out.abort()
        if actual_dir is not None:
            actual_dir.abort()

    out_console = console()
    columns = [Column(name, no_wrap=name != "source") for name in ("tensor", "role", "dtype", "shape", "source")]
    rows = [[escape(name), role, canonical_dtype(t.dtype), str(list(t.shape)), escape(source)]
            for name, t, role, source in inputs + outputs]
    rows += [[escape(name), role, canonical_dtype(t.dtype), str(list(t.shape)),
              "naive (input dtype)" if role == NAIVE_ROLE else escape(source)]
             for name, t, role, source in references]
    print_table(out_console, f"cann-attn golden: {case.op} (seed {case.seed})", columns, rows)
    out_console.print(
        f"[bold green]wrote[/] {args.out}: {len(inputs)} inputs, {len(outputs)} golden outputs, "
        f"{nbytes / 2**20:.1f} MiB per format, manifest.json ({time.perf_counter() - start:.1f} s)"
    )
    if actual_dir is not None:
        out_console.print(
            f"[bold green]wrote[/] {args.actual}: the outputs of cann_attn.{case.op} on {device} "
            f"({op_seconds * 1e3:.1f} ms); compare with: cann-attn compare {args.actual} {args.out}"
        )
    return 0
