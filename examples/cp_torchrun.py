"""Ring attention on two processes (docs/guides/context_parallel.md, "Two processes with torchrun"):

    torchrun --nproc-per-node 2 examples/cp_torchrun.py

gloo on the CPU, NCCL with one GPU per rank. Every rank draws the same whole tensors (same seed), keeps its shard,
runs the ring forward and backward, and rank 0 compares the gathered output with the single-process operator.
"""

import os

import torch
import torch.distributed as dist

import cann_attn
import cann_attn.distributed as cp

backend = "nccl" if torch.cuda.is_available() else "gloo"
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else torch.device("cpu")
if backend == "nccl":
    torch.cuda.set_device(device)

torch.manual_seed(0)  # the same whole tensors on every rank: shard() checks it
q_full, k_full, v_full = (torch.randn(1, 1024, 4, 64) for _ in range(3))
q, k, v = (cp.shard(t, 1).to(device).requires_grad_() for t in (q_full, k_full, v_full))
options = dict(sparse_mode=2, scale_value=64 ** -0.5)
out = cp.flash_attention(q, k, v, 4, "BSND", atten_mask=cann_attn.compressed_mask(2, device), **options)
out.sum().backward()  # q.grad, k.grad, v.grad: this rank's shards of the gradients
whole = cp.unshard(out.detach(), 1)
if rank == 0:
    single = cann_attn.flash_attention(q_full, k_full, v_full, 4, "BSND", atten_mask=cann_attn.compressed_mask(2),
                                       **options)
    print(f"{world} ranks: max |ring - single process| = {(whole.cpu() - single).abs().max().item():.1e}")
dist.destroy_process_group()
