# ruff: noqa: E402, I001  (imports follow the one added install() line)
import cann_attn.torch_npu; cann_attn.torch_npu.install()  # noqa: E702  (the one line added to an Ascend program)

# Below: a DeepSpeed-Ulysses check written the way sequence-parallel libraries write their NPU tests (run with
# `torchrun --nproc-per-node 2`). Every rank draws the whole tensors, keeps its sequence shard, exchanges heads for
# sequence with all-to-all, runs torch_npu.npu_fusion_attention_v2 on its heads, exchanges back, and compares output
# and gradients with one npu_fusion_attention_v2 call over the whole sequence.
import torch
import torch.distributed as dist

import torch_npu
from ring_helpers import causal_block_mask  # module-level @torch.jit.script helpers


class SeqAllToAll4D(torch.autograd.Function):
    """[B, S/P, N, D] sharded by sequence <-> [B, S, N/P, D] sharded by heads."""

    @staticmethod
    def forward(ctx, group, x, scatter_idx, gather_idx):
        ctx.group, ctx.scatter_idx, ctx.gather_idx = group, scatter_idx, gather_idx
        return all_to_all_4d(x, scatter_idx, gather_idx, group)

    @staticmethod
    def backward(ctx, grad):
        return None, all_to_all_4d(grad, ctx.gather_idx, ctx.scatter_idx, ctx.group), None, None


def all_to_all_4d(x, scatter_idx, gather_idx, group):
    world = dist.get_world_size(group)
    pieces = [p.contiguous() for p in x.chunk(world, dim=scatter_idx)]
    received = [torch.empty_like(p) for p in pieces]
    dist.all_to_all(received, pieces, group=group)
    return torch.cat(received, dim=gather_idx).contiguous()


def ulysses_attention(q, k, v, causal, group=None):
    q, k, v = (SeqAllToAll4D.apply(group, t, 2, 1) for t in (q, k, v))
    seqlen = q.shape[1]
    mask = causal_block_mask(seqlen, seqlen, 0, q.device) if causal else None
    out = torch_npu.npu_fusion_attention_v2(q, k, v, head_num=q.shape[2], input_layout="BSND",
                                            atten_mask=mask, scale=q.shape[-1] ** -0.5, pre_tokens=65535,
                                            next_tokens=0 if causal else 65535)[0]
    return SeqAllToAll4D.apply(group, out, 1, 2)


if __name__ == "__main__":
    dist.init_process_group("hccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"npu:{rank}")
    torch.npu.set_device(device)
    dtype = torch.bfloat16 if torch.npu.is_bf16_supported() else torch.float16
    batch_size, seqlen, nheads, d = 2, 64, 4, 32
    causal = True
    assert seqlen % world_size == 0 and nheads % world_size == 0

    q = torch.randn(batch_size, seqlen, nheads, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(batch_size, seqlen, nheads, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(batch_size, seqlen, nheads, d, device=device, dtype=dtype, requires_grad=True)
    dout = torch.randn(batch_size, seqlen, nheads, d, device=device, dtype=dtype)
    for t in (q, k, v, dout):
        dist.broadcast(t.data, src=0)

    local_q, local_k, local_v = (t.chunk(world_size, dim=1)[rank].detach().clone().requires_grad_()
                                 for t in (q, k, v))
    local_dout = dout.chunk(world_size, dim=1)[rank].detach().clone()

    local_out = ulysses_attention(local_q, local_k, local_v, causal)
    local_out.backward(local_dout)
    dist.barrier()

    mask = torch.triu(torch.ones(seqlen, seqlen, dtype=torch.bool, device=device), diagonal=1)
    out_ref = torch_npu.npu_fusion_attention_v2(q, k, v, head_num=nheads, input_layout="BSND", atten_mask=mask,
                                                scale=d ** -0.5, pre_tokens=65535, next_tokens=0)[0]
    out_ref.backward(dout)
    torch.npu.synchronize()

    checks = {"out": (local_out, out_ref), "dq": (local_q.grad, q.grad), "dk": (local_k.grad, k.grad),
              "dv": (local_v.grad, v.grad)}
    for name, (local, whole) in checks.items():
        reference = whole.chunk(world_size, dim=1)[rank].float()
        diff = (local.float() - reference).abs().max().item()
        print(f"[{rank}] {name} max diff {diff:.2e}", flush=True)
        assert diff <= 2e-2 * max(1.0, reference.abs().max().item()), (name, diff)  # a few 16-bit roundings
    dist.barrier()
    if rank == 0:
        print(f"ulysses ok on {world_size} ranks, device {q.device}")
    dist.destroy_process_group()
