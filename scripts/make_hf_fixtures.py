#!/usr/bin/env python3
"""Builds the HuggingFace conformance fixtures for Conveyor's engines.

Each fixture is a randomly initialised GPT2LMHeadModel (full 50257-token vocabulary),
saved with save_pretrained in fp16, plus golden.json: for several prompts (one longer
than 100 tokens), the greedy continuation and the per-step top-5 log-probabilities.
The reference runs in float64 on the CPU from the saved fp16 weights, so it is the exact
function the checkpoint defines.

    python3 scripts/make_hf_fixtures.py OUT_DIR

Needs PyTorch and transformers (the GPU machine has both; no GPU is used).
"""
import json
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel

# name: (n_embd, n_head, n_layer, n_inner or None, activation). Head dims 32, 48, 64, 128;
# n_inner other than 4*n_embd on three of them; 1 to 6 layers.
SHAPES = {
    "hd32_l2": (96, 3, 2, 300, "gelu_new"),
    "hd48_l3": (96, 2, 3, None, "gelu_new"),
    "hd64_l1_gelu": (64, 1, 1, 200, "gelu"),
    "hd128_l6": (128, 1, 6, 256, "gelu_new"),
}
PROMPT_LENGTHS = (1, 7, 23, 117)
STEPS = 48
N_POSITIONS = 256
MIN_TOP2_GAP = 2e-3  # reject draws where greedy would hinge on a near-tie


def build_model(name, seed):
    n_embd, n_head, n_layer, n_inner, act = SHAPES[name]
    cfg = GPT2Config(vocab_size=50257, n_positions=N_POSITIONS, n_embd=n_embd, n_layer=n_layer,
                     n_head=n_head, n_inner=n_inner, activation_function=act,
                     initializer_range=0.1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     attn_implementation="eager")
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg).eval()
    # Non-trivial LayerNorm gains and biases, so the loader's handling of each is tested.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.normal_(0.0, 0.05)
            elif ".ln_" in pname and pname.endswith(".weight"):
                p.normal_(1.0, 0.1)
    return model


def reference(model_dir, prompts):
    model = GPT2LMHeadModel.from_pretrained(model_dir, dtype=torch.float64,
                                            attn_implementation="eager").eval()
    cases, min_gap = [], float("inf")
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            greedy, top_ids, top_lp = [], [], []
            for _ in range(STEPS):
                logits = model(torch.tensor([ids])).logits[0, -1]
                lp = torch.log_softmax(logits, dim=-1)
                v, i = torch.topk(lp, 5)
                min_gap = min(min_gap, float(v[0] - v[1]))
                greedy.append(int(i[0]))
                top_ids.append([int(x) for x in i])
                top_lp.append([float(x) for x in v])
                ids.append(int(i[0]))
            cases.append({"prompt": list(prompt), "greedy": greedy, "top5_ids": top_ids,
                          "top5_logprobs": top_lp})
    return cases, min_gap


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "fixtures"
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    for k, name in enumerate(SHAPES):
        for attempt in range(20):
            seed = 1000 * k + attempt
            d = os.path.join(out, name)
            model = build_model(name, seed)
            model.half().save_pretrained(d, safe_serialization=True)
            g = torch.Generator().manual_seed(seed)
            prompts = [torch.randint(0, 50257, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
            cases, gap = reference(d, prompts)
            if gap >= MIN_TOP2_GAP:
                break
            print(f"{name}: seed {seed} has a top-2 gap of {gap:.2e}; drawing again", flush=True)
        with open(os.path.join(d, "golden.json"), "w") as f:
            json.dump({"cases": cases, "seed": seed, "min_top2_gap": gap,
                       "reference": "transformers GPT2LMHeadModel, float64 on CPU, from the fp16 checkpoint"}, f)
        for extra in os.listdir(d):
            if extra not in ("config.json", "model.safetensors", "golden.json"):
                os.remove(os.path.join(d, extra))
        print(f"{name}: seed {seed}, min top-2 gap {gap:.3f}, "
              f"{os.path.getsize(os.path.join(d, 'model.safetensors')) / 1e6:.1f} MB", flush=True)


if __name__ == "__main__":
    main()
