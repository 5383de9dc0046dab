"""The collectives context parallelism uses, on torch.distributed (gloo on CPU, NCCL on GPU), with the failure
behaviour of docs/guides/context_parallel.md: every wait is bounded by the caller's `timeout` (or the group's own),
and every call starts by agreeing on what each rank passes, so a rank that fails validation, or passes other
shapes, makes every rank raise the same clear error instead of hanging.

Bytes sent by this process are counted per kind (`comm_stats`), for the benchmarks' volume check.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import numbers
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import ParamInvalidError

_SENT: Counter = Counter()
_SIGNATURE_BYTES = 4096
# datetime.timedelta's largest whole-day span, in seconds (999999999 days).
MAX_TIMEOUT_SECONDS = float(datetime.timedelta.max.days * 86400)


class ContextParallelError(RuntimeError):
    """A collective of context parallelism failed or timed out: another rank raised, hung or left."""


def comm_stats() -> dict[str, int]:
    """Bytes this process has sent through cann_attn.distributed since the last `reset_comm_stats`, per kind
    (ring_kv, ring_grad, all_to_all, all_gather, reduce_scatter, all_reduce)."""
    return dict(_SENT)


def reset_comm_stats() -> None:
    _SENT.clear()


@dataclass(frozen=True)
class Group:
    """A process group with this rank's place in it and the wait bound of this call."""

    handle: object
    rank: int
    world: int
    timeout: datetime.timedelta | None
    device: torch.device

    def wait(self, work, what: str) -> None:
        try:
            if self.timeout is None:
                work.wait()
            else:
                work.wait(timeout=self.timeout)
        except Exception as exc:  # gloo raises RuntimeError, NCCL DistBackendError: one clear error for all
            raise ContextParallelError(
                f"cann_attn.distributed: rank {self.rank} of {self.world}: {what} failed or timed out "
                f"(timeout={self.timeout}); another rank probably raised, hung or exited: {exc}") from exc

    def peer(self, rank: int) -> int:
        """The global rank of group rank `rank` (what point-to-point calls take)."""
        return dist.get_global_rank(self.handle, rank) if self.handle is not None else rank


def resolve_group(group, timeout, device: torch.device) -> Group:
    timeout = resolve_timeout(timeout)
    if not dist.is_available() or not dist.is_initialized():
        raise ParamInvalidError("group: torch.distributed is not initialised; call "
                                "torch.distributed.init_process_group first")
    return Group(group, dist.get_rank(group), dist.get_world_size(group), timeout, device)


def resolve_timeout(timeout) -> datetime.timedelta | None:
    """`timeout` as a timedelta: seconds (a real number > 0) or a timedelta; None: the group's own."""
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        # bool is an int subclass (True is not "1 second"); NaN, inf and values beyond timedelta's range are no
        # duration either.
        seconds = float(timeout) if isinstance(timeout, numbers.Real) and not isinstance(timeout, bool) else math.nan
        if not (math.isfinite(seconds) and seconds > 0 and seconds <= MAX_TIMEOUT_SECONDS):
            raise ParamInvalidError(f"timeout: expected seconds in (0, {MAX_TIMEOUT_SECONDS:g}] or a "
                                    f"datetime.timedelta, got {timeout!r}")
        timeout = datetime.timedelta(seconds=seconds)
    return timeout


def agree(group: Group, signature: dict, error: Exception | None) -> None:
    """All ranks exchange what they pass (`signature`, JSON-able) and whether their own validation failed. Raises
    on every rank alike: the first rank's error (ParamInvalidError if it was one), or a description of the
    mismatch."""
    message = None if error is None else f"{type(error).__name__}: {error}"[:1024]
    entry = {"error": message, "invalid": isinstance(error, ParamInvalidError), "sig": signature}
    text = json.dumps(entry, sort_keys=True, default=str).encode()
    if len(text) > _SIGNATURE_BYTES:  # long length lists: ranks compare a digest (the message then names no field)
        digest = hashlib.sha256(json.dumps(signature, sort_keys=True, default=str).encode()).hexdigest()
        text = json.dumps(dict(entry, sig={"digest": digest}), sort_keys=True).encode()
    mine = torch.zeros(_SIGNATURE_BYTES, dtype=torch.uint8)
    mine[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    mine = mine.to(group.device)
    everyone = [torch.empty_like(mine) for _ in range(group.world)]
    group.wait(dist.all_gather(everyone, mine, group=group.handle, async_op=True), "the up-front agreement")
    entries = [json.loads(bytes(t.cpu().tolist()).rstrip(b"\0").decode()) for t in everyone]
    for rank, entry in enumerate(entries):
        if entry["error"] is not None:
            if error is not None and rank == group.rank:
                raise error
            kind = ParamInvalidError if entry["invalid"] else ContextParallelError
            raise kind(f"cann_attn.distributed: rank {rank} failed before the computation: {entry['error']}")
    first = entries[0]["sig"]
    for rank, entry in enumerate(entries[1:], start=1):
        if entry["sig"] != first:
            diff = {k: (first.get(k), entry["sig"].get(k)) for k in sorted(set(first) | set(entry["sig"]))
                    if first.get(k) != entry["sig"].get(k)}
            raise ParamInvalidError(
                f"cann_attn.distributed: ranks disagree on what they pass (rank 0 vs rank {rank}: {diff}); every "
                f"rank must pass shards of the same shapes, head counts, dtypes and options")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def send_recv(group: Group, send: list[torch.Tensor], recv: list[torch.Tensor], to_rank: int, from_rank: int,
              kind: str) -> list:
    """Post sends of `send` to `to_rank` and receives into `recv` from `from_rank`; returns the works."""
    ops = [dist.P2POp(dist.isend, t.contiguous(), group.peer(to_rank), group.handle) for t in send]
    ops += [dist.P2POp(dist.irecv, t, group.peer(from_rank), group.handle) for t in recv]
    _SENT[kind] += sum(_nbytes(t) for t in send)
    return dist.batch_isend_irecv(ops) if ops else []


def wait_all(group: Group, works: list, what: str) -> None:
    for work in works:
        group.wait(work, what)


def all_gather_rank_major(group: Group, x: torch.Tensor) -> torch.Tensor:
    """[world * x.shape[0], ...]: every rank's x along dim 0, rank after rank."""
    x = x.contiguous()
    out = torch.empty((group.world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _SENT["all_gather"] += _nbytes(x) * (group.world - 1)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    group.wait(gather(out, x, group=group.handle, async_op=True), "all_gather")
    return out


def reduce_scatter_rank_major(group: Group, x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks of x (dim 0 = world equal parts, rank-major); returns this rank's part."""
    x = x.contiguous()
    out = torch.empty((x.shape[0] // group.world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _SENT["reduce_scatter"] += _nbytes(x) * (group.world - 1) // group.world
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    group.wait(scatter(out, x, group=group.handle, async_op=True), "reduce_scatter")
    return out


def all_to_all(group: Group, x: torch.Tensor) -> torch.Tensor:
    """Part p of dim 0 (world equal parts) goes to rank p; part p of the result came from rank p."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _SENT["all_to_all"] += _nbytes(x) * (group.world - 1) // group.world
    group.wait(dist.all_to_all_single(out, x, group=group.handle, async_op=True), "all_to_all")
    return out


def all_reduce_sum(group: Group, x: torch.Tensor) -> torch.Tensor:
    out = x.detach().clone().contiguous()
    _SENT["all_reduce"] += _nbytes(out) * 2 * (group.world - 1) // group.world
    group.wait(dist.all_reduce(out, group=group.handle, async_op=True), "all_reduce")
    return out


_FINGERPRINT_CHUNK = 1 << 22  # words per step: the int64 temporaries stay at 32 MB whatever the tensor's size


def fingerprint(x: torch.Tensor) -> torch.Tensor:
    """int64 [3]: the number of bytes, the sum of x's 32-bit words (bytes when the size is not a multiple of 4)
    and their sum weighted by position. Exact and independent of the order of the additions (integer sums), so
    equal tensors give equal fingerprints on every rank; a changed or moved element changes them."""
    raw = x.detach().contiguous().reshape(-1)
    raw = torch.view_as_real(raw).reshape(-1) if raw.is_complex() else raw
    raw = raw.view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    total, weighted = torch.zeros((), dtype=torch.int64, device=x.device), torch.zeros((), dtype=torch.int64,
                                                                                       device=x.device)
    for start in range(0, words.numel(), _FINGERPRINT_CHUNK):
        chunk = words[start : start + _FINGERPRINT_CHUNK].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=x.device) % 65521 + 1
        total += chunk.sum()
        weighted += (chunk * weights).sum()
    return torch.stack([torch.tensor(raw.numel(), dtype=torch.int64, device=x.device), total, weighted])


def _collective_device(group: Group, x: torch.Tensor) -> torch.device:
    if x.device.type != "cpu":
        return x.device
    backend = str(dist.get_backend(group.handle)).lower()
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else x.device


def require_same_tensor(group: Group, x: torch.Tensor, param: str, call: str) -> None:
    """Raise ParamInvalidError on every rank when the ranks' `x` differ (one all-gather of 3 integers per rank)."""
    device = _collective_device(group, x)
    gathered = all_gather_rank_major(group, fingerprint(x).to(device).view(1, 3)).cpu()
    differing = [rank for rank in range(group.world) if not torch.equal(gathered[rank], gathered[0])]
    if differing:
        raise ParamInvalidError(
            f"{param}: {call} needs the same whole tensor on every rank, but ranks {differing} passed other data "
            f"than rank 0 (compared by a checksum); give every rank the same batch (a data loader seeded alike, or "
            f"broadcast it from rank 0), or pass verify=False to skip this check")
