# ruff: noqa: E402  (imports follow the one added install() line)
"""A CUDA training script as Ascend projects run it (docs/guides/torch_npu.md, "transfer_to_npu"): written for
CUDA, made NPU code by ``from torch_npu.contrib import transfer_to_npu``, with torch_npu's fused attention and mixed
precision. The one added line maps the npu device to CUDA when a GPU is available, else to the CPU.

    python examples/transfer_train.py                # 8 steps, a few seconds on a CPU
    python examples/transfer_train.py --steps 3

Prints each step's loss, the loss scale and whether the step was taken, then a summary line.
"""

import cann_attn.torch_npu; cann_attn.torch_npu.install()  # noqa: E702, I001  (the one added line)

import argparse

import torch
import torch_npu
from torch_npu.contrib import transfer_to_npu  # noqa: F401  (cuda -> npu)


class Attention(torch.nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x):  # x [B, S, H]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), diagonal=1)
        out = torch_npu.npu_fusion_attention(q, k, v, self.heads, "BSH", atten_mask=mask, sparse_mode=0,
                                             scale=(x.shape[-1] // self.heads) ** -0.5, keep_prob=1.0)[0]
        return self.proj(out)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = Attention(hidden=64, heads=4).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.cuda.amp.GradScaler(init_scale=2.0 ** 10)
    data = torch.randn(4, 32, 64, device="cuda")
    target = torch.roll(data, shifts=1, dims=1)

    taken, losses = 0, []
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        with torch.cuda.amp.autocast():
            loss = torch.nn.functional.mse_loss(model(data).float(), target)
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        stepped = scaler.get_scale() >= scale
        taken += stepped
        losses.append(loss.item())
        print(f"step {step}: loss {loss.item():.4f} scale {scale:.0f} {'stepped' if stepped else 'skipped'}")
    torch.cuda.synchronize()
    print(f"{taken} of {args.steps} steps taken on {data.device} ({torch.cuda.get_device_name()}); "
          f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
