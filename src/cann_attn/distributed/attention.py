"""Context-parallel FlashAttention: `flash_attention` over sequence shards (docs/guides/context_parallel.md)."""

from __future__ import annotations

from itertools import accumulate

import torch

from ..autograd import _frozen
from ..errors import ParamInvalidError, require
from ..ops.fa_problem import build_problem, start_index
from ..ops.flash_attention_score import FORWARD_MODES, INT_MAX
from ..problem.context_blocks import sequence_window
from ..problem.dropout import keep_prob_of
from ..problem.layout import head_count_of, head_dim_of
from ..problem.lengths import lengths_of_ends, require_same_sequence_count
from . import comm
from .blocks import ALIBI_TYPES, AttentionSetup
from .plan import SequencePlan
from .ring import RingAttention, RingOptions
from .ulysses import HeadToSeq, SeqToHead

LAYOUTS = ("BSND", "BNSD", "BSH", "SBH", "TND")
SEQ_DIMS = {"BSND": 1, "BNSD": 2, "BSH": 1, "SBH": 0, "TND": 0}
METHODS = ("ring", "ulysses")


def seq_dim(input_layout: str) -> int:
    """The sequence axis of a layout (what `shard` / `unshard` take as seq_dim)."""
    if input_layout not in SEQ_DIMS:
        raise ParamInvalidError(f"input_layout: expected one of {list(LAYOUTS)}, got {input_layout!r}")
    return SEQ_DIMS[input_layout]


def _packed(x: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    """A shard in its layout -> packed [B * S_local, N, D] (TND as is; `heads` splits H of BSH/SBH).
    Differentiable views/copies."""
    if layout == "TND":
        return x
    if layout == "BNSD":
        x = x.transpose(1, 2)
    elif layout == "SBH":
        x = x.transpose(0, 1)
    if layout in ("BSH", "SBH"):
        x = x.reshape(x.shape[0], x.shape[1], heads, -1)
    return x.reshape(-1, x.shape[2], x.shape[3])


def _unpacked(x: torch.Tensor, layout: str, batch: int) -> torch.Tensor:
    """Inverse of `_packed` for the output."""
    if layout == "TND":
        return x
    x = x.reshape(batch, -1, x.shape[1], x.shape[2])
    if layout == "BNSD":
        return x.transpose(1, 2)
    if layout in ("BSH", "SBH"):
        x = x.reshape(x.shape[0], x.shape[1], -1)
        return x.transpose(0, 1) if layout == "SBH" else x
    return x


def flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    *,
    group=None,
    method: str = "ring",
    load_balance: str | None = "head_tail",
    overlap: bool = True,
    timeout=None,
    dropout_seed: int | None = None,
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
    generator: torch.Generator | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Differentiable context-parallel `cann_attn.flash_attention`: every rank of `group` passes its shards
    (`shard(x, seq_dim(input_layout), load_balance=...)`) and gets its shard of the output, equal to the shard of
    `cann_attn.flash_attention` on the whole tensors.

    method "ring" (K/V travel around the ring, overlapped with the computation unless `overlap=False`) or "ulysses"
    (all-to-all to head shards; head_num and the key/value head count must be divisible by the world size).
    Supported: no mask, sparse_mode 2/3/4 with the compressed atten_mask, generated ALiBi (pse_type 2/3, slopes in
    `pse`, q/kv start indices of the whole sequence), GQA, layouts BSND/BNSD/BSH/SBH/TND (TND: the global cumulative
    `actual_seq_qlen`/`actual_seq_kvlen` on every rank). Dropout: the keep bits are a function of the seed and each
    element's global position (`dropout_mask` gives the whole mask); the seed is `dropout_seed`, else drawn from
    `generator` (every rank's generator must be seeded alike). `timeout` (seconds or timedelta) bounds every wait;
    default: the group's own timeout. Every rank must call with matching arguments; a mismatch or a rank whose
    arguments fail validation makes every rank raise ParamInvalidError before any computation.
    """
    group_info = comm.resolve_group(group, timeout, query.device if isinstance(query, torch.Tensor)
                                    else torch.device("cpu"))
    error, signature, prepared = None, {}, None
    try:
        prepared, signature = _prepare(locals(), group_info)
    except Exception as exc:  # reported to every rank by `agree`, then raised here
        error = exc
    comm.agree(group_info, signature, error)
    setup, plan, kv_plan, batch = prepared
    q = _packed(query, input_layout, head_num)
    heads_kv = head_count_of(key, head_dim_of(query, head_num, input_layout), input_layout)
    k, v = _packed(key, input_layout, heads_kv), _packed(value, input_layout, heads_kv)
    if method == "ring":
        out = RingAttention.apply(q, k, v, setup, RingOptions(group_info, overlap))
    else:
        single = comm.Group(None, 0, 1, group_info.timeout, group_info.device)
        heads = SeqToHead.apply(q, group_info, plan)
        k_heads, v_heads = SeqToHead.apply(k, group_info, kv_plan), SeqToHead.apply(v, group_info, kv_plan)
        out = HeadToSeq.apply(RingAttention.apply(heads, k_heads, v_heads, setup, RingOptions(single, True)),
                              group_info, plan)
    return _unpacked(out, input_layout, batch)


def _prepare(args: dict, group: comm.Group):
    """Validates one rank's call; returns (setup, query plan, key plan, batch) and the signature ranks compare."""
    query, key, value = args["query"], args["key"], args["value"]
    head_num, layout, method = args["head_num"], args["input_layout"], args["method"]
    load_balance = args["load_balance"]
    if method not in METHODS:
        raise ParamInvalidError(f"method: expected 'ring' or 'ulysses', got {method!r}")
    seq_dim(layout)
    for name in ("prefix", "padding_mask"):
        if args[name] is not None:
            raise ParamInvalidError(f"{name}: not supported under context parallelism")
    pse, pse_type, mask = args["pse"], args["pse_type"], args["atten_mask"]
    if pse is not None and pse_type not in ALIBI_TYPES:
        raise ParamInvalidError(f"pse: context parallelism supports generated ALiBi (pse_type 2 or 3, slopes in pse) "
                                f"only, got a pse with pse_type={pse_type!r}")
    keep_prob = keep_prob_of(args["keep_prob"], args["dropout_p"])
    require(0.0 < keep_prob <= 1.0, "keep_prob", "a float in (0, 1]", keep_prob)
    require(isinstance(args["overlap"], bool), "overlap", "a bool", args["overlap"])
    tnd = layout == "TND"
    if tnd:
        if args["actual_seq_qlen"] is None or args["actual_seq_kvlen"] is None:
            raise ParamInvalidError("actual_seq_qlen/actual_seq_kvlen: TND under context parallelism needs the "
                                    "global cumulative lengths of the whole packed sequence on every rank")
        q_lengths = lengths_of_ends(_frozen(args["actual_seq_qlen"]), "actual_seq_qlen")
        kv_lengths = lengths_of_ends(_frozen(args["actual_seq_kvlen"]), "actual_seq_kvlen")
        require_same_sequence_count(q_lengths, kv_lengths, "actual_seq_qlen", "actual_seq_kvlen")
        batch = len(q_lengths)
    else:
        if args["actual_seq_qlen"] is not None or args["actual_seq_kvlen"] is not None:
            raise ParamInvalidError("actual_seq_qlen: only the TND layout takes sequence lengths")
        dim = SEQ_DIMS[layout]
        batch = query.shape[1 if layout == "SBH" else 0]
        q_lengths = [query.shape[dim] * group.world] * batch
        kv_lengths = [key.shape[dim] * group.world] * batch
    plan = SequencePlan(tuple(q_lengths), group.world, load_balance)
    kv_plan = SequencePlan(tuple(kv_lengths), group.world, load_balance)
    local_q, local_kv = list(accumulate(plan.local_lengths)), list(accumulate(kv_plan.local_lengths))
    # The operator's own validation of this rank's shards (shapes, dtypes, heads, mask, pse, band).
    build_problem(query, key, value, head_num, layout, pse=pse, drop_mask=None, atten_mask=mask, prefix=None,
                  actual_seq_qlen=local_q if tnd else None, actual_seq_kvlen=local_kv if tnd else None,
                  q_start_idx=args["q_start_idx"], kv_start_idx=args["kv_start_idx"],
                  scale_value=args["scale_value"], keep_prob=1.0, pre_tokens=args["pre_tokens"],
                  next_tokens=args["next_tokens"], inner_precise=args["inner_precise"],
                  sparse_mode=args["sparse_mode"], pse_type=pse_type, softmax_layout=args["softmax_layout"],
                  allowed_modes=FORWARD_MODES)
    windows = tuple(sequence_window(mask is not None, args["sparse_mode"], args["pre_tokens"], args["next_tokens"],
                                    sq, skv) for sq, skv in zip(q_lengths, kv_lengths, strict=True))
    head_offset, local_heads = 0, head_num
    if method == "ulysses":
        heads_kv = head_count_of(key, head_dim_of(query, head_num, layout), layout)
        if head_num % group.world or heads_kv % group.world:
            raise ParamInvalidError(
                f"head_num: Ulysses splits heads over the {group.world} ranks; expected head_num ({head_num}) and "
                f"the key/value head count ({heads_kv}) divisible by {group.world}")
        local_heads = head_num // group.world
        head_offset = group.rank * local_heads
        if pse is not None:
            pse = pse[..., head_offset : head_offset + local_heads]
    seed = 0
    if 0.0 < keep_prob < 1.0:
        if args["dropout_seed"] is not None:
            seed = int(args["dropout_seed"])
        else:
            seed = int(torch.randint(0, 2**62, (1,), generator=args["generator"]).item())
    starts = [start_index(args["q_start_idx"], "q_start_idx"), start_index(args["kv_start_idx"], "kv_start_idx")]
    # Ulysses computes whole sequences on its heads; so does a ring of one rank, whose shard is the whole sequence in
    # order: one block call per sequence instead of the 2 x 2 head/tail chunk pairs (no merge, no accumulators).
    whole = method == "ulysses" or group.world == 1
    setup_plans = (plan, kv_plan) if not whole else (
        SequencePlan(tuple(q_lengths), 1, None), SequencePlan(tuple(kv_lengths), 1, None))
    setup = AttentionSetup(
        q_plan=setup_plans[0], kv_plan=setup_plans[1], windows=windows, head_num=local_heads, head_offset=head_offset,
        total_heads=head_num, pse=pse, pse_type=pse_type, q_start=starts[0], kv_start=starts[1],
        scale_value=float(args["scale_value"]), keep_prob=keep_prob, seed=seed,
        inner_precise=args["inner_precise"], backend=args["backend"], atten_mask=mask)
    signature = dict(
        q=list(query.shape), k=list(key.shape), v=list(value.shape), dtype=str(query.dtype), head_num=head_num,
        layout=layout, method=method, load_balance=load_balance, sparse_mode=args["sparse_mode"],
        mask=mask is not None, pre=args["pre_tokens"], next=args["next_tokens"], scale=float(args["scale_value"]),
        keep_prob=keep_prob, seed=seed, pse_type=pse_type, pse=None if pse is None else list(args["pse"].shape),
        starts=starts, q_lengths=q_lengths, kv_lengths=kv_lengths, overlap=args["overlap"],
        inner_precise=args["inner_precise"], backend=args["backend"])
    return (setup, plan, kv_plan, batch), signature


def dropout_mask(seed: int, keep_prob: float, head_num: int, *, batch: int | None = None, seq_q: int | None = None,
                 seq_kv: int | None = None, actual_seq_qlen=None, actual_seq_kvlen=None,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """The whole bit-packed keep mask that context-parallel `flash_attention` with this seed and keep_prob uses
    (dense: batch, seq_q, seq_kv of the whole tensors; TND: the global cumulative lengths): passed as `drop_mask`
    to a single-process `cann_attn.flash_attention_score` call it reproduces the distributed run at any world
    size."""
    from ..problem.dropout import positional_drop_mask

    if actual_seq_qlen is not None or actual_seq_kvlen is not None:
        q_lengths = lengths_of_ends(actual_seq_qlen, "actual_seq_qlen")
        kv_lengths = lengths_of_ends(actual_seq_kvlen, "actual_seq_kvlen")
    else:
        if batch is None or seq_q is None or seq_kv is None:
            raise ParamInvalidError("dropout_mask: give batch, seq_q and seq_kv, or the TND cumulative lengths")
        q_lengths, kv_lengths = [seq_q] * batch, [seq_kv] * batch
    return positional_drop_mask(seed, keep_prob, head_num, q_lengths, kv_lengths, device=device)
