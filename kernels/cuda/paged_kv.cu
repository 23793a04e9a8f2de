#include "kernels/cuda/paged_kv.h"

#include <algorithm>

#include "kernels/cuda/dtype.cuh"
#include "kernels/cuda/fp8.cuh"
#include "kernels/cuda/launch.cuh"

namespace conveyor::cuda {
namespace {

using namespace detail;

// One block per token; threads cover the 2 * n_head * head_dim elements of its K and V.
template <class T, bool VEC>
__global__ void kv_append_kernel(T* __restrict__ kc, T* __restrict__ vc, int64_t page_stride,
                                 const int32_t* __restrict__ tables, int max_pages,
                                 const T* __restrict__ qkv, int64_t qkv_stride,
                                 const int32_t* __restrict__ token_rows, const int32_t* __restrict__ token_pos,
                                 int n_head, int D) {
  grid_dependents_launch();
  grid_dependency_wait();
  const int64_t r = blockIdx.x;
  const int row = token_rows[r], t = token_pos[r];
  if (row < 0 || t < 0) return;  // padding token
  const int C = n_head * D;
  const int64_t page = tables[int64_t(row) * max_pages + t / kPageTokens];
  const int64_t base = page * page_stride + int64_t(t % kPageTokens) * D;  // + h * kPageTokens * D + d
  const T* src = qkv + r * qkv_stride + C;  // k then v
  const int step = VEC ? kVec : 1;
  for (int i = threadIdx.x * step; i < 2 * C; i += blockDim.x * step) {
    const int which = i / C, j = i % C, h = j / D, d = j % D;  // VEC: D % 8 == 0, so 8 never straddle
    T* dst = (which == 0 ? kc : vc) + base + int64_t(h) * kPageTokens * D + d;
    if constexpr (VEC) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src + i);
    } else {
      *dst = src[i];
    }
  }
}

// FP8 K/V: one block per token, one warp per (head, K or V): the head's head_dim values,
// their scale and their bytes (fp8.cuh). V4 (head_dim a multiple of 4, at most 128, the rows
// 8-byte and the cache 4-byte aligned): four values a lane, one 8-byte load and one 4-byte
// store, rather than a lane-strided element at a time (prefill's appends ran at a fifth of the
// bandwidth that way: 224 us a layer for 8,192 tokens of gpt3-6.7b, H200 under ncu).
template <class T, bool V4>
__global__ void kv_append_fp8_kernel(uint8_t* __restrict__ kc, uint8_t* __restrict__ vc, float* __restrict__ ks,
                                     float* __restrict__ vs, int64_t page_stride, int64_t scale_page_stride,
                                     const int32_t* __restrict__ tables, int max_pages, const T* __restrict__ qkv,
                                     int64_t qkv_stride, const int32_t* __restrict__ token_rows,
                                     const int32_t* __restrict__ token_pos, int n_head, int D) {
  grid_dependents_launch();
  grid_dependency_wait();
  const int64_t r = blockIdx.x;
  const int row = token_rows[r], t = token_pos[r];
  if (row < 0 || t < 0) return;  // padding token
  const int C = n_head * D;
  const int64_t page = tables[int64_t(row) * max_pages + t / kPageTokens];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int unit = warp; unit < 2 * n_head; unit += warps) {
    const int which = unit / n_head, h = unit % n_head;
    const T* src = qkv + r * qkv_stride + C + int64_t(which) * C + int64_t(h) * D;
    uint8_t* dst = (which == 0 ? kc : vc) + page * page_stride + (int64_t(h) * kPageTokens + t % kPageTokens) * D;
    float s;
    if constexpr (V4) {
      const int d = 4 * lane;
      float f[4] = {0.f, 0.f, 0.f, 0.f};
      if (d < D) {
        const uint2 u = *reinterpret_cast<const uint2*>(src + d);
        const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
        for (int i = 0; i < 4; ++i) f[i] = to_float(e[i]);
      }
      uint8_t q[4];
      s = quantize_kv_head(f, q);
      if (d < D) {
        uint32_t out = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) out |= uint32_t(q[i]) << (8 * i);
        *reinterpret_cast<uint32_t*>(dst + d) = out;
      }
    } else {
      float amax = 0.f;
      for (int d = lane; d < D; d += 32) amax = fmaxf(amax, fabsf(to_float(src[d])));
      s = kv_fp8_scale(warp_max(amax));  // max is exact in any order
      const float rs = fp8_rcp(s);
      for (int d = lane; d < D; d += 32) dst[d] = quantize_one(to_float(src[d]), rs);
    }
    if (lane == 0) (which == 0 ? ks : vs)[page * scale_page_stride + h * kPageTokens + t % kPageTokens] = s;
  }
}

// Grid (blocks, n_layer): each block copies a strided share of one layer's page, 16 bytes a thread.
__global__ void kv_copy_page_kernel(char* __restrict__ pool, int64_t layer_bytes, int64_t page_bytes, int32_t src,
                                    int32_t dst) {
  const char* from = pool + blockIdx.y * layer_bytes + int64_t(src) * page_bytes;
  char* to = pool + blockIdx.y * layer_bytes + int64_t(dst) * page_bytes;
  const int64_t n = page_bytes / 16;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    reinterpret_cast<uint4*>(to)[i] = reinterpret_cast<const uint4*>(from)[i];
}

}  // namespace

void kv_copy_page(void* pool, int64_t layer_bytes, int64_t page_bytes, int64_t n_layer, int32_t src, int32_t dst,
                  cudaStream_t stream) {
  if (n_layer <= 0 || page_bytes <= 0 || src == dst) return;
  if (page_bytes % 16 != 0 || layer_bytes % 16 != 0 || !aligned16(pool))
    throw Error("kv_copy_page: page and layer sizes must be multiples of 16 bytes and the pool 16-byte aligned");
  const int threads = 256;
  const int64_t vecs = page_bytes / 16;
  const unsigned blocks = unsigned(std::min<int64_t>(64, (vecs + threads - 1) / threads));
  kv_copy_page_kernel<<<dim3(blocks, unsigned(n_layer)), threads, 0, stream>>>(static_cast<char*>(pool), layer_bytes,
                                                                                page_bytes, src, dst);
  CUDA_CHECK(cudaGetLastError());
}

template <class T>
void kv_cache_append(const KvLayerView& kv, const T* qkv, int64_t qkv_stride, const int32_t* token_rows,
                     const int32_t* token_pos, int64_t num_tokens, int64_t n_head, int64_t head_dim,
                     cudaStream_t stream) {
  if (num_tokens <= 0) return;
  if (kv.fp8()) {
    const int threads = int(std::min<int64_t>(256, 2 * n_head * 32));
    const auto at = [](const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; };
    const bool v4 = head_dim % 4 == 0 && head_dim <= 128 && qkv_stride % 4 == 0 && kv.page_stride % 4 == 0 &&
                    at(qkv, 8) && at(kv.k, 4) && at(kv.v, 4);
    auto kernel = v4 ? kv_append_fp8_kernel<T, true> : kv_append_fp8_kernel<T, false>;
    LAUNCH_PDL("kv_append_fp8_kernel", kernel, dim3(unsigned(num_tokens)), dim3(threads), 0, stream,
               static_cast<uint8_t*>(kv.k), static_cast<uint8_t*>(kv.v), kv.k_scale, kv.v_scale, kv.page_stride,
               kv.scale_page_stride, kv.block_tables, kv.max_pages, qkv, qkv_stride, token_rows, token_pos,
               int(n_head), int(head_dim));
    return;
  }
  const bool vec = head_dim % kVec == 0 && qkv_stride % kVec == 0 && aligned16(qkv) && aligned16(kv.k) &&
                   aligned16(kv.v);
  const int64_t work = vec ? 2 * n_head * head_dim / kVec : 2 * n_head * head_dim;
  const int threads = int(std::min<int64_t>(256, (work + 31) / 32 * 32));
  T* k = static_cast<T*>(kv.k);
  T* v = static_cast<T*>(kv.v);
  if (vec)
    LAUNCH_PDL("kv_append_kernel", kv_append_kernel<T, true>, dim3(unsigned(num_tokens)), dim3(threads), 0, stream, k, v,
               kv.page_stride, kv.block_tables, kv.max_pages, qkv, qkv_stride, token_rows, token_pos, int(n_head),
               int(head_dim));
  else
    LAUNCH_PDL("kv_append_kernel", kv_append_kernel<T, false>, dim3(unsigned(num_tokens)), dim3(threads), 0, stream, k,
               v, kv.page_stride, kv.block_tables, kv.max_pages, qkv, qkv_stride, token_rows, token_pos, int(n_head),
               int(head_dim));
}

template void kv_cache_append<__half>(const KvLayerView&, const __half*, int64_t, const int32_t*, const int32_t*,
                                      int64_t, int64_t, int64_t, cudaStream_t);
template void kv_cache_append<__nv_bfloat16>(const KvLayerView&, const __nv_bfloat16*, int64_t, const int32_t*,
                                             const int32_t*, int64_t, int64_t, int64_t, cudaStream_t);

}  // namespace conveyor::cuda
