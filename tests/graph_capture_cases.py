"""Programs that capture attention in torch.npu graphs the way Ascend projects do, each run in a fresh interpreter
after the one install() line (tests/test_torch_npu_graphs.py on the CPU, tests/test_gpu_graphs.py on CUDA):

* ``VLLM_FIA_DECODE``: a vLLM-Ascend-style decode step (projection, FIA .out on a paged cache, residual) captured
  once, then replayed step after step with new inputs written in place and the key lengths and block table given
  by task updates made after ``replay()``;
* ``PAGED_ATTENTION``: op-plugin's ATB ``_npu_paged_attention`` capture with a task update, then vLLM-Ascend's
  update of ``context_lens`` and a new block table;
* ``PEER_PATTERNS``: op-plugin's ``npu_fusion_attention_v3`` / ``_grad_v3`` graph tests (random inputs drawn in the
  capture, two replays after restoring the generators, dropout, backward in the capture) and torch_npu's FIA task
  update tests (manual, and ``auto_dispatch_capture`` with ``g.update``).

Each compares with fresh eager calls bit for bit and prints "ok" at its end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from patience import HANG_SECONDS

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = """
import torch
import cann_attn.torch_npu
cann_attn.torch_npu.install(DEVICE)
import torch_npu

def same(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), (a, b)

def generator_states():
    return torch.npu.get_rng_state(), (torch.cuda if DEVICE == "cuda" else torch).get_rng_state()

def restore_generators(states):
    # torch.npu's generator is torch's own on the device npu is mapped to; both are restored.
    torch.npu.set_rng_state(states[0])
    (torch.cuda if DEVICE == "cuda" else torch).set_rng_state(states[1])
"""

VLLM_FIA_DECODE = """
torch.manual_seed(0)
B, N, NKV, D, BLOCK, BLOCKS, LAYERS = 3, 4, 2, 16, 16, 16, 2
scale = D ** -0.5
w_q = [(torch.randn(N * D, N * D) * 0.1).npu() for _ in range(LAYERS)]
key_caches = [torch.randn(BLOCKS, BLOCK, NKV * D, dtype=torch.float16).npu() for _ in range(LAYERS)]
value_caches = [torch.randn(BLOCKS, BLOCK, NKV * D, dtype=torch.float16).npu() for _ in range(LAYERS)]
block_table = torch.arange(B * 4, dtype=torch.int32).reshape(B, 4).npu()     # persistent metadata buffer
hidden = torch.randn(B, N * D).npu()                                          # persistent input buffer
positions = torch.zeros(B, dtype=torch.int64).npu()
seq_lens = [5, 17, 30]
common = dict(num_heads=N, num_key_value_heads=NKV, input_layout="BSH", scale=scale, block_size=BLOCK)

def step_eager(lens):
    x = hidden
    for layer in range(LAYERS):
        q = (x @ w_q[layer]).to(torch.float16).unsqueeze(1)
        out, _ = torch_npu.npu_fused_infer_attention_score(q, key_caches[layer], value_caches[layer],
                                                           block_table=block_table, actual_seq_lengths_kv=lens,
                                                           **common)
        x = out.squeeze(1).float() * 2 + x
    return x

class GraphParams:
    events, handles, attn_params = [], [], []

params = GraphParams()
update_stream = torch.npu.Stream()
graph = torch.npu.NPUGraph()
before = (hidden.clone(), key_caches[0].clone(), positions.clone())
with torch.npu.graph(graph, pool=torch.npu.graph_pool_handle()):
    result = hidden
    for layer in range(LAYERS):
        query = (result @ w_q[layer]).to(torch.float16).unsqueeze(1)
        output = torch.empty_like(query)
        softmax_lse = torch.empty(1, dtype=torch.float16, device=query.device)
        workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
            query, key_caches[layer], value_caches[layer], block_table=block_table, actual_seq_lengths_kv=seq_lens,
            **common)
        stream = torch_npu.npu.current_stream()
        event = torch.npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        params.events.append(event)
        params.attn_params.append((layer, *(torch_npu._C._weak_ref_tensor(t)
                                            for t in (query, output, softmax_lse, workspace))))
        torch.npu.graph_task_group_begin(stream)
        torch_npu.npu_fused_infer_attention_score.out(
            query, key_caches[layer], value_caches[layer], block_table=block_table, actual_seq_lengths_kv=seq_lens,
            **common, workspace=workspace, out=[output, softmax_lse])
        params.handles.append(torch.npu.graph_task_group_end(stream))
        result = output.squeeze(1).float() * 2 + result
    positions.add_(1)
# The capture ran nothing that existing tensors keep: the in-place increment waits for a replay.
for now, then in zip((hidden, key_caches[0], positions), before):
    same(now, then)

def update_attn_params(lens):
    with torch.npu.stream(update_stream):
        for (layer, q, out, lse, ws), handle, event in zip(params.attn_params, params.handles, params.events):
            torch.npu.graph_task_update_begin(update_stream, handle)
            torch_npu.npu_fused_infer_attention_score.out(
                q, key_caches[layer], value_caches[layer], block_table=block_table, actual_seq_lengths_kv=lens,
                **common, workspace=ws, out=[out, lse])
            torch.npu.graph_task_update_end(update_stream)
            event.record(update_stream)

for step, lens in enumerate(([6, 18, 31], [7, 19, 32], [1, 2, 3])):
    hidden.copy_(torch.randn(B, N * D))                              # the next tokens' hidden states
    key_caches[1][step, lens[0] % BLOCK].normal_()                   # the cache gains tokens in place
    block_table[1, 3] = BLOCKS - 1 - step                            # a sequence gets a new block
    previous = result.clone()
    graph.replay()                                                   # waits for layer 0's update ...
    same(result, previous)
    update_attn_params(lens)                                         # ... made after it, as vLLM-Ascend does
    same(result, step_eager(lens))
    same(positions, torch.full((B,), step + 1, dtype=torch.int64, device=positions.device))

# The update holds for later replays; the host list captured is a copy (changing it changes nothing).
seq_lens[0] = 99
hidden.mul_(0.5)
graph.replay()
for event in params.events:
    event.record()
same(result, step_eager([1, 2, 3]))
print("ok")
"""

PAGED_ATTENTION = """
torch.manual_seed(1)
T, N, NKV, D, BLOCK, BLOCKS, MAX_BLOCKS = 2, 4, 2, 16, 16, 12, 4
scale = 1.0 / D ** 0.5
query_t = torch.randn(T, N, D, dtype=torch.float16).npu()
key_cache_t = torch.randn(BLOCKS, BLOCK, NKV, D, dtype=torch.float16).npu()
value_cache_t = torch.randn(BLOCKS, BLOCK, NKV, D, dtype=torch.float16).npu()
block_tables_t = torch.randint(0, BLOCKS, (T, MAX_BLOCKS), dtype=torch.int32).npu()
context_lens = torch.tensor([64, 64], dtype=torch.int32)
context_lens_new = torch.tensor([21, 40], dtype=torch.int32)
output_t = torch.zeros_like(query_t)
output_graph = output_t.clone()

def eager(block_table, lens):
    out = torch.zeros_like(query_t)
    torch_npu._npu_paged_attention(query_t, key_cache_t, value_cache_t, NKV, N, scale, block_table, lens, out)
    return out

# op-plugin's aclgraph update test: capture with one context_lens, update to another, replay.
torch_npu._npu_paged_attention(query_t, key_cache_t, value_cache_t, NKV, N, scale, block_tables_t,
                               context_lens_new, output_t)
g = torch.npu.NPUGraph()
event = torch.npu.ExternalEvent()
update_stream = torch.npu.Stream()
workspace = torch_npu._npu_paged_attention_get_workspace(query_t, key_cache_t, value_cache_t, NKV, N, scale,
                                                         block_tables_t, context_lens_new, output_graph)
with torch.npu.graph(g):
    stream = torch.npu.current_stream()
    event.wait(stream)
    event.reset(stream)
    torch.npu.graph_task_group_begin(stream)
    torch_npu._npu_paged_attention(query_t, key_cache_t, value_cache_t, NKV, N, scale, block_tables_t,
                                   context_lens, output_graph, workspace=workspace)
    handle = torch.npu.graph_task_group_end(stream)
same(output_graph, torch.zeros_like(output_graph))                   # the capture left it as it was
with torch.npu.stream(update_stream):
    torch.npu.graph_task_update_begin(update_stream, handle)
    torch_npu._npu_paged_attention(query_t, key_cache_t, value_cache_t, NKV, N, scale, block_tables_t,
                                   context_lens_new, output_graph, workspace=workspace)
    torch.npu.graph_task_update_end(update_stream)
    event.record(update_stream)
g.replay()
same(output_graph, output_t)

# vLLM-Ascend's paged-attention update: in-place input changes, then new context_lens and a new block table.
for lens in ([9, 50], [33, 1]):
    query_t.copy_(torch.randn(T, N, D, dtype=torch.float16))
    value_cache_t[int(block_tables_t[0, 0])].normal_()
    new_table = torch.randint(0, BLOCKS, (T, MAX_BLOCKS), dtype=torch.int32).npu()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    g.replay()
    with torch.npu.stream(update_stream):
        torch.npu.graph_task_update_begin(update_stream, handle)
        torch_npu._npu_paged_attention(query=query_t, key_cache=key_cache_t, value_cache=value_cache_t,
                                       num_kv_heads=NKV, num_heads=N, scale_value=scale, block_table=new_table,
                                       context_lens=seq_lens, out=output_graph, workspace=workspace)
        torch.npu.graph_task_update_end(update_stream)
        event.record(update_stream)
    same(output_graph, eager(new_table, seq_lens))
    # context_lens is read on the host when the task is set: changing the tensor afterwards changes nothing,
    # while the block table is device memory the replay reads.
    seq_lens.fill_(1)
    new_table.copy_(new_table.flip(0))
    g.replay()
    event.record()
    same(output_graph, eager(new_table, torch.tensor(lens, dtype=torch.int32)))

# The same call through torch.ops.atb (install() defines it) is captured alike.
g2 = torch.npu.NPUGraph()
with torch.npu.graph(g2):
    torch.ops.atb._npu_paged_attention(query_t, key_cache_t, value_cache_t, NKV, N, scale, block_tables_t,
                                       context_lens_new, output_graph)
query_t.mul_(-1)
g2.replay()
same(output_graph, eager(block_tables_t, context_lens_new))

# CUDA graph code after transfer_to_npu: torch.cuda.CUDAGraph and torch.cuda.graph are torch.npu's.
from torch_npu.contrib import transfer_to_npu  # noqa: F401
g3 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g3, pool=torch.cuda.graph_pool_handle()):
    assert torch.cuda.is_current_stream_capturing()
    torch_npu._npu_paged_attention(query_t, key_cache_t, value_cache_t, NKV, N, scale, block_tables_t,
                                   context_lens, output_graph)
query_t.mul_(-1)
g3.replay()
same(output_graph, eager(block_tables_t, context_lens))
assert torch.cuda.make_graphed_callables is torch.npu.make_graphed_callables
print("ok")
"""

PEER_PATTERNS = """

torch.manual_seed(558)
torch.npu.manual_seed(558)
s = generator_states()
H, N, D, S = 64, 4, 16, 24
cu_q, cu_k = torch.tensor([1, 3, 6]), torch.tensor([3, 7, 12])

def v3_forward(keep_prob):
    q, k, v = (torch.randn(1, S, H, dtype=torch.float16, device="npu") for _ in range(3))
    return torch_npu.npu_fusion_attention_v3(q, k, v, head_num=N, input_layout="BSH", scale=0.25,
                                             keep_prob=keep_prob)

def v3_forward_grad(keep_prob):
    q, k, v, dy = (torch.randn(1, S, H, dtype=torch.float16, device="npu") for _ in range(4))
    out = torch_npu.npu_fusion_attention_v3(q, k, v, head_num=N, input_layout="BSH", scale=0.25,
                                            keep_prob=keep_prob)
    return torch_npu.npu_fusion_attention_grad_v3(
        q, k, v, dy, head_num=N, input_layout="BSH", softmax_max=out[1], softmax_sum=out[2],
        attention_in=out[0], scale_value=0.25, keep_prob=keep_prob, seed=out[4], offset=out[5])

def tnd_backward():
    q = 2 * (torch.rand([6, N, D], device="npu") - 0.5).to(torch.float16)
    k = 2 * (torch.rand([12, 2, D], device="npu") - 0.5).to(torch.float16)
    v = 2 * (torch.rand([12, 2, D], device="npu") - 0.5).to(torch.float16)
    dy = 2 * (torch.rand([6, N, D], device="npu") - 0.5).to(torch.float16)
    for t in (q, k, v):
        t.requires_grad = True
    result = torch_npu.npu_fusion_attention_v3(q, k, v, N, scale=D ** -0.5, input_layout="TND",
                                               actual_seq_qlen=cu_q, actual_seq_kvlen=cu_k, softmax_layout="TND")
    result[0].backward(dy)
    return result, q

# op-plugin test_npu_flash_attention_tensor_graph / _with_dropmask_graph and the grad file's pair: inputs drawn
# in the capture, each replay draws the next ones (as two eager runs did after the same generator state).
for run, keep_prob in ((v3_forward, 1.0), (v3_forward, 0.9), (v3_forward_grad, 1.0), (v3_forward_grad, 0.9)):
    restore_generators(s)
    first = [t.clone() for t in run(keep_prob)[:3]]
    second = [t.clone() for t in run(keep_prob)[:3]]
    g = torch_npu.npu.NPUGraph()
    with torch_npu.npu.graph(g):
        result = run(keep_prob)
    restore_generators(s)
    for t in result[:3]:
        t.copy_(torch.zeros_like(t, device="npu"))
    g.replay()
    for got, want in zip(result, first):
        same(got, want)
    g.replay()
    for got, want in zip(result, second):
        same(got, want)

# test_npu_flash_attention_tensor_tnd_graph: forward and backward in the capture.
restore_generators(s)
first, q1 = tnd_backward()
first, first_grad = first[0].clone(), q1.grad.clone()
g = torch_npu.npu.NPUGraph()
with torch_npu.npu.graph(g):
    result, q = tnd_backward()
restore_generators(s)
result[0].copy_(torch.zeros_like(result[0], device="npu"))
g.replay()
same(result[0], first)
same(q.grad, first_grad)

# With dropout the backward would reuse the capture's mask: refused, not replayed wrongly.
try:
    with torch_npu.npu.graph(torch_npu.npu.NPUGraph()):
        q = torch.randn(6, N, D, device="npu", requires_grad=True)
        torch_npu.npu_fusion_attention_v3(q, q, q, N, "TND", actual_seq_qlen=cu_q, actual_seq_kvlen=cu_q,
                                          keep_prob=0.9)
    raise AssertionError("captured")
except cann_attn.torch_npu.GraphCaptureError as error:
    assert "keep_prob=0.9" in str(error), error

# torch_npu's test_ifa_update (manual task update) and _with_auto_dispatch_capture (g.update), v1 and v2.
query = torch.randn(1, 32, 1, 128, dtype=torch.float16, device="npu")
key = torch.randn(1, 32, 100, 128, dtype=torch.float16, device="npu")
value = torch.randn(1, 32, 100, 128, dtype=torch.float16, device="npu")
length, length_new = [29], [100]
fia = dict(num_heads=32, input_layout="BNSD", scale=1 / 0.0078125, pre_tokens=65535, next_tokens=65535,
           softmax_lse_flag=False)
res_src = torch_npu.npu_fused_infer_attention_score(query, key, value, actual_seq_lengths_kv=length_new, **fia)
workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
    query, key, value, actual_seq_lengths_kv=length, **fia)
g = torch.npu.NPUGraph()
event = torch.npu.ExternalEvent()
update_stream = torch.npu.Stream()
with torch.npu.graph(g):
    stream = torch.npu.current_stream()
    output = torch.empty(1, 32, 1, 128, dtype=torch.float16, device="npu")
    softmax_lse = torch.empty_like(res_src[1], dtype=torch.float16, device="npu")
    event.wait(stream)
    event.reset(stream)
    torch.npu.graph_task_group_begin(stream)
    torch_npu.npu_fused_infer_attention_score.out(query, key, value, actual_seq_lengths_kv=length, **fia,
                                                  workspace=workspace, out=[output, softmax_lse])
    handle = torch.npu.graph_task_group_end(stream)
with torch.npu.stream(update_stream):
    torch.npu.graph_task_update_begin(update_stream, handle)
    output2, softmax_lse2 = torch_npu.npu_fused_infer_attention_score.out(
        query, key, value, actual_seq_lengths_kv=length_new, **fia, workspace=workspace, out=[output, softmax_lse])
    torch.npu.graph_task_update_end(update_stream)
    event.record(update_stream)
g.replay()
same(output, res_src[0])
assert output2 is output and softmax_lse2 is softmax_lse

# torch_npu's test_fia_out_4in1_with_graph: the update, the call and the record in one call.
q = torch.randn(1, 8, 24, 64, dtype=torch.float16, device="npu")
k = torch.randn(1, 8, 160, 64, dtype=torch.float16, device="npu")
four = dict(num_heads=8, input_layout="BNSD", scale=64 ** -0.5, pre_tokens=65535, next_tokens=65535)
output = torch.empty(1, 8, 24, 64, dtype=torch.float16, device="npu")
softmax_lse = torch.empty(1, dtype=torch.float16, device="npu")
torch_npu.npu_fused_infer_attention_score.out(q, k, k, actual_seq_lengths=[24], actual_seq_lengths_kv=[160],
                                              **four, out=[output, softmax_lse])
g, event = torch.npu.NPUGraph(), torch.npu.ExternalEvent()
with torch.npu.graph(g):
    stream = torch.npu.current_stream()
    output1 = torch.empty(1, 8, 24, 64, dtype=torch.float16, device="npu")
    softmax_lse1 = torch.empty(1, dtype=torch.float16, device="npu")
    event.wait(stream)
    event.reset(stream)
    torch.npu.graph_task_group_begin(stream)
    torch_npu.npu_fused_infer_attention_score.out(q, k, k, actual_seq_lengths=[24], actual_seq_lengths_kv=[100],
                                                  **four, out=[output1, softmax_lse1])
    handle = torch.npu.graph_task_group_end(stream)
with torch.npu.stream(update_stream):
    output2, softmax_lse2 = torch_npu._C._npu_fused_infer_attention_score_out_graph(
        update_stream, handle, event, q, k, k, actual_seq_lengths=[24], actual_seq_lengths_kv=[160], **four,
        out=[output1, softmax_lse1])
g.replay()
same(output1, output)
assert output2 is output1

for non_out in (False, True):
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, auto_dispatch_capture=True):
        output = torch.empty(1, 32, 1, 128, dtype=torch.float16, device="npu")
        softmax_lse = torch.empty(1, dtype=torch.float16, device="npu")
        if non_out:
            output, softmax_lse = torch_npu.npu_fused_infer_attention_score(
                query, key, value, actual_seq_lengths_kv=length, **fia)
        else:
            torch_npu.npu_fused_infer_attention_score.out(query, key, value, actual_seq_lengths_kv=length, **fia,
                                                          workspace=workspace, out=[output, softmax_lse])
    g.update(cpu_update_input=[{"actual_seq_lengths_kv": length_new}])
    g.replay()
    same(output, res_src[0])

v2 = dict(num_query_heads=32, input_layout="BNSD", softmax_scale=1 / 0.0078125, pre_tokens=65535,
          next_tokens=65535, return_softmax_lse=False)
res_v2 = torch_npu.npu_fused_infer_attention_score_v2(query, key, value, actual_seq_kvlen=length_new, **v2)
g = torch.npu.NPUGraph()
with torch.npu.graph(g, auto_dispatch_capture=True):
    output, softmax_lse = torch_npu.npu_fused_infer_attention_score_v2(query, key, value, actual_seq_kvlen=length,
                                                                       **v2)
g.update(cpu_update_input=[{"actual_seq_kvlen": length_new}])
g.replay()
same(output, res_v2[0])
print("ok")
"""

CASES = {"vllm_fia_decode": VLLM_FIA_DECODE, "paged_attention": PAGED_ATTENTION, "peer_patterns": PEER_PATTERNS}


def run_case(name: str, device: str) -> subprocess.CompletedProcess:
    """Run one program in a fresh interpreter with the npu device mapped to `device`."""
    source = textwrap.dedent(PRELUDE) + textwrap.dedent(CASES[name])
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-c", f"DEVICE = {device!r}\n{source}"], env=env, capture_output=True,
                          text=True, timeout=HANG_SECONDS, cwd=ROOT)
