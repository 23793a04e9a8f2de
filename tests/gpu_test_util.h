// Helpers shared by the CUDA test programs: how many GPUs there are, the skip for none, and
// the comparison of a GPU stage (GpuStage or TpStage) with the CPU stage on one micro-batch.
// Include only where CONVEYOR_HAVE_CUDA is defined.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "common/options.h"
#include "kernels/cuda/check.h"
#include "stage/cpu/cpu_stage.h"
#include "tests/test_util.h"

namespace conveyor::testing {

// CONVEYOR_PDL (common/options.h) as a worker applies it, before the first test: a program
// that includes this header runs with programmatic dependent launch off under CONVEYOR_PDL=0.
class KernelOptionsEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { cuda::set_pdl(process_options().kernels.pdl); }
};
inline ::testing::Environment* const kKernelOptions =
    ::testing::AddGlobalTestEnvironment(new KernelOptionsEnvironment);

inline int gpu_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}
inline bool have_gpu() { return gpu_count() > 0; }

// A tensor-parallel group of `ranks` can be built: a GPU each, or fewer GPUs that the ranks may
// share (tests/test_util.h: gpu_sharing_ranks_allowed).
inline bool can_place(int ranks) { return gpu_count() >= ranks || (gpu_count() > 0 && gpu_sharing_ranks_allowed()); }
inline constexpr const char* kNoPlace = "no GPU, or ranks would share a GPU without CUDA_DEVICE_MAX_CONNECTIONS >= 16";

// Rank r on GPU r where there are enough GPUs, else every rank on GPU 0.
inline std::vector<int> devices_for(int ranks) {
  std::vector<int> d;
  for (int r = 0; r < ranks; ++r) d.push_back(gpu_count() >= ranks ? r : 0);
  return d;
}

// A float as the bits of T (__half or __nv_bfloat16), rounded to nearest even, and back.
template <class T>
uint16_t to_bits(float f) {
  if constexpr (std::is_same_v<T, __half>) return float_to_fp16(f);
  else return float_to_bf16(f);
}
template <class T>
float from_bits(uint16_t b) {
  if constexpr (std::is_same_v<T, __half>) return fp16_to_float(b);
  else return bf16_to_float(b);
}

// Relative L2 error of a against ref; infinite when a holds a non-finite value.
inline double rel_err(const float* a, const float* ref, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// The argmax of a row of logits and its gap to the runner-up.
inline std::pair<int32_t, float> top1(const float* row, int64_t V) {
  int32_t best = 0;
  for (int64_t i = 1; i < V; ++i)
    if (row[i] > row[best]) best = int32_t(i);
  float second = -INFINITY;
  for (int64_t i = 0; i < V; ++i)
    if (i != best) second = std::max(second, row[i]);
  return {best, row[best] - second};
}

// One micro-batch through the CPU stage and a GPU stage (embed, forward, the logits of each
// slice's last row); checks the GPU's logits against the CPU's (relative L2 per row below
// tol) and returns the CPU's.
template <class GpuStageT>
std::vector<float> step_both(CpuStage& cpu, GpuStageT& gpu, const std::vector<SeqSlice>& slices,
                             const std::vector<int32_t>& ids, double tol, const std::string& what) {
  const int64_t C = cpu.hidden_size(), V = cpu.config().vocab_size;
  std::vector<float> hidden(size_t(total_tokens(slices) * C));
  EXPECT_TRUE(cpu.embed(slices, ids.data(), hidden.data()).ok());
  EXPECT_TRUE(cpu.forward(slices, hidden.data()).ok());
  std::vector<float> ref(slices.size() * size_t(V)), got(ref.size());
  EXPECT_TRUE(cpu.logits(slices, hidden.data(), false, ref.data()).ok());
  Status s = gpu.embed(slices, ids.data());
  EXPECT_TRUE(s.ok()) << s.message();
  s = gpu.forward(slices);
  EXPECT_TRUE(s.ok()) << s.message();
  s = gpu.logits(slices, false, got.data());
  EXPECT_TRUE(s.ok()) << s.message();
  for (size_t i = 0; i < slices.size(); ++i)
    EXPECT_LT(rel_err(got.data() + i * size_t(V), ref.data() + i * size_t(V), size_t(V)), tol)
        << what << ": sequence " << slices[i].seq_id << " row " << i;
  return ref;
}

}  // namespace conveyor::testing

#define REQUIRE_GPU()                                                                \
  do {                                                                               \
    if (!::conveyor::testing::have_gpu()) GTEST_SKIP() << "no CUDA device on this host"; \
  } while (0)

namespace conveyor::testing {

// The fixture of a typed test over the GPU's element types: skipped without a GPU, the
// device synchronised after each test (a failure there names the test that caused it).
template <class T>
class GpuTypedTest : public ::testing::Test {
 protected:
  void SetUp() override { REQUIRE_GPU(); }
  void TearDown() override {
    if (have_gpu()) CUDA_CHECK(cudaDeviceSynchronize());
  }
};

}  // namespace conveyor::testing
