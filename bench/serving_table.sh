#!/usr/bin/env bash
# The serving path beside the engine, in one command (issue 16): for one model shape, batch
# sizes = client counts, a prompt length and an output length, it runs
#   (a) the engine: a static batch in one process (CUDA: conveyor-bench-gpu-decode --sample,
#       whose decode steps sample every row as the REST requests are sampled, temperature 0.8
#       and top-k 40; CPU: conveyor-bench-cluster --engine, the in-process CPU engine);
#   (b) the cluster through REST: conveyor-bench-cluster (conveyor local, one or more
#       stages), one load per client count on one cluster, the 1-client load streamed for
#       its per-token latency, with the workers' and the coordinator's step traces;
#   (c) the compiled PyTorch static batch: scripts/torch_peer_decode.py (CUDA only, when
#       python3 can import torch; otherwise the column is left empty and says why), which
#       decodes greedily: it does less a step than the REST requests ask of us;
# and prints one markdown table with the ratios, plus (--mix) the time to first token and
# inter-token latency (p50, p99) of the cluster under a mix of prompt lengths.
#
#   bench/serving_table.sh [--backend cpu|cuda] [--shape gpt2-xl|gpt3-6.7b|L,C,H] [--clients 1,64,256]
#       [--prompt 128] [--new-tokens 128] [--requests-per-client 2] [--stages 1] [--mix 128,1024]
#       [--mix-clients 64] [--bin DIR] [--model DIR] [--out DIR] [--no-torch] [--no-trace]
#       [--no-step-ahead]
#
# --bin: where the programs are (default: build/bin, or $CONVEYOR_BIN_DIR for an unpacked
# bundle); --model: the tokenizer's checkpoint (default models/brown-gpt2; the random weights
# take the named shape's own vocabulary). Everything each program printed is kept under --out
# (default: a new folder in /tmp), with the table as table.md.
set -u
set -o pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
backend=cpu shape=gpt2-xl clients=1,64,256 prompt=128 new_tokens=128 rpc=2 stages=1
step_ahead=1 mix="" mix_clients=64 bin="${CONVEYOR_BIN_DIR:-$repo/build/bin}" model="$repo/models/brown-gpt2" out="" torch=1 trace=1

usage() { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
need() { [[ $# -ge 2 && -n "$2" ]] || { echo "serving_table.sh: $1 needs a value" >&2; exit 2; }; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --backend) need "$@"; backend="$2"; shift 2 ;;
    --shape) need "$@"; shape="$2"; shift 2 ;;
    --clients) need "$@"; clients="$2"; shift 2 ;;
    --prompt) need "$@"; prompt="$2"; shift 2 ;;
    --new-tokens) need "$@"; new_tokens="$2"; shift 2 ;;
    --requests-per-client) need "$@"; rpc="$2"; shift 2 ;;
    --stages) need "$@"; stages="$2"; shift 2 ;;
    --mix) need "$@"; mix="$2"; shift 2 ;;
    --mix-clients) need "$@"; mix_clients="$2"; shift 2 ;;
    --bin) need "$@"; bin="$2"; shift 2 ;;
    --model) need "$@"; model="$2"; shift 2 ;;
    --out) need "$@"; out="$2"; shift 2 ;;
    --no-torch) torch=0; shift ;;
    --no-trace) trace=0; shift ;;
    --no-step-ahead) step_ahead=0; shift ;;
    -h|--help) usage ;;
    *) echo "serving_table.sh: unknown argument '$1' (--help lists them)" >&2; exit 2 ;;
  esac
done
[[ "$backend" == cpu || "$backend" == cuda ]] || { echo "serving_table.sh: --backend is cpu or cuda, not '$backend'" >&2; exit 2; }
[[ "$clients" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || { echo "serving_table.sh: --clients wants counts like 1,64,256, not '$clients'" >&2; exit 2; }
for v in prompt new_tokens rpc stages mix_clients; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || { echo "serving_table.sh: --${v//_/-} wants a positive whole number, not '${!v}'" >&2; exit 2; }
done
[[ -z "$mix" || "$mix" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || { echo "serving_table.sh: --mix wants prompt lengths like 128,1024, not '$mix'" >&2; exit 2; }
[[ -x "$bin/conveyor-bench-cluster" ]] || { echo "serving_table.sh: no $bin/conveyor-bench-cluster (build it, or --bin DIR)" >&2; exit 1; }
[[ -f "$model/config.json" ]] || { echo "serving_table.sh: $model has no config.json (--model DIR: the tokenizer's checkpoint)" >&2; exit 1; }
[[ "$backend" == cpu || -x "$bin/conveyor-bench-gpu-decode" ]] || { echo "serving_table.sh: no $bin/conveyor-bench-gpu-decode" >&2; exit 1; }
out="${out:-$(mktemp -d /tmp/serving_table.XXXXXX)}"
mkdir -p "$out"
rm -f "$out"/engine.* "$out"/rest.jsonl "$out"/torch.csv
command_line="bench/serving_table.sh --backend $backend --shape $shape --clients $clients --prompt $prompt --new-tokens $new_tokens --requests-per-client $rpc --stages $stages${mix:+ --mix $mix --mix-clients $mix_clients}"
echo "serving_table.sh: logs and figures in $out"

# (a) the engine.
if [[ "$backend" == cuda ]]; then
  echo "== engine: conveyor-bench-gpu-decode"
  "$bin/conveyor-bench-gpu-decode" --shapes "$shape" --batches "$clients" --prompts "$prompt" --new-tokens "$new_tokens" \
      --sample --csv "$out/engine.csv" 2>&1 | tee "$out/engine.log"
else
  echo "== engine: conveyor-bench-cluster --engine (the in-process CPU engine)"
  "$bin/conveyor-bench-cluster" --engine --model "$model" --random "$shape" --concurrency "$clients" \
      --prompt-tokens "$prompt" --max-tokens "$new_tokens" --json "$out/engine.jsonl" 2>&1 | tee "$out/engine.log"
fi
engine_rc=$?

# (b) the cluster through REST.
echo "== cluster through REST: conveyor-bench-cluster --backend $backend"
trace_flag=(); [[ $trace == 1 ]] && trace_flag=(--trace)
# One cluster for every load (a large random checkpoint is written once): the client counts,
# then (--mix) the mixed prompts, streamed.
mix_flags=(); [[ -n "$mix" ]] && mix_flags=(--prompt-mix "$mix" --mix-clients "$mix_clients")
ahead_flag=(); [[ $step_ahead == 0 ]] && ahead_flag=(--no-step-ahead)
"$bin/conveyor-bench-cluster" --backend "$backend" --model "$model" --random "$shape" --stages "$stages" \
    --concurrency "$clients" --requests-per-client "$rpc" --prompt-tokens "$prompt" --max-tokens "$new_tokens" \
    --stream-at 1 "${mix_flags[@]}" "${trace_flag[@]}" "${ahead_flag[@]}" --json "$out/rest.jsonl" 2>&1 | tee "$out/rest.log"
rest_rc=$?

# (c) the compiled PyTorch static batch.
torch_note=""
if [[ $torch == 0 ]]; then
  torch_note="left out (--no-torch)"
elif [[ "$backend" != cuda ]]; then
  torch_note="not run: the PyTorch peer needs a GPU (--backend cuda)"
elif ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  torch_note="not run: python3 cannot import torch with CUDA here"
else
  echo "== PyTorch static batch: scripts/torch_peer_decode.py"
  python3 "$repo/scripts/torch_peer_decode.py" --shapes "$shape" --batches "$clients" --prompts "$prompt" \
      --new-tokens "$new_tokens" --csv "$out/torch.csv" 2>&1 | tee "$out/torch.log" || torch_note="failed: see $out/torch.log"
fi

# The table.
if [[ "$backend" == cuda ]]; then
  device="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
else
  device="$(nproc) cores of $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1), CPU"
fi
python3 - "$out" "$backend" "$shape" "$clients" "$prompt" "$new_tokens" "$device" "$command_line" "$torch_note" <<'PY' | tee "$out/table.md"
import csv, datetime, json, os, sys
out, backend, shape, clients, prompt, new_tokens, device, command, torch_note = sys.argv[1:]
clients = [int(c) for c in clients.split(",")]

def jsonl(name):
    path = os.path.join(out, name)
    return [json.loads(l) for l in open(path) if l.strip()] if os.path.exists(path) else []

def csv_rows(name):
    path = os.path.join(out, name)
    return list(csv.DictReader(open(path))) if os.path.exists(path) else []

engine = {}
if backend == "cuda":
    for r in csv_rows("engine.csv"):
        if r.get("mode", "det") != "det" or int(r["prompt"]) != int(prompt):
            continue
        whole = int(r["batch"]) * int(r["new_tokens"]) / (float(r["total_ms"]) / 1e3)  # first token + decode steps
        engine[int(r["batch"])] = (float(r["tokens_per_s"]), float(r["ms_per_token"]), whole)
else:
    for r in jsonl("engine.jsonl"):
        engine[int(r["clients"])] = (r["tokens_per_s"], r["ms_per_token"], r.get("whole_tokens_per_s"))
rest = {int(r["clients"]): r for r in jsonl("rest.jsonl") if not r.get("mixed")}
torch_rows = {}
for r in csv_rows("torch.csv"):
    if r.get("tokens_per_s"):
        torch_rows[int(r["batch"])] = (float(r["tokens_per_s"]), float(r["ms_per_token"]))

def f(x, fmt="{:,.0f}"):
    return fmt.format(x) if x is not None else "—"

def ratio(a, b):
    return f"{a / b:.2f}" if a is not None and b else "—"

print(f"\n{device}, {datetime.date.today().isoformat()}; shape {shape}, prompt {prompt} tokens, {new_tokens} new tokens, "
      f"temperature 0.8 / top-k 40 through REST and in the engine, greedy in PyTorch; "
      f"engine tokens/s: whole requests (prefill + decode, the static batch's tokens over its time) and decode steps "
      f"only; REST tokens/s: completions' tokens over the load's wall time; REST / engine: against whole requests\n")
print(f"    {command}\n")
print("| clients = batch | engine tokens/s, whole requests | engine tokens/s, decode only | REST tokens/s | REST / engine | PyTorch tokens/s | REST / PyTorch "
      "| engine ms/step | REST ms/token (1 client, streamed) | REST / engine step | stage busy | idle, input waiting (% of a step) | coordinator turn-around ms (mean / p99) |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|")
for c in clients:
    e_tps, e_ms, e_whole = engine.get(c, (None, None, None))
    r = rest.get(c, {})
    r_tps = r.get("tokens_per_s")
    t_tps = torch_rows.get(c, (None, None))[0]
    r_ms = r.get("itl_ms_mean") if c == 1 else None
    tr = r.get("trace", {})
    # Busy from the step trace (the load's own window); the heartbeats' figure needs a longer load.
    busy = " / ".join(f"{100 * st['busy']:.0f}%" for st in tr.get("stages", [])) or \
        " / ".join(f"{100 * b:.0f}%" for b in r.get("busy", [])) or "—"
    idle = " / ".join(f"{100 * s['idle_ready_of_step']:.1f}%" for s in tr.get("stages", [])) or "—"
    co = tr.get("coordinator")
    gap = f"{co['gap_ms_mean']:.3f} / {co['gap_ms_p99']:.3f}" if co else "—"
    print(f"| {c} | {f(e_whole)} | {f(e_tps)} | {f(r_tps)} | {ratio(r_tps, e_whole)} | {f(t_tps)} | {ratio(r_tps, t_tps)} | "
          f"{f(e_ms, '{:.3f}')} | {f(r_ms, '{:.3f}')} | {ratio(r_ms, e_ms) if c == 1 else '—'} | {busy} | {idle} | {gap} |")
if torch_note:
    print(f"\nPyTorch column: {torch_note}.")
mix = [r for r in jsonl("rest.jsonl") if r.get("mixed")]
if mix:
    print("\nUnder a mix of prompt lengths (requests take them in turn), streamed:\n")
    print("| clients | prompts | TTFT p50 ms | TTFT p99 ms | inter-token p50 ms | inter-token p99 ms | tokens/s |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in mix:
        print(f"| {r['clients']} | {r['prompt']} | {r['ttft_ms_p50']:.1f} | {r['ttft_ms_p99']:.1f} | "
              f"{r['itl_ms_p50']:.2f} | {r['itl_ms_p99']:.2f} | {r['tokens_per_s']:,.0f} |")
PY
table_rc=$?
if (( engine_rc | rest_rc | table_rc )); then
  echo "serving_table.sh: a step failed (engine $engine_rc, REST $rest_rc, table $table_rc); see $out" >&2
  exit 1
fi
