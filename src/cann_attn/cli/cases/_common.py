"""The registry of ``cann-attn verify`` cases and ``cann-attn golden`` operators, and the helpers every family shares.

See the package docstring (``cann_attn.cli.cases``) for what a case and an operator record hold.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import cann_attn

Outputs = Mapping[str, torch.Tensor]
F16, BF16, F32, I8 = torch.float16, torch.bfloat16, torch.float32, torch.int8


@dataclass(frozen=True)
class Call:
    """Positional and keyword arguments of one operator (and oracle) call."""

    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Call:
        """A copy with `fn` applied to every tensor (also inside lists and tuples)."""
        return Call(tuple(_map(a, fn) for a in self.args), {k: _map(v, fn) for k, v in self.kwargs.items()})


def _map(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, fn) for v in value)
    return value


@dataclass(frozen=True)
class Case:
    """One verification case: see the module docstring."""

    op: str
    name: str
    dtype: torch.dtype
    shape: str
    build: Callable[[torch.Generator], Call]
    run: Callable[[Call], Outputs]
    oracle: Callable[[Call], Outputs]
    quick: bool = True
    naive: Callable[[Call], Outputs] | None = None


CASES: list[Case] = []


def register(*cases: Case) -> None:
    """Add cases to the registry (names must be unique per operator)."""
    for case in cases:
        if any(c.op == case.op and c.name == case.name for c in CASES):
            raise ValueError(f"duplicate verify case {case.op}/{case.name}")
        CASES.append(case)


def cases_for(op: str | None = None, quick: bool = False) -> list[Case]:
    """Registered cases of operator `op` (all operators if None) whose operator exists in ``cann_attn``."""
    return [
        c for c in CASES if (op is None or c.op == op) and (c.quick or not quick) and hasattr(cann_attn, c.op)
    ]


def outputs_of(op_name: str, names: Sequence[str], written: Sequence[str] = ()) -> Callable[[Call], Outputs]:
    """A ``run`` function: call ``cann_attn.<op_name>`` and name the first ``len(names)`` results. The inputs in
    `written` (updated in place by the operator: MlaProlog's caches) are copied first, so the call's own inputs stay
    as they were, and the copies after the call are outputs named `written_output(name)`."""

    def run(call: Call) -> Outputs:
        copies = {}
        if written:
            named = by_name(op_name, call)
            copies = {n: named[n].clone() for n in written}
            call = bind(op_name, {**named, **copies})
        result = getattr(cann_attn, op_name)(*call.args, **call.kwargs)
        if isinstance(result, torch.Tensor):
            result = (result,)
        return {**dict(zip(names, result, strict=False)), **{written_output(n): t for n, t in copies.items()}}

    return run


def written_output(name: str) -> str:
    """The output name of input `name` after an operator updated it in place: kv_cache -> kv_cache_out (the input
    and its state after the call are two tensors of a golden directory)."""
    return f"{name}_out"


def randn(gen: torch.Generator, shape: Sequence[int], dtype: torch.dtype, std: float = 1.0) -> torch.Tensor:
    """Seeded normal values, drawn in fp32 and cast (the same numbers for every dtype)."""
    return (torch.randn(tuple(shape), generator=gen, dtype=torch.float32) * std).to(dtype)



def cumulative(lens: Sequence[int]) -> list[int]:
    ends, total = [], 0
    for n in lens:
        total += n
        ends.append(total)
    return ends


def layout_shape(layout: str, batch: int, seq: int, heads: int, dim: int, total: int) -> tuple[int, ...]:
    return {
        "BSH": (batch, seq, heads * dim),
        "SBH": (seq, batch, heads * dim),
        "BSND": (batch, seq, heads, dim),
        "BNSD": (batch, heads, seq, dim),
        "TND": (total, heads, dim),
    }[layout]

def int8_values(gen: torch.Generator, shape: Sequence[int]) -> torch.Tensor:
    """Seeded int8 values uniform in [-127, 127]."""
    return torch.randint(-127, 128, tuple(shape), generator=gen, dtype=torch.int64).to(torch.int8)


# ---------------------------------------------------------------------------------------------------------
# Arguments by name (the operators' signatures; used by the cases below and by ``cann-attn golden``)
# ---------------------------------------------------------------------------------------------------------
@functools.cache
def op_signature(op: str) -> inspect.Signature:
    """The signature of ``cann_attn.<op>``."""
    return inspect.signature(getattr(cann_attn, op))


def tensor_parameters(op: str) -> tuple[str, ...]:
    """The parameters of `op` annotated as tensors, in signature order."""
    return tuple(n for n, p in op_signature(op).parameters.items() if "Tensor" in str(p.annotation))


def tensor_list_parameters(op: str) -> tuple[str, ...]:
    """The parameters of `op` that take a list of tensors (AttentionUpdate's lse and local_out). A case file gives
    such a list as one tensor, the list's tensors stacked along a new first dimension (docs/guides/golden.md)."""
    return tuple(n for n, p in op_signature(op).parameters.items() if "Sequence[" in str(p.annotation)
                 and "Tensor" in str(p.annotation))


def bind(op: str, named: Mapping[str, Any]) -> Call:
    """The `Call` of `op` for arguments given by name: the parameters before ``*`` positionally (their defaults
    filled in), the keyword-only ones as given; a stacked tensor given for a list parameter becomes the list of its
    slices along the first dimension. Raises TypeError for an unknown or missing argument."""
    params = op_signature(op).parameters
    unknown = sorted(set(named) - set(params))
    if unknown:
        raise TypeError(f"{op}: unknown argument {unknown[0]!r}")
    lists = tensor_list_parameters(op)
    named = {k: list(v.unbind(0)) if k in lists and isinstance(v, torch.Tensor) else v for k, v in named.items()}
    args, kwargs = [], {}
    for name, p in params.items():
        if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            if name in named:
                args.append(named[name])
            elif p.default is not inspect.Parameter.empty:
                args.append(p.default)
            else:
                raise TypeError(f"{op}: missing required argument {name!r}")
        elif name in named:
            kwargs[name] = named[name]
    return Call(tuple(args), kwargs)


def by_name(op: str, call: Call) -> dict[str, Any]:
    """The arguments of a `Call` of `op` by parameter name (the inverse of `bind`)."""
    return dict(op_signature(op).bind(*call.args, **call.kwargs).arguments)


def without(named: Mapping[str, Any], *names: str) -> dict[str, Any]:
    return {k: v for k, v in named.items() if k not in names and k != "backend"}


# ---------------------------------------------------------------------------------------------------------
# Operators: output names, output dtypes, golden, and the inputs a grad op takes from its forward
# ---------------------------------------------------------------------------------------------------------
DTypes = Callable[[Mapping[str, Any]], dict[str, torch.dtype]]


# Parameters no golden depends on, with the reason (docs/guides/golden.md, "Every parameter reaches the golden").
COMMON_NO_EFFECT = {"backend": "selects the implementation, not the result"}
STATE_TOLERANCE = 2e-2  # a real fp16 / bf16 forward's statistics and output are within this of the float64 ones
FORWARD_STATE = "checked against the float64 forward of the given inputs, which the golden differentiates"
PRECISION_MODE = "a precision / performance mode of the NPU kernel; the golden is float64 whatever it is"


class UnsupportedParameter(ValueError):
    """A call sets a parameter the golden of its operator would not honour (it is neither passed to the oracle nor
    documented as without effect): a golden computed without it would be silently wrong."""

    def __init__(self, op: str, name: str, reason: str = "", message: str = "") -> None:
        self.op, self.name = op, name
        why = f" ({reason})" if reason else ""
        super().__init__(
            message or f"{name}: the golden of {op} does not take this parameter{why}; leave it out or at its default"
        )


@dataclass(frozen=True)
class Operator:
    """What ``cann-attn golden`` needs to know about an operator beyond its signature.

    - ``outputs``: names of the results, in order (``outputs_of``);
    - ``golden(call) -> {name: tensor}``: float64 goldens (integer outputs as integers) of the outputs the
      reference defines for this call (e.g. no ``dpse`` without a pse tensor);
    - ``output_dtypes(named) -> {name: dtype}``: the dtype of each output (goldens are cast to it);
    - ``state`` / ``derive(named) -> {name: tensor}``: the inputs a grad op takes from its forward (softmax
      statistics, forward output), computed with the float64 forward oracle when not given;
    - every parameter of the operator's signature has one role (`roles`), so that none is ever dropped:
      passed to ``oracle`` (the float64 oracle function; its parameter names, after ``renames`` from the
      operator's spelling, decide which), read by the golden itself (``consumed``: name -> how), or without
      effect on the result (``no_effect``: name -> why). Any other parameter set to a non-default value is
      refused by `check` (`UnsupportedParameter`);
    - ``naive(call)`` (optional): the same computation in the input dtype, the reference of the secondary
      (flash-attn) rule of docs/semantics/precision.md; ``golden`` writes it beside the golden for ``compare``;
    - ``written``: inputs the operator updates in place (MlaProlog's kv_cache / kr_cache): outputs too, as
      ``NAME_out`` (`written_output`: their state after the call); the operator runs on copies (``outputs_of``),
      so the inputs written to a golden directory are those of the call.
    """

    name: str
    outputs: tuple[str, ...]
    golden: Callable[[Call], Outputs]
    output_dtypes: DTypes
    state: tuple[str, ...] = ()
    derive: Callable[[Mapping[str, Any]], dict[str, torch.Tensor]] | None = None
    oracle: Callable[..., Any] | None = None
    renames: Mapping[str, str] = field(default_factory=dict)
    consumed: Mapping[str, str] = field(default_factory=dict)
    no_effect: Mapping[str, str] = field(default_factory=dict)
    unsupported: Mapping[str, str] = field(default_factory=dict)
    naive: Callable[[Call], Outputs] | None = None
    written: tuple[str, ...] = ()

    def passed(self) -> tuple[str, ...]:
        """The operator's parameters handed to the oracle (in the operator's spelling)."""
        if self.oracle is None:
            return ()
        accepted = inspect.signature(self.oracle).parameters
        return tuple(n for n in op_signature(self.name).parameters
                     if self.renames.get(n, n) in accepted and n not in self.consumed)

    def roles(self) -> dict[str, str]:
        """Every parameter of the operator -> "oracle", "golden: how", "no effect: why" or "refused: why"."""
        passed = self.passed()
        no_effect = {**COMMON_NO_EFFECT, **self.no_effect}
        out = {}
        for n in op_signature(self.name).parameters:
            if n in passed:
                out[n] = "oracle"
            elif n in self.consumed:
                out[n] = f"golden: {self.consumed[n]}"
            elif n in no_effect:
                out[n] = f"no effect: {no_effect[n]}"
            else:
                out[n] = f"refused: {self.unsupported.get(n, 'the oracle has no such input')}"
        return out

    def check(self, named: Mapping[str, Any]) -> None:
        """Raise `UnsupportedParameter` for the first argument the golden would not honour."""
        params = op_signature(self.name).parameters
        for n, role in self.roles().items():
            if role.startswith("refused") and n in named and not is_default(named[n], params[n].default):
                raise UnsupportedParameter(self.name, n, role.removeprefix("refused: "))
        given = [n for n in self.state if self.consumed.get(n) == FORWARD_STATE and named.get(n) is not None]
        if given and self.derive is not None:
            self._check_state(named, given)

    def _check_state(self, named: Mapping[str, Any], given: list[str]) -> None:
        """A grad golden differentiates the forward of the given inputs: forward statistics / output that are not
        those of that forward (beyond the rounding of a real forward) would make it the golden of another call."""
        derived = self.derive(named)
        for n in given:
            ours, theirs = derived[n].double(), named[n].detach().cpu().double()
            if ours.shape != theirs.shape:
                problem = f"shape {list(theirs.shape)}, the forward's is {list(ours.shape)}"
            elif not torch.allclose(theirs, ours, rtol=STATE_TOLERANCE, atol=STATE_TOLERANCE, equal_nan=True):
                finite = torch.isfinite(ours) & torch.isfinite(theirs)
                worst = (theirs - ours)[finite].abs().max().item() if finite.any() else float("inf")
                problem = f"differs from the forward's by up to {worst:.3g}"
            else:
                continue
            raise UnsupportedParameter(self.name, n, message=(
                f"{n}: {problem}: the golden of {self.name} differentiates the float64 forward of the given "
                "inputs, so give that forward's own output (or leave it out: it is derived)"))

    def oracle_kwargs(self, named: Mapping[str, Any]) -> dict[str, Any]:
        """The arguments of `named` the oracle takes, renamed to its spelling (`check` has refused the others)."""
        passed = self.passed()
        return {self.renames.get(n, n): v for n, v in named.items() if n in passed}


def is_default(value: Any, default: Any) -> bool:
    """Whether an argument leaves a parameter at its default (None counts as default: every tensor default is None)."""
    if value is None or isinstance(value, torch.Tensor):
        return value is None
    if default is inspect.Parameter.empty:
        return False
    if isinstance(value, bool) != isinstance(default, bool):
        return False
    try:
        return bool(value == default)
    except (TypeError, RuntimeError):
        return False


OPERATORS: dict[str, Operator] = {}

# torch_npu spellings (cann_attn.torch_npu) of the operators: `golden --op` / a case file's "op" and `verify --op`
# take them too. The parameters keep the cann_attn spelling of the operator (its public signature).
TORCH_NPU_NAMES = {
    "npu_fusion_attention": "flash_attention_score",
    "npu_fusion_attention_v2": "flash_attention_score",
    "npu_fusion_attention_v3": "flash_attention_score",
    "npu_fusion_attention_grad": "flash_attention_score_grad",
    "npu_fusion_attention_grad_v2": "flash_attention_score_grad",
    "npu_fusion_attention_grad_v3": "flash_attention_score_grad",
    "npu_prompt_flash_attention": "prompt_flash_attention",
    "npu_fused_infer_attention_score": "fused_infer_attention_score",
    "npu_fused_infer_attention_score_v2": "fused_infer_attention_score_v2",
    "npu_incre_flash_attention": "incre_flash_attention",
    "npu_sparse_flash_attention": "sparse_flash_attention",
    "npu_sparse_flash_attention_grad": "sparse_flash_attention_grad",
    "npu_lightning_indexer": "lightning_indexer",
    "npu_sparse_lightning_indexer_grad_kl_loss": "sparse_lightning_indexer_grad_kl_loss",
    "npu_ring_attention_update": "ring_attention_update",
    "npu_attention_update": "attention_update",
}


def canonical_op(name: str) -> str:
    """The cann_attn name of an operator given by its cann_attn or torch_npu name (others unchanged)."""
    return TORCH_NPU_NAMES.get(name, name)


def register_operator(op: Operator) -> None:
    OPERATORS[op.name] = op


def same_dtype(**pairs: str) -> DTypes:
    """Output dtypes: output name -> the input whose dtype it has, or a fixed dtype name ("float32", "int32")."""

    def dtypes(named: Mapping[str, Any]) -> dict[str, torch.dtype]:
        out = {}
        for output, source in pairs.items():
            fixed = getattr(torch, source, None)
            if isinstance(fixed, torch.dtype):
                out[output] = fixed
            elif isinstance(named.get(source), torch.Tensor):
                out[output] = named[source].dtype
        return out

    return dtypes


