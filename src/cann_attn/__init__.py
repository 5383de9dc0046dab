"""cann_attn: Huawei Ascend CANN fused-attention operators, exactly as documented, off the NPU.

Public API: docs/design.md. What every parameter means: docs/semantics/index.md, which the docstrings cite by page.
"""

import inspect as _inspect

from . import library  # noqa: F401  (registers the cann_attn::* custom ops)
from .autograd import dense_indexer_kl_loss, flash_attention, indexer_kl_loss, sparse_attention
from .backends import BackendFallbackWarning
from .errors import AclnnError, ParamInvalidError, ParamNullptrError
from .errors import keywords_checked as _keywords_checked
from .ops.atb_attention import (
    atb_flash_attention,
    atb_flash_attention_unpad,
    atb_paged_attention,
    atb_paged_attention_splitfuse,
)
from .ops.attention_update import AttentionUpdateResult, attention_update
from .ops.dense_indexer import (
    DenseLightningIndexerGradKLLossResult,
    DenseLightningIndexerSoftmaxLseResult,
    dense_lightning_indexer_grad_kl_loss,
    dense_lightning_indexer_softmax_lse,
)
from .ops.flash_attention_score import (
    FlashAttentionScoreResult,
    flash_attention_score,
    flash_attention_var_len_score,
)
from .ops.flash_attention_score_grad import FlashAttentionScoreGradResult, flash_attention_score_grad
from .ops.fused_infer_attention_score import fused_infer_attention_score, fused_infer_attention_score_v2
from .ops.incre_flash_attention import incre_flash_attention
from .ops.lightning_indexer import (
    LightningIndexerResult,
    SparseLightningIndexerGradKLLossResult,
    lightning_indexer,
    sparse_lightning_indexer_grad_kl_loss,
)
from .ops.mla_prolog import MlaPrologResult, mla_prolog
from .ops.prompt_flash_attention import prompt_flash_attention
from .ops.quant_dsa import kv_quant_sparse_flash_attention, quant_lightning_indexer
from .ops.ring_attention_update import RingAttentionUpdateResult, ring_attention_update
from .ops.sparse_flash_attention import (
    SparseFlashAttentionGradResult,
    SparseFlashAttentionResult,
    sparse_flash_attention,
    sparse_flash_attention_grad,
)
from .problem.dropout import drop_mask_numel, gen_drop_mask
from .problem.mask import compressed_mask
from .problem.precision import precision
from .problem.quant import trans_quant_param

__version__ = "0.1.0"

__all__ = [
    "AclnnError",
    "AttentionUpdateResult",
    "BackendFallbackWarning",
    "DenseLightningIndexerGradKLLossResult",
    "DenseLightningIndexerSoftmaxLseResult",
    "FlashAttentionScoreGradResult",
    "FlashAttentionScoreResult",
    "LightningIndexerResult",
    "MlaPrologResult",
    "ParamInvalidError",
    "ParamNullptrError",
    "RingAttentionUpdateResult",
    "SparseFlashAttentionGradResult",
    "SparseFlashAttentionResult",
    "SparseLightningIndexerGradKLLossResult",
    "__version__",
    "atb_flash_attention",
    "atb_flash_attention_unpad",
    "atb_paged_attention",
    "atb_paged_attention_splitfuse",
    "attention_update",
    "compressed_mask",
    "dense_indexer_kl_loss",
    "dense_lightning_indexer_grad_kl_loss",
    "dense_lightning_indexer_softmax_lse",
    "drop_mask_numel",
    "flash_attention",
    "flash_attention_score",
    "flash_attention_score_grad",
    "flash_attention_var_len_score",
    "fused_infer_attention_score",
    "fused_infer_attention_score_v2",
    "gen_drop_mask",
    "incre_flash_attention",
    "indexer_kl_loss",
    "kv_quant_sparse_flash_attention",
    "lightning_indexer",
    "mla_prolog",
    "precision",
    "prompt_flash_attention",
    "quant_lightning_indexer",
    "ring_attention_update",
    "sparse_attention",
    "sparse_flash_attention",
    "sparse_flash_attention_grad",
    "sparse_lightning_indexer_grad_kl_loss",
    "trans_quant_param",
]

# A keyword a public function does not take is refused naming the one the caller most likely meant
# (`scale=` -> scale_value): one wrapper for every function of __all__ (errors.keywords_checked).
for _name in __all__:
    if _inspect.isfunction(globals()[_name]):
        globals()[_name] = _keywords_checked(globals()[_name])
del _name
