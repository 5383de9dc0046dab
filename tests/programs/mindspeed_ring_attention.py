# ruff: noqa: E402, I001  (imports follow the one added install() line)
import cann_attn.torch_npu; cann_attn.torch_npu.install()  # noqa: E702  (the one line added to an Ascend program)

# Below: ring attention over the sequence (context parallelism) written as Megatron-style training code for Ascend
# writes it: CUDA spellings throughout, made NPU code by `transfer_to_npu`, run with `torchrun --nproc-per-node 2`.
# Each rank holds a sequence shard of q, k and v in SBH; the k/v shards travel around the ring with isend/irecv and
# every block's torch_npu.npu_fusion_attention result is merged with torch_npu.npu_ring_attention_update. Rank 0
# gathers the output and compares it with one npu_fusion_attention call over the whole sequence.
import os

import torch
import torch.distributed as dist
import torch_npu
from torch_npu.contrib import transfer_to_npu  # noqa: F401


class RingP2P:
    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.send_rank = (self.rank + 1) % self.world_size
        self.recv_rank = (self.rank - 1) % self.world_size

    def exchange(self, tensor):
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.send_rank, self.group),
               dist.P2POp(dist.irecv, received, self.recv_rank, self.group)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        return received


def ring_attention_forward(q, k, v, head_num, softmax_scale, group):
    ring = RingP2P(group)
    kv = torch.cat((k.unsqueeze(0), v.unsqueeze(0)), dim=0)
    attn_out = softmax_max = softmax_sum = None
    for step in range(ring.world_size):
        next_kv = ring.exchange(kv) if step + 1 < ring.world_size else None
        out, block_max, block_sum = torch_npu.npu_fusion_attention(
            q, kv[0], kv[1], head_num, "SBH", pse=None, padding_mask=None, atten_mask=None, scale=softmax_scale,
            pre_tockens=q.shape[0] + kv.shape[1], next_tockens=q.shape[0] + kv.shape[1], keep_prob=1.0)[:3]
        if attn_out is None:
            attn_out, softmax_max, softmax_sum = out, block_max, block_sum
        else:
            attn_out, softmax_max, softmax_sum = torch_npu.npu_ring_attention_update(
                attn_out, softmax_max, softmax_sum, out, block_max, block_sum)
        if next_kv is not None:
            kv = next_kv
    return attn_out


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    seq_length, micro_batch, head_num, head_dim = 128, 2, 4, 32
    hidden = head_num * head_dim
    assert seq_length % world_size == 0

    torch.manual_seed(1234)
    q_full, k_full, v_full = (torch.randn(seq_length, micro_batch, hidden, dtype=torch.float16).cuda()
                              for _ in range(3))
    shard = seq_length // world_size
    q, k, v = (t[rank * shard:(rank + 1) * shard].contiguous() for t in (q_full, k_full, v_full))
    assert q.device.type == torch.zeros(1).cuda().device.type

    out = ring_attention_forward(q, k, v, head_num, head_dim ** -0.5, dist.group.WORLD)
    gathered = [torch.empty_like(out) for _ in range(world_size)]
    dist.all_gather(gathered, out)
    torch.cuda.synchronize()
    if rank == 0:
        whole = torch.cat(gathered, dim=0)
        single = torch_npu.npu_fusion_attention(q_full, k_full, v_full, head_num, "SBH", scale=head_dim ** -0.5,
                                                keep_prob=1.0)[0]
        diff = (whole.float() - single.float()).abs().max().item()
        print(f"ring attention on {world_size} ranks ({whole.device}): max |ring - single| = {diff:.2e}")
        assert diff < 2e-3, diff
        print("ring attention ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
