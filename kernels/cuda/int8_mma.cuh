// Device helpers of the int8 weight-only products (quant.cu), not a public header: exact
// int8 -> fp16/bf16 conversion in registers, the m16n8k16 tensor-core MMA, and cp.async.
//
// How a warp feeds int8 rows to mma.m16n8k16 without shuffles. The MMA sums over its 16 k in
// an order of its own, so any bijection between the MMA's logical k and memory's k gives the
// same sum, provided both operands use it. We use, for a 64-wide chunk of k processed in four
// MMA steps j = 0..3, the one under which lane (g = lane / 4, t = lane % 4) reads 16
// contiguous values of k, [16t, 16t + 16), for one row:
//
//   logical k 2t + {0, 1}      <->  memory k 16t + 4j + {0, 1}
//   logical k 2t + 8 + {0, 1}  <->  memory k 16t + 4j + {2, 3}
//
// Lane (g, t) holds, in the PTX fragment layouts, logical k {2t, 2t+1, 2t+8, 2t+9} of its
// rows of A (rows g and g + 8) and of its column of B (column g). Under the mapping these are
// memory k 16t + 4j .. 16t + 4j + 3: the four int8 of 32-bit word j of the lane's 16-byte
// load of a weight row, or the four fp16/bf16 of 32-bit words 2j and 2j + 1 of its 32-byte
// load of an activation row. So every operand register is one word of a 16-byte vector load:
//
//   A regs {a0a1, a2a3, a4a5, a6a7} = {row g words(k 4j, 4j+1), row g+8 same, row g (4j+2,
//   4j+3), row g+8 same};  B regs {b0b1, b2b3} = {column g (4j, 4j+1), column g (4j+2, 4j+3)}.
//
// The int8 GEMV puts 16 weight rows in A and up to 8 tokens in B; the tiled kernel puts tokens
// in A and weight rows in B. Both use pair_lo/pair_hi of word j for the weights.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace conveyor::cuda::detail {

// Four int8 (one 32-bit word, lowest byte first) to two pairs of T: `lo` holds bytes 0 and 1
// (byte 0 in the low half), `hi` bytes 2 and 3. Exact: every int8 is an fp16 and a bf16.
//
// fp16: the byte biased to unsigned (q + 128 = q ^ 0x80) goes into the low mantissa bits of
// 1024.0 (0x6400), which gives 1024 + q + 128 exactly; subtracting 1152 leaves q.
// bf16 (7 mantissa bits, so 128 + 255 does not fit): the low 7 bits l go into 128.0 (0x4300),
// giving 128 + l; the sign bit s goes into the exponent of 0x4300 | s << 7, which is 128 or
// 256; their difference is l - 128 s = q. Both steps are exact, so the subtraction is too.
template <class T>
__device__ __forceinline__ void int8x4_to_pairs(uint32_t v, uint32_t& lo, uint32_t& hi);

template <>
__device__ __forceinline__ void int8x4_to_pairs<__half>(uint32_t v, uint32_t& lo, uint32_t& hi) {
  const uint32_t u = v ^ 0x80808080u;
  lo = __byte_perm(u, 0x64646464u, 0x4140);
  hi = __byte_perm(u, 0x64646464u, 0x4342);
  const uint32_t k1152 = 0x64806480u;
  asm("sub.f16x2 %0, %0, %1;" : "+r"(lo) : "r"(k1152));
  asm("sub.f16x2 %0, %0, %1;" : "+r"(hi) : "r"(k1152));
}

template <>
__device__ __forceinline__ void int8x4_to_pairs<__nv_bfloat16>(uint32_t v, uint32_t& lo, uint32_t& hi) {
  const uint32_t p_lo = __byte_perm(v, 0x43434343u, 0x4140);  // {b0, 0x43, b1, 0x43}
  const uint32_t p_hi = __byte_perm(v, 0x43434343u, 0x4342);
  lo = p_lo & 0xff7fff7fu;  // 128 + low 7 bits
  hi = p_hi & 0xff7fff7fu;
  const uint32_t s_lo = p_lo & 0xff80ff80u, s_hi = p_hi & 0xff80ff80u;  // 128 or 256
  asm("sub.rn.bf16x2 %0, %0, %1;" : "+r"(lo) : "r"(s_lo));
  asm("sub.rn.bf16x2 %0, %0, %1;" : "+r"(hi) : "r"(s_hi));
}

// d += a (16 x 16, row) * b (16 x 8, col), fp32 accumulation; T is __half or __nv_bfloat16.
template <class T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// 16 bytes global -> shared, bypassing L1; src_bytes < 16 fills the rest with zeros (0: all
// zeros, and `src` is not read).
__device__ __forceinline__ void cp_async16(void* smem, const void* src, int src_bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

}  // namespace conveyor::cuda::detail
