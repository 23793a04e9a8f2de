#!/usr/bin/env python3
"""The PyTorch peer of conveyor-bench-gpu-decode: the same GPT-2-family shapes, synthetic
weights, prompts and greedy decoding, written the way a PyTorch user would (gpt-fast style):
plain nn.Modules, a static K/V cache per layer written with index_copy_, attention through
F.scaled_dot_product_attention, and the decode step compiled with
torch.compile(mode="reduce-overhead") (CUDA graphs). Prefill runs eagerly with SDPA's causal
kernel. Prints the same columns as the C++ benchmark:

  shape dtype batch prompt ttft_ms ms/token p50_ms tokens/s floor_ms floor%

ms/token is one decode step for the whole batch, including reading the chosen ids back to
the host, as in the C++ benchmark. The floor (batch 1) is the bytes a decode step reads
(layers + LM head) over the device-to-device copy bandwidth measured in this run.

  python3 scripts/torch_peer_decode.py [--shapes gpt2-xl,gpt3-6.7b] [--batches 1,8,32,128]
      [--prompts 128,1024] [--new-tokens 128] [--dtype f16|bf16] [--no-compile] [--csv FILE]

A static batch: every sequence of a row has the same prompt length and decodes together, the
batch never changes (what conveyor-bench-gpu-decode measures, and bench/serving_table.sh
sets beside the engine and the cluster through REST). --csv appends one line per row:
shape,dtype,batch,prompt,new_tokens,ttft_ms,ms_per_token,p50_ms,tokens_per_s (a header first
when the file is new or empty); rows that did not fit in memory are written with empty
figures and the note "out of memory".
"""
import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

SHAPES = {  # n_layer, n_embd, n_head, n_positions (as common/model_config.cc's named_model_shape)
    "gpt2-xl": (48, 1600, 25, 1024),
    "gpt3-6.7b": (32, 4096, 32, 2048),
    "gpt3-13b": (40, 5120, 40, 2048),
    "gpt3-175b": (96, 12288, 96, 2048),
}
VOCAB = 50257


def parse_shape(spec):
    if spec in SHAPES:
        return SHAPES[spec]
    layers, embd, heads = (int(x) for x in spec.split(","))
    return layers, embd, heads, 2048


class Block(nn.Module):
    def __init__(self, C, H, batch, max_len, dtype):
        super().__init__()
        self.C, self.H, self.D = C, H, C // H
        self.ln_1 = nn.LayerNorm(C)
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)
        self.ln_2 = nn.LayerNorm(C)
        self.c_fc = nn.Linear(C, 4 * C)
        self.mlp_proj = nn.Linear(4 * C, C)
        self.register_buffer("k_cache", torch.zeros(batch, H, max_len, C // H, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(batch, H, max_len, C // H, dtype=dtype), persistent=False)

    def forward(self, x, input_pos, mask):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=-1)
        q = q.view(B, T, self.H, self.D).transpose(1, 2)
        k = k.view(B, T, self.H, self.D).transpose(1, 2)
        v = v.view(B, T, self.H, self.D).transpose(1, 2)
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        if mask is None:  # prefill from an empty cache: causal over the new tokens alone
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # decode: the whole static cache, positions past input_pos masked
            y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, L, C, H, P, batch, max_len, dtype):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, C)
        self.wpe = nn.Embedding(P, C)
        self.blocks = nn.ModuleList(Block(C, H, batch, max_len, dtype) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)
        self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)), persistent=False)

    def forward(self, ids, input_pos, decode: bool):
        x = self.wte(ids) + self.wpe(input_pos)[None]
        mask = self.causal[input_pos][None, None] if decode else None
        for b in self.blocks:
            x = b(x, input_pos, mask)
        logits = F.linear(self.ln_f(x[:, -1]), self.wte.weight)  # tied LM head
        return logits.argmax(dim=-1)


def build(shape, batch, max_len, dtype):
    L, C, H, P = parse_shape(shape)
    P = max(P, max_len)
    with torch.device("cuda"):
        model = GPT(L, C, H, P, batch, max_len, dtype).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight":
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    elem = torch.empty((), dtype=dtype).element_size()
    step_bytes = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("wpe")) * elem
    return model.eval(), step_bytes


def copy_bandwidth():
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(1)
    b = torch.empty_like(a)
    b.copy_(a)
    best = 0.0
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            b.copy_(a)
        e1.record()
        e1.synchronize()
        best = max(best, 2.0 * n * 10 / (e0.elapsed_time(e1) * 1e-3))
    del a, b
    return best


@torch.no_grad()
def run_once(model, step, batch, prompt, decode_steps, gen):
    ids = torch.randint(0, VOCAB, (batch, prompt), device="cuda", generator=gen)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    nxt = model(ids, torch.arange(prompt, device="cuda"), False).view(batch, 1)
    nxt.cpu()
    ttft = (time.perf_counter() - t0) * 1e3
    times = []
    pos = torch.tensor([prompt], device="cuda")
    for i in range(decode_steps):
        t = time.perf_counter()
        out = step(nxt, pos, True)
        out_host = out.cpu()  # read the ids back, as a server would
        times.append((time.perf_counter() - t) * 1e3)
        nxt = out.clone().view(batch, 1)
        pos += 1
        del out_host
    return ttft, times


def parse_args():
    """The command line, checked: (args, batches, prompts)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="gpt2-xl,gpt3-6.7b")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--prompts", default="128,1024")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="f16", choices=["f16", "bf16"])
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--csv", default="", help="append one line per row to this file")
    args = ap.parse_args()
    try:
        batches = [int(x) for x in args.batches.split(",")]
        prompts = [int(x) for x in args.prompts.split(",")]
    except ValueError:
        ap.error(f"--batches and --prompts take whole numbers separated by commas, got {args.batches!r} and {args.prompts!r}")
    if min(batches) < 1 or min(prompts) < 1 or args.new_tokens < 2:
        ap.error("--batches and --prompts must be at least 1, --new-tokens at least 2")
    for shape in args.shapes.split(","):
        try:
            parse_shape(shape)
        except ValueError:
            ap.error(f"unknown shape {shape!r}: use {', '.join(SHAPES)} or n_layer,n_embd,n_head")
    return args, batches, prompts


def main():
    args, batches, prompts = parse_args()
    csv = None
    if args.csv:
        new_file = not os.path.exists(args.csv) or os.path.getsize(args.csv) == 0
        csv = open(args.csv, "a")
        if new_file:
            csv.write("shape,dtype,batch,prompt,new_tokens,ttft_ms,ms_per_token,p50_ms,tokens_per_s,note\n")
            csv.flush()

    def csv_row(shape, batch, prompt, ttft="", ms="", p50="", tps="", note=""):
        if csv:
            csv.write(f"{shape},{args.dtype},{batch},{prompt},{args.new_tokens},{ttft},{ms},{p50},{tps},{note}\n")
            csv.flush()
    dtype = torch.float16 if args.dtype == "f16" else torch.bfloat16
    torch._dynamo.config.cache_size_limit = 64
    torch.backends.cuda.matmul.allow_tf32 = True
    bw = copy_bandwidth()
    prop = torch.cuda.get_device_properties(0)
    print(f"# device: {prop.name}, {prop.multi_processor_count} SMs; torch {torch.__version__}; "
          f"device-to-device copy {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    header = (f"{'shape':<10} {'dtype':<5} {'batch':>5} {'prompt':>6} {'ttft_ms':>10} {'ms/token':>9} {'p50_ms':>9} "
              f"{'tokens/s':>10} {'floor_ms':>9} {'floor%':>8}")
    table = [header]
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1234)
    for shape in args.shapes.split(","):
        for prompt in prompts:
            for batch in batches:
                max_len = prompt + args.new_tokens
                try:
                    model, step_bytes = build(shape, batch, max_len, dtype)
                except torch.cuda.OutOfMemoryError:
                    table.append(f"{shape:<10} {args.dtype:<5} {batch:>5} {prompt:>6}   skipped: out of memory")
                    print(table[-1], flush=True)
                    csv_row(shape, batch, prompt, note="out of memory")
                    torch.cuda.empty_cache()
                    continue
                step = model if args.no_compile else torch.compile(model, mode="reduce-overhead", fullgraph=True)
                t0 = time.perf_counter()
                try:
                    run_once(model, step, batch, prompt, 4, gen)  # compile + graph capture
                    ttft, times = run_once(model, step, batch, prompt, args.new_tokens - 1, gen)
                except torch.cuda.OutOfMemoryError:
                    table.append(f"{shape:<10} {args.dtype:<5} {batch:>5} {prompt:>6}   skipped: out of memory")
                    print(table[-1], flush=True)
                    csv_row(shape, batch, prompt, note="out of memory")
                    del model, step
                    torch.cuda.empty_cache()
                    continue
                warm = time.perf_counter() - t0
                ms = statistics.fmean(times)
                p50 = statistics.median(times)
                floor = step_bytes / bw * 1e3
                floor_s, frac_s = (f"{floor:.3f}", f"{100 * floor / ms:.1f}%") if batch == 1 else ("-", "-")
                table.append(f"{shape:<10} {args.dtype:<5} {batch:>5} {prompt:>6} {ttft:>10.2f} {ms:>9.3f} {p50:>9.3f} "
                             f"{batch * 1e3 / ms:>10.1f} {floor_s:>9} {frac_s:>8}")
                print(table[-1] + f"   (compile + runs {warm:.0f} s)", flush=True)
                csv_row(shape, batch, prompt, f"{ttft:.3f}", f"{ms:.4f}", f"{p50:.4f}", f"{batch * 1e3 / ms:.1f}")
                del model, step
                torch._dynamo.reset()
                torch.cuda.empty_cache()
    print()
    print("\n".join(table))


if __name__ == "__main__":
    sys.exit(main())
