"""torch_npu.npu_format_cast / npu_format_cast_ / get_npu_format and torch_npu.Format (docs/guides/torch_npu.md,
"Storage formats"): the logical tensor (shape, dtype, values) is unchanged, the format is recorded and read back, a
tensor never cast has its base format, unknown formats are refused naming the parameter; operators read an
NZ-cast tensor like the tensor it was cast from.

The format values are op-plugin's table (docs/zh/custom_APIs/torch_npu/(beta)torch_npu-npu_format_cast.md); the
calls are the callers': vllm-ascend vllm_ascend/attention/mla_v1.py:1009 (``npu_format_cast(wd_qkv, 29)``) and
:911 (``npu_format_cast(weight, ACL_FORMAT_FRACTAL_ND)``), the op-plugin example ``npu_format_cast(x, 2)`` on a
4-D tensor whose format was 0.
"""

from __future__ import annotations

import pytest
import torch

import cann_attn
import cann_attn.torch_npu as torch_npu
from cann_attn import ParamInvalidError
from cann_attn.problem.nz import to_nz

DOCUMENTED = {"UNDEFINED": -1, "NCHW": 0, "NHWC": 1, "ND": 2, "NC1HWC0": 3, "FRACTAL_Z": 4, "NC1HWC0_C04": 12,
              "HWCN": 16, "NDHWC": 27, "FRACTAL_NZ": 29, "NCDHW": 30, "NDC1HWC0": 32, "FRACTAL_Z_3D": 33, "NC": 35,
              "NCL": 47}


def test_format_enum_is_the_documented_table():
    assert {f.name: int(f) for f in torch_npu.Format} == DOCUMENTED


@pytest.mark.parametrize("shape,base", [((2, 3, 4, 5), 0), ((2, 3, 4, 5, 6), 30), ((7, 8), 2), ((3,), 2)])
def test_base_format_by_rank(shape, base):
    assert torch_npu.get_npu_format(torch.zeros(shape)) == base


@pytest.mark.parametrize("acl_format", [29, torch_npu.Format.FRACTAL_NZ, 2, torch_npu.Format.NHWC, 4])
def test_cast_keeps_the_logical_tensor_and_records_the_format(acl_format):
    x = torch.randn(2, 3, 32, 16, generator=torch.Generator().manual_seed(0)).bfloat16()
    y = torch_npu.npu_format_cast(x, acl_format)
    assert y.shape == x.shape and y.dtype == x.dtype and torch.equal(y, x)
    assert torch_npu.get_npu_format(y) == int(acl_format)
    assert torch_npu.get_npu_format(x) == 0  # a new tensor: the input keeps its format
    if int(acl_format) != 0:
        assert y is not x
        y.add_(1)  # not a view of the input
        assert not torch.equal(y, x)


def test_cast_to_the_same_format_returns_the_input_and_back_to_nd():
    x = torch.zeros(4, 4)
    assert torch_npu.npu_format_cast(x, 2) is x
    nz = torch_npu.npu_format_cast(x, 29)
    assert torch_npu.get_npu_format(torch_npu.npu_format_cast(nz, torch_npu.Format.ND)) == 2


def test_nz_of_fewer_than_two_dims_is_nd():
    assert torch_npu.get_npu_format(torch_npu.npu_format_cast(torch.zeros(5), 29)) == 2


def test_in_place_cast_from_int_format_and_tensor():
    x = torch.rand(2, 3, 4, 5)
    assert torch_npu.get_npu_format(torch_npu.npu_format_cast_(x, 2)) == 2
    assert torch_npu.get_npu_format(torch_npu.npu_format_cast_(x, torch_npu.Format.NHWC)) == 1
    other = torch_npu.npu_format_cast(torch.zeros(3, 3), 29)
    assert torch_npu.npu_format_cast_(x, other) is x and torch_npu.get_npu_format(x) == 29


def test_cast_is_differentiable():
    x = torch.randn(4, 4, requires_grad=True)
    torch_npu.npu_format_cast(x, 29).sum().backward()
    assert torch.equal(x.grad, torch.ones(4, 4))


@pytest.mark.parametrize("bad", [5, 100, -1, 12, "ND", 2.0, True, None])
def test_unknown_formats_name_acl_format(bad):
    with pytest.raises(ParamInvalidError, match="acl_format"):
        torch_npu.npu_format_cast(torch.zeros(2, 2), bad)
    with pytest.raises(ParamInvalidError, match="src"):
        torch_npu.npu_format_cast_(torch.zeros(2, 2), bad)


def test_bad_customize_dtype_and_self():
    with pytest.raises(ParamInvalidError, match="customize_dtype"):
        torch_npu.npu_format_cast(torch.zeros(2, 2), 29, customize_dtype="int32")
    assert torch_npu.get_npu_format(torch_npu.npu_format_cast(torch.zeros(32, 32, dtype=torch.int32), 29,
                                                              customize_dtype=3)) == 29
    with pytest.raises(ParamInvalidError, match="self"):
        torch_npu.npu_format_cast([1, 2], 29)


def test_fia_reads_an_nz_cast_cache_like_the_original():
    """An MLA NZ cache view cast to FRACTAL_NZ (format tag only) gives the same bits as the uncast view."""
    g = torch.Generator().manual_seed(3)
    latent = torch.randn(4, 16, 1, 512, generator=g).bfloat16()
    rope = torch.randn(4, 16, 1, 64, generator=g).bfloat16()
    key, key_rope = to_nz(latent), to_nz(rope)
    q, qr = torch.randn(2, 1, 2, 512, generator=g).bfloat16(), torch.randn(2, 1, 2, 64, generator=g).bfloat16()
    kw = dict(query_rope=qr, num_query_heads=2, num_key_value_heads=1, input_layout="BSND", softmax_scale=0.1,
              block_table=torch.tensor([[0, 2], [3, 1]], dtype=torch.int32), block_size=16, actual_seq_kvlen=[20, 9])
    plain = cann_attn.fused_infer_attention_score_v2(q, key, key, key_rope=key_rope, **kw)[0]
    cast = torch_npu.npu_format_cast(key, 29)
    tagged = cann_attn.fused_infer_attention_score_v2(q, cast, cast, key_rope=torch_npu.npu_format_cast(key_rope, 29),
                                                      **kw)[0]
    assert torch.equal(plain, tagged)


def test_install_exposes_the_format_calls():
    with torch_npu.installed():
        import torch_npu as installed_npu

        assert installed_npu.npu_format_cast is torch_npu.npu_format_cast
        assert installed_npu.Format.FRACTAL_NZ == 29
        assert installed_npu.get_npu_format(torch.zeros(2, 3, 4, 5)) == 0
        through_ops = torch.ops.npu.npu_format_cast(torch.ones(2, 2), 29)
        assert installed_npu.get_npu_format(through_ops) == 29 and torch.equal(through_ops, torch.ones(2, 2))
