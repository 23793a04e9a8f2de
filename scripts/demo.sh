#!/usr/bin/env bash
# The main job: sets up and builds if needed, then generates a continuation of an English
# prompt with the shipped demo model (models/brown-gpt2).
#   scripts/demo.sh ["prompt"]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
PROMPT=${1:-"The jury said"}
exec build/bin/conveyor run --model models/brown-gpt2 --max-tokens 80 \
  --temperature 0.8 --top-k 40 --seed 7 "$PROMPT"
