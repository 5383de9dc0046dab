"""cann_attn: Huawei Ascend CANN fused-attention operators, exactly as documented, off the NPU.

Public API: DESIGN.md. Semantics: SEMANTICS.md (section numbers are cited in docstrings).
"""

from .autograd import flash_attention
from .errors import AclnnError, ParamInvalidError, ParamNullptrError
from .ops.flash_attention_score import (
    FlashAttentionScoreResult,
    flash_attention_score,
    flash_attention_var_len_score,
)
from .ops.flash_attention_score_grad import FlashAttentionScoreGradResult, flash_attention_score_grad
from .ops.prompt_flash_attention import prompt_flash_attention
from .ops.sparse_flash_attention import (
    SparseFlashAttentionGradResult,
    SparseFlashAttentionResult,
    sparse_flash_attention,
    sparse_flash_attention_grad,
)
from .problem.dropout import drop_mask_numel, gen_drop_mask
from .problem.mask import compressed_mask
from .problem.quant import trans_quant_param

__version__ = "0.1.0"

__all__ = [
    "AclnnError",
    "FlashAttentionScoreGradResult",
    "FlashAttentionScoreResult",
    "ParamInvalidError",
    "ParamNullptrError",
    "SparseFlashAttentionGradResult",
    "SparseFlashAttentionResult",
    "__version__",
    "compressed_mask",
    "drop_mask_numel",
    "flash_attention",
    "flash_attention_score",
    "flash_attention_score_grad",
    "flash_attention_var_len_score",
    "gen_drop_mask",
    "prompt_flash_attention",
    "sparse_flash_attention",
    "sparse_flash_attention_grad",
    "trans_quant_param",
]
