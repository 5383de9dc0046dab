"""Every documented constraint of ring_attention_update and attention_update raises ParamInvalidError /
ParamNullptrError naming the parameter (docs/operators/ring_attention_update.md, attention_update.md), through the
cann_attn names and the torch_npu spellings, and the inputs are never written."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import cann_attn
from cann_attn import ParamInvalidError, ParamNullptrError
from cann_attn import torch_npu as npu

RING_NAMES = ("prev_attn_out", "prev_softmax_max", "prev_softmax_sum", "cur_attn_out", "cur_softmax_max",
              "cur_softmax_sum")


def stats(*shape):
    return torch.rand(*shape).unsqueeze(-1).expand(*shape, 8).contiguous()


def sbh_args(s=4, b=2, n=2, d=8, dtype=torch.float16):
    return dict(prev_attn_out=torch.randn(s, b, n * d).to(dtype), prev_softmax_max=stats(b, n, s),
                prev_softmax_sum=stats(b, n, s) + 1, cur_attn_out=torch.randn(s, b, n * d).to(dtype),
                cur_softmax_max=stats(b, n, s), cur_softmax_sum=stats(b, n, s) + 1)


def tnd_args(t=5, n=2, d=64, dtype=torch.float32):
    return dict(prev_attn_out=torch.randn(t, n, d).to(dtype), prev_softmax_max=stats(t, n),
                prev_softmax_sum=stats(t, n) + 1, cur_attn_out=torch.randn(t, n, d).to(dtype),
                cur_softmax_max=stats(t, n), cur_softmax_sum=stats(t, n) + 1,
                actual_seq_qlen=torch.tensor([0, 2, 5]), input_layout="TND")


def ring(args):
    args = dict(args)
    tensors = [args.pop(k) for k in RING_NAMES]
    return cann_attn.ring_attention_update(*tensors, **args)


def npu_ring(args):
    args = dict(args)
    tensors = [args.pop(k) for k in RING_NAMES]
    return npu.npu_ring_attention_update(*tensors, **args)


def replaced(args, **changes):
    out = dict(args)
    out.update(changes)
    return out


RING_CASES = [
    # (name, builder, error, parameter named in the message)
    ("missing prev_attn_out", lambda: replaced(sbh_args(), prev_attn_out=None), ParamNullptrError, "prev_attn_out"),
    ("missing cur_softmax_sum", lambda: replaced(sbh_args(), cur_softmax_sum=None), ParamNullptrError,
     "cur_softmax_sum"),
    ("bad layout", lambda: replaced(sbh_args(), input_layout="BSH"), ParamInvalidError, "input_layout"),
    ("bad softmax layout", lambda: replaced(tnd_args(), input_softmax_layout="BNSD"), ParamInvalidError,
     "input_softmax_layout"),
    ("int attn", lambda: replaced(sbh_args(), prev_attn_out=torch.ones(4, 2, 16, dtype=torch.int32),
                                  cur_attn_out=torch.ones(4, 2, 16, dtype=torch.int32)),
     ParamInvalidError, "prev_attn_out"),
    ("dtype mismatch", lambda: replaced(sbh_args(), cur_attn_out=torch.randn(4, 2, 16)), ParamInvalidError,
     "cur_attn_out"),
    ("shape mismatch", lambda: replaced(sbh_args(), cur_attn_out=torch.randn(4, 2, 8).half()), ParamInvalidError,
     "cur_attn_out"),
    ("4-D attn", lambda: replaced(sbh_args(), prev_attn_out=torch.randn(4, 2, 2, 8).half(),
                                  cur_attn_out=torch.randn(4, 2, 2, 8).half()), ParamInvalidError, "prev_attn_out"),
    ("fp16 stats", lambda: replaced(sbh_args(), prev_softmax_max=stats(2, 2, 4).half()), ParamInvalidError,
     "prev_softmax_max"),
    ("fp64 stats with fp16 out", lambda: replaced(sbh_args(), cur_softmax_max=stats(2, 2, 4).double()),
     ParamInvalidError, "cur_softmax_max"),
    ("stats shape mismatch", lambda: replaced(sbh_args(), prev_softmax_sum=stats(2, 2, 3)), ParamInvalidError,
     "prev_softmax_sum"),
    ("last dim not 8", lambda: replaced(sbh_args(), **{k: torch.rand(2, 2, 4, 4) for k in RING_NAMES[1:3] +
                                                      RING_NAMES[4:]}), ParamInvalidError, "prev_softmax_max"),
    ("SBH stats 3-D", lambda: replaced(sbh_args(), **{k: stats(2, 4) for k in RING_NAMES[1:3] + RING_NAMES[4:]}),
     ParamInvalidError, "prev_softmax_max"),
    ("SBH stats B/S mismatch", lambda: replaced(sbh_args(), **{k: stats(2, 2, 5) for k in RING_NAMES[1:3] +
                                                              RING_NAMES[4:]}), ParamInvalidError,
     "prev_softmax_max"),
    ("SBH N does not divide H", lambda: replaced(sbh_args(), **{k: stats(2, 3, 4) for k in RING_NAMES[1:3] +
                                                               RING_NAMES[4:]}), ParamInvalidError,
     "prev_softmax_max"),
    ("lanes differ", lambda: replaced(sbh_args(), cur_softmax_sum=torch.rand(2, 2, 4, 8)), ParamInvalidError,
     "cur_softmax_sum"),
    ("TND without lengths", lambda: replaced(tnd_args(), actual_seq_qlen=None), ParamNullptrError,
     "actual_seq_qlen"),
    ("TND lengths int32", lambda: replaced(tnd_args(), actual_seq_qlen=torch.tensor([0, 2, 5], dtype=torch.int32)),
     ParamInvalidError, "actual_seq_qlen"),
    ("TND lengths int32, TND softmax", lambda: replaced(tnd_args(), input_softmax_layout="TND",
                                                        actual_seq_qlen=torch.tensor([5], dtype=torch.int32)),
     ParamInvalidError, "actual_seq_qlen"),
    ("TND lengths without leading 0", lambda: replaced(tnd_args(), actual_seq_qlen=[2, 5]), ParamInvalidError,
     "actual_seq_qlen"),
    ("TND lengths decreasing", lambda: replaced(tnd_args(), actual_seq_qlen=[0, 3, 2, 5]), ParamInvalidError,
     "actual_seq_qlen"),
    ("TND lengths beyond T", lambda: replaced(tnd_args(), actual_seq_qlen=[0, 2, 6]), ParamInvalidError,
     "actual_seq_qlen"),
    ("TND lengths 2-D", lambda: replaced(tnd_args(), actual_seq_qlen=torch.tensor([[0, 2, 5]])), ParamInvalidError,
     "actual_seq_qlen"),
    ("TND D not a multiple of 64", lambda: replaced(tnd_args(), prev_attn_out=torch.randn(5, 2, 32),
                                                    cur_attn_out=torch.randn(5, 2, 32)), ParamInvalidError,
     "prev_attn_out"),
    ("TND D > 768", lambda: replaced(tnd_args(d=832)), ParamInvalidError, "prev_attn_out"),
    ("TND N > 256", lambda: replaced(tnd_args(t=1, n=257)), ParamInvalidError, "prev_attn_out"),
    ("TND stats [B,N,S,8]", lambda: replaced(tnd_args(), **{k: stats(1, 2, 5) for k in RING_NAMES[1:3] +
                                                           RING_NAMES[4:]}), ParamInvalidError, "prev_softmax_max"),
    ("TND stats T mismatch", lambda: replaced(tnd_args(), **{k: stats(4, 2) for k in RING_NAMES[1:3] +
                                                            RING_NAMES[4:]}), ParamInvalidError, "prev_softmax_max"),
    ("not a tensor", lambda: replaced(sbh_args(), cur_softmax_max=[[1.0]]), ParamInvalidError, "cur_softmax_max"),
]


@pytest.mark.parametrize("spelling", [ring, npu_ring], ids=["cann_attn", "torch_npu"])
@pytest.mark.parametrize("name,build,error,param", RING_CASES, ids=[c[0] for c in RING_CASES])
def test_ring_attention_update_rejects(name, build, error, param, spelling):
    args = build()
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(error, match=rf"^\[\d+\] {param}\b"):
        spelling(args)
    for k, v in before.items():
        assert torch.equal(args[k], v), f"{k} was written"


def test_ring_attention_update_sbh_warns_that_lengths_are_ignored():
    args = sbh_args()
    plain = ring(args)
    with pytest.warns(UserWarning, match="actual_seq_qlen"):
        with_lengths = ring(replaced(args, actual_seq_qlen=torch.tensor([0, 4])))
    assert all(torch.equal(a, b) for a, b in zip(plain, with_lengths, strict=True))


def test_ring_attention_update_tnd_softmax_layout_does_not_read_lengths():
    """With token-major statistics the rows pair up token by token; op-plugin's own test passes [2, T]."""
    args = replaced(tnd_args(), input_softmax_layout="TND")
    a = ring(args)
    b = ring(replaced(args, actual_seq_qlen=torch.tensor([2, 5])))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_ring_attention_update_inputs_are_not_written_and_results_are_new():
    for args in (sbh_args(), tnd_args(), replaced(tnd_args(), input_softmax_layout="TND")):
        before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
        result = ring(args)
        for k, v in before.items():
            assert torch.equal(args[k], v)
        for out, src in zip(result, (args["prev_attn_out"], args["prev_softmax_max"], args["prev_softmax_sum"]),
                            strict=True):
            assert out.shape == src.shape and out.dtype == src.dtype
            assert out.data_ptr() != src.data_ptr()


def test_ring_attention_update_empty():
    for args in (sbh_args(s=0), tnd_args(t=0)):
        if args.get("input_layout") == "TND":
            args["actual_seq_qlen"] = [0]
        out, mx, sm = ring(args)
        assert out.numel() == 0 and mx.numel() == 0 and sm.numel() == 0


# ------------------------------------------------------------------------------------------------ attention_update
def au_args(k=2, rows=3, d=16, dtype=torch.float32):
    return dict(lse=[torch.randn(rows) for _ in range(k)], local_out=[torch.randn(rows, d).to(dtype)
                                                                       for _ in range(k)], update_type=1)


AU_CASES = [
    ("lse None", lambda: replaced(au_args(), lse=None), ParamNullptrError, "lse"),
    ("local_out None", lambda: replaced(au_args(), local_out=None), ParamNullptrError, "local_out"),
    ("lse item None", lambda: replaced(au_args(), lse=[torch.randn(3), None]), ParamNullptrError, r"lse\[1\]"),
    ("local_out item None", lambda: replaced(au_args(), local_out=[None, torch.randn(3, 16)]), ParamNullptrError,
     r"local_out\[0\]"),
    ("lse a tensor", lambda: replaced(au_args(), lse=torch.randn(2, 3)), ParamInvalidError, "lse"),
    ("lse item not a tensor", lambda: replaced(au_args(), lse=[torch.randn(3), 1.0]), ParamInvalidError,
     r"lse\[1\]"),
    ("no parts", lambda: replaced(au_args(), lse=[], local_out=[]), ParamInvalidError, "lse"),
    ("17 parts", lambda: au_args(k=17), ParamInvalidError, "lse"),
    ("length mismatch", lambda: replaced(au_args(), local_out=[torch.randn(3, 16)]), ParamInvalidError, "local_out"),
    ("update_type 2", lambda: replaced(au_args(), update_type=2), ParamInvalidError, "update_type"),
    ("update_type bool", lambda: replaced(au_args(), update_type=True), ParamInvalidError, "update_type"),
    ("update_type float", lambda: replaced(au_args(), update_type=1.0), ParamInvalidError, "update_type"),
    ("int out", lambda: replaced(au_args(), local_out=[torch.ones(3, 16, dtype=torch.int32)] * 2), ParamInvalidError,
     r"local_out\[0\]"),
    ("3-D out", lambda: replaced(au_args(), local_out=[torch.randn(3, 2, 16)] * 2), ParamInvalidError,
     r"local_out\[0\]"),
    ("head dim 4", lambda: au_args(d=4), ParamInvalidError, r"local_out\[0\]"),
    ("head dim 12", lambda: au_args(d=12), ParamInvalidError, r"local_out\[0\]"),
    ("head dim 520", lambda: au_args(d=520), ParamInvalidError, r"local_out\[0\]"),
    ("out dtype mismatch", lambda: replaced(au_args(), local_out=[torch.randn(3, 16), torch.randn(3, 16).half()]),
     ParamInvalidError, r"local_out\[1\]"),
    ("out shape mismatch", lambda: replaced(au_args(), local_out=[torch.randn(3, 16), torch.randn(4, 16)]),
     ParamInvalidError, r"local_out\[1\]"),
    ("lse fp16", lambda: replaced(au_args(), lse=[torch.randn(3), torch.randn(3).half()]), ParamInvalidError,
     r"lse\[1\]"),
    ("lse 2-D", lambda: replaced(au_args(), lse=[torch.randn(3, 1)] * 2), ParamInvalidError, r"lse\[0\]"),
    ("lse rows mismatch", lambda: replaced(au_args(), lse=[torch.randn(3), torch.randn(4)]), ParamInvalidError,
     r"lse\[1\]"),
]


def au(args):
    return cann_attn.attention_update(args["lse"], args["local_out"], args["update_type"])


def npu_au(args):
    return npu.npu_attention_update(args["lse"], args["local_out"], args["update_type"])


@pytest.mark.parametrize("spelling", [au, npu_au], ids=["cann_attn", "torch_npu"])
@pytest.mark.parametrize("name,build,error,param", AU_CASES, ids=[c[0] for c in AU_CASES])
def test_attention_update_rejects(name, build, error, param, spelling):
    args = build()
    tensors = [t for key in ("lse", "local_out") if isinstance(args[key], list) for t in args[key]
               if isinstance(t, torch.Tensor)]
    before = [t.clone() for t in tensors]
    with pytest.raises(error, match=rf"^\[\d+\] {param}"):
        spelling(args)
    assert all(torch.equal(a, b) for a, b in zip(before, tensors, strict=True))


def test_attention_update_limits_are_inclusive():
    for k, d in ((1, 8), (16, 512)):
        out, lse = au(au_args(k=k, d=d))
        assert out.shape == (3, d) and lse.shape == (3,)


# ------------------------------------------------------------------------------------------ torch_npu signatures
def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_torch_npu_signatures_follow_the_op_plugin_schema():
    """op_plugin_functions.yaml: npu_ring_attention_update(Tensor prev_attn_out, Tensor prev_softmax_max,
    Tensor prev_softmax_sum, Tensor cur_attn_out, Tensor cur_softmax_max, Tensor cur_softmax_sum, *,
    Tensor? actual_seq_qlen=None, str input_layout="SBH", str input_softmax_layout="") -> (Tensor, Tensor, Tensor);
    npu_attention_update(Tensor[] lse, Tensor[] local_out, int update_type) -> (Tensor, Tensor)."""
    pos, kw, empty = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.empty
    assert _params(npu.npu_ring_attention_update) == [(n, pos, empty) for n in RING_NAMES] + [
        ("actual_seq_qlen", kw, None), ("input_layout", kw, "SBH"), ("input_softmax_layout", kw, "")]
    assert _params(npu.npu_attention_update) == [("lse", pos, empty), ("local_out", pos, empty),
                                                 ("update_type", pos, empty)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(npu_ring(sbh_args())) == 3
    assert len(npu_au(au_args())) == 2
    assert npu_au(replaced(au_args(), update_type=0))[1] is None
