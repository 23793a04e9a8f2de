// The CPU reference ops. Two things make them batch-invariant (a row's bits never depend
// on the other rows of the call):
//
// 1. Matrix products go to OpenBLAS in blocks of exactly kMatmulRowBlock rows, the last
//    block padded with zero rows in a scratch buffer. OpenBLAS picks its code path
//    (gemv for M = 1, edge kernels for M not a multiple of its unroll, how threads split
//    the work) from the call's shape, and on this project's machines those paths round
//    differently: a row computed with M = 1, 3 or 7 differs in the last bits from the
//    same row inside M = 64 (see tests/kernels/test_cpu_ops.cc). With every call shaped
//    [kMatmulRowBlock, K] x [K, N], a row meets the same code path and the same K order
//    whatever T is and wherever it sits in the batch (slots within a block are
//    interchangeable: OpenBLAS packs A, and no kernel reduces across rows).
//    The bits still depend on OpenBLAS's kernel (its detected core type, or
//    OPENBLAS_CORETYPE) and, for some core types and shapes, its thread count: processes
//    that must agree bit for bit (a failover replay on another worker) need the same
//    OpenBLAS build, core type and OPENBLAS_NUM_THREADS.
// 2. Every other op works row by row (attention: query row by query row) with a fixed
//    summation order, and any threading splits rows or heads, never a reduction.
#include "kernels/cpu/ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <numbers>
#include <string>
#include <thread>
#include <vector>

namespace conveyor::cpu {
namespace {

// Rows per OpenBLAS call; see the note at the top. The padding is paid in full by a
// decode step of one sequence, so the block is small: measured on GPT-2 small shapes
// (2 cores), a block of 8 costs ~2.5x a gemv for one row yet runs large batches at ~75%
// of OpenBLAS's large-M throughput (16: ~4x a gemv, ~90%). Changing it changes the bits
// of every result (not their invariance).
constexpr int64_t kMatmulRowBlock = 8;

// A tiny fork-join pool for attention: parallel_for(n, fn) runs fn(i) for i in [0, n)
// split into contiguous ranges over the pool's threads and the caller. Each fn(i) writes
// its own output, so the result is the same however the range is split. A caller that
// finds the pool busy (another thread's call, e.g. tensor-parallel ranks) runs serially.
class ForkJoinPool {
 public:
  // `threads` in all, the caller included.
  explicit ForkJoinPool(int threads) {
    // OpenBLAS runs single-threaded under us: its own threads spin while waiting (ruinous
    // when several workers share cores) and its results can depend on its thread count.
    // Parallelism comes from this pool, over independent row blocks and heads.
    openblas_set_num_threads(1);
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { worker_loop(unsigned(i)); });
  }
  ~ForkJoinPool() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
    std::unique_lock busy(call_mu_, std::try_to_lock);
    if (workers_.empty() || n < 2 || !busy.owns_lock()) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    const int64_t parts = int64_t(workers_.size()) + 1;
    {
      std::lock_guard lock(mu_);
      fn_ = &fn;
      n_ = n;
      parts_ = parts;
      pending_ = int(workers_.size());
      ++generation_;
    }
    cv_.notify_all();
    run_part(0);
    std::unique_lock lock(mu_);
    done_cv_.wait(lock, [&] { return pending_ == 0; });
    fn_ = nullptr;
  }

 private:
  void run_part(int64_t part) {
    const int64_t begin = n_ * part / parts_, end = n_ * (part + 1) / parts_;
    for (int64_t i = begin; i < end; ++i) (*fn_)(i);
  }
  void worker_loop(unsigned index) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      run_part(index);
      {
        std::lock_guard lock(mu_);
        if (--pending_ == 0) done_cv_.notify_one();
      }
    }
  }

  std::mutex call_mu_;  // one parallel_for at a time
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, parts_ = 1;
  int pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

// The pool's size as set_threads asked (0: the hardware's), and whether it has started (then
// the size is fixed).
std::mutex g_threads_mu;
int g_threads = 0;
bool g_pool_started = false;

int resolved_threads(int threads) {
  return threads > 0 ? threads : int(std::max(1u, std::thread::hardware_concurrency()));
}

int start_pool() {
  std::lock_guard lock(g_threads_mu);
  g_pool_started = true;
  return resolved_threads(g_threads);
}

ForkJoinPool& pool() {
  static ForkJoinPool p(start_pool());
  return p;
}

// out[rows, N] = in[rows, K] @ w (w is [K, N] when !w_transposed, [N, K] when transposed),
// in blocks of exactly kMatmulRowBlock rows.
void blocked_sgemm(float* out, const float* in, const float* w, bool w_transposed, int64_t T,
                   int64_t K, int64_t N) {
  const CBLAS_TRANSPOSE tb = w_transposed ? CblasTrans : CblasNoTrans;
  const int64_t ldb = w_transposed ? K : N;
  const int64_t blocks = (T + kMatmulRowBlock - 1) / kMatmulRowBlock;
  // Every block is one independent 8-row call, so the bits do not depend on which thread
  // runs it or how the blocks are spread.
  pool().parallel_for(blocks, [&](int64_t b) {
    const int64_t t0 = b * kMatmulRowBlock;
    const int64_t rows = std::min(kMatmulRowBlock, T - t0);
    if (rows == kMatmulRowBlock) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, tb, blasint(kMatmulRowBlock), blasint(N), blasint(K),
                  1.0f, in + t0 * K, blasint(K), w, blasint(ldb), 0.0f, out + t0 * N, blasint(N));
      return;
    }
    thread_local std::vector<float> pad_in, pad_out;
    pad_in.assign(size_t(kMatmulRowBlock * K), 0.0f);
    pad_out.resize(size_t(kMatmulRowBlock * N));
    std::memcpy(pad_in.data(), in + t0 * K, sizeof(float) * size_t(rows * K));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, tb, blasint(kMatmulRowBlock), blasint(N), blasint(K), 1.0f,
                pad_in.data(), blasint(K), w, blasint(ldb), 0.0f, pad_out.data(), blasint(N));
    std::memcpy(out + t0 * N, pad_out.data(), sizeof(float) * size_t(rows * N));
  });
}

// Dot product with eight interleaved partial sums, combined in a fixed tree: the same
// order for every call, and it vectorises.
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  for (int j = 0; i < n; ++i, ++j) acc[j] += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// One query row of one head: out[D] = softmax(q . k_j / sqrt(D), j <= pos) @ v.
// `scores` has room for pos + 1 floats.
void attend_row(float* out, const float* q, const float* k, const float* v, int64_t kv_stride,
                int64_t pos, int64_t D, float* scores) {
  // HF GPT-2 (scale_attn_weights): (q @ k^T) / sqrt(D) in fp32, then softmax in fp32.
  const float scale_div = std::sqrt(float(D));
  float max_score = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j <= pos; ++j) {
    const float s = dot(q, k + j * kv_stride, D) / scale_div;
    scores[j] = s;
    max_score = std::max(max_score, s);
  }
  float sum = 0.0f;
  for (int64_t j = 0; j <= pos; ++j) {
    scores[j] = std::exp(scores[j] - max_score);
    sum += scores[j];
  }
  const float inv_sum = 1.0f / sum;
  std::fill(out, out + D, 0.0f);
  for (int64_t j = 0; j <= pos; ++j) {
    const float p = scores[j] * inv_sum;
    const float* vj = v + j * kv_stride;
    for (int64_t d = 0; d < D; ++d) out[d] += p * vj[d];
  }
}

}  // namespace

Status set_threads(int threads) {
  if (threads < 0) return Status::error("cpu ops: threads " + std::to_string(threads) + " (0: one per hardware thread)");
  std::lock_guard lock(g_threads_mu);
  if (g_pool_started && resolved_threads(threads) != resolved_threads(g_threads))
    return Status::error("cpu ops: the pool already runs " + std::to_string(resolved_threads(g_threads)) +
                         " threads; " + std::to_string(threads) + " must be set before the first op");
  g_threads = threads;
  return {};
}

int threads() {
  std::lock_guard lock(g_threads_mu);
  return resolved_threads(g_threads);
}

void embedding_forward(float* out, const int32_t* ids, const int32_t* positions, int64_t num_tokens,
                       const float* wte, const float* wpe, int64_t C) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* te = wte + int64_t(ids[t]) * C;
    const float* pe = wpe + int64_t(positions[t]) * C;
    float* o = out + t * C;
    for (int64_t c = 0; c < C; ++c) o[c] = te[c] + pe[c];
  }
}

void layernorm_forward(float* out, const float* in, const float* gamma, const float* beta,
                       int64_t num_tokens, int64_t C, float eps) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* x = in + t * C;
    double sum = 0.0;
    for (int64_t c = 0; c < C; ++c) sum += x[c];
    const double mean = sum / double(C);
    double var = 0.0;
    for (int64_t c = 0; c < C; ++c) {
      const double d = double(x[c]) - mean;
      var += d * d;
    }
    var /= double(C);
    const float rstd = float(1.0 / std::sqrt(var + double(eps)));
    const float fmean = float(mean);
    float* o = out + t * C;
    for (int64_t c = 0; c < C; ++c) o[c] = (x[c] - fmean) * rstd * gamma[c] + beta[c];
  }
}

void matmul_forward(float* out, const float* in, const float* w, const float* bias, int64_t T,
                    int64_t K, int64_t N) {
  if (T <= 0) return;
  blocked_sgemm(out, in, w, /*w_transposed=*/false, T, K, N);
  if (bias == nullptr) return;
  for (int64_t t = 0; t < T; ++t) {
    float* o = out + t * N;
    for (int64_t n = 0; n < N; ++n) o[n] += bias[n];
  }
}

void lm_head_forward(float* logits, const float* in, const float* head, int64_t T, int64_t C,
                     int64_t V) {
  if (T <= 0) return;
  blocked_sgemm(logits, in, head, /*w_transposed=*/true, T, C, V);
}

void gelu_forward(float* x, int64_t n) {
  const float s = float(std::sqrt(2.0 / std::numbers::pi));  // as HF: math.sqrt(2/pi) -> fp32
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    x[i] = 0.5f * v * (1.0f + std::tanh(s * (v + 0.044715f * (v * v * v))));
  }
}

void gelu_erf_forward(float* x, int64_t n) {
  const float inv_sqrt2 = float(1.0 / std::sqrt(2.0));
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    x[i] = 0.5f * v * (1.0f + std::erf(v * inv_sqrt2));
  }
}

void residual_forward(float* out, const float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void attention_context(float* out, const float* q, int64_t q_stride, const float* k, const float* v,
                       int64_t kv_stride, int64_t q_len, int64_t kv_len, int64_t n_head,
                       int64_t head_dim) {
  if (q_len <= 0) return;
  const int64_t C = n_head * head_dim;
  const int64_t first_pos = kv_len - q_len;
  // Work items are (head, query row) pairs; each writes its own D outputs.
  auto item = [&](int64_t idx, std::vector<float>& scores) {
    const int64_t h = idx / q_len, i = idx % q_len;
    const int64_t pos = first_pos + i;
    if (int64_t(scores.size()) < pos + 1) scores.resize(size_t(pos + 1));
    attend_row(out + i * C + h * head_dim, q + i * q_stride + h * head_dim, k + h * head_dim,
               v + h * head_dim, kv_stride, pos, head_dim, scores.data());
  };
  const int64_t items = n_head * q_len;
  // Rough multiply-adds; below ~256K the pool's hand-off costs more than it saves.
  const int64_t work = items * (first_pos + (q_len + 1) / 2 + 1) * head_dim * 2;
  thread_local std::vector<float> scores;
  if (work < (int64_t(1) << 18)) {
    for (int64_t idx = 0; idx < items; ++idx) item(idx, scores);
    return;
  }
  pool().parallel_for(items, [&](int64_t idx) {
    thread_local std::vector<float> worker_scores;
    item(idx, worker_scores);
  });
}

void attention_decode(float* out, const float* q, const float* k, const float* v, int64_t kv_stride,
                      int64_t kv_len, int64_t n_head, int64_t head_dim) {
  attention_context(out, q, n_head * head_dim, k, v, kv_stride, 1, kv_len, n_head, head_dim);
}

void log_softmax_forward(float* x, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * n;
    float max_v = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) max_v = std::max(max_v, row[i]);
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) sum += std::exp(double(row[i]) - double(max_v));
    const double lse = double(max_v) + std::log(sum);
    for (int64_t i = 0; i < n; ++i) row[i] = float(double(row[i]) - lse);
  }
}

}  // namespace conveyor::cpu
