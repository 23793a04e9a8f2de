#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <system_error>
#include <utility>

#include <nlohmann/json.hpp>

#include "common/json_limits.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace conveyor {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using nlohmann::ordered_json;

// A header larger than this is not a checkpoint header (GPT-3 175B's has ~1000 entries,
// a few hundred KB).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

Status file_error(const std::string& path, const std::string& what) {
  return Status::error(path + ": " + what);
}

Status tensor_error(const std::string& path, const std::string& tensor, const std::string& what) {
  return Status::error(path + ": tensor \"" + tensor + "\": " + what);
}

// Closes a file descriptor on scope exit.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

// Reads a whole (small) file: the sharded index. Errors carry the errno text.
Expected<std::string> read_text_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return file_error(path, "cannot open: " + errno_text(errno));
  FdCloser closer{fd};
  std::string text;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      return file_error(path, "read failed: " + errno_text(errno));
    }
    if (n == 0) break;
    text.append(buf, size_t(n));
  }
  return text;
}

size_t page_bytes() {
  static const size_t bytes = size_t(::sysconf(_SC_PAGESIZE));
  return bytes;
}

// Parses one header entry (everything but the data offsets' placement in the file).
// `data_bytes` is the size of the data section; offsets must lie within it.
Status parse_entry(const std::string& path, const std::string& name, const ordered_json& entry,
                   uint64_t data_start, uint64_t data_bytes, TensorInfo& out) {
  if (!entry.is_object()) return tensor_error(path, name, "header entry is not a JSON object");
  out.name = name;

  auto dt = entry.find("dtype");
  if (dt == entry.end() || !dt->is_string())
    return tensor_error(path, name, "missing or non-string \"dtype\"");
  const auto dtype = dtype_from_name(dt->get<std::string>());
  if (!dtype)
    return tensor_error(path, name, "unsupported dtype \"" + dt->get<std::string>() +
                                        "\" (supported: F32, F16, BF16, I8, I32, I64)");
  out.dtype = *dtype;

  auto sh = entry.find("shape");
  if (sh == entry.end() || !sh->is_array())
    return tensor_error(path, name, "missing or non-array \"shape\"");
  uint64_t num_elements = 1;
  for (const auto& d : *sh) {
    if (!d.is_number_unsigned())
      return tensor_error(path, name, "shape " + sh->dump() + " has an entry that is not a non-negative integer");
    const uint64_t dim = d.get<uint64_t>();
    if (dim > uint64_t(INT64_MAX) || __builtin_mul_overflow(num_elements, dim, &num_elements))
      return tensor_error(path, name, "shape " + sh->dump() + " overflows");
    out.shape.push_back(int64_t(dim));
  }
  uint64_t shape_bytes = 0;
  if (__builtin_mul_overflow(num_elements, uint64_t(dtype_bytes(out.dtype)), &shape_bytes))
    return tensor_error(path, name, "shape " + sh->dump() + " overflows");

  auto off = entry.find("data_offsets");
  if (off == entry.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
      !(*off)[1].is_number_unsigned())
    return tensor_error(path, name, "\"data_offsets\" must be two non-negative integers");
  const uint64_t begin = (*off)[0].get<uint64_t>(), end = (*off)[1].get<uint64_t>();
  if (begin > end)
    return tensor_error(path, name, "data_offsets " + off->dump() + " are out of order (begin > end)");
  if (end > data_bytes)
    return tensor_error(path, name, "data_offsets " + off->dump() + " run past the end of the file (data section is " +
                                        std::to_string(data_bytes) + " bytes)");
  if (end - begin != shape_bytes)
    return tensor_error(path, name, "dtype " + std::string(dtype_name(out.dtype)) + " and shape " +
                                        shape_string(out.shape) + " make " + std::to_string(shape_bytes) +
                                        " bytes, but data_offsets " + off->dump() + " hold " +
                                        std::to_string(end - begin));
  out.offset = data_start + begin;
  out.size_bytes = shape_bytes;
  return ok_status();
}

#if defined(__x86_64__)
__attribute__((target("avx,f16c"))) void f16_to_f32_f16c(const std::byte* src, size_t n, float* dst) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, src + 2 * i, 2);
    dst[i] = fp16_to_float(h);
  }
}
#endif

}  // namespace

int64_t TensorInfo::num_elements() const {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
}

std::string shape_string(std::span<const int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

Expected<std::vector<TensorInfo>> parse_safetensors(std::span<const std::byte> file, const std::string& path) {
  const uint64_t file_bytes = file.size();
  if (file_bytes < 8)
    return file_error(path, "file is " + std::to_string(file_bytes) +
                                " bytes, shorter than the 8-byte header length of a safetensors file");
  uint64_t header_bytes = 0;  // little-endian u64
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | std::to_integer<uint64_t>(file[i]);
  if (header_bytes > kMaxHeaderBytes)
    return file_error(path, "header length " + std::to_string(header_bytes) +
                                " bytes is absurd (limit 100 MB); not a safetensors file?");
  if (header_bytes > file_bytes - 8)
    return file_error(path, "header length " + std::to_string(header_bytes) + " bytes runs past the end of the file (" +
                                std::to_string(file_bytes) + " bytes)");
  const char* header_text = reinterpret_cast<const char*>(file.data() + 8);
  // Before parsing: ordered_json's parser copies nested values (json_limits.h), and copies
  // and dump()s recurse once per level.
  if (json_text_deeper_than(std::string_view(header_text, header_bytes), kMaxJsonDepth))
    return file_error(path, "header nests deeper than " + std::to_string(kMaxJsonDepth) + " levels");
  const ordered_json header = ordered_json::parse(header_text, header_text + header_bytes, nullptr,
                                                  /*allow_exceptions=*/false);
  if (header.is_discarded()) return file_error(path, "header is not valid JSON");
  if (!header.is_object()) return file_error(path, "header is not a JSON object");

  const uint64_t data_start = 8 + header_bytes;
  const uint64_t data_bytes = file_bytes - data_start;
  std::vector<TensorInfo> tensors;
  tensors.reserve(header.size());
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;  // free-form string map; not ours to interpret
    TensorInfo info;
    if (Status s = parse_entry(path, name, entry, data_start, data_bytes, info); !s) return s;
    tensors.push_back(std::move(info));
  }

  // No two tensors may share a byte: sort the non-empty ones by offset, compare neighbours.
  std::vector<const TensorInfo*> by_offset;
  for (const auto& t : tensors)
    if (t.size_bytes > 0) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const TensorInfo& prev = *by_offset[i - 1];
    const TensorInfo& cur = *by_offset[i];
    if (cur.offset < prev.offset + prev.size_bytes)
      return tensor_error(path, cur.name, "data overlaps tensor \"" + prev.name + "\"");
  }
  return tensors;
}

// ---------------------------------------------------------------------------------------
// SafetensorsFile

Expected<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return file_error(path, "cannot open: " + errno_text(errno));
  FdCloser closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) return file_error(path, "fstat failed: " + errno_text(errno));
  if (!S_ISREG(st.st_mode)) return file_error(path, "not a regular file");
  const uint64_t file_bytes = uint64_t(st.st_size);
  if (file_bytes < 8)
    return file_error(path, "file is " + std::to_string(file_bytes) +
                                " bytes, shorter than the 8-byte header length of a safetensors file");

  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  if (map == MAP_FAILED) return file_error(path, "mmap failed: " + errno_text(errno));
  SafetensorsFile f;  // owns the mapping and the fd from here on
  f.path_ = path;
  f.map_ = static_cast<std::byte*>(map);
  f.map_bytes_ = file_bytes;
  f.fd_ = std::exchange(closer.fd, -1);

  auto tensors = parse_safetensors(std::span<const std::byte>(f.map_, f.map_bytes_), path);
  if (!tensors) return tensors.status();
  f.tensors_ = std::move(tensors).value();
  for (size_t i = 0; i < f.tensors_.size(); ++i) f.index_.emplace(f.tensors_[i].name, i);
  return f;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept
    : path_(std::move(other.path_)),
      map_(std::exchange(other.map_, nullptr)),
      map_bytes_(std::exchange(other.map_bytes_, 0)),
      fd_(std::exchange(other.fd_, -1)),
      tensors_(std::move(other.tensors_)),
      index_(std::move(other.index_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    if (map_) ::munmap(map_, map_bytes_);
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    tensors_ = std::move(other.tensors_);
    index_ = std::move(other.index_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, map_bytes_);
  if (fd_ >= 0) ::close(fd_);
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

std::span<const std::byte> SafetensorsFile::data(const TensorInfo& info) const {
  // Bounds were checked at open; `info` must come from this file.
  return {map_ + info.offset, size_t(info.size_bytes)};
}

Status SafetensorsFile::read(const TensorInfo& info, uint64_t begin, uint64_t bytes, std::byte* out) const {
  if (begin > info.size_bytes || bytes > info.size_bytes - begin)
    return tensor_error(path_, info.name, "bytes [" + std::to_string(begin) + ", " + std::to_string(begin + bytes) +
                                              ") asked of a tensor of " + std::to_string(info.size_bytes));
  for (uint64_t done = 0; done < bytes;) {
    const ssize_t n = ::pread(fd_, out + done, size_t(bytes - done), off_t(info.offset + begin + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      return tensor_error(path_, info.name, n < 0 ? "read failed: " + errno_text(errno)
                                                  : "the file ends early (was it truncated since it was opened?)");
    done += uint64_t(n);
  }
  return ok_status();
}

void SafetensorsFile::advise(uint64_t offset, uint64_t bytes, int advice) const {
  if (bytes == 0) return;
  const uint64_t begin = offset & ~uint64_t(page_bytes() - 1);  // madvise needs page alignment
  (void)::madvise(map_ + begin, size_t(offset + bytes - begin), advice);
}

void SafetensorsFile::prefetch(const TensorInfo& info) const {
  advise(info.offset, info.size_bytes, MADV_SEQUENTIAL);
  advise(info.offset, info.size_bytes, MADV_WILLNEED);
}

void SafetensorsFile::populate(const TensorInfo& info) const { populate(info, 0, info.size_bytes); }

void SafetensorsFile::populate(const TensorInfo& info, uint64_t begin, uint64_t bytes) const {
#ifdef MADV_POPULATE_READ
  advise(info.offset + begin, std::min(bytes, info.size_bytes - std::min(begin, info.size_bytes)), MADV_POPULATE_READ);
#else
  (void)info, (void)begin, (void)bytes;
#endif
}

void SafetensorsFile::release(const TensorInfo& info) const { release(info, 0, info.size_bytes); }

void SafetensorsFile::release(const TensorInfo& info, uint64_t begin, uint64_t bytes) const {
  // The mapping is private and never written, so dropping its pages loses nothing; a later
  // read of a shared boundary page simply faults it back in from the page cache.
  advise(info.offset + begin, std::min(bytes, info.size_bytes - std::min(begin, info.size_bytes)), MADV_DONTNEED);
}

// ---------------------------------------------------------------------------------------
// Conversion

Status convert_to_f32(DType src_dtype, const std::byte* src, size_t num_elements, float* dst) {
  switch (src_dtype) {
    case DType::F32:
      std::memcpy(dst, src, num_elements * 4);
      return ok_status();
    case DType::BF16: {
      size_t i = 0;
#if defined(__x86_64__)
      // SSE2 (x86-64 baseline): interleaving zeros below each half puts it in the top 16 bits.
      const __m128i zero = _mm_setzero_si128();
      for (; i + 8 <= num_elements; i += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm_unpacklo_epi16(zero, h));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i + 4), _mm_unpackhi_epi16(zero, h));
      }
#endif
      for (; i < num_elements; ++i) {  // memcpy: the source may be unaligned
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        const uint32_t bits = uint32_t(h) << 16;
        std::memcpy(dst + i, &bits, 4);
      }
      return ok_status();
    }
    case DType::F16: {
#if defined(__x86_64__)
      // F16C from CPUID leaf 1 (ECX bit 29): clang before 16 knows no "f16c" feature string.
      static const bool have_f16c = [] {
        unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
        return __builtin_cpu_supports("avx") && __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
      }();
      if (have_f16c) {
        f16_to_f32_f16c(src, num_elements, dst);
        return ok_status();
      }
#endif
      for (size_t i = 0; i < num_elements; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = fp16_to_float(h);
      }
      return ok_status();
    }
    default:
      return Status::error("cannot convert " + std::string(dtype_name(src_dtype)) +
                           " to F32 (weights must be stored as F32, F16 or BF16)");
  }
}

// ---------------------------------------------------------------------------------------
// Checkpoint

Expected<Checkpoint> Checkpoint::open(const std::string& model_dir) {
  Checkpoint c;
  c.dir_ = model_dir;
  std::error_code ec;
  if (!fs::is_directory(model_dir, ec))
    return file_error(model_dir, "not a directory" + (ec ? " (" + ec.message() + ")" : std::string()));

  // A single file wins over an index, as in HF transformers.
  const std::string single = (fs::path(model_dir) / "model.safetensors").string();
  if (fs::exists(single, ec)) {
    auto f = SafetensorsFile::open(single);
    if (!f) return f.status();
    c.single_ = std::make_unique<SafetensorsFile>(std::move(f).value());
    return c;
  }

  const std::string index_path = (fs::path(model_dir) / "model.safetensors.index.json").string();
  if (!fs::exists(index_path, ec))
    return file_error(model_dir, "holds neither model.safetensors nor model.safetensors.index.json "
                                 "(only safetensors checkpoints are supported)");
  auto text = read_text_file(index_path);
  if (!text) return text.status();
  const json index = json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded()) return file_error(index_path, "not valid JSON");
  if (!index.is_object()) return file_error(index_path, "top level is not a JSON object");
  auto wm = index.find("weight_map");
  if (wm == index.end() || !wm->is_object())
    return file_error(index_path, "missing or non-object \"weight_map\"");
  for (const auto& [name, shard] : wm->items()) {
    if (!shard.is_string())
      return file_error(index_path, "weight_map entry for tensor \"" + name + "\" is not a string");
    const std::string file = shard.get<std::string>();
    const fs::path p(file);
    // Shards live inside the model directory.
    if (file.empty() || p.is_absolute() || std::find(p.begin(), p.end(), fs::path("..")) != p.end())
      return file_error(index_path, "weight_map entry for tensor \"" + name + "\" names shard \"" + file +
                                        "\", which is not a file inside the model directory");
    c.weight_map_.emplace(name, file);
  }
  return c;
}

bool Checkpoint::contains(const std::string& name) const {
  return single_ ? single_->find(name) != nullptr : weight_map_.count(name) > 0;
}

Expected<TensorRef> Checkpoint::find(const std::string& name) {
  if (single_) {
    const TensorInfo* info = single_->find(name);
    if (!info)
      return Status::error(single_->path() + ": tensor \"" + name + "\" not found in checkpoint " + dir_);
    return TensorRef{single_.get(), info};
  }
  auto it = weight_map_.find(name);
  if (it == weight_map_.end())
    return Status::error(dir_ + ": tensor \"" + name +
                         "\" not found in checkpoint (not in model.safetensors.index.json)");
  auto& shard = shards_[it->second];
  if (!shard) {
    auto f = SafetensorsFile::open((fs::path(dir_) / it->second).string());
    if (!f) {
      shards_.erase(it->second);
      return Status::error(f.error() + " (shard named in model.safetensors.index.json, needed for tensor \"" +
                           name + "\")");
    }
    shard = std::make_unique<SafetensorsFile>(std::move(f).value());
  }
  const TensorInfo* info = shard->find(name);
  if (!info)
    return tensor_error(shard->path(), name, "not in this shard, though model.safetensors.index.json puts it there");
  return TensorRef{shard.get(), info};
}

std::vector<std::string> Checkpoint::open_shards() const {
  std::vector<std::string> names;
  for (const auto& [name, file] : shards_) names.push_back(name);
  return names;
}

}  // namespace conveyor
