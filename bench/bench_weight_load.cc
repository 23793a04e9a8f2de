// Weight load from a warm page cache (issue 31): how fast a stage's checkpoint gets onto its
// GPU by the old path (load_stage_weights: fp32 host vectors, then GpuStage's upload through
// an fp32 staging buffer) and the direct one (GpuStage from a StageCheckpoint: the stored
// bytes, several reader threads into page-locked slots, copied and converted on the GPU), in
// GB/s of checkpoint bytes (the stored dtype: 2 bytes a weight for fp16).
//
//   conveyor-bench-weight-load [--shape gpt2-xl|gpt3-6.7b|L,C,H] [--dir DIR] [--storage f16|bf16|f32]
//       [--dtype f16|bf16] [--weights dtype|int8|fp8] [--gpus 0[,1,...]] [--threads 4] [--slots 6]
//       [--slot-mb 16] [--read pread|mmap] [--repeat 3] [--host-only]
//
// It writes a checkpoint of random weights of the shape into DIR (default
// /tmp/conveyor-weight-load-<shape>-<storage>; kept and reused when its config matches), reads
// it once to warm the page cache, then prints the floors (the page cache read by pread on one
// thread, a host memcpy on one and on --threads threads, and on a GPU the copy from pinned
// memory) and each path's time, best and median of --repeat runs (the first CUDA call once:
// the context, and under CUDA_MODULE_LOADING=EAGER every module of every CUDA library linked):
//   host: load_stage_weights          the old path's host part (read + convert to fp32, 8 threads)
//   host: direct read                 the new path's host part (its reader threads into plain memory)
//   gpu: stage without weights        GpuStage's other costs (buffers, K/V cache, synthetic fill)
//   gpu: old (load + upload)          load_stage_weights + TpStage::create(weights)
//   gpu: direct                       TpStage::create(checkpoint)
// --read: how the direct path's readers copy whole rows (pread, the default, or from the mapping;
// a rank's columns always come from the mapping). --gpus: the stage's GPUs (tensor parallel over several; one GPU may be named twice to run
// both ranks on it). Without a GPU (or with --host-only) only the host rows run, and it says so.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/model_config.h"
#include "model/checkpoint_writer.h"
#include "model/piece_reader.h"
#include "model/stage_checkpoint.h"
#include "model/weights.h"
#include "stage/backend_factory.h"

#ifdef CONVEYOR_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/check.h"
#include "stage/cuda/tp_stage.h"
#endif

namespace conveyor {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string shape = "gpt2-xl", dir, storage = "f16", dtype = "f16", weights = "dtype";
  std::vector<int> gpus = {0};
  int threads = 4, slots = 6, repeat = 3;
  uint64_t slot_mb = 16;
  PieceRead read = PieceRead::Pread;
  bool host_only = false;
};

struct Timing {
  std::vector<double> seconds;
  double best() const { return *std::min_element(seconds.begin(), seconds.end()); }
  double median() const {
    std::vector<double> s = seconds;
    std::sort(s.begin(), s.end());
    return s[s.size() / 2];
  }
};

// Runs `fn` `repeat` times; fn returns false to stop (an error it has printed).
Timing time_runs(int repeat, const std::function<bool()>& fn) {
  Timing t;
  for (int i = 0; i < repeat; ++i) {
    const auto t0 = Clock::now();
    if (!fn()) std::exit(1);
    t.seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return t;
}

void row(const std::string& what, int64_t bytes, const Timing& t) {
  if (bytes == 0) {
    std::printf("| %-40s | %9s | %8.3f | %8.3f | %7s |\n", what.c_str(), "-", t.best(), t.median(), "-");
    return;
  }
  std::printf("| %-40s | %9.1f | %8.3f | %8.3f | %7.2f |\n", what.c_str(), double(bytes) / 1e6, t.best(), t.median(),
              double(bytes) / t.best() / 1e9);
}

Expected<DType> parse_dtype(const std::string& s) {
  if (s == "f16") return DType::F16;
  if (s == "bf16") return DType::BF16;
  if (s == "f32") return DType::F32;
  return Status::error("dtype '" + s + "': f16, bf16 or f32");
}

// The checkpoint: reused when DIR holds one of this shape, else written (random weights).
Expected<std::string> checkpoint_dir(const Args& a, const ModelConfig& c, DType storage) {
  const std::string dir = a.dir.empty() ? "/tmp/conveyor-weight-load-" + a.shape + "-" + a.storage : a.dir;
  if (auto have = load_model_config(dir); have && have->n_layer == c.n_layer && have->n_embd == c.n_embd &&
                                          have->n_head == c.n_head && have->vocab_size == c.vocab_size)
    if (auto ckpt = Checkpoint::open(dir); ckpt && ckpt->contains("transformer.h.0.ln_1.weight") &&
                                           ckpt->find("transformer.h.0.ln_1.weight")->info->dtype == storage) {
      std::printf("# reusing the checkpoint in %s\n", dir.c_str());
      return dir;
    }
  std::printf("# writing a %s checkpoint of random weights into %s ...\n", a.storage.c_str(), dir.c_str());
  std::fflush(stdout);
  fs::create_directories(dir);
  if (Status s = write_gpt2_checkpoint(dir, c, random_stage_weights(c, 0, c.n_layer, 1234), storage); !s) return s;
  return dir;
}

// Reads every file of `dir` once with read() into one 16 MiB buffer, faulted in once (warms
// the page cache; timed, the page cache's floor on one thread); returns the bytes read.
Expected<int64_t> read_all(const std::string& dir) {
  int64_t total = 0;
  static std::vector<char> buf(size_t(16) << 20, 1);
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (!entry.is_regular_file() || entry.path().extension() != ".safetensors") continue;
    const int fd = ::open(entry.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return Status::error(entry.path().string() + ": cannot open");
    for (ssize_t n; (n = ::read(fd, buf.data(), buf.size())) > 0;) total += n;
    ::close(fd);
  }
  return total;
}

// memcpy of `from` into `to`, split over `threads` threads.
double memcpy_seconds(const std::vector<char>& from, std::vector<char>& to, int threads) {
  const auto t0 = Clock::now();
  std::vector<std::thread> pool;
  const size_t part = from.size() / size_t(threads);
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] { std::memcpy(to.data() + size_t(t) * part, from.data() + size_t(t) * part, part); });
  for (auto& th : pool) th.join();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The host's floors: the warm page cache read by pread on one thread, and memcpy of 1 GiB.
void host_floors(const Args& a, const std::string& dir, int64_t checkpoint_file_bytes) {
  row("floor: page cache read (1 thread)", checkpoint_file_bytes, time_runs(a.repeat, [&] { return bool(read_all(dir)); }));
  const std::vector<char> x(size_t(1) << 30, 1);
  std::vector<char> y(x.size(), 2);
  for (int threads : {1, a.threads}) {
    Timing t;
    for (int i = 0; i < a.repeat; ++i) t.seconds.push_back(memcpy_seconds(x, y, threads));
    row("floor: host memcpy (" + std::to_string(threads) + (threads > 1 ? " threads)" : " thread)"), int64_t(x.size()), t);
  }
}

// The tensors a single-GPU stage of the whole model holds (rank 0 of one): the embedding, the
// final LayerNorm and the head unless it is the embedding itself.
bool whole_stage_holds(const ModelConfig& c, StageTensor t) { return !(t == StageTensor::LmHead && c.tie_word_embeddings); }

// The direct path's host part: its reader threads gather every piece into plain memory.
bool direct_read(const Args& a, const StageCheckpoint& ckpt) {
  auto pieces = stage_pieces(ckpt, TpShard::of(ckpt.config, 0, 1),
                             [&](StageTensor t) { return whole_stage_holds(ckpt.config, t); }, a.slot_mb << 20);
  if (!pieces) {
    std::fprintf(stderr, "%s\n", pieces.error().c_str());
    return false;
  }
  static std::vector<std::vector<std::byte>> memory;  // kept across runs: faulted in once
  PieceRing ring;
  ring.slot_bytes = a.slot_mb << 20;
  ring.read = a.read;
  memory.resize(size_t(a.slots));
  for (auto& m : memory) {
    m.resize(ring.slot_bytes);
    ring.slots.push_back(m.data());
  }
  ring.consume = [](size_t, size_t) { return ok_status(); };
  if (Status s = read_pieces(*pieces, a.threads, ring); !s) {
    std::fprintf(stderr, "%s\n", s.message().c_str());
    return false;
  }
  return true;
}

#ifdef CONVEYOR_HAVE_CUDA
// Copy bandwidth from page-locked memory to the first GPU: 8 copies of 256 MiB.
Timing h2d_floor(const Args& a) {
  cuda::DeviceGuard on(a.gpus[0]);
  const size_t bytes = size_t(256) << 20;
  cuda::PinnedBuffer host(bytes, "bench pinned source");
  std::memset(host.get(), 1, bytes);
  cuda::DeviceBuffer dev = cuda::device_alloc(bytes, "bench", "copy destination");
  return time_runs(a.repeat, [&] {
    for (int i = 0; i < 8; ++i) CUDA_CHECK(cudaMemcpyAsync(dev.get(), host.get(), bytes, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaDeviceSynchronize());
    return true;
  });
}

template <class Make>
bool make_stage(Make&& make) {
  auto stage = make();
  if (!stage) std::fprintf(stderr, "%s\n", stage.error().c_str());
  return bool(stage);  // destroyed here, outside no timing: the caller times make() and this
}

void gpu_rows(const Args& a, const ModelConfig& c, const std::string& dir, DType dtype, int64_t bytes) {
  // Once a process, and part of a worker's first load: the context, and under
  // CUDA_MODULE_LOADING=EAGER every kernel of every CUDA library the program links.
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  row(std::string("gpu: first CUDA call (") + (loading ? loading : "LAZY") + ")", 0, time_runs(1, [&] {
        CUDA_CHECK(cudaSetDevice(a.gpus[0]));
        CUDA_CHECK(cudaFree(nullptr));
        return true;
      }));
  row("floor: pinned host -> GPU copy", int64_t(8) << 28, h2d_floor(a));
  cuda::GpuStageOptions o;
  o.name = "bench stage";
  o.dtype = dtype;
  o.int8_weights = a.weights == "int8";
  o.fp8 = a.weights == "fp8";
  o.max_seqs = 512;  // as a worker builds it (stage/backend_factory.cc)
  cuda::DirectLoadOptions load{a.threads, a.slots, a.slot_mb << 20, a.read};
  row("gpu: stage without weights", 0, time_runs(a.repeat, [&] {
        return make_stage([&] { return cuda::TpStage::create_synthetic(c, 0, c.n_layer, 1, a.gpus, o); });
      }));
  row("gpu: old (load_stage_weights + upload)", bytes, time_runs(a.repeat, [&] {
        return make_stage([&]() -> Expected<std::unique_ptr<cuda::TpStage>> {
          auto w = load_stage_weights(dir, c, 0, c.n_layer);
          if (!w) return w.status();
          return cuda::TpStage::create(*w, a.gpus, o);
        });
      }));
  row("gpu: direct", bytes, time_runs(a.repeat, [&] {
        return make_stage([&]() -> Expected<std::unique_ptr<cuda::TpStage>> {
          auto ckpt = open_stage_checkpoint(dir, c, 0, c.n_layer);
          if (!ckpt) return ckpt.status();
          return cuda::TpStage::create(*ckpt, a.gpus, o, load);
        });
      }));
}
#endif

Expected<Args> parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--host-only") {
      a.host_only = true;
      continue;
    }
    if (i + 1 >= argc) return Status::error(k + " needs a value");
    const std::string v = argv[++i];
    if (k == "--shape") a.shape = v;
    else if (k == "--dir") a.dir = v;
    else if (k == "--storage") a.storage = v;
    else if (k == "--dtype") a.dtype = v;
    else if (k == "--weights") a.weights = v;
    else if (k == "--threads") a.threads = std::atoi(v.c_str());
    else if (k == "--slots") a.slots = std::atoi(v.c_str());
    else if (k == "--slot-mb") a.slot_mb = uint64_t(std::atoll(v.c_str()));
    else if (k == "--repeat") a.repeat = std::atoi(v.c_str());
    else if (k == "--read" && (v == "pread" || v == "mmap")) a.read = v == "pread" ? PieceRead::Pread : PieceRead::Map;
    else if (k == "--gpus") {
      a.gpus.clear();
      std::stringstream ss(v);
      for (std::string g; std::getline(ss, g, ',');) a.gpus.push_back(std::atoi(g.c_str()));
    } else {
      return Status::error("unknown option " + k);
    }
  }
  if (a.threads < 1 || a.slots < 1 || a.slot_mb < 1 || a.repeat < 1 || a.gpus.empty())
    return Status::error("--threads, --slots, --slot-mb and --repeat must be positive, --gpus non-empty");
  if (a.weights != "dtype" && a.weights != "int8" && a.weights != "fp8")
    return Status::error("--weights takes dtype, int8 or fp8, not '" + a.weights + "'");
  return a;
}

int run(int argc, char** argv) {
  auto args = parse_args(argc, argv);
  if (!args) {
    std::fprintf(stderr, "%s\n", args.error().c_str());
    return 2;
  }
  const Args& a = *args;
  auto config = named_model_shape(a.shape);
  auto storage = parse_dtype(a.storage);
  auto dtype = parse_dtype(a.dtype);
  if (!config || !storage || !dtype || *dtype == DType::F32) {
    std::fprintf(stderr, "%s\n", !config ? config.error().c_str() : "--storage f16|bf16|f32, --dtype f16|bf16");
    return 2;
  }
  auto dir = checkpoint_dir(a, *config, *storage);
  if (!dir) {
    std::fprintf(stderr, "%s\n", dir.error().c_str());
    return 1;
  }
  auto file_bytes = read_all(*dir);  // warms the page cache
  auto ckpt = open_stage_checkpoint(*dir, *config, 0, config->n_layer);
  if (!file_bytes || !ckpt) {
    std::fprintf(stderr, "%s\n", !file_bytes ? file_bytes.error().c_str() : ckpt.error().c_str());
    return 1;
  }
  const int64_t bytes = ckpt->bytes();
  std::printf("# %s, %s checkpoint (%.1f MB of tensors), the whole model as one stage; %d reader threads (%s), %d "
              "slots of %lu MiB; %u host threads\n",
              a.shape.c_str(), a.storage.c_str(), double(bytes) / 1e6, a.threads,
              a.read == PieceRead::Pread ? "pread" : "mmap", a.slots, (unsigned long)a.slot_mb,
              std::thread::hardware_concurrency());
  std::printf("| path | MB | best s | median s | GB/s (best) |\n|---|---:|---:|---:|---:|\n");
  host_floors(a, *dir, *file_bytes);
  row("host: load_stage_weights (fp32)", bytes, time_runs(a.repeat, [&] {
        auto w = load_stage_weights(*dir, *config, 0, config->n_layer);
        if (!w) std::fprintf(stderr, "%s\n", w.error().c_str());
        return bool(w);
      }));
  row("host: direct read", bytes, time_runs(a.repeat, [&] { return direct_read(a, *ckpt); }));
  if (a.host_only || usable_gpus() == 0) {
    std::printf("# no GPU rows: %s\n", a.host_only ? "--host-only" : "this machine has no usable GPU (or no CUDA build)");
    return 0;
  }
#ifdef CONVEYOR_HAVE_CUDA
  gpu_rows(a, *config, *dir, *dtype, bytes);
#endif
  return 0;
}

}  // namespace
}  // namespace conveyor

int main(int argc, char** argv) {
  try {
    return conveyor::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
