// The context kernel of the tile order (attention_tiles.cuh says the order): a block of
// 4 warps per (64-row query tile, head, sequence), sharing each piece's K and V.
#include "kernels/cuda/attention_tiles.cuh"

namespace conveyor::cuda {
namespace {

using namespace detail;

// ---- context --------------------------------------------------------------------------------

// Shared memory of a context block: two pieces' tiles (bf16/fp16), or one piece's V tile and
// two staged FP8 pieces (the scores read K's bytes; V is widened into the tile).
template <class T, int D, bool FP8>
constexpr size_t context_smem() {
  return FP8 ? piece_smem_bytes<D>(sizeof(T)) / 2 + 2 * fp8_stage_bytes<D>() : 2 * piece_smem_bytes<D>(sizeof(T));
}

template <class T, int D, bool FP8>
__global__ void __launch_bounds__(kContextWarps * 32)
    context_tiles_kernel(T* __restrict__ out, const T* q_base, int64_t q_stride, PagedKv<T> kv, Fp8Kv f8,
                         const int32_t* __restrict__ q_begins, const int32_t* __restrict__ q_lens,
                         const int32_t* __restrict__ kv_lens, int n_head, float scale_log2) {
  constexpr int kRows = kContextWarps * 16;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  grid_dependents_launch();
  grid_dependency_wait();
  const int s = blockIdx.z, h = blockIdx.y;
  const int q_len = q_lens[s];
  const int q0 = blockIdx.x * kRows;
  if (q0 >= q_len) return;  // whole block
  const int kv_len = kv_lens[s], q_begin = q_begins[s];
  const int rows = min(kRows, q_len - q0);
  const int pos0 = kv_len - q_len + q0;  // position of tile row 0
  const int n_kv = pos0 + rows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const int64_t C = int64_t(n_head) * D;
  // bf16/fp16: stage b's K at stage_k(b), its V kPiece rows after. FP8: the V tile at
  // stage_k(0), the staged pieces after it.
  auto stage_k = [&](int b) { return reinterpret_cast<T*>(smem_raw) + b * 2 * kPiece * pitch<D>(); };
  auto staged = [&](int b) { return smem_raw + piece_smem_bytes<D>(sizeof(T)) / 2 + b * fp8_stage_bytes<D>(); };
  auto load = [&](int pc) {
    constexpr int kThreads = kContextWarps * 32;
    if constexpr (FP8) {
      load_piece_fp8<D, kThreads>(staged(pc & 1), f8, s, h, pc * kPiece, n_kv, threadIdx.x);
    } else {
      T* sK = stage_k(pc & 1);
      load_piece<T, D, kThreads>(sK, sK + kPiece * pitch<D>(), kv, s, h, pc * kPiece, n_kv, -1, threadIdx.x);
    }
  };

  int pos[2];
  const T* qrow[2];
  for (int r = 0; r < 2; ++r) {
    const int row = warp * 16 + g + 8 * r;
    pos[r] = row < rows ? pos0 + row : -1;
    qrow[r] = row < rows ? q_base + int64_t(q_begin + q0 + row) * q_stride + int64_t(h) * D : nullptr;
  }
  uint32_t q[D / 16][4];
  load_q<D, FP8>(q, qrow[0], qrow[1]);
  const int warp_last = warp * 16 < rows ? min(pos0 + warp * 16 + 15, n_kv - 1) : -1;

  const int n_pieces = (n_kv + kPiece - 1) / kPiece;
  load(0);
  cp_async_commit();
  TileState<D> run, piece;
  for (int pc = 0; pc < n_pieces; ++pc) {
    if (pc + 1 < n_pieces) {
      load(pc + 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if constexpr (FP8) {  // V's bytes widened into the tile; the scores read K's bytes
      widen_values<T, D>(stage_k(0), staged(pc & 1), threadIdx.x, blockDim.x);
      __syncthreads();
    }
    const int kb = pc * kPiece;
    if (kb <= warp_last) {
      if constexpr (FP8) {
        uint32_t p[4][4];
        float S[2];
        v_scale_rows<D>(S, staged(pc & 1), kb, pos);
        piece_scores_fp8<T, D>(piece, p, q, staged(pc & 1), kb, pos, scale_log2, S);
        piece_values<T, D>(piece, p, stage_k(0));
        scale_values<D>(piece, S);
      } else {
        const T* sK = stage_k(pc & 1);
        piece_state<T, D>(piece, q, sK, sK + kPiece * pitch<D>(), kb, pos, scale_log2);
      }
      for (int r = 0; r < 2; ++r)
        if (kb <= pos[r]) merge(run, piece, r, pc == 0);
    }
    __syncthreads();  // the stage (the tile) is free for the piece after next (the next)
  }
  for (int r = 0; r < 2; ++r)
    if (pos[r] >= 0) store_row<T, D>(out + int64_t(q_begin + q0 + warp * 16 + g + 8 * r) * C + int64_t(h) * D, run, r);
}

}  // namespace

template <class T>
void attention_context_tiles(T* out, const T* qkv, const KvLayerView& view, const SeqArrays& seqs, int64_t max_q_len,
                             int64_t n_head, int64_t head_dim, cudaStream_t stream) {
  if (max_q_len <= 0 || seqs.num_seqs <= 0) return;
  if (seqs.num_seqs > 65535 || n_head > 65535) throw Error("attention_context (tile order): too many sequences or heads");
  const int64_t C = n_head * head_dim;
  const float scale_log2 = kLog2e / std::sqrt(float(head_dim));
  const auto kv = paged<T>(view, int(head_dim));
  const Fp8Kv f8 = fp8_view(view, head_dim);
  constexpr int kRows = kContextWarps * 16;
  const dim3 grid{unsigned((max_q_len + kRows - 1) / kRows), unsigned(n_head), unsigned(seqs.num_seqs)};
  with_head_dim(head_dim, [&]<int D>() {
    auto launch = [&]<bool FP8>() {
      const size_t smem = context_smem<T, D, FP8>();
      allow_smem(context_tiles_kernel<T, D, FP8>, smem);
      LAUNCH_PDL("context_tiles_kernel", context_tiles_kernel<T, D, FP8>, grid, dim3(kContextWarps * 32), smem, stream,
                 out, qkv, 3 * C, kv, f8, seqs.q_begins, seqs.q_lens, seqs.kv_lens, int(n_head), scale_log2);
    };
    if (view.fp8()) launch.template operator()<true>();
    else launch.template operator()<false>();
  });
}

template void attention_context_tiles<half>(half*, const half*, const KvLayerView&, const SeqArrays&, int64_t,
                                            int64_t, int64_t, cudaStream_t);
template void attention_context_tiles<bf16>(bf16*, const bf16*, const KvLayerView&, const SeqArrays&, int64_t,
                                            int64_t, int64_t, cudaStream_t);

}  // namespace conveyor::cuda
