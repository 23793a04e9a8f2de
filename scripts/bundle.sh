#!/usr/bin/env bash
# Bundles Conveyor's programs with the shared libraries a bare node lacks, for shipping to
# GPU nodes (which have the NVIDIA driver, CUDA runtime, cuBLAS and NCCL, but not Debian's
# ZeroMQ, UCX, yaml-cpp, OpenBLAS, ...). Programs get an rpath of $ORIGIN/../lib plus the
# CUDA toolkit's library folders; the archive unpacks to bin/, tests/, lib/, share/conveyor/.
#
#   scripts/bundle.sh [BUILD_DIR] [OUT.tar.xz]      (defaults: build, .dist/conveyor-bundle.tar.xz)
#
# On the node:  mkdir -p /opt/conveyor && tar xJf conveyor-bundle.tar.xz -C /opt/conveyor
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}
OUT=${2:-.dist/conveyor-bundle.tar.xz}
command -v patchelf >/dev/null || { echo "bundle: patchelf missing (apt-get install patchelf, or scripts/setup.sh)" >&2; exit 1; }

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/bin" "$STAGE/tests" "$STAGE/lib" "$STAGE/share/conveyor"
# The measured figures `conveyor local --gpus N` chooses a layout from (coordinator/layout_choice.h).
cp "$(dirname "${BASH_SOURCE[0]}")/../bench/layout_figures.jsonl" "$STAGE/share/conveyor/"

# Libraries every node has (glibc, the C++ runtime) or must take from its own CUDA install.
is_system_lib() {
  case "$1" in
    linux-vdso*|ld-linux*|libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|libresolv.so*|\
    libgcc_s.so*|libstdc++.so*|libcuda.so*|libcudart.so*|libcublas*.so*|libnccl.so*|libnvidia*|\
    libnvrtc*|libcurand*) return 0 ;;
  esac
  return 1
}

copy_deps() {
  local elf=$1
  ldd "$elf" | awk '/=> \// { print $1, $3 }' | while read -r name path; do
    if ! is_system_lib "$name" && [[ ! -e "$STAGE/lib/$name" ]]; then
      cp -L "$path" "$STAGE/lib/$name"
      chmod u+w "$STAGE/lib/$name"
      copy_deps "$path"
    fi
  done
}

shopt -s nullglob
for f in "$BUILD_DIR"/bin/* "$BUILD_DIR"/tests/test_*; do
  [[ -f "$f" && -x "$f" ]] || continue
  dest="$STAGE/$(basename "$(dirname "$f")")/$(basename "$f")"
  cp "$f" "$dest"
  strip --strip-debug "$dest"
  copy_deps "$f"
done
# UCX loads its transports (tcp, shared memory, verbs, and with the UCX scripts/setup.sh
# builds when CUDA is present, cuda_copy and cuda_ipc in libuct_cuda) as modules from the
# folder "ucx" beside the libucs the programs link; a module whose own libraries the node
# lacks (libibverbs, say) is skipped by UCX. The run scripts point UCX_MODULE_DIR at lib/ucx.
UCX_LIBDIR=""
for f in "$BUILD_DIR"/bin/*; do
  UCX_LIBDIR=$(ldd "$f" 2>/dev/null | awk '/libucs\.so/ { print $3; exit }')
  [[ -n "$UCX_LIBDIR" ]] && UCX_LIBDIR=$(dirname "$UCX_LIBDIR") && break
done
if [[ -n "$UCX_LIBDIR" && -d "$UCX_LIBDIR/ucx" && -e "$STAGE/lib/libucs.so.0" ]]; then
  mkdir -p "$STAGE/lib/ucx"
  # UCX opens each module by its soname (libuct_cuda.so.0), not the .so link.
  for m in "$UCX_LIBDIR"/ucx/lib{uct,ucm}_*.so.0; do
    [[ -e "$m" ]] && cp -L "$m" "$STAGE/lib/ucx/"
  done
fi
CUDA_RPATH='/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib'
for f in "$STAGE"/bin/* "$STAGE"/tests/*; do
  patchelf --set-rpath "\$ORIGIN/../lib:$CUDA_RPATH" "$f"
done
for f in "$STAGE"/lib/*.so* "$STAGE"/lib/ucx/*.so*; do
  [[ -f "$f" ]] || continue
  chmod u+w "$f"
  strip --strip-unneeded "$f" 2>/dev/null || true
  # The CUDA modules (libuct_cuda, libucm_cuda) need the node's CUDA runtime as well.
  patchelf --set-rpath "\$ORIGIN:\$ORIGIN/..:$CUDA_RPATH" "$f"
done
mkdir -p "$(dirname "$OUT")"
tar -C "$STAGE" -cf - bin tests lib | xz -T0 -6 > "$OUT"
ucx_note="UCX from ${UCX_LIBDIR:-?}"
[[ -e "$STAGE/lib/ucx/libuct_cuda.so" ]] && ucx_note+=" with CUDA (cuda_copy, cuda_ipc)"
echo "bundle: $OUT ($(du -h "$OUT" | cut -f1)): $(ls "$STAGE/bin" "$STAGE/tests" | grep -vc :) programs, $(ls "$STAGE/lib" | wc -l) libraries; $ucx_note"
