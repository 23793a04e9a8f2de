#include "model/checkpoint_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>
#include <system_error>

#include <nlohmann/json.hpp>

#include "model/safetensors.h"

namespace conveyor {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using nlohmann::ordered_json;

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

// Writes `parts` (concatenated) to `path` through `path.tmp.<pid>` + rename.
Status write_file_atomic(const std::string& path, const std::vector<std::span<const std::byte>>& parts) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::error(tmp + ": cannot create: " + errno_text(errno));
  auto fail = [&](const std::string& what) {
    const std::string msg = tmp + ": " + what + ": " + errno_text(errno);
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    return Status::error(msg);
  };
  for (const auto& part : parts) {
    const std::byte* p = part.data();
    size_t left = part.size();
    while (left > 0) {
      const ssize_t n = ::write(fd, p, left);
      if (n < 0) {
        if (errno == EINTR) continue;
        return fail("write failed");
      }
      p += n;
      left -= size_t(n);
    }
  }
  if (::close(fd) != 0) {
    const std::string msg = tmp + ": close failed: " + errno_text(errno);
    ::unlink(tmp.c_str());
    return Status::error(msg);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string msg = path + ": rename from " + tmp + " failed: " + errno_text(errno);
    ::unlink(tmp.c_str());
    return Status::error(msg);
  }
  return ok_status();
}

std::span<const std::byte> as_bytes(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

Status remove_if_present(const fs::path& p) {
  std::error_code ec;
  fs::remove(p, ec);  // false without error when absent
  if (ec) return Status::error(p.string() + ": cannot remove stale file: " + ec.message());
  return ok_status();
}

// Which shard group a tensor belongs to: "embed", "h.N" or "final". Layers never split.
std::string shard_group(std::string_view name, std::string_view prefix) {
  if (name.starts_with(prefix)) name.remove_prefix(prefix.size());
  if (name.starts_with("h.")) return std::string(name.substr(0, name.find('.', 2)));
  if (name.starts_with("wte.") || name.starts_with("wpe.")) return "embed";
  return "final";
}

}  // namespace

NamedTensor make_tensor(std::string name, std::vector<int64_t> shape, std::span<const float> values,
                        DType storage) {
  NamedTensor t{std::move(name), storage, std::move(shape), {}};
  t.bytes.resize(values.size() * dtype_bytes(storage));
  std::byte* out = t.bytes.data();
  for (size_t i = 0; i < values.size(); ++i) {
    if (storage == DType::F32) {
      std::memcpy(out + 4 * i, &values[i], 4);
    } else {
      const uint16_t h = storage == DType::F16 ? float_to_fp16(values[i]) : float_to_bf16(values[i]);
      std::memcpy(out + 2 * i, &h, 2);
    }
  }
  return t;
}

Status write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  ordered_json header = ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string_view> names;
  uint64_t offset = 0;  // bytes from the start of the data section
  for (const NamedTensor& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__" || !names.insert(t.name).second)
      return Status::error(path + ": tensor name \"" + t.name + "\" is empty, reserved or repeated");
    int64_t num_elements = 1;
    for (int64_t d : t.shape) {
      if (d < 0) return Status::error(path + ": tensor \"" + t.name + "\" has a negative dimension");
      num_elements *= d;
    }
    if (uint64_t(num_elements) * dtype_bytes(t.dtype) != t.bytes.size())
      return Status::error(path + ": tensor \"" + t.name + "\": shape " + shape_string(t.shape) + " of " +
                           std::string(dtype_name(t.dtype)) + " needs " +
                           std::to_string(uint64_t(num_elements) * dtype_bytes(t.dtype)) + " bytes, got " +
                           std::to_string(t.bytes.size()));
    header[t.name] = {{"dtype", dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data section starts 8-byte aligned
  std::byte length[8];
  for (int i = 0; i < 8; ++i) length[i] = std::byte((uint64_t(text.size()) >> (8 * i)) & 0xff);

  // Written piece by piece: length, header, then every tensor's bytes (no second copy).
  std::vector<std::span<const std::byte>> parts{std::span<const std::byte>(length, 8), as_bytes(text)};
  for (const NamedTensor& t : tensors) parts.emplace_back(t.bytes);
  return write_file_atomic(path, parts);
}

Expected<std::vector<NamedTensor>> gpt2_named_tensors(const ModelConfig& config, const StageWeights& m,
                                                      DType storage, std::string_view prefix) {
  if (storage != DType::F32 && storage != DType::F16 && storage != DType::BF16)
    return Status::error("checkpoint storage must be F32, F16 or BF16, not " + std::string(dtype_name(storage)));
  if (m.layer_begin != 0 || m.layer_end != config.n_layer || int64_t(m.layers.size()) != config.n_layer)
    return Status::error("writing a checkpoint needs the full model (layers [0, " + std::to_string(config.n_layer) +
                         ")), got layers [" + std::to_string(m.layer_begin) + ", " + std::to_string(m.layer_end) + ")");
  const int64_t C = config.n_embd, I = config.n_inner, V = config.vocab_size, P = config.n_positions;
  std::vector<NamedTensor> out;
  Status status;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, const std::vector<float>& values) {
    if (!status) return;
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    if (int64_t(values.size()) != n) {
      status = Status::error("tensor \"" + name + "\" has " + std::to_string(values.size()) +
                             " values, but config shape " + shape_string(shape) + " needs " + std::to_string(n));
      return;
    }
    out.push_back(make_tensor(name, std::move(shape), values, storage));
  };
  const std::string p(prefix);
  add(p + "wte.weight", {V, C}, m.wte);
  add(p + "wpe.weight", {P, C}, m.wpe);
  for (int64_t l = 0; l < config.n_layer; ++l) {
    const LayerWeights& lw = m.layers[size_t(l)];
    const std::string h = p + "h." + std::to_string(l) + ".";
    add(h + "ln_1.weight", {C}, lw.ln_1_g);
    add(h + "ln_1.bias", {C}, lw.ln_1_b);
    add(h + "attn.c_attn.weight", {C, 3 * C}, lw.attn_qkv_w);
    add(h + "attn.c_attn.bias", {3 * C}, lw.attn_qkv_b);
    add(h + "attn.c_proj.weight", {C, C}, lw.attn_proj_w);
    add(h + "attn.c_proj.bias", {C}, lw.attn_proj_b);
    add(h + "ln_2.weight", {C}, lw.ln_2_g);
    add(h + "ln_2.bias", {C}, lw.ln_2_b);
    add(h + "mlp.c_fc.weight", {C, I}, lw.mlp_fc_w);
    add(h + "mlp.c_fc.bias", {I}, lw.mlp_fc_b);
    add(h + "mlp.c_proj.weight", {I, C}, lw.mlp_proj_w);
    add(h + "mlp.c_proj.bias", {C}, lw.mlp_proj_b);
  }
  add(p + "ln_f.weight", {C}, m.ln_f_g);
  add(p + "ln_f.bias", {C}, m.ln_f_b);
  if (!m.lm_head.empty()) add("lm_head.weight", {V, C}, m.lm_head);  // HF keeps it top level
  if (!status) return status;
  return out;
}

Status write_gpt2_config(const std::string& path, const ModelConfig& c) {
  ordered_json j;
  j["architectures"] = {"GPT2LMHeadModel"};
  j["model_type"] = "gpt2";
  j["n_embd"] = c.n_embd;
  j["n_head"] = c.n_head;
  j["n_layer"] = c.n_layer;
  j["n_inner"] = c.n_inner == 4 * c.n_embd ? json(nullptr) : json(c.n_inner);
  j["n_positions"] = c.n_positions;
  j["n_ctx"] = c.n_positions;
  j["vocab_size"] = c.vocab_size;
  j["layer_norm_epsilon"] = c.layer_norm_epsilon;
  j["activation_function"] = c.activation == Activation::GeluNew ? "gelu_new" : "gelu";
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  if (c.eos_token_id >= 0) {
    j["bos_token_id"] = c.eos_token_id;
    j["eos_token_id"] = c.eos_token_id;
  }
  return write_file_atomic(path, {as_bytes(j.dump(2) + "\n")});
}

Status write_gpt2_checkpoint(const std::string& dir, const ModelConfig& config, const StageWeights& full_model,
                             DType storage, int num_shards, std::string_view prefix) {
  auto tensors = gpt2_named_tensors(config, full_model, storage, prefix);
  if (!tensors) return Status::error(dir + ": " + tensors.error());
  const int num_groups = int(config.n_layer) + 2;  // embed, each layer, final
  if (num_shards < 1 || num_shards > num_groups)
    return Status::error(dir + ": num_shards " + std::to_string(num_shards) + " must be in [1, " +
                         std::to_string(num_groups) + "] (shards split on layer boundaries)");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::error(dir + ": cannot create directory: " + ec.message());
  const fs::path root(dir);
  if (Status s = write_gpt2_config((root / "config.json").string(), config); !s) return s;
  const std::map<std::string, std::string> metadata{{"format", "pt"}};

  if (num_shards == 1) {
    if (Status s = remove_if_present(root / "model.safetensors.index.json"); !s) return s;
    return write_safetensors((root / "model.safetensors").string(), *tensors, metadata);
  }
  if (Status s = remove_if_present(root / "model.safetensors"); !s) return s;

  // Groups of consecutive tensors (embed, h.0, ..., final) with their byte counts.
  struct Group { size_t first, last; uint64_t bytes; };
  std::vector<Group> groups;
  uint64_t total_bytes = 0;
  for (size_t i = 0; i < tensors->size(); ++i) {
    const auto& t = (*tensors)[i];
    if (groups.empty() || shard_group(t.name, prefix) != shard_group((*tensors)[i - 1].name, prefix))
      groups.push_back({i, i, 0});
    groups.back().last = i;
    groups.back().bytes += t.bytes.size();
    total_bytes += t.bytes.size();
  }
  // Shard of group g: by where its middle byte falls, then kept monotonic, stepping by at
  // most one, and late enough that every later shard still gets a group (none is empty).
  const int G = int(groups.size()), S = num_shards;
  std::vector<int> shard_of(size_t(G), 0);
  uint64_t cum = 0;
  for (int g = 0; g < G; ++g) {
    const uint64_t mid = cum + groups[size_t(g)].bytes / 2;
    cum += groups[size_t(g)].bytes;
    int s = total_bytes ? int(mid * uint64_t(S) / total_bytes) : 0;
    if (g == 0) s = 0;
    else s = std::clamp(s, shard_of[size_t(g - 1)], shard_of[size_t(g - 1)] + 1);
    s = std::max(s, S - G + g);
    shard_of[size_t(g)] = std::min(s, S - 1);
  }

  json weight_map = json::object();
  for (int s = 0; s < S; ++s) {
    char file[64];
    std::snprintf(file, sizeof file, "model-%05d-of-%05d.safetensors", s + 1, S);
    std::vector<NamedTensor> shard;
    for (int g = 0; g < G; ++g) {
      if (shard_of[size_t(g)] != s) continue;
      for (size_t i = groups[size_t(g)].first; i <= groups[size_t(g)].last; ++i) {
        weight_map[(*tensors)[i].name] = file;
        shard.push_back(std::move((*tensors)[i]));
      }
    }
    if (Status st = write_safetensors((root / file).string(), shard, metadata); !st) return st;
  }
  const json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
  return write_file_atomic((root / "model.safetensors.index.json").string(), {as_bytes(index.dump(2) + "\n")});
}

}  // namespace conveyor
