"""Test-side handle on the independent oracle (``import oracle`` in tests) and the precision rules."""

from cann_attn.testing.oracle import *  # noqa: F403
from cann_attn.testing.oracle import (
    FLT_MAX,
    INT_MAX,
    LAYOUTS,
    cum_to_lengths,
    fa_forward_oracle,
    make_compressed_mask,
    naive_same_dtype_forward,
    pack_drop_mask,
    unpack_drop_mask,
)
from cann_attn.testing.precision import (
    ASCEND_THRESHOLDS,
    EPS,
    ascend_rule,
    assert_close_to_oracle,
    flash_attn_rule,
    mere_mare,
)

__all__ = [
    "ASCEND_THRESHOLDS",
    "EPS",
    "FLT_MAX",
    "INT_MAX",
    "LAYOUTS",
    "ascend_rule",
    "assert_close_to_oracle",
    "cum_to_lengths",
    "fa_forward_oracle",
    "flash_attn_rule",
    "make_compressed_mask",
    "mere_mare",
    "naive_same_dtype_forward",
    "pack_drop_mask",
    "unpack_drop_mask",
]
