"""Differentiable entry points pairing each forward operator with its grad operator (docs/design.md).

Each is one small torch.autograd.Function over the operators of `cann_attn.ops`. While torch.compile traces,
those operators route to their custom ops (`traceable.py`), so `torch.compile(fullgraph=True)` traces a model that
calls these functions without a graph break.

The grad operators are first derivatives only: every backward is `once_differentiable`, so differentiating a
gradient (create_graph=True, gradient penalties) raises instead of silently dropping the second-order terms.
Whatever the backward reads again is fixed at the forward: tensors through `save_for_backward` (an in-place change
raises autograd's version error), lengths / prefix / start indices as copies.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from . import library
from .backends import resolve_backend
from .backends.triton.dense_plan import dense_unsupported
from .errors import ParamInvalidError, require, require_bool
from .ops.dense_indexer import dense_lightning_indexer_grad_kl_loss
from .ops.fa_problem import build_problem
from .ops.flash_attention_score import FORWARD_MODES, INT_MAX, flash_attention_score
from .ops.flash_attention_score_grad import flash_attention_score_grad
from .ops.lightning_indexer import sparse_lightning_indexer_grad_kl_loss
from .ops.sparse_flash_attention import INT64_MAX, sparse_flash_attention, sparse_flash_attention_grad
from .problem.dropout import drop_mask_numel, gen_drop_mask, keep_prob_of
from .problem.lengths import IntList


def _distinct(*tensors) -> tuple[list, tuple[int, ...]]:
    """Differentiable inputs with repeats replaced by None, and for each input the position of its first occurrence
    (-1 for a first occurrence). torch.compile cannot trace an autograd.Function given one tensor twice, and DSA
    passes its latent as both key and value."""
    aliases = tuple(next((j for j in range(i) if t is not None and tensors[j] is t), -1) for i, t in enumerate(tensors))
    return [None if j >= 0 else t for t, j in zip(tensors, aliases, strict=True)], aliases


def _restored(tensors, aliases: tuple[int, ...]) -> list:
    """The inputs as the caller gave them (inverse of `_distinct`)."""
    return [tensors[j] if j >= 0 else t for t, j in zip(tensors, aliases, strict=True)]


def _frozen(value):
    """A copy of a length / prefix / start-index argument that the backward reads again: changing the caller's list
    or tensor in place after the forward must not change the backward's problem."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(value)
    return value


def _folded(grads, aliases: tuple[int, ...]) -> list:
    """Gradients per distinct input: a repeated input's gradients are summed into its first occurrence, as autograd
    sums them for a tensor passed twice."""
    grads = list(grads)
    for i, j in enumerate(aliases):
        if j >= 0:
            if grads[i] is not None:
                grads[j] = grads[i] if grads[j] is None else grads[j] + grads[i]
            grads[i] = None
    return grads


class _FlashAttentionFunction(torch.autograd.Function):
    """Saves exactly what FlashAttentionScoreGradV2 consumes: inputs, output, softmax statistics, drop mask."""

    @staticmethod
    def forward(ctx, query, key, value, pse, sink, drop_mask, atten_mask, options: dict, aliases: tuple[int, ...]):
        query, key, value, pse = _restored((query, key, value, pse), aliases)
        result = flash_attention_score(query, key, value, pse=pse, drop_mask=drop_mask, atten_mask=atten_mask,
                                       sink=sink, **options)
        ctx.save_for_backward(query, key, value, pse, sink, drop_mask, atten_mask, result.attention_out,
                              result.softmax_max, result.softmax_sum)
        ctx.options, ctx.aliases = options, aliases
        return result.attention_out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        query, key, value, pse, sink, drop_mask, atten_mask, out, softmax_max, softmax_sum = ctx.saved_tensors
        grads = flash_attention_score_grad(
            query, key, value, dy.contiguous(), pse=pse, drop_mask=drop_mask, atten_mask=atten_mask,
            softmax_max=softmax_max, softmax_sum=softmax_sum, attention_in=out, sink=sink, **ctx.options,
        )
        dpse = grads.dpse if pse is not None and ctx.needs_input_grad[3] else None
        dsink = grads.dsink if sink is not None and ctx.needs_input_grad[4] else None
        return *_folded((grads.dq, grads.dk, grads.dv, dpse), ctx.aliases), dsink, None, None, None, None


def flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    *,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    q_start_idx=None,
    kv_start_idx=None,
    scale_value: float = 1.0,
    keep_prob: float = 1.0,
    dropout_p: float | None = None,
    pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX,
    inner_precise: int = 0,
    sparse_mode: int = 0,
    pse_type: int = 1,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Differentiable FlashAttentionScore: returns attention_out; gradients flow to query, key, value, a
    type 0/1 pse tensor and a `sink` ([N1] float32, one softmax logit per query head, docs/semantics/sinks.md)
    through FlashAttentionScoreGradV2.

    Takes `flash_attention_score`'s parameters except `drop_mask`: with `keep_prob < 1` (or `dropout_p =
    1 - keep_prob`, given instead of keep_prob, not with it) a bit-packed mask is drawn from `generator`
    (docs/semantics/dropout.md), saved and reused by the backward, so a seeded generator makes forward and backward
    reproducible. Every argument is checked before the mask is drawn: a call that raises leaves the generator as
    it was.
    """
    keep_prob = keep_prob_of(keep_prob, dropout_p)
    require(generator is None or isinstance(generator, torch.Generator), "generator", "a torch.Generator or None",
            generator)
    prefix, actual_seq_qlen, actual_seq_kvlen, q_start_idx, kv_start_idx = (
        _frozen(v) for v in (prefix, actual_seq_qlen, actual_seq_kvlen, q_start_idx, kv_start_idx))
    drop_mask = None
    if 0.0 < keep_prob < 1.0:
        # Validated first, so that bad input raises the operator's own errors (docs/semantics/errors.md) as it does
        # without dropout; the per-sequence lengths then size the mask for every layout (dense: B equal sequences).
        problem, shapes = build_problem(
            query, key, value, head_num, input_layout, pse=pse, drop_mask=None, atten_mask=atten_mask, prefix=prefix,
            actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, q_start_idx=q_start_idx,
            kv_start_idx=kv_start_idx, scale_value=scale_value, keep_prob=1.0, pre_tokens=pre_tokens,
            next_tokens=next_tokens, inner_precise=inner_precise, sparse_mode=sparse_mode, pse_type=pse_type,
            softmax_layout=softmax_layout, allowed_modes=FORWARD_MODES, sink=sink)
        resolve_backend(backend, query.device, "flash_attention_score", warn=False,
                        unsupported=lambda: dense_unsupported(problem, query.dtype,
                                                              tensors={"q": query, "k": key, "v": value}))
        numel = drop_mask_numel(head_num, actual_seq_qlen=list(accumulate(shapes.seq_q)),
                                actual_seq_kvlen=list(accumulate(shapes.seq_kv)))
        drop_mask = gen_drop_mask(numel, keep_prob, generator=generator, device=query.device)
    options = dict(
        head_num=head_num, input_layout=input_layout, padding_mask=padding_mask, prefix=prefix,
        actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen,
        q_start_idx=q_start_idx, kv_start_idx=kv_start_idx, scale_value=scale_value, keep_prob=keep_prob,
        pre_tokens=pre_tokens, next_tokens=next_tokens, inner_precise=inner_precise, sparse_mode=sparse_mode,
        pse_type=pse_type, softmax_layout=softmax_layout, backend=backend,
    )
    inputs, aliases = _distinct(query, key, value, pse)
    return _FlashAttentionFunction.apply(*inputs, sink, drop_mask, atten_mask, options, aliases)


class _SparseAttentionFunction(torch.autograd.Function):
    """Pairs SparseFlashAttention with SparseFlashAttentionGrad; saves inputs, output and softmax statistics."""

    @staticmethod
    def forward(ctx, query, key, value, query_rope, key_rope, sinks, sparse_indices, scale_value, options: dict,
                aliases: tuple[int, ...]):
        query, key, value, query_rope, key_rope = _restored((query, key, value, query_rope, key_rope), aliases)
        forward_options = {k: v for k, v in options.items() if k != "deterministic"}
        result = sparse_flash_attention(query, key, value, sparse_indices, scale_value, query_rope=query_rope,
                                        key_rope=key_rope, sinks=sinks, **forward_options)
        ctx.save_for_backward(query, key, value, query_rope, key_rope, sinks, sparse_indices, result.attention_out,
                              result.softmax_max, result.softmax_sum)
        ctx.scale_value, ctx.options, ctx.aliases = scale_value, options, aliases
        return result.attention_out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        query, key, value, query_rope, key_rope, sinks, sparse_indices, out, softmax_max, softmax_sum = \
            ctx.saved_tensors
        result = sparse_flash_attention_grad(
            query, key, value, sparse_indices, d_out.contiguous(), out, softmax_max, softmax_sum, ctx.scale_value,
            query_rope=query_rope, key_rope=key_rope, sinks=sinks, **ctx.options,
        )
        grads = _folded((result.d_query, result.d_key, result.d_value, result.d_query_rope, result.d_key_rope),
                        ctx.aliases)
        d_sinks = result.d_sinks if sinks is not None and ctx.needs_input_grad[5] else None
        return *grads, d_sinks, None, None, None, None


def sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sparse_indices: torch.Tensor,
    scale_value: float,
    *,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    actual_seq_lengths_query=None,
    actual_seq_lengths_kv=None,
    sparse_block_size: int = 1,
    layout: str = "BSND",
    sparse_mode: int = 3,
    pre_tokens: int = INT64_MAX,
    next_tokens: int = INT64_MAX,
    deterministic: bool = False,
    backend: str = "auto",
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differentiable DSA sparse attention (docs/operators/sparse_flash_attention.md): returns attention_out; gradients
    flow to query, key, value, query_rope and key_rope through SparseFlashAttentionGrad. DSA passes the same latent
    as key and value; autograd then adds both gradients. `deterministic` is forwarded to the grad op. `sinks`
    (float32 [N1], one softmax logit per query head, docs/semantics/sinks.md) is a leaf that receives its gradient
    too."""
    options = dict(
        actual_seq_lengths_query=_frozen(actual_seq_lengths_query),
        actual_seq_lengths_kv=_frozen(actual_seq_lengths_kv), sparse_block_size=sparse_block_size, layout=layout,
        sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens, backend=backend,
    )
    options["deterministic"] = require_bool(deterministic, "deterministic")  # checked now, used by the backward
    inputs, aliases = _distinct(query, key, value, query_rope, key_rope)
    return _SparseAttentionFunction.apply(*inputs, sinks, sparse_indices, scale_value, options, aliases)


class _IndexerKLLossFunction(torch.autograd.Function):
    """Forward and gradients come from one SparseLightningIndexerGradKLLoss call; backward scales them."""

    @staticmethod
    def forward(ctx, query_index, key_index, weights, query, key, sparse_indices, softmax_max, softmax_sum,
                scale_value, options: dict, mean: bool):
        result = sparse_lightning_indexer_grad_kl_loss(query, key, query_index, key_index, weights, sparse_indices,
                                                       softmax_max, softmax_sum, scale_value, **options)
        loss = result.loss.reshape(())
        # A 0-d tensor max(1, tokens with a valid key) from a custom op (traceable), counted after the op has
        # validated the inputs, so bad input raises the op's own errors.
        divisor = library.count_tokens_with_keys(
            query_index, key_index, sparse_indices, options["layout"], options["sparse_mode"],
            options["actual_seq_lengths_query"], options["actual_seq_lengths_key"]) if mean else None
        ctx.save_for_backward(result.d_query_index, result.d_key_index, result.d_weights, divisor)
        return loss if divisor is None else loss / divisor.to(device=loss.device, dtype=loss.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        d_qi, d_ki, d_w, divisor = ctx.saved_tensors
        factor = grad_loss if divisor is None else grad_loss / divisor.to(device=grad_loss.device,
                                                                           dtype=grad_loss.dtype)
        return (d_qi * factor).to(d_qi.dtype), (d_ki * factor).to(d_ki.dtype), (d_w * factor).to(d_w.dtype), \
            None, None, None, None, None, None, None, None


def indexer_kl_loss(
    query: torch.Tensor,
    key: torch.Tensor,
    query_index: torch.Tensor,
    key_index: torch.Tensor,
    weights: torch.Tensor,
    sparse_indices: torch.Tensor,
    softmax_max: torch.Tensor,
    softmax_sum: torch.Tensor,
    scale_value: float,
    *,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    actual_seq_lengths_query=None,
    actual_seq_lengths_key=None,
    layout: str = "BSND",
    sparse_mode: int = 3,
    pre_tokens: int = INT64_MAX,
    next_tokens: int = INT64_MAX,
    deterministic: bool = False,
    reduction: str = "sum",
    backend: str = "auto",
) -> torch.Tensor:
    """Differentiable indexer KL loss (docs/operators/lightning_indexer.md): a scalar; gradients flow to query_index,
    key_index and weights (the op's documented gradients: dI = q - p). `reduction="mean"` divides the summed loss by
    the number of query tokens with at least one valid selected key. query/key/rope and the statistics get no
    gradient."""
    if reduction not in ("sum", "mean"):
        raise ParamInvalidError(f"reduction: expected 'sum' or 'mean', got {reduction!r}")
    options = dict(query_rope=query_rope, key_rope=key_rope, actual_seq_lengths_query=actual_seq_lengths_query,
                   actual_seq_lengths_key=actual_seq_lengths_key, layout=layout, sparse_mode=sparse_mode,
                   pre_tokens=pre_tokens, next_tokens=next_tokens, deterministic=deterministic, backend=backend)
    # query/key and the statistics get no gradient (detached); None passes through for the op to report.
    query, key, softmax_max, softmax_sum = (t.detach() if isinstance(t, torch.Tensor) else t
                                            for t in (query, key, softmax_max, softmax_sum))
    return _IndexerKLLossFunction.apply(query_index, key_index, weights, query, key, sparse_indices, softmax_max,
                                        softmax_sum, scale_value, options, reduction == "mean")


class _DenseIndexerKLLossFunction(torch.autograd.Function):
    """Forward and gradients from one DenseLightningIndexerGradKLLoss call; backward scales them."""

    @staticmethod
    def forward(ctx, query_index, key_index, weights, query, key, softmax_max, softmax_sum, softmax_max_index,
                softmax_sum_index, scale_value, options: dict):
        result = dense_lightning_indexer_grad_kl_loss(query, key, query_index, key_index, weights, softmax_max,
                                                      softmax_sum, softmax_max_index, softmax_sum_index, scale_value,
                                                      **options)
        ctx.save_for_backward(result.d_query_index, result.d_key_index, result.d_weights)
        return result.loss.reshape(())

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        d_qi, d_ki, d_w = ctx.saved_tensors
        return (d_qi * grad_loss).to(d_qi.dtype), (d_ki * grad_loss).to(d_ki.dtype), \
            (d_w * grad_loss).to(d_w.dtype), None, None, None, None, None, None, None, None


def dense_indexer_kl_loss(
    query: torch.Tensor,
    key: torch.Tensor,
    query_index: torch.Tensor,
    key_index: torch.Tensor,
    weights: torch.Tensor,
    softmax_max: torch.Tensor,
    softmax_sum: torch.Tensor,
    softmax_max_index: torch.Tensor,
    softmax_sum_index: torch.Tensor,
    scale_value: float,
    *,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    actual_seq_qlen: IntList | None = None,
    actual_seq_klen: IntList | None = None,
    layout: str = "BSND",
    sparse_mode: int = 3,
    pre_tokens: int = INT64_MAX,
    next_tokens: int = INT64_MAX,
) -> torch.Tensor:
    """Differentiable dense indexer KL loss (docs/operators/dense_lightning_indexer.md): the summed loss as a scalar
    whose backward gives DenseLightningIndexerGradKLLoss's gradients (dI = q - p) to query_index, key_index and
    weights. query/key/rope and the four statistics get no gradient."""
    options = dict(query_rope=query_rope, key_rope=key_rope, actual_seq_qlen=actual_seq_qlen,
                   actual_seq_klen=actual_seq_klen, layout=layout, sparse_mode=sparse_mode, pre_tokens=pre_tokens,
                   next_tokens=next_tokens)
    query, key, softmax_max, softmax_sum, softmax_max_index, softmax_sum_index = (
        t.detach() if isinstance(t, torch.Tensor) else t
        for t in (query, key, softmax_max, softmax_sum, softmax_max_index, softmax_sum_index))
    return _DenseIndexerKLLossFunction.apply(query_index, key_index, weights, query, key, softmax_max, softmax_sum,
                                             softmax_max_index, softmax_sum_index, scale_value, options)
