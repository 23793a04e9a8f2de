#!/usr/bin/env bash
# The main job: sets up and builds if needed, starts a local cluster (a coordinator and
# three stage workers, one per pipeline stage, as separate processes on this machine) with
# the shipped demo model, and generates a continuation of an English prompt through the
# REST API. The cluster is stopped on exit.
#   scripts/demo.sh ["prompt"]        (CONVEYOR_BUILD_DIR: another build folder than build/)
set -euo pipefail
cd "$(dirname "$0")/.."
# setup says what it installs and builds (on stderr: stdout is the generated text), and
# nothing when all is in place. --demo: only the build packages and the three programs run
# here (scripts/test.sh builds the rest).
scripts/setup.sh --demo >&2
BIN=${CONVEYOR_BUILD_DIR:-build}/bin
PROMPT=${1:-"The jury said"}
LOG=$(mktemp -d)
echo "demo: starting the cluster (a coordinator and 3 stage workers; logs in $LOG)" >&2
"$BIN"/conveyor local --model models/brown-gpt2 --stages 3 --port 0 --log-dir "$LOG" > "$LOG/local.out" 2>&1 &
LOCAL=$!
trap 'kill -INT $LOCAL 2>/dev/null; wait $LOCAL 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
  URL=$(sed -n 's/^conveyor local: ready at \(http:[^ ]*\).*/\1/p' "$LOG/local.out")
  [[ -n "$URL" ]] && break
  kill -0 $LOCAL 2>/dev/null || { cat "$LOG/local.out" >&2; exit 1; }
  sleep 0.1
done
[[ -n "${URL:-}" ]] || { echo "demo: the cluster did not start; logs in $LOG" >&2; exit 1; }
echo "demo: a 3-stage cluster is serving models/brown-gpt2 at $URL" >&2
"$BIN"/conveyor generate --url "$URL" --max-tokens 80 --temperature 0.8 --top-k 40 --seed 7 "$PROMPT"
