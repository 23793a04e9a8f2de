#!/usr/bin/env python3
"""Builds beam_golden.json beside each HuggingFace conformance fixture (tests/data/hf_fixtures/*,
made by scripts/make_hf_fixtures.py): the beams transformers' generate() returns for a few
prompts and settings, for Conveyor's beam-search conformance test
(tests/coordinator/test_hf_beam_conformance.cc).

    python3 scripts/make_hf_beam_fixtures.py tests/data/hf_fixtures
    python3 scripts/make_hf_beam_fixtures.py --model models/brown-gpt2 --out tests/data/beam_golden/brown-gpt2.json

The first form: for every fixture directory under the argument (or the argument itself when it is one), the
model is loaded from its fp16 checkpoint in float64 on the CPU (as golden.json's reference),
and for each draw (prompt, num_beams, num_return_sequences, length_penalty, early_stopping,
max_new_tokens, eos_token_id):

  1. transformers runs generate(num_beams=B, num_return_sequences=n, length_penalty=...,
     early_stopping=..., do_sample=False, max_new_tokens=M, eos_token_id=E) and gives the
     sequences and their sequence scores;
  2. this script runs the same search itself (the algorithm docs/API.md "Beam search" states,
     which is transformers >= 4.50's _beam_search), recomputing every live beam from scratch
     in float64, and records the smallest margin any of its decisions had: between the K-th
     and (K+1)-th candidate (K = 2B), the B-th and (B+1)-th running candidate, ranks B-1 and B
     when one of them ends a beam, the finished hypotheses kept and dropped, the n returned
     and their order, and the early-stopping test;
  3. the two must agree (same sequences, scores within 1e-4), else the script stops: the
     installed transformers decides differently from the algorithm Conveyor implements (an
     older release counted the prompt in the length penalty, or left the EOS token out);
  4. a draw whose smallest margin is below MIN_MARGIN is skipped: Conveyor computes the
     logits in float32 (fp32 weights from the fp16 checkpoint, fp32 activations), which moves
     log-probs by up to ~1e-5 on these models; a decision closer than that could go either
     way without either side being wrong. 1e-3 leaves a factor of ~100.

The eos_token_id of a draw is the model's (50256, which these random models almost never
pick) or a token the prompt's greedy continuation produces early (so beams end on it and the
EOS rules are exercised); Conveyor's test sets the model's end-of-text id to it.

The second form (--model DIR --out FILE) does the same for a trained model that has no
golden.json (the demo model, models/brown-gpt2): the prompts are the English sentences in
PROMPTS, tokenized with the model folder's vocab.json + merges.txt (transformers'
GPT2TokenizerFast), their greedy continuations computed here (float64), and the settings are
TRAINED_SETTINGS. The file also names the model folder relative to the repository root
("model"), which the tests load. It also prints how many kept draws have min_margin >= 0.1,
the margin a half-precision GPU's log-prob error (up to about 0.03) would need for a direct
comparison: with these models hardly any, so the GPU's beams are checked against a GPU
reference instead (tests/stage/cuda/test_gpu_beam_search.cc says how).

Needs PyTorch and transformers >= 4.50 (the GPU machine has both; no GPU is used).
"""
import json
import math
import os
import sys

import torch
import transformers
from transformers import GPT2LMHeadModel

MIN_MARGIN = 1e-3
SCORE_TOL = 1e-4
# (num_beams, num_return_sequences, max_new_tokens, length_penalty, early_stopping, eos choice)
# eos choice: None = the model's eos; k = the k-th token of the prompt's greedy continuation.
SETTINGS = [
    (2, 2, 12, 1.0, False, None),
    (4, 3, 16, 0.7, True, 3),
    (3, 1, 10, 2.0, "never", 2),
    (5, 5, 8, -0.5, False, 1),
    (4, 2, 14, 1.0, False, 4),
    (6, 3, 9, 1.5, "never", None),
]


# For --model: English prompts like the Brown corpus (news, fiction, learned prose), 3 to ~60 tokens.
PROMPTS = [
    "The jury said",
    "He looked at her and",
    "The President told reporters that",
    "It was a cold morning in the city, and the",
    "The committee will meet again next week to consider the new proposals for",
    "She had never seen so many people in one place. They stood along the",
    "In the spring of that year the school board voted to",
    "The state legislature adjourned yesterday without passing the bill, which would have raised "
    "the tax on",
    "He walked slowly down the road toward the old house, thinking of the letter he had received "
    "from his brother the week before, and wondering whether he should",
    "The results of the study suggest that the rate of growth in the population of the region "
    "depends largely on the supply of water and on the number of",
    "When the war ended, the family moved back to the farm. The fields had not been planted for "
    "three years, and the barn was falling down. His father said that they would have to start "
    "again, and that the first thing to do was to",
    "The church was full on Sunday morning. The minister spoke of the long winter and of the men "
    "who had gone to work in the mills of the north, and he asked the people to remember those "
    "who were sick. After the service the women gathered in the",
]
# (num_beams, num_return_sequences, max_new_tokens, length_penalty, early_stopping, eos choice), as SETTINGS.
TRAINED_SETTINGS = [
    (2, 1, 8, 1.0, False, None),
    (2, 2, 12, 1.0, True, None),
    (3, 1, 10, 2.0, "never", 2),
    (4, 3, 16, 0.7, True, 3),
    (5, 5, 8, -0.5, False, 1),
    (4, 2, 14, 1.0, False, 4),
    (6, 3, 9, 1.5, "never", None),
    (3, 2, 24, 1.0, False, None),
    (2, 1, 20, 1.2, True, 5),
]
GREEDY_TOKENS = 8
# What the GPU test needs (tests/stage/cuda/test_gpu_beam_search.cc, fp16).
GPU_MARGIN = 0.1


def log_probs_of(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    return torch.log_softmax(logits.double(), dim=-1)


def reference(model, prompt, B, n, M, lp, early, eos):
    """The search as docs/API.md states it; returns (hypotheses, smallest decision margin)."""
    K = 2 * B
    live = [([], 0.0)]  # (generated tokens, sum of log-probs)
    finished = []       # (score, tokens), best first, at most B
    margin = math.inf
    improving = True
    g = 0

    def note(a, b):
        nonlocal margin
        margin = min(margin, abs(a - b))

    while True:
        cands = []
        for b, (toks, s) in enumerate(live):
            lp_row = log_probs_of(model, prompt + toks)
            v, i = torch.topk(lp_row, K + 1)
            for x, t in zip(v.tolist(), i.tolist()):
                cands.append((s + x, b, t))
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        note(cands[K - 1][0], cands[K][0])
        top = cands[:K]
        at_length = g + 1 >= M
        stops = [at_length or c[2] == eos for c in top]
        was_full = len(finished) >= B
        running = [c for c, st in zip(top, stops) if not st]
        if len(running) > B:
            note(running[B - 1][0], running[B][0])
        if any(stops[r] for r in (B - 1, B)) and len(top) > B:
            note(top[B - 1][0], top[B][0])
        for r, (c, st) in enumerate(zip(top, stops)):
            if not st or r >= B or (early is True and was_full):
                continue
            score = c[0] / ((g + 1) ** lp)
            finished.append((score, live[c[1]][0] + [c[2]]))
            finished.sort(key=lambda h: -h[0])
            if len(finished) > B:
                note(finished[B - 1][0], finished[B][0])
                finished.pop()
        live = [(live[c[1]][0] + [c[2]], c[0]) for c in running[:B]]
        g += 1
        full = len(finished) >= B
        if all(stops) or not live or (early is True and full):
            break
        if full:
            L = M if (early == "never" and lp > 0) else g
            best_possible = live[0][1] / (L ** lp)
            note(best_possible, finished[-1][0])
            if not best_possible > finished[-1][0]:
                improving = False
        if not improving:
            break
    for r in range(min(n, len(finished) - 1)):
        note(finished[r][0], finished[r + 1][0])
    return finished[:n], margin


def hf_beams(model, prompt, B, n, M, lp, early, eos):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         num_beams=B, num_return_sequences=n, length_penalty=lp, early_stopping=early,
                         do_sample=False, max_new_tokens=M, eos_token_id=eos, pad_token_id=eos,
                         output_scores=True, return_dict_in_generate=True)
    seqs = []
    for row in out.sequences.tolist():
        gen = row[len(prompt):]
        if eos in gen:
            gen = gen[:gen.index(eos) + 1]
        seqs.append(gen)
    return seqs, [float(x) for x in out.sequences_scores.tolist()]


def fixture_dirs(root):
    if os.path.isfile(os.path.join(root, "golden.json")):
        return [root]
    return sorted(os.path.join(root, d) for d in os.listdir(root)
                  if os.path.isfile(os.path.join(root, d, "golden.json")))


def load_model(d):
    return GPT2LMHeadModel.from_pretrained(d, dtype=torch.float64, attn_implementation="eager").eval()


def draws_of(model, label, cases, settings):
    """Runs every setting on every case ({"prompt", "greedy"}); returns (kept draws, skipped draws)."""
    model_eos = int(model.config.eos_token_id)
    draws, skipped = [], []
    for case in cases:
        prompt = case["prompt"]
        for (B, n, M, lp, early, eos_choice) in settings:
            eos = model_eos if eos_choice is None else int(case["greedy"][eos_choice])
            want, margin = reference(model, prompt, B, n, M, lp, early, eos)
            seqs, scores = hf_beams(model, prompt, B, n, M, lp, early, eos)
            draw = {"prompt": prompt, "num_beams": B, "num_return_sequences": n, "max_new_tokens": M,
                    "length_penalty": lp, "early_stopping": early, "eos_token_id": eos,
                    "min_margin": margin if math.isfinite(margin) else 1e9}
            if margin < MIN_MARGIN:
                skipped.append(draw)
                print(f"{label}: prompt of {len(prompt)}, B={B} n={n}: margin {margin:.2e}, skipped", flush=True)
                continue
            mine = [t for _, t in want]
            if seqs != mine or any(abs(a - s) > SCORE_TOL for a, (s, _) in zip(scores, want)):
                sys.exit(f"{label}: prompt {prompt[:8]}..., B={B} n={n} lp={lp} early={early} eos={eos}: transformers "
                         f"{transformers.__version__} returned {seqs} {scores}, the stated algorithm {mine} "
                         f"{[s for s, _ in want]}")
            draw["sequences"] = seqs
            draw["scores"] = scores
            draws.append(draw)
    return draws, skipped


def fixtures_main(root):
    for d in fixture_dirs(root):
        model = load_model(d)
        golden = json.load(open(os.path.join(d, "golden.json")))
        draws, skipped = draws_of(model, os.path.basename(d), golden["cases"], SETTINGS)
        with open(os.path.join(d, "beam_golden.json"), "w") as f:
            json.dump({"draws": draws, "skipped": skipped, "min_margin": MIN_MARGIN,
                       "transformers": transformers.__version__,
                       "reference": "transformers GPT2LMHeadModel.generate (beam search), float64 on CPU, "
                                    "from the fp16 checkpoint"}, f)
        print(f"{os.path.basename(d)}: {len(draws)} draws kept, {len(skipped)} skipped", flush=True)


def tokenizer_of(model_dir):
    """transformers' GPT-2 tokenizer over the folder's vocab.json + merges.txt (else the tokenizers
    library's ByteLevelBPETokenizer over the same files, which made them); returns (encode, name)."""
    cls = getattr(transformers, "GPT2TokenizerFast", None) or transformers.GPT2Tokenizer
    try:
        tok = cls.from_pretrained(model_dir)
        return (lambda text: tok(text, add_special_tokens=False)["input_ids"]), f"transformers {cls.__name__}"
    except Exception as e:  # a release whose class wants other files
        print(f"transformers {cls.__name__} did not load {model_dir} ({e}); using tokenizers' ByteLevelBPETokenizer",
              flush=True)
    from tokenizers import ByteLevelBPETokenizer
    tok = ByteLevelBPETokenizer(os.path.join(model_dir, "vocab.json"), os.path.join(model_dir, "merges.txt"),
                                add_prefix_space=False)
    return (lambda text: tok.encode(text).ids), "tokenizers ByteLevelBPETokenizer"


def greedy_of(model, prompt, count):
    ids = list(prompt)
    for _ in range(count):
        ids.append(int(torch.argmax(log_probs_of(model, ids))))
    return ids[len(prompt):]


def trained_main(model_dir, out):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rel = os.path.relpath(os.path.abspath(model_dir), repo)
    if rel.startswith(".."):
        sys.exit(f"--model {model_dir}: not inside the repository ({repo}); the tests load it by a path relative to it")
    for f in ("config.json", "model.safetensors", "vocab.json", "merges.txt"):
        if not os.path.isfile(os.path.join(model_dir, f)):
            sys.exit(f"--model {model_dir}: {f} is missing")
    model = load_model(model_dir)
    encode, tokenizer_name = tokenizer_of(model_dir)
    cases = []
    for text in PROMPTS:
        prompt = [int(t) for t in encode(text)]
        if not prompt or int(model.config.eos_token_id) in prompt:
            sys.exit(f"prompt {text!r} tokenizes to {prompt}: empty or holds the end-of-text token")
        greedy = greedy_of(model, prompt, GREEDY_TOKENS)
        print(f"prompt of {len(prompt)} tokens, greedy {greedy}: {text[:50]!r}", flush=True)
        cases.append({"prompt": prompt, "greedy": greedy, "text": text})
    label = os.path.basename(os.path.normpath(model_dir))
    draws, skipped = draws_of(model, label, cases, TRAINED_SETTINGS)
    texts = {tuple(c["prompt"]): c["text"] for c in cases}
    for d in draws + skipped:
        d["text"] = texts[tuple(d["prompt"])]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"model": rel, "draws": draws, "skipped": skipped, "min_margin": MIN_MARGIN,
                   "transformers": transformers.__version__, "tokenizer": tokenizer_name,
                   "reference": "transformers GPT2LMHeadModel.generate (beam search), float64 on CPU, "
                                "from the fp16 checkpoint"}, f)
    wide = sum(d["min_margin"] >= GPU_MARGIN for d in draws)
    print(f"{label}: {len(draws)} draws kept, {len(skipped)} skipped; {wide} with min_margin >= {GPU_MARGIN}, "
          f"{sum(d['min_margin'] >= 0.3 for d in draws)} >= 0.3; wrote {out}", flush=True)


def main():
    args = sys.argv[1:]
    if len(args) == 1 and not args[0].startswith("-"):
        mode = None
    elif len(args) == 4 and sorted(args[0::2]) == ["--model", "--out"]:
        mode = dict(zip(args[0::2], args[1::2]))
    else:
        sys.exit(__doc__)
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    if (major, minor) < (4, 50):
        sys.exit(f"transformers {transformers.__version__}: 4.50 or newer is needed (its beam search is the one "
                 "docs/API.md states)")
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    if mode is None:
        fixtures_main(args[0])
    else:
        trained_main(mode["--model"], mode["--out"])


if __name__ == "__main__":
    main()
