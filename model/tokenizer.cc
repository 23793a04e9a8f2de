// GPT-2 byte-level BPE (see tokenizer.h for the contract and the JavaScript quirks kept).
//
// Layout of this file: the byte-level alphabet; loading (vocabulary, merges, the symbol/pair
// tables); BPE; the word cache; the public methods. The pre-tokenizer (the GPT-2 regex and
// the code point classes under it) is in pre_tokenizer.cc.
#include "model/tokenizer.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <queue>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "model/pre_tokenizer.h"

namespace conveyor {
namespace {

using tokenizer_detail::code_point_at;
using tokenizer_detail::CodePoint;
using tokenizer_detail::decode_utf8;
using tokenizer_detail::kSpace;
using tokenizer_detail::pre_token_end;

// ---- The byte-level alphabet (bytes_to_unicode of GPT-2) ----------------------------------

// Code point standing for each byte: printable Latin-1 bytes stand for themselves, the
// other 68 get U+0100.. in byte order.
std::array<uint32_t, 256> byte_to_code_point() {
  std::array<uint32_t, 256> map{};
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    map[b] = printable ? b : next++;
  }
  return map;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// The bytes a token text (byte-level alphabet) stands for. A character outside the
// alphabet (possible in an added token) stands for its own UTF-8 bytes.
std::string token_text_to_bytes(std::string_view text, const std::array<int16_t, 0x144>& byte_of) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    uint32_t length = 1;
    const int32_t cp = decode_utf8(text, i, &length);
    if (cp >= 0 && cp < 0x144 && byte_of[cp] >= 0) {
      out += static_cast<char>(byte_of[cp]);
    } else {
      out.append(text.substr(i, length));
    }
    i += length;
  }
  return out;
}

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <class V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

// Word cache keys carry their hash, computed once per piece (it also picks the shard).
struct CacheKey {
  std::string text;
  size_t hash;
};
struct CacheKeyView {
  std::string_view text;
  size_t hash;
};
struct CacheKeyHash {
  using is_transparent = void;
  size_t operator()(const CacheKey& k) const { return k.hash; }
  size_t operator()(const CacheKeyView& k) const { return k.hash; }
};
struct CacheKeyEqual {
  using is_transparent = void;
  template <class A, class B>
  bool operator()(const A& a, const B& b) const {
    return a.hash == b.hash && std::string_view(a.text) == std::string_view(b.text);
  }
};

// Open-addressing map from a symbol pair (left << 32 | right) to its merge: the JS rank of
// the pair and the symbol the merge makes. Built once, read-only afterwards.
struct Merge {
  int32_t rank = -1;
  int32_t merged = -1;
};
class PairTable {
 public:
  void build(const std::vector<std::pair<uint64_t, Merge>>& entries) {
    size_t capacity = 16;
    while (capacity < entries.size() * 2) capacity *= 2;
    keys_.assign(capacity, kEmpty);
    values_.assign(capacity, Merge{});
    mask_ = capacity - 1;
    for (const auto& [key, merge] : entries) {
      size_t i = slot(key);
      while (keys_[i] != kEmpty && keys_[i] != key) i = (i + 1) & mask_;
      keys_[i] = key;
      values_[i] = merge;
    }
  }
  const Merge* find(int32_t left, int32_t right) const {
    const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
                         static_cast<uint32_t>(right);
    for (size_t i = slot(key);; i = (i + 1) & mask_) {
      if (keys_[i] == key) return &values_[i];
      if (keys_[i] == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  size_t slot(uint64_t key) const {
    key ^= key >> 33;
    key *= 0xff51afd7ed558ccdULL;
    key ^= key >> 33;
    return static_cast<size_t>(key) & mask_;
  }
  std::vector<uint64_t> keys_{kEmpty};
  std::vector<Merge> values_{Merge{}};
  size_t mask_ = 0;
};

// Read a whole file; errors name it.
Expected<std::string> read_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return Status::error(path + ": no such file");
  if (!std::filesystem::is_regular_file(path, ec)) return Status::error(path + ": not a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error(path + ": cannot open: " + std::strerror(errno));
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) return Status::error(path + ": read error");
  return buffer.str();
}

bool file_exists(const std::string& path) {
  std::error_code ec;
  return std::filesystem::exists(path, ec);
}

// JS whitespace (\s, and what String.prototype.trim removes) at s[i]; 0 if none.
size_t whitespace_length(std::string_view s, size_t i) {
  const CodePoint c = code_point_at(s, i);
  return c.cls == kSpace ? c.length : 0;
}

// The parts of a merges line as `x.split(/(\s+)/).filter(e => e.trim().length > 0)`.
std::vector<std::string_view> split_on_whitespace(std::string_view line) {
  std::vector<std::string_view> parts;
  size_t i = 0;
  while (i < line.size()) {
    size_t w;
    while (i < line.size() && (w = whitespace_length(line, i)) != 0) i += w;
    const size_t start = i;
    while (i < line.size() && whitespace_length(line, i) == 0) i += code_point_at(line, i).length;
    if (i > start) parts.push_back(line.substr(start, i - start));
  }
  return parts;
}

// Longer pieces than this are not cached (they are rare and would bloat the cache).
constexpr size_t kMaxCachedPieceBytes = 64;
// Entries per cache shard; a full shard is cleared (cheap, and keeps memory bounded).
constexpr size_t kMaxCacheEntriesPerShard = 8192;
constexpr size_t kCacheShards = 16;
// Words with more symbols than this use the heap-based BPE (O(n log n)) instead of the
// direct transcription of the JS loop (O(n^2), faster for short words). Same results.
constexpr size_t kMaxSymbolsForScanBpe = 48;
// Ids index dense tables (decode), so an absurd id is a corrupt file, not a 16 GB vector.
constexpr int64_t kMaxTokenId = int64_t{1} << 24;

}  // namespace

// ---- The loaded tokenizer -----------------------------------------------------------------

struct Tokenizer::Impl {
  // Vocabulary.
  StringMap<int32_t> token_to_id;
  std::vector<std::string> id_to_bytes;  // "" where no token has the id
  std::vector<uint8_t> id_present;
  int32_t vocab_size = 0;

  // Symbols: every string BPE can hold, interned. The first 256 are the single bytes.
  std::array<int32_t, 256> byte_symbol{};
  std::vector<int32_t> symbol_token_id;        // vocabulary id, or -1
  std::vector<std::string> symbol_bytes;       // the bytes it stands for
  PairTable pairs;

  struct CacheShard {
    std::mutex mu;
    std::unordered_map<CacheKey, std::vector<int32_t>, CacheKeyHash, CacheKeyEqual> words;
  };
  mutable std::array<CacheShard, kCacheShards> cache;

  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  void bpe_scan(std::vector<int32_t>& word) const;
  void bpe_heap(std::vector<int32_t>& word) const;
  void emit(const std::vector<int32_t>& word, std::vector<int32_t>& out) const;
  void index_ids(const std::array<int16_t, 0x144>& byte_of);
};

namespace {

Status load_vocabulary(const std::string& path, const std::string& text,
                       StringMap<int32_t>& token_to_id) {
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return Status::error(path + ": not valid JSON: " + e.what());
  }
  if (!doc.is_object()) return Status::error(path + ": expected a JSON object {token: id}");
  if (doc.empty()) return Status::error(path + ": the vocabulary is empty");
  std::vector<const std::string*> id_to_text;
  token_to_id.reserve(doc.size());
  for (const auto& [token, value] : doc.items()) {
    if (!value.is_number_integer() || value.get<int64_t>() < 0 ||
        value.get<int64_t>() >= kMaxTokenId) {
      return Status::error(path + ": token \"" + token + "\" has id " + value.dump() +
                           ", expected an integer in [0, " + std::to_string(kMaxTokenId) + ")");
    }
    const auto id = static_cast<int32_t>(value.get<int64_t>());
    auto [it, inserted] = token_to_id.emplace(token, id);
    if (static_cast<size_t>(id) >= id_to_text.size()) id_to_text.resize(id + 1, nullptr);
    if (id_to_text[id] != nullptr) {
      return Status::error(path + ": id " + std::to_string(id) + " is used by both \"" +
                           *id_to_text[id] + "\" and \"" + token + "\"");
    }
    id_to_text[id] = &it->first;
  }
  return ok_status();
}

// Every string BPE can hold, interned into a tokenizer's symbol tables (symbol_token_id and
// symbol_bytes, indexed by symbol): each text gets one symbol, the first time it is seen.
struct SymbolInterner {
  const StringMap<int32_t>& token_to_id;
  const std::array<int16_t, 0x144>& byte_of;
  std::vector<int32_t>& symbol_token_id;
  std::vector<std::string>& symbol_bytes;
  StringMap<int32_t> symbol_of;

  int32_t intern(std::string_view text) {
    if (auto it = symbol_of.find(text); it != symbol_of.end()) return it->second;
    const auto symbol = static_cast<int32_t>(symbol_bytes.size());
    symbol_of.emplace(std::string(text), symbol);
    auto id = token_to_id.find(text);
    symbol_token_id.push_back(id == token_to_id.end() ? -1 : id->second);
    symbol_bytes.push_back(token_text_to_bytes(text, byte_of));
    return symbol;
  }
};

// The lines of `text` (split at '\n'; the last one is what follows the last '\n').
std::vector<std::string_view> split_lines(std::string_view text) {
  std::vector<std::string_view> lines;
  for (size_t start = 0;;) {
    const size_t nl = text.find('\n', start);
    lines.push_back(text.substr(start, nl == std::string_view::npos ? nl : nl - start));
    if (nl == std::string_view::npos) break;
    start = nl + 1;
  }
  return lines;
}

// Merges: lines.slice(1, lines.length - 1), each split on whitespace; JS keys the rank by
// parts.join(",") and a later line with the same key overwrites the earlier rank.
Expected<StringMap<int32_t>> merge_ranks(const std::string& path, std::string_view merges) {
  const std::vector<std::string_view> lines = split_lines(merges);
  StringMap<int32_t> rank_of_key;
  for (size_t i = 1; i + 1 < lines.size(); ++i) {
    const std::vector<std::string_view> parts = split_on_whitespace(lines[i]);
    if (parts.empty()) continue;  // blank: its JS key "" can never match a pair
    if (parts.size() != 2) {
      return Status::error(path + ": line " + std::to_string(i + 1) +
                           ": expected two tokens separated by a space, got " +
                           std::to_string(parts.size()) + ": \"" + std::string(lines[i]) + "\"");
    }
    std::string key = std::string(parts[0]) + "," + std::string(parts[1]);
    rank_of_key[std::move(key)] = static_cast<int32_t>(i - 1);
  }
  return rank_of_key;
}

// A pair (x, y) has the rank of key x + "," + y: every split of a key at one of its
// commas into two non-empty halves is a pair with that key's rank; merging it makes x + y.
std::vector<std::pair<uint64_t, Merge>> merge_pairs(const StringMap<int32_t>& rank_of_key, SymbolInterner& symbols) {
  std::vector<std::pair<uint64_t, Merge>> pair_entries;
  pair_entries.reserve(rank_of_key.size());
  for (const auto& [key, rank] : rank_of_key) {
    for (size_t c = key.find(','); c != std::string::npos; c = key.find(',', c + 1)) {
      if (c == 0 || c + 1 == key.size()) continue;
      const std::string_view left = std::string_view(key).substr(0, c);
      const std::string_view right = std::string_view(key).substr(c + 1);
      const int32_t l = symbols.intern(left);
      const int32_t r = symbols.intern(right);
      const int32_t merged = symbols.intern(std::string(left) + std::string(right));
      const uint64_t pair = (static_cast<uint64_t>(l) << 32) | static_cast<uint32_t>(r);
      pair_entries.emplace_back(pair, Merge{rank, merged});
    }
  }
  return pair_entries;
}

}  // namespace

// id -> bytes, for decode.
void Tokenizer::Impl::index_ids(const std::array<int16_t, 0x144>& byte_of) {
  for (const auto& [token, id] : token_to_id) {
    vocab_size = std::max(vocab_size, id + 1);
  }
  id_to_bytes.assign(vocab_size, std::string());
  id_present.assign(vocab_size, 0);
  for (const auto& [token, id] : token_to_id) {
    id_to_bytes[id] = token_text_to_bytes(token, byte_of);
    id_present[id] = 1;
  }
}

Expected<Tokenizer> Tokenizer::load_files(const std::string& vocab_json,
                                          const std::string& merges_txt) {
  auto impl = std::make_shared<Impl>();
  auto vocab_text = read_file(vocab_json);
  if (!vocab_text) return vocab_text.status();
  auto merges_text = read_file(merges_txt);
  if (!merges_text) return merges_text.status();
  if (Status s = load_vocabulary(vocab_json, *vocab_text, impl->token_to_id); !s) return s;

  // Byte-level alphabet both ways.
  const std::array<uint32_t, 256> byte_cp = byte_to_code_point();
  std::array<int16_t, 0x144> byte_of;
  byte_of.fill(-1);
  for (int b = 0; b < 256; ++b) byte_of[byte_cp[b]] = static_cast<int16_t>(b);
  impl->index_ids(byte_of);

  // Symbols.
  SymbolInterner symbols{.token_to_id = impl->token_to_id, .byte_of = byte_of,
                         .symbol_token_id = impl->symbol_token_id, .symbol_bytes = impl->symbol_bytes,
                         .symbol_of = {}};
  for (int b = 0; b < 256; ++b) {
    std::string text;
    append_utf8(text, byte_cp[b]);
    impl->byte_symbol[b] = symbols.intern(text);
  }
  auto rank_of_key = merge_ranks(merges_txt, *merges_text);
  if (!rank_of_key) return rank_of_key.status();
  impl->pairs.build(merge_pairs(*rank_of_key, symbols));
  return Tokenizer(std::move(impl));
}

Tokenizer::Tokenizer() {
  static const std::shared_ptr<const Impl> empty = [] {
    auto impl = std::make_shared<Impl>();
    for (int b = 0; b < 256; ++b) {
      impl->byte_symbol[b] = b;
      impl->symbol_token_id.push_back(-1);
      impl->symbol_bytes.emplace_back(1, static_cast<char>(b));
    }
    return impl;
  }();
  impl_ = empty;
}

Expected<Tokenizer> Tokenizer::load(const std::string& model_dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(model_dir, ec)) {
    return Status::error(model_dir + ": no such directory (looking for the tokenizer files)");
  }
  const std::string hf_vocab = model_dir + "/vocab.json";
  const std::string hf_merges = model_dir + "/merges.txt";
  const std::string gpt2_vocab = model_dir + "/encoder.json";
  const std::string gpt2_merges = model_dir + "/vocab.bpe";
  if (file_exists(hf_vocab) || file_exists(hf_merges)) return load_files(hf_vocab, hf_merges);
  if (file_exists(gpt2_vocab) || file_exists(gpt2_merges)) {
    return load_files(gpt2_vocab, gpt2_merges);
  }
  return Status::error(model_dir + ": no tokenizer files: expected vocab.json + merges.txt " +
                       "or encoder.json + vocab.bpe");
}

// ---- BPE --------------------------------------------------------------------------------

// Encoder.js bpe() transcribed: find the lowest-ranked adjacent pair (the rightmost among
// equal ranks: JS's minPairs keeps the last pair stored under a rank), then merge every
// occurrence of exactly that pair, left to right, and repeat.
void Tokenizer::Impl::bpe_scan(std::vector<int32_t>& word) const {
  while (word.size() > 1) {
    int32_t best_rank = INT32_MAX;
    const Merge* best = nullptr;
    size_t best_at = 0;
    for (size_t i = 0; i + 1 < word.size(); ++i) {
      const Merge* m = pairs.find(word[i], word[i + 1]);
      if (m != nullptr && m->rank <= best_rank) {
        best_rank = m->rank;
        best = m;
        best_at = i;
      }
    }
    if (best == nullptr) return;
    const int32_t first = word[best_at];
    const int32_t second = word[best_at + 1];
    size_t out = 0;
    for (size_t i = 0; i < word.size();) {
      if (word[i] == first && i + 1 < word.size() && word[i + 1] == second) {
        word[out++] = best->merged;
        i += 2;
      } else {
        word[out++] = word[i++];
      }
    }
    word.resize(out);
  }
}

// The same algorithm in O(n log n) for long words. Symbols live in a linked list indexed by
// their original position (a merge keeps the left node, so indices stay in word order); a
// min-heap holds candidate pairs by rank, checked lazily (a node's symbol only ever grows,
// so a stale entry can never look valid again). Each step takes every live pair of the
// lowest rank, picks the rightmost (JS's tie rule; pairs of one rank can differ only
// through the comma-key quirk), and merges all live occurrences of that exact pair left to
// right. Pairs created by a merge contain the new, longer symbol, so they can never be the
// pair being merged: they wait in the heap for a later step, as in the JS loop.
void Tokenizer::Impl::bpe_heap(std::vector<int32_t>& word) const {
  const auto n = static_cast<int32_t>(word.size());
  std::vector<int32_t> symbol = word;
  std::vector<int32_t> next(n), prev(n);
  for (int32_t i = 0; i < n; ++i) {
    next[i] = i + 1 < n ? i + 1 : -1;
    prev[i] = i - 1;
  }
  struct Candidate {
    int32_t rank, at, left, right;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : at > o.at; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto push = [&](int32_t at) {
    if (at < 0 || next[at] < 0) return;
    if (const Merge* m = pairs.find(symbol[at], symbol[next[at]])) {
      heap.push({m->rank, at, symbol[at], symbol[next[at]]});
    }
  };
  auto live = [&](const Candidate& c) {
    return symbol[c.at] == c.left && next[c.at] >= 0 && symbol[next[c.at]] == c.right;
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i);

  std::vector<Candidate> step;
  while (!heap.empty()) {
    const int32_t rank = heap.top().rank;
    step.clear();
    while (!heap.empty() && heap.top().rank == rank) {
      if (live(heap.top())) step.push_back(heap.top());
      heap.pop();
    }
    if (step.empty()) continue;
    // `step` is in increasing position; the rightmost decides which pair is merged.
    const int32_t first = step.back().left;
    const int32_t second = step.back().right;
    const int32_t merged = pairs.find(first, second)->merged;
    for (const Candidate& c : step) {
      if (c.left != first || c.right != second) {
        heap.push(c);  // same rank, other pair (comma quirk): a later step
        continue;
      }
      if (!live(c)) continue;  // overlapped by the previous merge (runs like "a a a")
      const int32_t gone = next[c.at];
      symbol[c.at] = merged;
      symbol[gone] = -1;
      next[c.at] = next[gone];
      if (next[gone] >= 0) prev[next[gone]] = c.at;
      push(prev[c.at]);
      push(c.at);
    }
  }
  word.clear();
  for (int32_t i = 0; i >= 0; i = next[i]) word.push_back(symbol[i]);
}

void Tokenizer::Impl::emit(const std::vector<int32_t>& word, std::vector<int32_t>& out) const {
  for (const int32_t s : word) {
    if (symbol_token_id[s] >= 0) {
      out.push_back(symbol_token_id[s]);
      continue;
    }
    // Not in the vocabulary (JS would give null): its bytes' tokens; bytes without one drop.
    for (const char b : symbol_bytes[s]) {
      const int32_t id = symbol_token_id[byte_symbol[static_cast<unsigned char>(b)]];
      if (id >= 0) out.push_back(id);
    }
  }
}

void Tokenizer::Impl::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  const bool cacheable = piece.size() <= kMaxCachedPieceBytes;
  const size_t hash = cacheable ? StringHash{}(piece) : 0;
  CacheShard& shard = cache[(hash >> 7) % kCacheShards];  // low bits pick the bucket
  if (cacheable) {
    std::lock_guard lock(shard.mu);
    if (auto it = shard.words.find(CacheKeyView{piece, hash}); it != shard.words.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> word(piece.size());
  for (size_t i = 0; i < piece.size(); ++i) {
    word[i] = byte_symbol[static_cast<unsigned char>(piece[i])];
  }
  if (word.size() <= kMaxSymbolsForScanBpe) {
    bpe_scan(word);
  } else {
    bpe_heap(word);
  }
  const size_t begin = out.size();
  emit(word, out);
  if (cacheable) {
    std::vector<int32_t> ids(out.begin() + static_cast<std::ptrdiff_t>(begin), out.end());
    std::lock_guard lock(shard.mu);
    if (shard.words.size() >= kMaxCacheEntriesPerShard) shard.words.clear();
    shard.words.emplace(CacheKey{std::string(piece), hash}, std::move(ids));
  }
}

// ---- Public methods -----------------------------------------------------------------------

std::vector<int32_t> Tokenizer::encode(std::string_view utf8) const {
  std::vector<int32_t> ids;
  ids.reserve(utf8.size() / 3 + 1);
  for (size_t p = 0; p < utf8.size();) {
    const size_t end = pre_token_end(utf8, p);
    impl_->encode_piece(utf8.substr(p, end - p), ids);
    p = end;
  }
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (const int32_t id : ids) {
    if (id >= 0 && id < impl_->vocab_size && impl_->id_present[id]) out += impl_->id_to_bytes[id];
  }
  return out;
}

Expected<std::string> Tokenizer::decode_checked(std::span<const int32_t> ids) const {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= impl_->vocab_size || !impl_->id_present[id]) {
      return Status::error("token id " + std::to_string(id) + " at position " + std::to_string(i) +
                           " is not in the vocabulary (" + std::to_string(impl_->vocab_size) +
                           " ids)");
    }
    out += impl_->id_to_bytes[id];
  }
  return out;
}

std::string Tokenizer::token_bytes(int32_t id) const {
  if (id < 0 || id >= impl_->vocab_size || !impl_->id_present[id]) return {};
  return impl_->id_to_bytes[id];
}

int32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

std::optional<int32_t> Tokenizer::token_id(std::string_view token_text) const {
  auto it = impl_->token_to_id.find(token_text);
  if (it == impl_->token_to_id.end()) return std::nullopt;
  return it->second;
}

std::vector<std::string_view> Tokenizer::pre_tokenize(std::string_view utf8) {
  std::vector<std::string_view> pieces;
  for (size_t p = 0; p < utf8.size();) {
    const size_t end = pre_token_end(utf8, p);
    pieces.push_back(utf8.substr(p, end - p));
    p = end;
  }
  return pieces;
}

std::string_view Tokenizer::unicode_version() { return tokenizer_detail::unicode_tables_version(); }

}  // namespace conveyor
