# ruff: noqa: E402  (imports follow the one added install() line)
"""An Ascend training script, written the way torch_npu code is written, run off the NPU by one added line.

Everything below the marked line is ordinary Ascend code: ``import torch_npu``, ``torch.npu.set_device``,
``.npu()``, ``device="npu"``, ``torch_npu.npu_fusion_attention`` in the forward pass (its backward through
autograd), ``torch.npu.synchronize()`` and NPU events for timing. ``cann_attn.torch_npu.install()`` maps the npu
device to CUDA when a GPU is available, else to the CPU (docs/guides/torch_npu.md, "The npu device"); on an
Ascend machine, delete that line and the script runs on the NPU with the real torch_npu.

    python examples/ascend_train.py                 # 20 steps of a one-layer causal attention model, a few seconds
    python examples/ascend_train.py --steps 5 --out /tmp/ascend_train.pt

Prints the loss per step; ``--out`` saves the losses and the final weights (torch.save). tests/test_npu_device.py
runs it after ``install(device="cpu")``, and checks a smaller script of the same style against the plain CPU call.
"""

import cann_attn.torch_npu; cann_attn.torch_npu.install()  # noqa: E702, I001  (the one added line)

import argparse
import os

import torch
import torch_npu
from torch import nn


class CausalSelfAttention(nn.Module):
    """One attention layer in the packed TND layout: several sequences of different lengths in one batch."""

    def __init__(self, hidden: int, head_num: int):
        super().__init__()
        self.head_num, self.head_dim = head_num, hidden // head_num
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        # sparse_mode 3 (causal, the lower-right triangle) takes the 2048 x 2048 compressed mask.
        self.register_buffer("atten_mask", torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device="npu"), 1),
                             persistent=False)

    def forward(self, x: torch.Tensor, cu_seqlens: list) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv(x).view(tokens, 3, self.head_num, self.head_dim).unbind(1)
        out = torch_npu.npu_fusion_attention(
            q, k, v, self.head_num, "TND", atten_mask=self.atten_mask, scale=self.head_dim ** -0.5,
            sparse_mode=3, actual_seq_qlen=cu_seqlens, actual_seq_kvlen=cu_seqlens)[0]
        return self.proj(out.reshape(tokens, -1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None, help="torch.save the losses and final weights here")
    args = parser.parse_args(argv)

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.npu.set_device(local_rank)
    torch.manual_seed(0)
    torch.npu.manual_seed_all(0)

    hidden, head_num, vocabulary = 64, 4, 97
    embed = nn.Embedding(vocabulary, hidden).npu()
    model = CausalSelfAttention(hidden, head_num).to(f"npu:{local_rank}")
    head = nn.Linear(hidden, vocabulary).npu()
    parameters = [*embed.parameters(), *model.parameters(), *head.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=3e-3)

    cu_seqlens = [24, 40, 64]                                  # three packed sequences: 24, 16 and 24 tokens
    tokens = torch.randint(0, vocabulary, (cu_seqlens[-1] + 1,), device="npu")
    start, end = torch.npu.Event(enable_timing=True), torch.npu.Event(enable_timing=True)
    losses = []
    start.record()
    for step in range(args.steps):
        hidden_states = embed(tokens[:-1])
        logits = head(hidden_states + model(hidden_states, cu_seqlens))
        loss = nn.functional.cross_entropy(logits, tokens[1:].long())
        optimizer.zero_grad()
        loss.backward()                                        # FlashAttentionScoreGrad through autograd
        optimizer.step()
        losses.append(loss.item())
        print(f"step {step:3d}  loss {losses[-1]:.4f}")
    end.record()
    torch.npu.synchronize()
    print(f"{args.steps} steps in {start.elapsed_time(end):.0f} ms on {'npu' if tokens.is_npu else tokens.device}"
          f" (mapped to {tokens.device}), peak memory {torch.npu.max_memory_allocated() / 2**20:.1f} MiB")
    if args.out:
        weights = {name: value.cpu() for name, value in model.state_dict().items()}
        torch.save({"losses": losses, "weights": weights}, args.out)
    return losses


if __name__ == "__main__":
    main()
