"""Built-in verification cases for ``cann-attn verify`` and the golden rules of ``cann-attn golden``, one module per
operator family, each family's cases beside its golden rule:

- ``_common.py``: the registries (`CASES`, `OPERATORS`), `Case`, `Call`, `Operator`, arguments by name (`bind`,
  `by_name`, `tensor_parameters`) and the input helpers every family shares;
- ``fa.py`` (FlashAttentionScore / VarLen forward), ``fa_grad.py`` (FlashAttentionScoreGrad), ``pfa.py``
  (PromptFlashAttention), ``fia.py`` (FusedInferAttentionScore v1/v2, IncreFlashAttention), ``dsa.py``
  (SparseFlashAttention(+Grad), LightningIndexer, the KL-loss grad), ``merge.py`` (RingAttentionUpdate,
  AttentionUpdate), ``mla_prolog.py`` (MlaProlog: the caches it writes in place are outputs too, ``written``).

Adding a family: add one module ``cli/cases/<family>.py`` (a name without a leading underscore). Every such module
of this package is imported here, in name order, so its ``register_operator(Operator(...))`` (what ``golden`` needs)
and ``register(case, ...)`` (what ``verify`` runs) calls take effect; nothing else needs editing. Import what you
need from ``._common`` (and another family's builders from its module, as ``fa_grad.py`` does from ``fa.py``).
See docs/guides/golden.md.

A case is a small `Case` record:

- ``op``: the operator's public name in ``cann_attn`` (``verify --op`` filters on it; cases whose operator
  is not importable from ``cann_attn`` yet are skipped, so cases may be registered before the operator lands);
- ``name``: unique within the operator; ``dtype`` and ``shape``: what the results table shows;
- ``build(generator) -> Call``: the inputs, built on the CPU from the given seeded ``torch.Generator`` only
  (``verify`` moves the tensors to ``--device`` for the operator and keeps the CPU copy for the oracle);
- ``run(call) -> {output name: tensor}``: the operator call (timed by ``verify``);
- ``oracle(call) -> {output name: tensor}``: the golden outputs (float64); every output the oracle returns is
  compared with the operator's output of the same name by the Ascend rule of docs/semantics/precision.md, with the
  threshold of the operator output's dtype;
- ``quick``: whether ``verify --quick`` runs it (keep quick cases small: the oracles materialise S x S);
- ``naive(call) -> {output name: tensor}`` (optional): the same computation in the input dtype; an output the
  Ascend rule rejects still passes when the flash-attn rule accepts it against this reference (the secondary
  rule of docs/semantics/precision.md, as in the tests). Only computed when needed.

Adding cases for a new operator (grad, PFA, DSA) takes one function and one ``register`` call::

    def _grad_case(name, cfg, **kwargs) -> Case:
        def build(gen):
            fwd = fa_inputs(gen, cfg, kwargs)              # reuse the FA input builders of fa.py
            dy = randn(gen, fwd.args[0].shape, cfg.dtype)
            return Call((*fwd.args[:3], dy, *fwd.args[3:]), fwd.kwargs)

        return Case(
            op="flash_attention_score_grad", name=name, dtype=cfg.dtype, shape=cfg.summary(),
            build=build,
            run=outputs_of("flash_attention_score_grad", ("dq", "dk", "dv")),
            oracle=lambda call: my_grad_oracle(*call.args, **call.kwargs),  # {"dq": .., "dk": .., "dv": ..}
        )

    register(_grad_case("bsh_gqa", FAConfig("BSH", torch.float16, batch=2, heads_q=8, heads_kv=2)))

``outputs_of(op_name, names)`` calls ``cann_attn.<op_name>(*call.args, **call.kwargs)`` and names the elements
of its (NamedTuple or tuple or single tensor) result; ``Call`` holds positional and keyword arguments.

``OPERATORS`` describes every operator for ``cann-attn golden``, by parameter name: its output names, the
float64 golden of a call, the output dtypes, and for grad operators the inputs taken from the forward (derived
with the forward oracle). ``bind(op, named)`` / ``by_name(op, call)`` convert between arguments by name and a
``Call``; the cases of PromptFlashAttention and of the DSA operators are built that way and use these goldens.
"""

from __future__ import annotations

import importlib
import pkgutil

from ._common import (
    CASES,
    OPERATORS,
    TORCH_NPU_NAMES,
    Call,
    Case,
    Operator,
    UnsupportedParameter,
    bind,
    by_name,
    canonical_op,
    cases_for,
    op_signature,
    outputs_of,
    randn,
    register,
    register_operator,
    tensor_parameters,
    written_output,
)

FAMILIES = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))
for _family in FAMILIES:
    importlib.import_module(f"{__name__}.{_family}")

from .dsa import random_sparse_indices  # noqa: E402  (the case-file generator sparse_indices uses it)
from .fa import FAConfig, fa_case, fa_inputs  # noqa: E402

__all__ = [
    "CASES",
    "FAMILIES",
    "OPERATORS",
    "TORCH_NPU_NAMES",
    "Call",
    "Case",
    "FAConfig",
    "Operator",
    "UnsupportedParameter",
    "bind",
    "by_name",
    "canonical_op",
    "cases_for",
    "fa_case",
    "fa_inputs",
    "op_signature",
    "outputs_of",
    "randn",
    "random_sparse_indices",
    "register",
    "register_operator",
    "tensor_parameters",
    "written_output",
]
