#!/usr/bin/env bash
# The CPU parts under ThreadSanitizer (issue 28): configures a TSAN build (no CUDA), builds the
# multi-threaded tests and the daemons the cluster tests start, and runs them; every report,
# the daemons' included, goes to one folder (TSAN's log_path), since a daemon's stderr is
# deleted with its test's folder when the test passes.
#   scripts/tsan.sh [extra ctest arguments; a -R of your own replaces the list below]
# CONVEYOR_TSAN_BUILD_DIR (build-tsan), CONVEYOR_TSAN_REPORTS (build-tsan/tsan-reports),
# CONVEYOR_TSAN_JOBS (nproc) change where and how wide. tests/README.md tells how to read it.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${CONVEYOR_TSAN_BUILD_DIR:-build-tsan}
REPORTS=${CONVEYOR_TSAN_REPORTS:-$BUILD_DIR/tsan-reports}
JOBS=${CONVEYOR_TSAN_JOBS:-$(nproc)}
# The threaded pieces: control plane, channels, handoff, executor, scheduler and engine,
# the coordinator's control, metrics; then every test that starts real daemons.
UNIT_TESTS="test_control_plane test_inproc_channel test_ucx_channel test_handoff test_stage_executor
  test_scheduler test_coordinator_control test_metrics test_prefix_reuse test_beam_search_scheduler"
CLUSTER_TESTS="test_cluster test_replan test_failover test_serving_trace test_beam_search_cluster test_status_page
  test_cli_local"
DAEMONS="conveyor-coordinator conveyor-worker conveyor"

flags="-fsanitize=thread -O1 -g"
# UCX's memory hooks (libucm) catch the madvise of a thread's exit, after TSAN has let go of
# that thread, and crash it (in ucm_event_enter's rwlock). Nothing here needs them; the test
# programs also run at build time (gtest_discover_tests), so this is set for ninja as well.
export UCX_MEM_MMAP_HOOK_MODE=none
cmake -S . -B "$BUILD_DIR" -G Ninja -DCONVEYOR_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
  -DCMAKE_EXE_LINKER_FLAGS=-fsanitize=thread -DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=thread >/dev/null
targets=()
for t in $UNIT_TESTS $CLUSTER_TESTS; do targets+=("tests/$t"); done
for t in $DAEMONS; do targets+=("bin/$t"); done
ninja -C "$BUILD_DIR" -j "$JOBS" "${targets[@]}"

mkdir -p "$REPORTS"
REPORTS=$(cd "$REPORTS" && pwd)
regex=$(echo $UNIT_TESTS $CLUSTER_TESTS | sed -E 's/test_//g; s/ /\/|^/g')
export TSAN_OPTIONS="halt_on_error=0 second_deadlock_stack=1 history_size=4 suppressions=$PWD/scripts/tsan.supp log_path=$REPORTS/tsan ${TSAN_OPTIONS:-}"
set +e
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$JOBS" --timeout 900 -R "^$regex/" "$@"
rc=$?
set -e
n=$(cat "$REPORTS"/tsan.* 2>/dev/null | grep -c '^WARNING: ThreadSanitizer' || true)
echo "tsan: $n report(s) in $REPORTS (one file per process: tsan.<pid>)"
exit $(( rc != 0 || n != 0 ))
