"""torch.npu graph capture (cann_attn/torch_npu/_graphs.py, docs/guides/torch_npu.md "Graph capture"): the
Ascend programs of tests/graph_capture_cases.py in fresh interpreters after install("cpu"), then the rules one by
one in this process: replay equals eager, host arguments frozen, task updates, external events, what is refused and
the errors of misuse."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import cann_attn.torch_npu as torch_npu
from cann_attn import ParamInvalidError
from cann_attn.torch_npu import GraphCaptureError, GraphReplayError, npu
from graph_capture_cases import CASES, run_case


@pytest.mark.parametrize("case", sorted(CASES))
def test_ascend_capture_programs_run_unedited(case):
    result = run_case(case, "cpu")
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-4000:]


def _paged(out: torch.Tensor, query, cache, table, lens) -> None:
    torch_npu._npu_paged_attention(query, cache, cache, 1, 2, 0.25, table, lens, out)


def _paged_inputs():
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(2, 2, 16, generator=gen).half()
    cache = torch.randn(6, 16, 1, 16, generator=gen).half()
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    return query, cache, table


def test_replay_reads_current_contents_and_plain_torch_ops_between_calls():
    query, cache, table = _paged_inputs()
    bias = torch.randn(2, 2, 16).half()
    g = npu.NPUGraph()
    with npu.graph(g):
        scaled = query * 2
        out = torch.empty(2, 2, 16, dtype=torch.half)
        workspace = torch_npu._npu_paged_attention_get_workspace(scaled, cache, cache, 1, 2, 0.25, table,
                                                                 torch.tensor([20, 32], dtype=torch.int32), out)
        _paged(out, scaled, cache, table, torch.tensor([20, 32], dtype=torch.int32))
        result = out.sum(-1) + bias.sum(-1)
    # The workspace query ran on the host: not one of the graph's calls.
    assert [type(step).__name__ for step in g._steps].count("_OperatorStep") == 1 and workspace.numel() == 0
    for _ in range(2):
        query.normal_()
        cache.normal_()
        bias.normal_()
        g.replay()
        expected = torch.zeros(2, 2, 16, dtype=torch.half)
        _paged(expected, query * 2, cache, table, torch.tensor([20, 32], dtype=torch.int32))
        assert torch.equal(result, expected.sum(-1) + bias.sum(-1))


def test_capture_leaves_existing_tensors_as_they_were_and_replay_applies_once():
    counter = torch.zeros(3)
    rows = torch.tensor([2, 0])
    g = npu.NPUGraph()
    with npu.graph(g):
        counter.add_(1)
        doubled = counter * 2 + torch.arange(3.0)
        gathered = doubled[rows]  # integer indexing: the output's shape is the indices'
    rows.copy_(torch.tensor([1, 1]))
    assert torch.equal(counter, torch.zeros(3))
    g.replay()
    assert torch.equal(counter, torch.ones(3)) and torch.equal(doubled, torch.tensor([2.0, 3.0, 4.0]))
    assert torch.equal(gathered, torch.tensor([3.0, 3.0]))
    g.replay()
    assert torch.equal(counter, torch.full((3,), 2.0))


def test_host_lengths_are_frozen_until_a_task_update_and_the_update_persists():
    query, cache, table = _paged_inputs()
    lens = torch.tensor([20, 32], dtype=torch.int32)
    out = torch.zeros(2, 2, 16, dtype=torch.half)
    g, event = npu.NPUGraph(), npu.ExternalEvent()
    with npu.graph(g):
        event.wait()
        event.reset()
        npu.graph_task_group_begin(None)
        _paged(out, query, cache, table, lens)
        handle = npu.graph_task_group_end(None)
    lens.fill_(3)  # read on the host at capture: no effect
    event.record()
    g.replay()
    expected = torch.zeros(2, 2, 16, dtype=torch.half)
    _paged(expected, query, cache, table, torch.tensor([20, 32], dtype=torch.int32))
    assert torch.equal(out, expected)
    npu.graph_task_update_begin(None, handle)
    assert torch_npu._npu_paged_attention(query, cache, cache, 1, 2, 0.25, table,
                                          torch.tensor([5, 7], dtype=torch.int32), out) is None
    npu.graph_task_update_end(None)
    assert torch.equal(out, expected)  # an update is recorded, not run
    _paged(expected, query, cache, table, torch.tensor([5, 7], dtype=torch.int32))
    for _ in range(2):
        out.zero_()
        g.replay()
        event.record()
        assert torch.equal(out, expected)
    # An update's arguments are checked when a replay runs them; a later update repairs the task.
    for lengths, error in (([999, 7], ParamInvalidError), ([5, 7], None)):
        npu.graph_task_update_begin(None, handle)
        _paged(out, query, cache, table, torch.tensor(lengths, dtype=torch.int32))
        npu.graph_task_update_end(None)
        g.replay()
        if error is None:
            event.record()
            assert torch.equal(out, expected)
        else:
            with pytest.raises(error, match="999 keys"):
                event.record()


def test_a_replay_waits_for_its_external_event_and_later_replays_queue_behind_it():
    x = torch.ones(2)
    g, event = npu.NPUGraph(), npu.ExternalEvent()
    with npu.graph(g):
        y = x + 1
        event.wait()
        event.reset()
        z = y * 3
    g.replay()
    assert torch.equal(y, torch.full((2,), 2.0)) and npu.is_current_stream_capturing() is False
    with pytest.raises(GraphReplayError, match="waits for an ExternalEvent"):
        npu.synchronize()  # would never return on the NPU
    x.fill_(5)
    g.replay()  # queued behind the first
    z_before = z.clone()
    event.record()  # the first goes on to its end, the second stops at the wait
    assert torch.equal(z, z_before) or torch.equal(z, torch.full((2,), 6.0))
    assert torch.equal(y, torch.full((2,), 6.0))
    event.record()
    assert torch.equal(z, torch.full((2,), 18.0))
    with pytest.raises(GraphReplayError, match="not recorded"):
        event.wait()  # eagerly, nothing could record it


def test_calls_of_other_threads_are_not_captured():
    query, cache, table = _paged_inputs()
    lens = torch.tensor([20, 32], dtype=torch.int32)
    outside = torch.zeros(2, 2, 16, dtype=torch.half)
    g = npu.NPUGraph()
    with npu.graph(g):
        worker = threading.Thread(target=_paged, args=(outside, query, cache, table, lens))
        worker.start()
        worker.join()
        doubled = query * 2
    assert len(g._steps) == 1 and outside.abs().sum() > 0  # the thread's call ran, eagerly, and only there
    outside.zero_()
    g.replay()
    assert torch.equal(outside, torch.zeros_like(outside)) and torch.equal(doubled, query * 2)


def test_v1_dropout_replays_the_capture_mask_as_the_npu_task_keeps_its_seed_and_offset():
    q = torch.randn(1, 8, 32)
    torch_npu.npu.manual_seed(11)
    g = npu.NPUGraph()
    with npu.graph(g):
        out, _, _, _, seed, offset, _ = torch_npu.npu_fusion_attention(q, q, q, 2, "BSH", keep_prob=0.5)
    captured = out.clone()
    state = torch_npu.npu.get_rng_state()
    for _ in range(2):
        out.zero_()
        g.replay()
        assert torch.equal(out, captured) and torch.equal(torch_npu.npu.get_rng_state(), state)
    eager = torch_npu.npu_fusion_attention(q, q, q, 2, "BSH", keep_prob=0.5, seed=seed, offset=offset)[0]
    assert seed == 11 and torch.equal(captured, eager)
    # With autograd: the backward in the capture keeps the same mask the replays apply.
    leaf = q.clone().requires_grad_()
    g = npu.NPUGraph()
    with npu.graph(g):
        out, _, _, _, seed, offset, _ = torch_npu.npu_fusion_attention(leaf, leaf, leaf, 2, "BSH", keep_prob=0.5)
        out.sum().backward()
    leaf.grad.zero_()
    leaf.data.mul_(0.5)
    g.replay()
    check = leaf.detach().clone().requires_grad_()
    torch_npu.npu_fusion_attention(check, check, check, 2, "BSH", keep_prob=0.5, seed=seed,
                                   offset=offset)[0].sum().backward()
    assert torch.equal(leaf.grad, check.grad)


def test_refused_captures_name_the_reason_and_leave_no_graph():
    for body, reason in ((lambda x: x.nonzero(), "depends on tensor values"), (lambda x: x[x > 0], "depends on"),
                         (lambda x: x.sum().item(), "host"),
                         (lambda x: x.t_(), "shape or strides in place")):
        g = npu.NPUGraph()
        x = torch.ones(2, 2)
        with pytest.raises(GraphCaptureError, match=reason), npu.graph(g):
            body(x)
        assert not npu.is_current_stream_capturing()
        with pytest.raises(GraphReplayError, match="failed"):
            g.replay()
        g.reset()
        with npu.graph(g):
            x.add(1)  # the graph captures again after reset()


def test_replay_after_a_captured_input_was_freed_is_a_typed_error():
    g = npu.NPUGraph()
    x = torch.ones(4)
    with npu.graph(g):
        y = x * 2
    g.replay()
    view = x[1:]
    del x
    gc.collect()
    g.replay()  # the view keeps the memory alive
    del view
    gc.collect()
    with pytest.raises(GraphReplayError, match=r"aten.mul.Tensor\(self=...\): a tensor captured by reference"):
        g.replay()
    assert torch.equal(y, torch.full((4,), 2.0))


def test_task_group_and_update_misuse():
    query, cache, table = _paged_inputs()
    out = torch.zeros(2, 2, 16, dtype=torch.half)
    lens = torch.tensor([20, 32], dtype=torch.int32)
    with pytest.raises(GraphCaptureError, match="no graph capture"):
        npu.graph_task_group_begin(None)
    g = npu.NPUGraph()
    with npu.graph(g):
        npu.graph_task_group_begin(None)
        _paged(out, query, cache, table, lens)
        handle = npu.graph_task_group_end(None)
    npu.graph_task_update_begin(None, handle)
    torch_npu._npu_paged_attention_splitfuse(query, cache, cache, table, lens, torch.zeros(2, 32),
                                             torch.tensor([1, 1], dtype=torch.int32), 1, 2, 0.25, out)
    with pytest.raises(GraphCaptureError, match="left as it was"):
        npu.graph_task_update_end(None)
    npu.graph_task_update_begin(None, handle)
    with pytest.raises(GraphCaptureError, match="allocates its outputs"):
        torch_npu.npu_fused_infer_attention_score(query.unsqueeze(2), query.unsqueeze(2), query.unsqueeze(2))
    with pytest.raises(GraphCaptureError, match=r"update called \[\]"):
        npu.graph_task_update_end(None)  # nothing recorded: the group keeps its call
    with pytest.raises(ParamInvalidError, match="handle"):
        npu.graph_task_update_begin(None, 7)
    with pytest.raises(GraphCaptureError, match="no task group"), npu.graph(npu.NPUGraph()):
        npu.graph_task_group_end(None)
    with pytest.raises(GraphCaptureError, match="without graph_task_group_end"), npu.graph(npu.NPUGraph()):
        npu.graph_task_group_begin(None)


def test_graph_arguments_are_validated():
    with pytest.raises(ParamInvalidError, match="npu_graph"):
        npu.graph(object())
    with pytest.raises(ParamInvalidError, match="pool"), npu.graph(npu.NPUGraph(), pool=(0, 1)):
        pass
    with pytest.raises(ParamInvalidError, match="capture_error_mode"), \
            npu.graph(npu.NPUGraph(), capture_error_mode="strict"):
        pass
    g = npu.NPUGraph()
    with pytest.raises(GraphReplayError, match="no finished capture"):
        g.replay()
    with npu.graph(g, pool=npu.graph_pool_handle(), capture_error_mode="thread_local"):
        pass
    with pytest.raises(GraphCaptureError, match="reset"), npu.graph(g, pool=g.pool()):
        pass
    with pytest.raises(GraphReplayError, match="auto_dispatch_capture"):
        g.update([{}])


def test_make_graphed_callables_checks_warms_up_and_returns_callables_equal_to_eager():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    x = torch.randn(8, 4, requires_grad=True)
    graphed = npu.make_graphed_callables(model, (x,))
    assert int(model[1].num_batches_tracked) == 3  # torch_npu's three warm-up iterations ran
    out = graphed(x)
    out.sum().backward()
    assert torch.equal(out, model(x)) and x.grad is not None
    f, g = npu.make_graphed_callables((torch.sin, torch.cos), ((x,), (x,)), num_warmup_iters=1)
    assert f is torch.sin and g is torch.cos
    model.register_forward_hook(lambda *_: None)
    with pytest.raises(RuntimeError, match="hooks"):
        npu.make_graphed_callables(model, (x,))
    with pytest.raises(RuntimeError, match="only Tensors"):
        npu.make_graphed_callables(torch.sin, (x, 2))
