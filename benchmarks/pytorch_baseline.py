"""The reference the shakespeare_char recipe is held to: the same baby GPT in PyTorch eager.

GPT-2 block (LayerNorm, learned positions, GELU, biases, tied embeddings), 4 layers, 4 heads,
width 128, context 64, batch 12, vocabulary 256 (bytes), AdamW, float32, as nanoGPT's CPU
recipe. Needs torch (not a meshlm dependency):

    python benchmarks/pytorch_baseline.py [--steps=200] [--bf16]

Prints one JSON object: median step time and tokens/s over the timed steps, on random tokens.
"""

import argparse
import json
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F

V, D, H, L, T, B = 256, 128, 4, 4, 64, 12


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.ln_f = nn.LayerNorm(D)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T
        return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--bf16", action="store_true", help="autocast matmuls to bfloat16 (float32 weights)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    data = torch.randint(0, V, (8, B, T + 1))
    times = []
    for i in range(args.steps + 5):
        batch = data[i % 8]
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - start)
    times = times[5:]
    step = statistics.median(times)
    print(json.dumps({"torch": torch.__version__, "bf16": args.bf16, "threads": torch.get_num_threads(), "step_time_s": step,
                      "step_time_min_s": min(times), "tokens_per_sec": B * T / step}))


if __name__ == "__main__":
    main()
