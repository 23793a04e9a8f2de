// Reading safetensors checkpoints: one file (SafetensorsFile, memory-mapped) and a model
// directory holding either model.safetensors or shards listed in
// model.safetensors.index.json (Checkpoint, which opens a shard only when a tensor in it
// is asked for).
//
// File layout (https://github.com/huggingface/safetensors): 8 bytes little-endian u64 N,
// then N bytes of JSON header {name: {"dtype", "shape", "data_offsets": [begin, end]}, and
// an optional "__metadata__"}, then the data section. data_offsets are byte offsets
// relative to the start of the data section (file offset 8 + N), end exclusive.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"

namespace conveyor {

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;  // empty for a scalar
  uint64_t offset = 0;         // bytes from the start of the file (not of the data section)
  uint64_t size_bytes = 0;     // == num_elements() * dtype_bytes(dtype), checked at open

  int64_t num_elements() const;
};

// "[768, 2304]": for error messages.
std::string shape_string(std::span<const int64_t> shape);

// Validates a whole safetensors file held in memory (`file`: all of its bytes) and returns
// its tensors in header order, as SafetensorsFile::open does after mapping; `path` only names
// the file in errors. Never reads outside `file`: every offset is checked against its size.
Expected<std::vector<TensorInfo>> parse_safetensors(std::span<const std::byte> file, const std::string& path);

// A validated, read-only, memory-mapped safetensors file. Move-only; the mapping lives as
// long as the object (spans from data() dangle after it is destroyed or moved from).
class SafetensorsFile {
 public:
  // Maps `path` and validates the whole header; every tensor's bytes lie inside the file
  // and no two tensors overlap. Errors name the file and, where one is at fault, the tensor.
  static Expected<SafetensorsFile> open(const std::string& path);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // in header order
  const TensorInfo* find(std::string_view name) const;                 // null when absent
  std::span<const std::byte> data(const TensorInfo& info) const;

  // Page hints for a tensor's byte range, all advisory (failures, e.g. an older kernel,
  // are ignored): prefetch starts asynchronous readahead (SEQUENTIAL + WILLNEED);
  // populate maps the whole range in one call (POPULATE_READ, Linux 5.14+) instead of a
  // page fault per 64 KB; release drops the mapping's pages after conversion (DONTNEED)
  // so they do not count in our RSS.
  void prefetch(const TensorInfo& info) const;
  void populate(const TensorInfo& info) const;
  void release(const TensorInfo& info) const;
  // Reads bytes [begin, begin + bytes) of a tensor's data into `out` with pread (no page of the
  // mapping touched). Errors name the file and the tensor (a range outside it, a read error, a
  // file cut short since it was opened).
  Status read(const TensorInfo& info, uint64_t begin, uint64_t bytes, std::byte* out) const;
  // The same for bytes [begin, begin + bytes) of a tensor's data (a loader's piece of it).
  void populate(const TensorInfo& info, uint64_t begin, uint64_t bytes) const;
  void release(const TensorInfo& info, uint64_t begin, uint64_t bytes) const;

 private:
  SafetensorsFile() = default;
  // `advice` over file bytes [offset, offset + bytes), widened to whole pages.
  void advise(uint64_t offset, uint64_t bytes, int advice) const;

  std::string path_;
  std::byte* map_ = nullptr;  // whole file, PROT_READ, MAP_PRIVATE
  size_t map_bytes_ = 0;
  int fd_ = -1;               // kept open for read()
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> index_;  // name -> position in tensors_
};

// Converts `num_elements` values of `src_dtype` (F32, F16 or BF16; any alignment) to fp32.
// Exact: fp16 and bf16 are subsets of fp32. Tight loops; F16 uses F16C where the CPU has it.
Status convert_to_f32(DType src_dtype, const std::byte* src, size_t num_elements, float* dst);

// A tensor found in a Checkpoint: the file it lives in and its entry there.
struct TensorRef {
  const SafetensorsFile* file = nullptr;
  const TensorInfo* info = nullptr;
};

// A model directory: DIR/model.safetensors, or else DIR/model.safetensors.index.json whose
// "weight_map" maps tensor name -> shard file (relative to DIR). Shards open lazily, so a
// stage never opens (or needs to have on disk) a shard holding none of its tensors.
class Checkpoint {
 public:
  static Expected<Checkpoint> open(const std::string& model_dir);

  const std::string& dir() const { return dir_; }
  bool sharded() const { return single_ == nullptr; }
  // Whether the checkpoint names this tensor (from the index alone when sharded).
  bool contains(const std::string& name) const;
  // Finds a tensor, opening its shard on first use. Errors: tensor absent (names tensor and
  // directory), shard missing or corrupt, shard lacking a tensor the index puts there.
  Expected<TensorRef> find(const std::string& name);
  // Shards (file names as in the index) opened so far; for tests and load reports.
  std::vector<std::string> open_shards() const;

 private:
  std::string dir_;
  std::unique_ptr<SafetensorsFile> single_;                  // set when not sharded
  std::unordered_map<std::string, std::string> weight_map_;  // tensor -> shard file name
  std::map<std::string, std::unique_ptr<SafetensorsFile>> shards_;  // opened shards
};

}  // namespace conveyor
