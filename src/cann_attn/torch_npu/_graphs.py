"""torch_npu's graph capture (``torch.npu.NPUGraph``, ``torch.npu.graph``, task groups and updates,
``ExternalEvent``) with the NPU's semantics on the CPU or a GPU (docs/guides/torch_npu.md, "Graph capture").

A capture records, instead of device kernels, every call made in it: each torch_npu operator call (through the
``npu_op`` registry, its host-side arguments, the sequence lengths, ``context_lens`` and ``seq_len``, frozen as
they were, as an NPU's tiling freezes them) and every plain torch operator (a ``TorchDispatchMode``), with their
tensor arguments by reference and their outputs. ``replay()`` runs the recorded calls again on the tensors' current
contents and writes into the captured outputs, so it equals a fresh eager call bit for bit. Calls run once while
they are captured (their outputs exist at once), but a tensor that existed before the capture and was written in it
gets its contents back at the end: a capture has no effect on existing tensors, as on the NPU.

Task groups mark captured calls that ``graph_task_update_begin/end`` may replace: the calls made between the two
are recorded, not run, and take the group's place in the graph for every later replay. ``ExternalEvent.wait``
captured in a graph makes a replay stop there until the event is recorded, as the NPU's stream does: vLLM-Ascend
replays first and updates the attention parameters after, each update ending in ``event.record``, which lets the
replay go on with the new parameters.

Random draws (``torch.randn``, the attention operators' dropout) draw again at each replay from the generator's
state at that time and advance it, as an NPU graph's random kernels do; a capture leaves the generators as it found
them. Calls that cannot be replayed faithfully are refused during capture with :class:`GraphCaptureError` (outputs
whose shape depends on data, host reads of tensor values, in-place view changes). Tensors that existed before the
capture are held weakly, as the NPU holds their addresses: replaying after they were freed raises
:class:`GraphReplayError`; tensors made during the capture belong to the graph until ``reset()``.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import itertools
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import ParamInvalidError, describe
from . import _registry, _rng

__all__ = [
    "ExternalEvent",
    "GraphCaptureError",
    "GraphReplayError",
    "NPUGraph",
    "graph",
    "graph_pool_handle",
    "graph_task_group_begin",
    "graph_task_group_end",
    "graph_task_update_begin",
    "graph_task_update_end",
    "is_current_stream_capturing",
    "make_graphed_callables",
]

CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")
# ATB reads these tensors on the host when the task is set up (as FIA reads its int[] lengths): a captured call keeps
# their values of the capture, and only a task update changes them.
_HOST_TENSOR_PARAMS = frozenset({"context_lens", "seq_len"})
# The workspace queries run on the host (a size, an allocation): called in a capture or an update, they run at once.
_HOST_ONLY_SUFFIXES = ("_get_workspace", "_get_max_workspace")
# FlashAttention forwards that return their dropout's (seed, offset) as host ints (_v3 returns tensors).
_HOST_SEEDED = ("npu_fusion_attention", "npu_fusion_attention_v2")
# Allocation only: no kernel to replay, the captured tensor keeps its memory.
_ALLOCATIONS = frozenset({"empty.memory_format", "empty_strided.default", "empty_like.default", "new_empty.default",
                          "new_empty_strided.default"})
# Constants entering the graph (torch.tensor(...) in a capture): the graph owns them.
_CONSTANTS = frozenset({"lift_fresh.default", "lift_fresh_copy.default", "lift.default"})
_METADATA_WRITES = frozenset({"resize_.default", "set_.source_Storage", "set_.source_Storage_storage_offset",
                              "set_.source_Tensor", "set_.default", "resize_as_.default"})
_TENSOR_RETURNS = frozenset({"Tensor", "List[Tensor]", "Optional[Tensor]", "List[Optional[Tensor]]"})
# torch_npu's auto_dispatch_capture handlers: the operators it makes updatable, and the host arguments an update
# dictionary may name (torch_npu/npu/_npugraph_handlers).
_AUTO_DISPATCH_OPS = {
    "npu_fused_infer_attention_score": ("actual_seq_lengths", "actual_seq_lengths_kv"),
    "npu_fused_infer_attention_score.out": ("actual_seq_lengths", "actual_seq_lengths_kv"),
    "npu_fused_infer_attention_score_v2": ("actual_seq_qlen", "actual_seq_kvlen"),
    "npu_fused_infer_attention_score_v2.out": ("actual_seq_qlen", "actual_seq_kvlen"),
    "_npu_paged_attention": ("context_lens",),
}


class GraphCaptureError(RuntimeError):
    """A call made during graph capture that a replay could not repeat faithfully, or a capture-state misuse."""


class GraphReplayError(RuntimeError):
    """A replay, update or event use that cannot proceed (nothing captured, a captured tensor freed...)."""


# ------------------------------------------------------------------------------------------------ process state
@dataclass
class _Update:
    handle: _TaskGroupHandle
    calls: list = field(default_factory=list)


@dataclass
class _State:
    graph: NPUGraph | None = None            # the graph being captured
    mode: TorchDispatchMode | None = None
    auto_dispatch: bool = False
    group_start: int | None = None           # index of the first step of the open task group
    update: _Update | None = None            # the open task update
    inside_operator: bool = False            # a torch_npu call is running: its inner calls are not recorded
    thread: int | None = None                # the thread that captures or updates (others run as usual)
    pending: collections.deque = field(default_factory=collections.deque)  # replays waiting on an event


_STATE = _State()


def is_current_stream_capturing() -> bool:
    """True while a graph capture is under way."""
    return _STATE.graph is not None


class _PoolHandle:
    """The opaque token of a graph memory pool (memory sharing is a hint; tensors here are ordinary tensors)."""

    _ids = itertools.count(1)

    def __init__(self) -> None:
        self.id = next(self._ids)

    def __repr__(self) -> str:
        return f"<graph pool {self.id}>"


def graph_pool_handle() -> _PoolHandle:
    """An opaque token naming a graph memory pool, for ``graph(..., pool=)``."""
    return _PoolHandle()


# ----------------------------------------------------------------------------------------- tensors of a graph
@dataclass(frozen=True)
class _Borrowed:
    """A tensor that existed before the capture: held by its storage's weak reference, rebuilt at replay."""

    storage: weakref.ref
    dtype: torch.dtype
    device: torch.device
    size: tuple
    stride: tuple
    offset: int
    label: str

    def resolve(self) -> torch.Tensor:
        storage = self.storage()
        if storage is None:
            raise GraphReplayError(f"{self.label}: a tensor captured by reference was freed after the capture "
                                   "(the graph would read freed memory); keep the graph's inputs alive or "
                                   "capture again")
        return torch.empty(0, dtype=self.dtype, device=self.device).set_(storage, self.offset, self.size,
                                                                         self.stride)


def _storage_key(tensor: torch.Tensor) -> int | None:
    storage = tensor.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else None


def _resolve(value: Any) -> Any:
    return tree_map(lambda leaf: leaf.resolve() if isinstance(leaf, _Borrowed) else leaf, value)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]


# ------------------------------------------------------------------------------------------------------ steps
@dataclass
class _TorchStep:
    """One plain torch operator. Views keep their captured metadata and allocations their memory; in-place and
    out= operators run again on the same tensors; functional ones run again into their captured outputs."""

    func: Any
    args: tuple
    kwargs: dict
    outputs: Any
    kind: str  # "view", "allocation", "inplace" or "functional"

    def run(self) -> None:
        if self.kind in ("view", "allocation"):
            return
        result = self.func(*_resolve(self.args), **_resolve(self.kwargs))
        if self.kind == "functional":
            _write_into(_resolve(self.outputs), result)


@dataclass
class _OperatorStep:
    """One torch_npu operator call: run again with the recorded arguments, results copied into the captured
    outputs (the .out forms and the ATB operators write into their given tensors themselves)."""

    op: Any
    run_call: Any
    args: tuple
    kwargs: dict
    outputs: Any

    def run(self) -> None:
        result = self.run_call(*_resolve(self.args), **_resolve(self.kwargs))
        _write_into(_resolve(self.outputs), result)


@dataclass
class _EventStep:
    event: ExternalEvent
    action: str  # "wait", "reset" or "record"

    def run(self) -> None:
        if self.action == "reset":
            self.event._recorded = False
        elif self.action == "record":
            self.event._recorded = True


def _write_into(captured: Any, result: Any) -> None:
    for target, value in zip(_tensors(captured), _tensors(result), strict=False):
        if target is value or (target.data_ptr() == value.data_ptr() and target.stride() == value.stride()):
            continue
        target.copy_(value)


# ------------------------------------------------------------------------------------------------- the graph
@dataclass
class _TaskGroupHandle:
    """What ``graph_task_group_end`` returns: the captured calls of one task group of one graph."""

    graph: weakref.ref
    start: int
    stop: int
    names: tuple[str, ...]

    def __repr__(self) -> str:
        return f"<task group {list(self.names)} steps {self.start}:{self.stop}>"


class NPUGraph:
    """``torch.npu.NPUGraph()``: a captured sequence of calls; ``with torch.npu.graph(g):`` captures,
    :meth:`replay` runs it again (docs/guides/torch_npu.md, "Graph capture")."""

    def __init__(self) -> None:
        self._steps: list = []
        self._owned: dict[int, torch.UntypedStorage] = {}   # storages made during the capture, kept alive
        self._snapshots: dict[int, tuple] = {}              # storages written during the capture, restored at end
        self._state = "empty"                               # "empty", "capturing", "captured" or "failed"
        self._pool = _PoolHandle()
        self.auto_dispatch_capture = False
        self._auto_groups: list[tuple[_TaskGroupHandle, ExternalEvent]] = []

    def __repr__(self) -> str:
        return f"<NPUGraph {self._state}, {len(self._steps)} calls>"

    # ------------------------------------------------------------------------------------------- capture
    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        """Begin capturing (``torch.npu.graph`` calls it); ``pool`` and ``capture_error_mode`` are checked and
        otherwise have no effect."""
        if pool is not None and not isinstance(pool, _PoolHandle):
            raise ParamInvalidError(f"pool: expected a token from torch.npu.graph_pool_handle() or "
                                    f"NPUGraph.pool(), got {describe(pool)}")
        if capture_error_mode not in CAPTURE_ERROR_MODES:
            raise ParamInvalidError(f"capture_error_mode: expected one of {list(CAPTURE_ERROR_MODES)}, got "
                                    f"{capture_error_mode!r}")
        if _STATE.graph is not None:
            raise GraphCaptureError("capture_begin: another graph capture is under way (one at a time)")
        if self._state != "empty":
            raise GraphCaptureError("capture_begin: this NPUGraph already holds a capture; call reset() first")
        if _STATE.pending:
            raise GraphCaptureError("capture_begin: a replay is waiting for an ExternalEvent to be recorded")
        self._generators = _generator_states()
        _STATE.graph, _STATE.group_start, _STATE.thread = self, None, threading.get_ident()
        _STATE.auto_dispatch = self.auto_dispatch_capture
        self._state = "capturing"
        _STATE.mode = _Recorder()
        _STATE.mode.__enter__()
        _registry.CALL_HOOKS.append(_operator_call)

    def capture_end(self) -> None:
        """End the capture: tensors that existed before it get their contents back."""
        self._end_capture(failed=False)

    def _end_capture(self, failed: bool) -> None:
        if _STATE.graph is not self:
            raise GraphCaptureError("capture_end: this graph is not being captured")
        open_group = _STATE.group_start is not None
        _STATE.mode.__exit__(None, None, None)
        _registry.CALL_HOOKS.remove(_operator_call)
        _STATE.graph = _STATE.mode = _STATE.group_start = None
        for storage, saved in self._snapshots.values():
            storage.copy_(saved)
        self._snapshots.clear()
        _restore_generators(self._generators)
        self._state = "failed" if failed or open_group else "captured"
        if open_group and not failed:
            raise GraphCaptureError("capture_end: graph_task_group_begin without graph_task_group_end")

    # -------------------------------------------------------------------------------------------- replay
    def replay(self) -> None:
        """Run the captured calls again. A captured ``ExternalEvent.wait`` whose event is not recorded makes the
        replay stop there; the event's ``record`` lets it go on (later replays queue behind it, as on a stream)."""
        if self._state != "captured":
            raise GraphReplayError(f"replay: this NPUGraph holds no finished capture ({self._state})")
        if _STATE.graph is not None:
            raise GraphCaptureError("replay: a graph capture is under way")
        from . import npu

        _STATE.pending.append([self, 0, npu.current_stream()])
        if len(_STATE.pending) == 1:
            _drain()

    def reset(self) -> None:
        """Drop the capture and the tensors it owns; the graph can capture again."""
        if _STATE.graph is self:
            raise GraphCaptureError("reset: the graph is being captured")
        if any(entry[0] is self for entry in _STATE.pending):
            raise GraphReplayError("reset: a replay of this graph is waiting for an ExternalEvent")
        self._steps, self._owned, self._auto_groups = [], {}, []
        self._state = "empty"

    def pool(self) -> _PoolHandle:
        """The token of this graph's memory pool, for another capture's ``pool=``."""
        return self._pool

    def update(self, cpu_update_input: list[dict]) -> None:
        """``auto_dispatch_capture`` graphs: replace the named host arguments (``actual_seq_lengths_kv``,
        ``context_lens``...) of every captured attention call, one dictionary per call (one for all), as torch_npu
        does; the change holds for every later replay and releases the replay waiting for it."""
        if not self.auto_dispatch_capture or self._state != "captured":
            raise GraphReplayError("update: the graph was not captured with auto_dispatch_capture=True")
        if not isinstance(cpu_update_input, (list, tuple)) or not all(isinstance(d, dict)
                                                                      for d in cpu_update_input):
            raise ParamInvalidError(f"cpu_update_input: expected a list of dicts, got {describe(cpu_update_input)}")
        updates = list(cpu_update_input)
        if len(updates) == 1:
            updates = updates * len(self._auto_groups)
        if len(updates) != len(self._auto_groups):
            raise ParamInvalidError(f"cpu_update_input: {len(self._auto_groups)} captured operators to update, got "
                                    f"{len(updates)} dictionaries")
        for (handle, _), changes in zip(self._auto_groups, updates, strict=True):
            step = self._steps[handle.start]
            bound = _bind(step.op, step.args, step.kwargs)
            for name, value in changes.items():
                if name in bound.arguments or name in _AUTO_DISPATCH_OPS.get(step.op.name, ()):
                    bound.arguments[name] = value
            args, kwargs = _freeze_call(step.op, self, bound.args, bound.kwargs)
            self._steps[handle.start] = _OperatorStep(step.op, step.run_call, args, kwargs, step.outputs)
        for _, event in self._auto_groups:
            event.record()

    # ------------------------------------------------------------------------------------------ recording
    def _append(self, step: Any) -> None:
        self._steps.append(step)

    def _own(self, value: Any, inputs: Any = ()) -> None:
        """Outputs that are no input's storage were made in the capture: the graph keeps them."""
        input_keys = {_storage_key(t) for t in _tensors(inputs)}
        for tensor in _tensors(value):
            key = _storage_key(tensor)
            if key is not None and key not in input_keys:
                self._owned[key] = tensor.untyped_storage()

    def _snapshot(self, tensor: torch.Tensor) -> None:
        key = _storage_key(tensor)
        if key is None or key in self._owned or key in self._snapshots:
            return
        storage = tensor.untyped_storage()
        self._snapshots[key] = (storage, storage.clone())

    def _freeze(self, value: Any, label: str, host: bool = False) -> Any:
        """Tensors of the graph by reference, others weakly; host-side tensors as a copy of their values."""

        def freeze(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            if host:
                return leaf.clone()
            key = _storage_key(leaf)
            if key is None or key in self._owned:
                return leaf
            return _Borrowed(weakref.ref(leaf.untyped_storage()), leaf.dtype, leaf.device, tuple(leaf.shape),
                             leaf.stride(), leaf.storage_offset(), label)

        return tree_map(freeze, value)


def _generator_states() -> tuple:
    from . import npu

    # torch.cuda.random's own functions: transfer_to_npu points torch.cuda's at torch.npu's.
    cuda = torch.cuda.random.get_rng_state_all() if npu._on_cuda() else None
    return torch.get_rng_state(), _rng.get_rng_state(), cuda


def _restore_generators(states: tuple) -> None:
    cpu, dropout, cuda = states
    torch.set_rng_state(cpu)
    _rng.set_rng_state(dropout)
    if cuda is not None:
        torch.cuda.random.set_rng_state_all(cuda)


@torch.no_grad()
def _drain() -> None:
    """Run queued replays in order until one waits for an event that is not recorded. Replays write below
    autograd, as kernels do: the captured tensors' values change, their autograd history does not."""
    from . import npu

    while _STATE.pending:
        graph, index, stream = entry = _STATE.pending[0]
        steps = graph._steps
        # A replay resumed by a record on another stream goes on on the stream it was launched on (on CUDA its
        # first calls may still be running there).
        with npu.stream(stream):
            while index < len(steps):
                step = steps[index]
                if isinstance(step, _EventStep) and step.action == "wait" and not step.event._recorded:
                    entry[1] = index
                    return
                try:
                    step.run()
                except BaseException:
                    _STATE.pending.popleft()
                    raise
                index += 1
        _STATE.pending.popleft()


# ------------------------------------------------------------------------------------------- plain torch ops
def _refusal(func: Any, args: tuple) -> str | None:
    name = func.__name__
    tags = set(func.tags)
    if torch.Tag.dynamic_output_shape in tags and not _integer_indexing(func, args):
        return "its output shape depends on tensor values"
    if torch.Tag.inplace_view in tags or name in _METADATA_WRITES:
        return "it changes a tensor's shape or strides in place"
    if any(str(ret.type) not in _TENSOR_RETURNS for ret in func._schema.returns):
        return "it reads a tensor's value on the host (item(), bool(), equal...), which a replay cannot redo"
    return None


def _integer_indexing(func: Any, args: tuple) -> bool:
    """``x[index_tensor]`` with integer indices: the output's shape is the indices' (a boolean mask's is not)."""
    return func.__name__ == "index.Tensor" and all(
        index is None or not (index.dtype == torch.bool or index.dtype == torch.uint8) for index in args[1])


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    written = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        written += _tensors(value)
    return written


def _kind(func: Any, written: list) -> str:
    if written:
        return "inplace"
    if func.__name__ in _ALLOCATIONS:
        return "allocation"
    returns = func._schema.returns
    if returns and all(ret.alias_info is not None for ret in returns):
        return "view"
    return "functional"


class _Recorder(TorchDispatchMode):
    """Records every torch operator run during a capture (torch_npu calls record themselves, whole)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        graph = _STATE.graph
        if graph is None:
            return func(*args, **kwargs)
        if _STATE.inside_operator:  # not recorded (the call is), but what it allocates belongs to the graph
            result = func(*args, **kwargs)
            if not _written(func, args, kwargs) and _kind(func, []) != "view":
                graph._own(result, (args, kwargs))
            return result
        reason = _refusal(func, args)
        if reason is not None:
            raise GraphCaptureError(f"graph capture: torch operator {func} cannot be captured: {reason}")
        written = _written(func, args, kwargs)
        for tensor in written:
            graph._snapshot(tensor)
        result = func(*args, **kwargs)
        kind = _kind(func, written)
        if func.__name__ in _CONSTANTS:
            graph._own(result)
        elif kind in ("functional", "allocation"):
            graph._own(result, (args, kwargs))
        names = [argument.name for argument in func._schema.arguments]
        frozen_args = tuple(graph._freeze(value, f"{func}({name}=...)")
                            for value, name in zip(args, names + ["..."] * len(args), strict=False))
        frozen_kwargs = {name: graph._freeze(value, f"{func}({name}=...)") for name, value in kwargs.items()}
        graph._append(_TorchStep(func, frozen_args, frozen_kwargs, graph._freeze(result, f"output of {func}"), kind))
        return result


# -------------------------------------------------------------------------------------------- torch_npu calls
def _bind(op: Any, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    return inspect.signature(op.wrapper).bind_partial(*args, **kwargs)


def _host_params(op: Any) -> set[str]:
    schema = op.schema(_registry.active_release())
    host = {p.name for p in schema.params if p.type.rstrip("?").endswith("[]") and "Tensor" not in p.type}
    return host | (_HOST_TENSOR_PARAMS & {p.name for p in schema.params})


def _written_params(op: Any) -> set[str]:
    schema = op.schema(_registry.active_release())
    return {p.name for p in schema.params if "!" in p.type} | {"out"}


def _freeze_call(op: Any, graph: NPUGraph, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's arguments as a graph keeps them: host-side ones frozen (sequence lengths, ATB's context_lens)."""
    bound = _bind(op, args, kwargs)
    host = _host_params(op)
    for name, value in bound.arguments.items():
        bound.arguments[name] = graph._freeze(value, f"{op.name}({name}=...)", host=name in host)
    return bound.args, bound.kwargs


def _bound_or_raise(op: Any, run_call: Any, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """The call's arguments by name; a call that does not fit the signature raises the call's own error."""
    try:
        return _bind(op, args, kwargs)
    except TypeError:
        with _operator_running():
            run_call(*args, **kwargs)
        raise GraphCaptureError(f"graph capture: {op.name} accepted arguments its signature does not name") from None


def _refuse_dropout_with_autograd(op: Any, bound: inspect.BoundArguments) -> None:
    """``_v3``'s dropout mask is drawn inside the call and kept by autograd for the backward: a replay draws a new
    mask the captured backward would not see. Forward-only dropout, and the grad functions given the forward's
    seed and offset tensors, replay faithfully."""
    keep_prob = bound.arguments.get("keep_prob", 1.0)
    if "grad" in op.name or op.name in _HOST_SEEDED or not isinstance(keep_prob, (int, float)) or keep_prob >= 1:
        return  # the host-seeded forms replay the capture's mask, the one the captured backward keeps
    if torch.is_grad_enabled() and any(t.requires_grad for t in _tensors(list(bound.arguments.values()))):
        raise GraphCaptureError(f"graph capture: {op.name}(keep_prob={keep_prob}) on tensors that require grad "
                                "cannot be captured: its backward would reuse the capture's dropout mask while a "
                                "replay draws a new one; capture it under torch.no_grad(), or call the "
                                "npu_fusion_attention_grad function with the seed and offset it returns")


def _with_drawn_seed(op: Any, bound: inspect.BoundArguments, result: Any) -> tuple[tuple, dict]:
    """npu_fusion_attention / _v2 draw their dropout at a (seed, offset) computed on the host and return it as ints:
    the NPU's task keeps that pair, so every replay applies the capture's mask and the generator does not move.
    The call is recorded with the pair given explicitly (a non-zero seed draws there). ``_v3`` returns the pair as
    tensors and draws anew at each replay."""
    keep_prob = bound.arguments.get("keep_prob", 1.0)
    drew = (op.name in _HOST_SEEDED and isinstance(keep_prob, (int, float))
            and keep_prob < 1 and bound.arguments.get("dropout_mask") is None and not bound.arguments.get("seed"))
    if not drew:
        return bound.args, bound.kwargs
    seed, offset = result[4], result[5]
    takes_seed = "seed" in {p.name for p in op.schema(_registry.active_release()).params}
    if not takes_seed or seed == 0:
        raise GraphCaptureError(f"graph capture: {op.name}(keep_prob={keep_prob}) drew its dropout at seed {seed}, "
                                "which a replay cannot give back (torch_npu release without seed=, or seed 0); "
                                "capture npu_fusion_attention_v3 instead")
    bound.arguments["seed"], bound.arguments["offset"] = seed, offset
    return bound.args, bound.kwargs


@contextlib.contextmanager
def _operator_running():
    previous = _STATE.inside_operator
    _STATE.inside_operator = True
    try:
        yield
    finally:
        _STATE.inside_operator = previous


def _operator_call(op: Any, run_call: Any, args: tuple, kwargs: dict) -> Any:
    """The registry's hook while a capture or a task update is open (docs/guides/torch_npu.md, "Graph capture")."""
    if _STATE.inside_operator or _STATE.thread != threading.get_ident():
        return run_call(*args, **kwargs)
    graph = _STATE.graph
    if op.name.endswith(_HOST_ONLY_SUFFIXES):  # no device work to capture or update: run now, as on the NPU
        with _operator_running():
            result = run_call(*args, **kwargs)
            if graph is not None:
                graph._own(result, (args, kwargs))
        return result
    if _STATE.update is not None:
        return _record_update(op, run_call, args, kwargs)
    if graph is None:
        return run_call(*args, **kwargs)
    bound = _bound_or_raise(op, run_call, args, kwargs)
    _refuse_dropout_with_autograd(op, bound)
    auto = _STATE.auto_dispatch and op.name in _AUTO_DISPATCH_OPS and _STATE.group_start is None
    if auto:  # torch_npu's auto_dispatch_capture: the call becomes an updatable task behind an external event
        event = ExternalEvent()
        event.wait()
        event.reset()
        graph_task_group_begin(None)
    with _operator_running():
        for name in _written_params(op) & set(bound.arguments):
            for tensor in _tensors(bound.arguments[name]):
                graph._snapshot(tensor)
        result = run_call(*args, **kwargs)
        graph._own(result, (args, kwargs))
        args, kwargs = _with_drawn_seed(op, bound, result)
        frozen_args, frozen_kwargs = _freeze_call(op, graph, args, kwargs)
        graph._append(_OperatorStep(op, run_call, frozen_args, frozen_kwargs,
                                    graph._freeze(result, f"output of {op.name}")))
    if auto:
        graph._auto_groups.append((graph_task_group_end(None), event))
    return result


def _record_update(op: Any, run_call: Any, args: tuple, kwargs: dict) -> Any:
    """A call inside graph_task_update_begin/end: recorded for the task group, not run (the NPU updates the
    captured task's parameters); it returns the tensors it names as outputs, as the .out forms do."""
    bound = _bound_or_raise(op, run_call, args, kwargs)
    if not any(name in bound.arguments for name in _written_params(op)):
        raise GraphCaptureError(f"graph_task_update: {op.name} allocates its outputs; a task update takes the form "
                                "that writes into given tensors (.out, or the ATB operators' out=)")
    _STATE.update.calls.append((op, run_call, bound.args, bound.kwargs))
    if "out" in bound.arguments and isinstance(bound.arguments["out"], (list, tuple)):
        return tuple(bound.arguments["out"])
    outputs = [bound.arguments[name] for name in ("attention_out", "softmax_lse") if name in bound.arguments]
    return tuple(outputs) if outputs else None


# ----------------------------------------------------------------------------------------------- task groups
def graph_task_group_begin(stream: Any) -> None:
    """Start a task group in the capture: the calls until :func:`graph_task_group_end` can be updated."""
    if _STATE.graph is None:
        raise GraphCaptureError("graph_task_group_begin: no graph capture is under way")
    if _STATE.group_start is not None:
        raise GraphCaptureError("graph_task_group_begin: a task group is already open")
    _STATE.group_start = len(_STATE.graph._steps)


def graph_task_group_end(stream: Any) -> _TaskGroupHandle:
    """Close the task group; returns its handle for :func:`graph_task_update_begin`."""
    graph = _STATE.graph
    if graph is None or _STATE.group_start is None:
        raise GraphCaptureError("graph_task_group_end: no task group is open")
    start, _STATE.group_start = _STATE.group_start, None
    steps = graph._steps[start:]
    if not steps or not all(isinstance(step, _OperatorStep) for step in steps):
        raise GraphCaptureError("graph_task_group_end: a task group holds torch_npu operator calls only (at least "
                                f"one); got {[getattr(s, 'func', getattr(s, 'action', None)) for s in steps]}")
    return _TaskGroupHandle(weakref.ref(graph), start, len(graph._steps), tuple(s.op.name for s in steps))


def graph_task_update_begin(stream: Any, handle: _TaskGroupHandle) -> None:
    """Start replacing the calls of the task group ``handle``: the calls until :func:`graph_task_update_end` are
    recorded (not run) and take the group's place."""
    if not isinstance(handle, _TaskGroupHandle):
        raise ParamInvalidError(f"handle: expected the value of graph_task_group_end, got {describe(handle)}")
    if _STATE.graph is not None:
        raise GraphCaptureError("graph_task_update_begin: a graph capture is under way")
    if _STATE.update is not None:
        raise GraphCaptureError("graph_task_update_begin: a task update is already open")
    if handle.graph() is None or handle.graph()._state != "captured":
        raise GraphReplayError("graph_task_update_begin: the handle's graph was reset or freed")
    _STATE.update, _STATE.thread = _Update(handle), threading.get_ident()
    _registry.CALL_HOOKS.append(_operator_call)


def graph_task_update_end(stream: Any) -> None:
    """Replace the task group's calls with those made since :func:`graph_task_update_begin` (the same
    operators, in the same order); the change holds for every later replay."""
    update = _STATE.update
    if update is None:
        raise GraphCaptureError("graph_task_update_end: no task update is open")
    _STATE.update = None
    _registry.CALL_HOOKS.remove(_operator_call)
    handle, graph = update.handle, update.handle.graph()
    names = tuple(op.name for op, *_ in update.calls)
    if names != handle.names:
        raise GraphCaptureError(f"graph_task_update_end: the task group captured {list(handle.names)}, the update "
                                f"called {list(names)}; the group is left as it was")
    steps = []
    for (op, run_call, args, kwargs), old in zip(update.calls, graph._steps[handle.start:handle.stop], strict=True):
        frozen_args, frozen_kwargs = _freeze_call(op, graph, args, kwargs)
        steps.append(_OperatorStep(op, run_call, frozen_args, frozen_kwargs, old.outputs))
    graph._steps[handle.start:handle.stop] = steps


def refuse_waiting_replays(caller: str) -> None:
    """A synchronisation while a replay waits for an ExternalEvent nothing has recorded would never return on the
    NPU; here it raises instead of returning before the graph's outputs are written."""
    if _STATE.pending:
        raise GraphReplayError(f"{caller}: a graph replay waits for an ExternalEvent that is not recorded (record "
                               "it, e.g. after the task updates, before synchronizing)")


def cancel_task_update() -> None:
    """Close an open task update without applying it (its call raised): the task keeps its calls."""
    if _STATE.update is not None:
        _STATE.update = None
        _registry.CALL_HOOKS.remove(_operator_call)


# ---------------------------------------------------------------------------------------------------- events
class ExternalEvent:
    """``torch.npu.ExternalEvent()``: an event that may be waited on before it is recorded. ``reset`` clears
    it for reuse. Captured in a graph, ``wait`` makes a replay stop until the event is recorded, ``reset``
    clears it again; outside a capture ``record`` lets waiting replays go on."""

    def __init__(self) -> None:
        self._recorded = False

    def __repr__(self) -> str:
        return f"<torch.npu.ExternalEvent {'recorded' if self._recorded else 'not recorded'}>"

    def _captured(self, action: str) -> bool:
        graph = _STATE.graph
        if graph is None or _STATE.inside_operator or _STATE.thread != threading.get_ident():
            return False
        graph._append(_EventStep(self, action))
        return True

    def record(self, stream: Any = None) -> None:
        if self._captured("record"):
            return
        self._recorded = True
        if _STATE.pending:
            _drain()

    def wait(self, stream: Any = None) -> None:
        if self._captured("wait") or self._recorded:
            return
        raise GraphReplayError("ExternalEvent.wait: the event is not recorded and nothing could record it while "
                               "this thread waits (on the NPU the stream would block); record it first")

    def reset(self, stream: Any = None) -> None:
        if not self._captured("reset"):
            self._recorded = False


# ------------------------------------------------------------------------------------------ graph() context
class graph:
    """``with torch.npu.graph(g, pool=None, stream=None):`` captures the block into ``g``. ``stream`` becomes the
    current stream in the block; ``auto_dispatch_capture=True`` makes each attention call an updatable task group
    (``g.update``)."""

    def __init__(self, npu_graph: NPUGraph, pool: Any = None, stream: Any = None,
                 auto_dispatch_capture: bool = False, capture_error_mode: str = "global") -> None:
        if not isinstance(npu_graph, NPUGraph):
            raise ParamInvalidError(f"npu_graph: expected a torch.npu.NPUGraph, got {describe(npu_graph)}")
        self.npu_graph, self.pool, self.capture_error_mode = npu_graph, pool, capture_error_mode
        self.capture_stream = stream
        self.npu_graph.auto_dispatch_capture = bool(auto_dispatch_capture)
        self._stream_context: Any = contextlib.nullcontext()

    def __enter__(self) -> None:
        from . import npu

        npu.synchronize()
        if self.capture_stream is not None:
            self._stream_context = npu.stream(self.capture_stream)
        self._stream_context.__enter__()
        try:
            self.npu_graph.capture_begin(self.pool, capture_error_mode=self.capture_error_mode)
        except BaseException:
            self._stream_context.__exit__(None, None, None)
            raise

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        try:
            self.npu_graph._end_capture(failed=exc_type is not None)
        finally:
            self._stream_context.__exit__(exc_type, exc_value, traceback)


# ------------------------------------------------------------------------------------- make_graphed_callables
def make_graphed_callables(callables: Any, sample_args: Any, num_warmup_iters: int = 3,
                           allow_unused_input: bool = False, pool: Any = None) -> Any:
    """``torch.npu.make_graphed_callables``: torch_npu's checks and warm-up runs (forward, and backward where an
    output requires grad), then the callables themselves. A graphed callable replays its capture, and a replay
    here is the eager call, so the callables are returned as they are (their outputs are new tensors at each
    call instead of the graph's static ones)."""
    if torch.is_autocast_enabled() and torch.is_autocast_cache_enabled():
        raise RuntimeError("make_graphed_callables does not support the autocast caching. Please set "
                           "`cache_enabled=False`.")
    if pool is not None and not isinstance(pool, _PoolHandle):
        raise ParamInvalidError(f"pool: expected a token from torch.npu.graph_pool_handle(), got {describe(pool)}")
    single = not isinstance(callables, tuple)
    functions, samples = ((callables,), (sample_args,)) if single else (callables, sample_args)
    for function, args in zip(functions, samples, strict=True):
        if isinstance(function, torch.nn.Module):
            if function._backward_hooks or function._forward_hooks or function._forward_pre_hooks:
                raise RuntimeError("Modules must not have hooks registered at the time they are passed. However, "
                                   "registering hooks on modules after passing them through "
                                   "make_graphed_callables is allowed.")
            if any(buffer.requires_grad for buffer in function.buffers()):
                raise RuntimeError("In any torch.nn.Module passed to make_graphed_callables, only parameters may "
                                   "be trainable. All buffers must have requires_grad=False.")
        if not all(isinstance(arg, torch.Tensor) for arg in tree_flatten(args)[0]):
            raise RuntimeError("sample_args for each callable must contain only Tensors. Other types are not "
                               "allowed.")
    for function, args in zip(functions, samples, strict=True):
        inputs = tuple(t for t in tree_flatten(args)[0] if t.requires_grad)
        if isinstance(function, torch.nn.Module):
            inputs += tuple(p for p in function.parameters() if p.requires_grad)
        for _ in range(num_warmup_iters):
            outputs = tuple(t for t in tree_flatten(function(*args))[0]
                            if isinstance(t, torch.Tensor) and t.requires_grad)
            if outputs and inputs:
                torch.autograd.grad(outputs, inputs, grad_outputs=tuple(torch.empty_like(o) for o in outputs),
                                    only_inputs=True, allow_unused=allow_unused_input)
    return functions[0] if single else functions
