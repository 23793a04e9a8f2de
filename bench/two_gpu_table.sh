#!/usr/bin/env bash
# The same GPUs three ways, through REST (issue 31): one model shape served by
#   one      one stage on one GPU (the baseline the others are divided by),
#   tp       one stage whose ranks span the N GPUs (conveyor local --tp N),
#   stages   N pipeline stages, one a GPU (--stages N),
#   replicas N one-stage pipelines, one a GPU (--replicas N; when the model fits one GPU),
# each at the same client counts, streamed, and one markdown table of tokens/s (and its
# ratio to one GPU's), time to first token and inter-token latency (p50 / p99) and the
# serving workers' busy fractions.
#
#   bench/two_gpu_table.sh [--shape gpt3-6.7b] [--gpus 2] [--clients 1,64,256] [--prompt 128]
#       [--new-tokens 128] [--requests-per-client 2] [--layouts one,tp,stages,replicas] [--bin DIR]
#       [--model DIR] [--out DIR] [--table-only]
#
# --bin: where the programs are (default: build/bin, or $CONVEYOR_BIN_DIR for an unpacked
# bundle); --model: the tokenizer's checkpoint (default models/brown-gpt2). Everything each
# run printed is kept under --out (default: a new folder in /tmp), with the table as table.md;
# the table also shows the rows of layouts an earlier run left in --out (--table-only: runs
# nothing, makes the table of what is there). figures.jsonl: the rows as
# `conveyor local --layout-figures` reads them (coordinator/layout_choice.h).
set -u
set -o pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
shape=gpt3-6.7b gpus=2 clients=1,64,256 prompt=128 new_tokens=128 rpc=2 layouts=one,tp,stages,replicas
bin="${CONVEYOR_BIN_DIR:-$repo/build/bin}" model="$repo/models/brown-gpt2" out="" table_only=0

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
need() { [[ $# -ge 2 && -n "$2" ]] || { echo "two_gpu_table.sh: $1 needs a value" >&2; exit 2; }; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --shape) need "$@"; shape="$2"; shift 2 ;;
    --gpus) need "$@"; gpus="$2"; shift 2 ;;
    --clients) need "$@"; clients="$2"; shift 2 ;;
    --prompt) need "$@"; prompt="$2"; shift 2 ;;
    --new-tokens) need "$@"; new_tokens="$2"; shift 2 ;;
    --requests-per-client) need "$@"; rpc="$2"; shift 2 ;;
    --layouts) need "$@"; layouts="$2"; shift 2 ;;
    --bin) need "$@"; bin="$2"; shift 2 ;;
    --model) need "$@"; model="$2"; shift 2 ;;
    --out) need "$@"; out="$2"; shift 2 ;;
    --table-only) table_only=1; shift ;;
    -h|--help) usage ;;
    *) echo "two_gpu_table.sh: unknown argument '$1' (--help lists them)" >&2; exit 2 ;;
  esac
done
[[ "$clients" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || { echo "two_gpu_table.sh: --clients wants counts like 1,64,256, not '$clients'" >&2; exit 2; }
for v in gpus prompt new_tokens rpc; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || { echo "two_gpu_table.sh: --${v//_/-} wants a positive whole number, not '${!v}'" >&2; exit 2; }
done
[[ "$layouts" =~ ^(one|tp|stages|replicas)(,(one|tp|stages|replicas))*$ ]] ||
  { echo "two_gpu_table.sh: --layouts wants one, tp, stages and/or replicas separated by commas, not '$layouts'" >&2; exit 2; }
[[ $table_only == 1 && -z "$out" ]] && { echo "two_gpu_table.sh: --table-only needs --out DIR (an earlier run's)" >&2; exit 2; }
[[ $table_only == 1 ]] || [[ -x "$bin/conveyor-bench-cluster" ]] || { echo "two_gpu_table.sh: no $bin/conveyor-bench-cluster (build it, or --bin DIR)" >&2; exit 1; }
[[ -f "$model/config.json" ]] || { echo "two_gpu_table.sh: $model has no config.json (--model DIR: the tokenizer's checkpoint)" >&2; exit 1; }
out="${out:-$(mktemp -d /tmp/two_gpu_table.XXXXXX)}"
mkdir -p "$out"
[[ $table_only == 1 ]] && layouts=""
for layout in ${layouts//,/ }; do rm -f "$out/$layout.jsonl"; done  # others' rows stay (the 1-GPU baseline)
echo "two_gpu_table.sh: logs and figures in $out"

rc=0
for layout in ${layouts//,/ }; do
  case "$layout" in
    one) flags=(--stages 1 --gpus 1) ;;
    tp) flags=(--stages 1 --tp "$gpus" --gpus "$gpus") ;;
    stages) flags=(--stages "$gpus" --gpus "$gpus") ;;
    replicas) flags=(--stages 1 --replicas "$gpus" --gpus "$gpus") ;;
  esac
  echo "== $layout: conveyor-bench-cluster ${flags[*]}"
  "$bin/conveyor-bench-cluster" --backend cuda --model "$model" --random "$shape" "${flags[@]}" \
      --concurrency "$clients" --requests-per-client "$rpc" --prompt-tokens "$prompt" --max-tokens "$new_tokens" \
      --stream --json "$out/$layout.jsonl" 2>&1 | tee "$out/$layout.log" || rc=1
done

device="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
[[ -n "$device" ]] || device="$(sed -n 's/^device: //p' "$out/device.txt" 2>/dev/null)"
[[ -n "$device" ]] && echo "device: $device" > "$out/device.txt"
python3 - "$out" "$layouts" "$shape" "$gpus" "$prompt" "$new_tokens" "$device" <<'PY' | tee "$out/table.md"
import datetime, json, os, sys
out, layouts, shape, gpus, prompt, new_tokens, device = sys.argv[1:]
names = {"one": "1 stage on 1 GPU", "tp": f"1 stage at tp {gpus}", "stages": f"{gpus} stages",
         "replicas": f"{gpus} replicas"}
def rows_of(layout):
    path = os.path.join(out, layout + ".jsonl")
    return [json.loads(l) for l in open(path) if l.strip()] if os.path.exists(path) else []
one = {r["clients"]: r["tokens_per_s"] for r in rows_of("one")}
print(f"{shape}, {gpus} x {device}, {datetime.date.today()}, deterministic, prompt {prompt}, {new_tokens} new tokens, streamed\n")
print("| layout | clients | tokens/s | / 1 GPU | TTFT p50 ms | TTFT p99 ms | inter-token p50 ms | inter-token p99 ms | workers busy |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
figures = []
for layout in [l for l in names if l in layouts.split(",") or rows_of(l)]:
    rows = rows_of(layout)
    for r in rows:
        figures.append({"layout": layout, "gpus": 1 if layout == "one" else int(gpus), "clients": r["clients"],
                        "tokens_per_s": round(r["tokens_per_s"], 1), "itl_ms_p50": round(r.get("itl_ms_p50", 0), 2),
                        "device": f"{1 if layout == 'one' else gpus} x {device}, {shape}, {datetime.date.today()}"})
    if not rows:
        print(f"| {names[layout]} | — | failed: see {layout}.log | | | | | | |")
    for r in rows:
        busy = " / ".join(f"{100 * b:.0f}%" for b in r.get("busy", [])) or "—"
        base = one.get(r["clients"])
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "—"
        print(f"| {names[layout]} | {r['clients']} | {r['tokens_per_s']:,.0f} | {ratio} | {r.get('ttft_ms_p50', 0):,.1f} | "
              f"{r.get('ttft_ms_p99', 0):,.1f} | {r.get('itl_ms_p50', 0):.2f} | {r.get('itl_ms_p99', 0):.2f} | {busy} |")
with open(os.path.join(out, "figures.jsonl"), "w") as f:
    f.writelines(json.dumps(x) + "\n" for x in figures)
PY
exit $rc
