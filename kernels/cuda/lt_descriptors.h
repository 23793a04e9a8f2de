// A cuBLASLt matmul descriptor and the layouts of its A, B and D, owned together: what a
// planned product keeps (Gemm's plans, the sequential-order and FP8 problems) and destroys in
// reverse order; the one way they are described; and the heuristic, the algorithm check and
// the reading of an algorithm's configuration that the three planners share.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cuda/check.h"

namespace conveyor::cuda {

struct LtDescriptors {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;

  LtDescriptors() = default;
  LtDescriptors(const LtDescriptors&) = delete;
  LtDescriptors& operator=(const LtDescriptors&) = delete;
  ~LtDescriptors() {
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

// cuBLASLt's type of T: __half, __nv_bfloat16 or float.
template <class T>
cudaDataType_t lt_data_type() {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, float>);
  if constexpr (std::is_same_v<T, __half>) return CUDA_R_16F;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return CUDA_R_16BF;
  else return CUDA_R_32F;
}

// Describes into p: out (col-major N x T, i.e. [T, N] row-major) = op(W) * in (col-major K x T),
// fp32 compute, W [N, K] row-major (`weights_nk`, transposed) or [K, N]; with cuBLASLt's bias
// epilogue when asked (its pointer is the caller's to set).
inline void lt_describe(LtDescriptors& p, cudaDataType_t in_type, cudaDataType_t out_type, int64_t T_, int64_t K,
                        int64_t N, bool weights_nk, bool bias_epilogue) {
  CUDA_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_a = weights_nk ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = CUBLAS_OP_N;
  CUDA_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  CUDA_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  if (bias_epilogue) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    CUDA_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
  }
  if (weights_nk)
    CUDA_CHECK(cublasLtMatrixLayoutCreate(&p.a, in_type, uint64_t(K), uint64_t(N), K));
  else
    CUDA_CHECK(cublasLtMatrixLayoutCreate(&p.a, in_type, uint64_t(N), uint64_t(K), N));
  CUDA_CHECK(cublasLtMatrixLayoutCreate(&p.b, in_type, uint64_t(K), uint64_t(T_), K));
  CUDA_CHECK(cublasLtMatrixLayoutCreate(&p.d, out_type, uint64_t(N), uint64_t(T_), N));
}

// The largest power of two up to 16 that divides the address (16 for null): the alignment a
// product's operands promise cuBLASLt, and part of every plan's key.
inline int lt_alignment(const void* p) {
  if (p == nullptr) return 16;
  const auto a = reinterpret_cast<uintptr_t>(p);
  int align = 16;
  while (align > 1 && (a % align) != 0) align /= 2;
  return align;
}

// The heuristic's proposals (at most `count`) for `p`, with `align` bytes of alignment on every
// operand and `workspace_bytes` of workspace; empty when it has none.
inline std::vector<cublasLtMatmulHeuristicResult_t> lt_proposals(cublasLtHandle_t lt, const LtDescriptors& p,
                                                                 int align, uint64_t workspace_bytes, int count) {
  std::vector<cublasLtMatmulHeuristicResult_t> r;
  cublasLtMatmulPreference_t pref = nullptr;
  if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS) return r;
  const uint32_t a = uint32_t(align);
  bool ok = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                                 sizeof(workspace_bytes)) == CUBLAS_STATUS_SUCCESS;
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    ok = ok && cublasLtMatmulPreferenceSetAttribute(pref, attr, &a, sizeof(a)) == CUBLAS_STATUS_SUCCESS;
  int found = 0;
  r.resize(size_t(count));
  if (!ok || cublasLtMatmulAlgoGetHeuristic(lt, p.desc, p.a, p.b, p.d, p.d, pref, count, r.data(), &found) !=
                 CUBLAS_STATUS_SUCCESS)
    found = 0;
  cublasLtMatmulPreferenceDestroy(pref);
  r.resize(size_t(found > 0 ? found : 0));
  return r;
}

// Whether cuBLASLt runs `algo` for `p` within `workspace_bytes` (cublasLtMatmulAlgoCheck).
inline bool lt_accepts(cublasLtHandle_t lt, const LtDescriptors& p, const cublasLtMatmulAlgo_t& algo,
                       uint64_t workspace_bytes) {
  cublasLtMatmulHeuristicResult_t check{};
  return cublasLtMatmulAlgoCheck(lt, p.desc, p.a, p.b, p.d, p.d, &algo, &check) == CUBLAS_STATUS_SUCCESS &&
         check.workspaceSize <= workspace_bytes;
}

// One attribute of an algorithm's configuration (V{} when cuBLASLt does not say).
template <class V>
V lt_algo_config(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  V v{};
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written) != CUBLAS_STATUS_SUCCESS) return V{};
  return v;
}

// Whether the algorithm splits the K sum over blocks (partial sums added in a grid-shaped order).
inline bool lt_splits_k(const cublasLtMatmulAlgo_t& algo) {
  return lt_algo_config<int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) > 1 ||
         lt_algo_config<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME) != CUBLASLT_REDUCTION_SCHEME_NONE;
}

// The same algorithm without a split along K; false when cuBLASLt refuses the change.
inline bool lt_unsplit(cublasLtMatmulAlgo_t& algo) {
  const int32_t one = 1;
  const uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
  return cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof(one)) ==
             CUBLAS_STATUS_SUCCESS &&
         cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &none, sizeof(none)) ==
             CUBLAS_STATUS_SUCCESS &&
         !lt_splits_k(algo);
}

// "algo 66 tile 20 stages 8 cluster 2 splitK 1": for plan descriptions.
inline std::string lt_algo_name(const cublasLtMatmulAlgo_t& algo) {
  std::ostringstream os;
  os << "algo " << lt_algo_config<int32_t>(algo, CUBLASLT_ALGO_CONFIG_ID) << " tile "
     << lt_algo_config<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_TILE_ID) << " stages "
     << lt_algo_config<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID) << " cluster "
     << lt_algo_config<uint16_t>(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID) << " splitK "
     << lt_algo_config<int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
  return os.str();
}

}  // namespace conveyor::cuda
