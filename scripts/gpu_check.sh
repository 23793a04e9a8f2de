#!/usr/bin/env bash
# One call that checks the CUDA backend on a GPU machine: the CUDA op tests, the GPU stage
# tests, the decode benchmark and its PyTorch peer, then a short table against the targets.
# Meant to fit a short device lease (about 6-8 minutes on an H100/H200).
#
#   scripts/gpu_check.sh BUILD_DIR                 run from a build tree (tests/, bin/)
#   scripts/gpu_check.sh --pack BUILD_DIR BUNDLE   write BUNDLE (.tar.xz): the stripped test and
#                                                  benchmark programs plus the non-CUDA shared
#                                                  libraries they need, for a machine that has
#                                                  the CUDA driver and toolkit but not the build
#                                                  (PACK_PROGRAMS="bin/x tests/y ..." packs only those);
#                                                  a build linking a UCX without CUDA is first
#                                                  moved to UCX built with CUDA (built if need be)
#   scripts/gpu_check.sh --bundle BUNDLE           unpack BUNDLE and run from it
#
# Environment: OUT (logs go to $OUT, else /tmp/gpu_check), CHECK_PEER=0 skips the PyTorch
# peer, CHECK_BENCH=0 the decode benchmark, CHECK_KERNELS=0 the per-kernel profile,
# CHECK_CLUSTER=0 the local cluster, CHECK_DATA_PLANE=0 the data plane's direct path (the
# transport's path tests and the handoff benchmark, staged against direct), CHECK_TP=0 the tensor-parallel part (the all-reduce and
# TpStage tests everywhere; with two GPUs or more also the all-reduce table and the decode
# benchmark at tp 1 and 2, for each of TP_WEIGHTS: "f16", "int8" or both), CHECK_INT8=0
# the int8 weight-only tests and GEMM benchmark, BENCH_ARGS / PEER_ARGS / TP_BENCH_ARGS
# override the benchmark arguments.
set -u
set -o pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"

# The CUDA test programs: every tests/**/cuda/test_*.cc (they skip without a GPU).
cuda_tests() {
  find "$repo/tests" -path '*/cuda/test_*.cc' -printf '%f\n' | sed 's/\.cc$//' | sort
}

# A GPU bundle moves activations GPU to GPU, which needs UCX built with CUDA: when the build
# folder links a UCX without it (setup.sh builds one only where a GPU is), build it now
# (setup.sh --ucx-cuda, once), point the folder at it and rebuild the programs to pack.
ensure_ucx_cuda() {
  local build="$1"; shift
  local libdir prefix=${CONVEYOR_UCX_PREFIX:-/opt/conveyor/ucx-1.13.1-cuda}
  libdir=$(sed -n 's/^UCX_LIBDIR:INTERNAL=//p' "$build/CMakeCache.txt" 2>/dev/null)
  [[ -n "$libdir" && -e "$libdir/ucx/libuct_cuda.so" ]] && return 0
  echo "gpu_check: $build links a UCX without CUDA (${libdir:-none}): building UCX with CUDA into $prefix"
  CONVEYOR_UCX_PREFIX="$prefix" "$repo/scripts/setup.sh" --ucx-cuda || return 1
  cmake -S "$repo" -B "$build" -DCONVEYOR_UCX_PREFIX="$prefix" >"$build/configure-ucx-cuda.log" 2>&1 ||
    { tail -n 20 "$build/configure-ucx-cuda.log" >&2; return 1; }
  local targets=()
  for p in "$@"; do targets+=("$(basename "$p")"); done
  cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"
}

if [[ "${1:-}" == "--pack" ]]; then
  build="$2"; bundle="$3"
  programs=${PACK_PROGRAMS:-"$(cuda_tests | sed 's#^#tests/#')
           bin/conveyor-bench-all-reduce bin/conveyor-bench-int8-gemm
           bin/conveyor-bench-gpu-decode bin/conveyor-bench-gpu-kernels bin/conveyor-bench-cluster
           bin/conveyor-bench-stage-step bin/conveyor-bench-transport tests/test_ucx_channel tests/test_handoff
           bin/conveyor bin/conveyor-coordinator bin/conveyor-worker"}
  # shellcheck disable=SC2086  # one program a word
  ensure_ucx_cuda "$build" $programs || exit 1
  stage="$(mktemp -d)"
  for p in $programs; do
    strip -o "$stage/$(basename "$p")" "$build/$p" || exit 1
  done
  # UCX loads its transports as modules at run time, from the folder "ucx" beside the libucs
  # the programs link (the UCX built with CUDA when setup.sh made one: cuda_copy, cuda_ipc).
  ucx_libdir=""
  for f in "$stage"/conveyor* "$stage"/test_*; do
    ucx_libdir=$(ldd "$f" 2>/dev/null | awk '/libucs\.so/ { print $3; exit }')
    [[ -n "$ucx_libdir" ]] && ucx_libdir=$(dirname "$ucx_libdir") && break
  done
  if [[ -n "$ucx_libdir" && -d "$ucx_libdir/ucx" ]]; then
    mkdir -p "$stage/ucx"
    # UCX opens each module by its soname (libuct_cuda.so.0), not the .so link.
    for m in "$ucx_libdir"/ucx/lib{uct,ucm}_*.so.0; do
      [[ -e "$m" ]] && cp -L "$m" "$stage/ucx/"
    done
    echo "UCX from $ucx_libdir$([[ -e "$stage/ucx/libuct_cuda.so.0" ]] && echo " with CUDA (cuda_copy, cuda_ipc)")"
  fi
  # Shared libraries that are neither glibc/libstdc++ nor CUDA's or NCCL's (the GPU machine has those).
  ldd "$stage"/test_* "$stage"/conveyor* | awk '/=> \//{print $3}' | sort -u |
    grep -v -E '/(libc|libm|libdl|libpthread|librt|libgcc_s|libstdc\+\+|ld-linux[^/]*)\.so|/libcu(dart|blas|blasLt)\.so|/libnccl\.so' |
    while read -r lib; do cp -L "$lib" "$stage/" && strip --strip-unneeded "$stage/$(basename "$lib")"; done
  # xz -9: a 64 MiB window, so the three programs' common GPU code is stored once.
  tar -C "$stage" -cf - . | xz -9 -T1 >"$bundle" && rm -rf "$stage"
  echo "wrote $bundle ($(du -h "$bundle" | cut -f1))"
  exit 0
fi

if [[ "${1:-}" == "--bundle" ]]; then
  dir="$(mktemp -d)"
  tar -C "$dir" -xJf "$2" || exit 1
  tests="$dir"; bins="$dir"
  export CONVEYOR_BIN_DIR="$dir"
  export LD_LIBRARY_PATH="$dir:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}"
  [[ -d "$dir/ucx" ]] && export UCX_MODULE_DIR="$dir/ucx"
elif [[ $# -ge 1 ]]; then
  tests="$1/tests"; bins="$1/bin"
else
  sed -n '2,16p' "$0"; exit 2
fi

out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
export CONVEYOR_SOURCE_DIR="$repo"
# Ranks of a tensor-parallel test that share a GPU wait for each other inside kernels: their
# streams must not share a hardware queue (8 by default), and no kernel may be loaded on
# first launch (that waits for the running ones). See tests/test_util.h. EAGER loading is
# for the test programs alone (run_tests): under it a worker's first cuBLASLt handle loads
# every kernel of the library, which made the benchmarks' placements and failovers 1.5 s
# slower (docs/PERFORMANCE.md, "The placement regression").
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
summary=()
t_start=$SECONDS

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | tee "$out/gpu.txt"

run_tests() {  # name, program
  local name="$1" prog="$2"
  if [[ ! -x "$prog" ]]; then summary+=("$name: MISSING ($prog)"); return; fi
  CUDA_MODULE_LOADING=EAGER timeout 300 "$prog" --gtest_brief=1 --gtest_color=no >"$out/$name.log" 2>&1
  local rc=$?
  local passed failed skipped
  passed=$(grep -c '^\[       OK \]' "$out/$name.log")
  passed=$(grep -oE '^\[  PASSED  \] [0-9]+' "$out/$name.log" | grep -oE '[0-9]+$' || echo 0)
  failed=$(grep -oE '^\[  FAILED  \] [0-9]+ test' "$out/$name.log" | grep -oE '[0-9]+' || echo 0)
  skipped=$(grep -oE '^\[  SKIPPED \] [0-9]+' "$out/$name.log" | grep -oE '[0-9]+$' || echo 0)
  summary+=("$name: rc=$rc passed=${passed:-0} failed=${failed:-0} skipped=${skipped:-0}")
  grep -E '^\[  FAILED  \] [A-Za-z]|Failure|error:|Expected|Which is|rel_err|seed' "$out/$name.log" | head -40
}

# Tensor-parallel and int8 programs run in their own sections below.
for t in $(cuda_tests | grep -v -E '^test_(custom_all_reduce|tp_all_reduce|tp_stage|quant)$'); do
  echo "== $t"; run_tests "$t" "$tests/$t"
done
grep -E '^\[(fixture|note)\]' "$out/test_gpu_hf_conformance.log" | head -40

if [[ "${CHECK_TP:-1}" != "0" ]]; then
  echo "== tensor parallel: all-reduce and TpStage tests"
  run_tests test_custom_all_reduce "$tests/test_custom_all_reduce"
  run_tests test_tp_all_reduce "$tests/test_tp_all_reduce"
  run_tests test_tp_stage "$tests/test_tp_stage"
  if [[ $(nvidia-smi -L | wc -l) -ge 2 ]]; then
    echo "== all-reduce: custom vs NCCL (fp16)"
    timeout 120 "$bins/conveyor-bench-all-reduce" 2>&1 | tee "$out/all_reduce.log"
    summary+=("bench-all-reduce: rc=$?")
    tp_args=${TP_BENCH_ARGS:-"--shapes gpt3-6.7b,gpt3-13b --batches 1,32 --prompts 128 --new-tokens 64"}
    for w in ${TP_WEIGHTS:-f16}; do
      for tp in 1 2; do
        echo "== decode benchmark, $w weights, tp $tp"
        # shellcheck disable=SC2046,SC2086
        timeout 240 "$bins/conveyor-bench-gpu-decode" $tp_args --tp "$tp" $([[ $w == int8 ]] && echo --int8) \
          --csv "$out/bench_${w}_tp$tp.csv" 2>&1 | tee "$out/bench_${w}_tp$tp.log"
        summary+=("bench $w tp $tp: rc=$?")
      done
    done
  fi
fi

if [[ "${CHECK_INT8:-1}" != "0" ]]; then
  echo "== int8 weight-only: kernels and GEMM benchmark"
  run_tests test_quant "$tests/test_quant"
  timeout 180 "$bins/conveyor-bench-int8-gemm" 2>&1 | tee "$out/int8_gemm.log"
  summary+=("bench-int8-gemm: rc=$?")
fi

if [[ "${CHECK_BENCH:-1}" != "0" ]]; then
  echo "== decode benchmark"
  bench_args=${BENCH_ARGS:-"--shapes gpt2-xl,gpt3-6.7b --batches 1,8,32,128 --prompts 128,1024 --new-tokens 128"}
  # shellcheck disable=SC2086
  timeout 330 "$bins/conveyor-bench-gpu-decode" $bench_args --csv "$out/bench.csv" 2>&1 | tee "$out/bench.log"
  summary+=("bench: rc=$?")
fi

if [[ "${CHECK_CLUSTER:-1}" != "0" ]]; then
  echo "== a local cluster on the GPU, through REST"
  for st in 1 2; do
    timeout 120 "$bins/conveyor-bench-cluster" --backend cuda --model "$repo/models/brown-gpt2" --stages "$st" \
      --requests 512 --concurrency 64 --max-tokens 48 2>&1 | tail -4 | tee -a "$out/cluster.log"
  done
fi

if [[ "${CHECK_DATA_PLANE:-1}" != "0" ]]; then
  # Activations GPU to GPU (UCX built with CUDA): the transport's wire-format and ordering
  # tests over both paths (the direct ones between two processes on one GPU go through
  # cuda_ipc), then one micro-batch handoff, staged against direct, 16 KiB to 64 MiB.
  echo "== data plane: staged and direct paths"
  if [[ -x "$tests/test_ucx_channel" ]]; then
    CONVEYOR_EXPECT_UCX_CUDA="${CONVEYOR_EXPECT_UCX_CUDA:-0}" timeout 300 "$tests/test_ucx_channel" \
      --gtest_filter='Paths/*:*DevicePath*' --gtest_color=no >"$out/test_ucx_channel.log" 2>&1
    rc=$?
    grep -E '^\[  (FAILED|SKIPPED) \] [A-Za-z]|^\[  PASSED|Failure|cuda_ipc|moves CUDA' "$out/test_ucx_channel.log" | head -30
    summary+=("test_ucx_channel (paths): rc=$rc")
  fi
  if [[ -x "$tests/test_handoff" ]]; then
    timeout 120 "$tests/test_handoff" --gtest_filter='*Device*' --gtest_color=no >"$out/test_handoff.log" 2>&1
    rc=$?
    grep -E '^\[  (FAILED|SKIPPED) \] [A-Za-z]|^\[  PASSED|Failure' "$out/test_handoff.log" | head -10
    summary+=("test_handoff (device slots): rc=$rc")
  fi
  timeout 240 "$bins/conveyor-bench-transport" --handoff 2>&1 | tee "$out/handoff.log"
  summary+=("bench-transport --handoff: rc=$?")
fi

if [[ "${CHECK_KERNELS:-1}" != "0" ]]; then
  echo "== where a decode step's time goes (batch 1)"
  for shape in gpt2-xl gpt3-6.7b; do
    timeout 120 "$bins/conveyor-bench-gpu-kernels" --shape "$shape" 2>&1 | sed '/^$/,$d' | tee -a "$out/kernels.log"
  done
fi

if [[ "${CHECK_PEER:-1}" != "0" ]] && python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  echo "== PyTorch peer (torch.compile reduce-overhead)"
  peer_args=${PEER_ARGS:-"--shapes gpt2-xl,gpt3-6.7b --batches 1 --prompts 128 --new-tokens 128"}
  # shellcheck disable=SC2086
  PYTHONUNBUFFERED=1 timeout 240 python3 "$repo/scripts/torch_peer_decode.py" $peer_args 2>&1 | tee "$out/peer.log"
  summary+=("peer: rc=$?")
fi

echo
echo "== summary ($((SECONDS - t_start)) s; logs in $out)"
printf '%s\n' "${summary[@]}"
python3 - "$out" <<'EOF'
import re, sys, os
out = sys.argv[1]
def rows(path):
    r = {}
    if not os.path.exists(path):
        return r
    for line in open(path):
        f = line.split()
        if len(f) >= 8 and f[2].isdigit() and f[3].isdigit() and "skipped" not in line:
            try:
                if f[4].isdigit() and len(f) >= 12:  # ours: shape dtype batch prompt new ttft ms/token p50 tok/s floor floor% total
                    r[(f[0], int(f[2]), int(f[3]))] = (float(f[5]), float(f[6]), f[9], f[10])
                else:  # the peer's
                    r[(f[0], int(f[2]), int(f[3]))] = (float(f[4]), float(f[5]), f[8], f[9] if len(f) > 9 else "-")
            except ValueError:
                pass
    return r
ours, peer = rows(f"{out}/bench.log"), rows(f"{out}/peer.log")
print(f"{'shape':<10} {'batch':>5} {'prompt':>6} {'ttft_ms':>9} {'ms/token':>9} {'floor%':>7} {'peer ms/tok':>11} {'speedup':>8}")
for k in sorted(ours):
    ttft, ms, floor, frac = ours[k]
    p = peer.get(k)
    pm = f"{p[1]:.3f}" if p else "-"
    sp = f"{p[1] / ms:.2f}x" if p else "-"
    print(f"{k[0]:<10} {k[1]:>5} {k[2]:>6} {ttft:>9.2f} {ms:>9.3f} {frac:>7} {pm:>11} {sp:>8}")
def check(name, ok):
    print(f"target {name}: {'MET' if ok else 'NOT MET' if ok is not None else 'not measured'}")
k = ("gpt3-6.7b", 1, 128)
frac = float(ours[k][3].rstrip("%")) if k in ours and ours[k][3] != "-" else None
check("gpt3-6.7b batch 1 >= 85% of the bandwidth floor", None if frac is None else frac >= 85)
check("gpt3-6.7b batch 1 >= 1.3x the compiled PyTorch peer",
      None if k not in ours or k not in peer else peer[k][1] / ours[k][1] >= 1.3)
k2 = ("gpt2-xl", 1, 128)
check("gpt2-xl batch 1 < 1.2 ms/token", None if k2 not in ours else ours[k2][1] < 1.2)
EOF
