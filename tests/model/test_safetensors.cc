// The safetensors reader (model/safetensors.h) and writer (model/checkpoint_writer.h):
// valid files round-trip, every kind of corrupt header gives an error naming the file and
// the tensor at fault, sharded directories open shards lazily.
#include "model/safetensors.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "model/checkpoint_writer.h"

namespace conveyor {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("conveyor_st_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A file made by hand: u64 header length (or `header_len_override`), header, data.
  std::string write_raw(const std::string& name, const std::string& header, size_t data_bytes,
                        int64_t header_len_override = -1) {
    const std::string path = (dir_ / name).string();
    std::ofstream out(path, std::ios::binary);
    const uint64_t n = header_len_override >= 0 ? uint64_t(header_len_override) : header.size();
    for (int i = 0; i < 8; ++i) out.put(char((n >> (8 * i)) & 0xff));
    out << header << std::string(data_bytes, '\x01');
    return path;
  }

  // Opening must fail; the message names the file and contains every `needles` entry.
  void expect_open_error(const std::string& path, std::initializer_list<std::string> needles) {
    auto f = SafetensorsFile::open(path);
    ASSERT_FALSE(f.ok()) << path;
    EXPECT_NE(f.error().find(path), std::string::npos) << f.error();
    for (const auto& n : needles) EXPECT_NE(f.error().find(n), std::string::npos) << "want \"" << n << "\" in: " << f.error();
  }

  fs::path dir_;
};

json entry(const std::string& dtype, std::vector<int64_t> shape, uint64_t begin, uint64_t end) {
  return {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {begin, end}}};
}

TEST_F(SafetensorsTest, WriteThenReadAllDtypes) {
  const std::vector<float> values = {1.0f, -2.5f, 3.14159f, 1e-6f, 65504.f, -0.f};
  std::vector<NamedTensor> tensors;
  tensors.push_back(make_tensor("a.f32", {2, 3}, values, DType::F32));
  tensors.push_back(make_tensor("b.f16", {6}, values, DType::F16));
  tensors.push_back(make_tensor("c.bf16", {3, 2}, values, DType::BF16));
  tensors.push_back(NamedTensor{"d.i32", DType::I32, {1}, std::vector<std::byte>(4, std::byte{7})});
  tensors.push_back(make_tensor("e.empty", {0, 4}, {}, DType::F32));
  tensors.push_back(make_tensor("f.odd", {1}, std::vector<float>{0.5f}, DType::F16));  // later tensors unaligned
  tensors.push_back(make_tensor("g.f32", {2}, std::vector<float>{7.f, 8.f}, DType::F32));
  const std::string path = (dir_ / "x.safetensors").string();
  ASSERT_TRUE(write_safetensors(path, tensors, {{"format", "pt"}}).ok());

  auto f = SafetensorsFile::open(path);
  ASSERT_TRUE(f.ok()) << f.error();
  ASSERT_EQ(f->tensors().size(), tensors.size());  // __metadata__ is not a tensor
  EXPECT_EQ(f->find("__metadata__"), nullptr);
  EXPECT_EQ(f->find("nope"), nullptr);
  for (const NamedTensor& t : tensors) {
    const TensorInfo* info = f->find(t.name);
    ASSERT_NE(info, nullptr) << t.name;
    EXPECT_EQ(info->dtype, t.dtype);
    EXPECT_EQ(info->shape, t.shape);
    EXPECT_EQ(info->size_bytes, t.bytes.size());
    const auto bytes = f->data(*info);
    ASSERT_EQ(bytes.size(), t.bytes.size());
    EXPECT_EQ(std::memcmp(bytes.data(), t.bytes.data(), bytes.size()), 0) << t.name;
  }
  for (const char* name : {"a.f32", "b.f16", "c.bf16"}) {
    const TensorInfo& info = *f->find(name);
    std::vector<float> out(6);
    ASSERT_TRUE(convert_to_f32(info.dtype, f->data(info).data(), 6, out.data()).ok());
    for (size_t i = 0; i < 6; ++i) {
      const float want = info.dtype == DType::F32   ? values[i]
                         : info.dtype == DType::F16 ? fp16_to_float(float_to_fp16(values[i]))
                                                    : bf16_to_float(float_to_bf16(values[i]));
      EXPECT_EQ(out[i], want) << name << "[" << i << "]";
    }
  }
  std::vector<float> g(2);
  ASSERT_TRUE(convert_to_f32(DType::F32, f->data(*f->find("g.f32")).data(), 2, g.data()).ok());
  EXPECT_EQ(g, (std::vector<float>{7.f, 8.f}));

  // Moving keeps the mapping alive and valid.
  SafetensorsFile moved = std::move(f).value();
  EXPECT_EQ(moved.tensors().size(), tensors.size());
  EXPECT_EQ(std::memcmp(moved.data(*moved.find("a.f32")).data(), tensors[0].bytes.data(), 24), 0);
}

TEST_F(SafetensorsTest, HeaderIsPaddedAndDataAligned) {
  const std::string path = (dir_ / "p.safetensors").string();
  ASSERT_TRUE(write_safetensors(path, {make_tensor("w", {3}, std::vector<float>{1, 2, 3}, DType::F32)}).ok());
  std::ifstream in(path, std::ios::binary);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(in.get())) << (8 * i);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(fs::file_size(path), 8 + n + 12);
}

TEST_F(SafetensorsTest, WriterRejectsBadTensors) {
  const std::string path = (dir_ / "w.safetensors").string();
  NamedTensor wrong{"w", DType::F32, {2, 2}, std::vector<std::byte>(12)};
  auto s = write_safetensors(path, {wrong});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("\"w\""), std::string::npos) << s.message();
  auto t = make_tensor("dup", {1}, std::vector<float>{1}, DType::F32);
  EXPECT_FALSE(write_safetensors(path, {t, t}).ok());
  EXPECT_FALSE(fs::exists(path));  // nothing half-written
}

TEST_F(SafetensorsTest, MissingFileAndDirectory) {
  const std::string missing = (dir_ / "absent.safetensors").string();
  expect_open_error(missing, {"No such file or directory"});
  expect_open_error(dir_.string(), {"not a regular file"});
}

TEST_F(SafetensorsTest, ShorterThanEightBytes) {
  const std::string path = (dir_ / "short.safetensors").string();
  std::ofstream(path) << "abc";
  expect_open_error(path, {"shorter than the 8-byte"});
  std::ofstream(path, std::ios::trunc).close();  // empty
  expect_open_error(path, {"0 bytes"});
}

TEST_F(SafetensorsTest, HeaderLengthPastEndOrAbsurd) {
  expect_open_error(write_raw("past.safetensors", "{}", 0, 1000), {"runs past the end"});
  expect_open_error(write_raw("absurd.safetensors", "{}", 0, int64_t(1) << 40), {"absurd"});
  expect_open_error(write_raw("absurd2.safetensors", "{}", 0, int64_t(200) << 20), {"absurd"});
}

TEST_F(SafetensorsTest, HeaderNotJsonOrNotObject) {
  expect_open_error(write_raw("nj.safetensors", "{\"a\": {", 0), {"not valid JSON"});
  expect_open_error(write_raw("arr.safetensors", "[1, 2]", 0), {"not a JSON object"});
  expect_open_error(write_raw("bin.safetensors", std::string("\0\xff\x13", 3), 0), {"not valid JSON"});
}

TEST_F(SafetensorsTest, EntryErrorsNameTheTensor) {
  auto header = [](const json& e) { return json{{"__metadata__", {{"format", "pt"}}}, {"h.0.w", e}}.dump(); };
  expect_open_error(write_raw("dt.safetensors", header(entry("F64", {2}, 0, 16)), 16),
                    {"\"h.0.w\"", "unsupported dtype \"F64\""});
  expect_open_error(write_raw("dt2.safetensors", header(json{{"shape", {2}}, {"data_offsets", {0, 8}}}), 8),
                    {"\"h.0.w\"", "dtype"});
  expect_open_error(write_raw("size.safetensors", header(entry("F32", {2, 3}, 0, 20)), 24),
                    {"\"h.0.w\"", "[2, 3]", "24 bytes", "hold 20"});
  expect_open_error(write_raw("order.safetensors", header(entry("F32", {0}, 8, 4)), 8), {"\"h.0.w\"", "out of order"});
  expect_open_error(write_raw("end.safetensors", header(entry("F32", {4}, 0, 16)), 12),
                    {"\"h.0.w\"", "run past the end"});
  expect_open_error(write_raw("neg.safetensors", header(entry("F32", {-2}, 0, 8)), 8), {"\"h.0.w\"", "shape"});
  expect_open_error(write_raw("frac.safetensors", header(json{{"dtype", "F32"}, {"shape", {1.5}}, {"data_offsets", {0, 4}}}), 4),
                    {"\"h.0.w\"", "shape"});
  expect_open_error(write_raw("offs.safetensors", header(json{{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {0}}}), 4),
                    {"\"h.0.w\"", "data_offsets"});
  expect_open_error(write_raw("notobj.safetensors", header(json("F32")), 0), {"\"h.0.w\"", "not a JSON object"});
  expect_open_error(write_raw("huge.safetensors", header(entry("F32", {int64_t(1) << 62, 8}, 0, 8)), 8),
                    {"\"h.0.w\"", "overflows"});
}

TEST_F(SafetensorsTest, OverlappingTensorsNameBoth) {
  const json h = {{"first", entry("F32", {4}, 0, 16)}, {"second", entry("F32", {2}, 12, 20)}};
  expect_open_error(write_raw("ov.safetensors", h.dump(), 20), {"\"second\"", "overlaps", "\"first\""});
  // Touching is fine; a zero-size tensor may sit anywhere.
  const json ok = {{"first", entry("F32", {4}, 0, 16)}, {"second", entry("F32", {2}, 16, 24)},
                   {"empty", entry("F16", {0}, 4, 4)}};
  auto f = SafetensorsFile::open(write_raw("ok.safetensors", ok.dump(), 24));
  ASSERT_TRUE(f.ok()) << f.error();
  EXPECT_EQ(f->find("second")->offset, 8 + ok.dump().size() + 16);
}

TEST(ConvertToF32, MatchesScalarForEveryPatternAtAnyAlignment) {
  std::vector<std::byte> raw(2 * 65536 + 1);
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t v = uint16_t(h);
    std::memcpy(raw.data() + 1 + 2 * h, &v, 2);  // offset 1: deliberately misaligned
  }
  std::vector<float> out(65536);
  for (DType t : {DType::F16, DType::BF16}) {
    ASSERT_TRUE(convert_to_f32(t, raw.data() + 1, 65536, out.data()).ok());
    for (uint32_t h = 0; h < 65536; ++h) {
      const float want = t == DType::F16 ? fp16_to_float(uint16_t(h)) : bf16_to_float(uint16_t(h));
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(out[h])) << h;
      } else {
        uint32_t a, b;
        std::memcpy(&a, &want, 4);
        std::memcpy(&b, &out[h], 4);
        ASSERT_EQ(a, b) << dtype_name(t) << " pattern " << h;
      }
    }
  }
  // Tail handling: lengths that are not multiples of the vector width.
  for (size_t n : {0, 1, 7, 9, 17}) {
    std::vector<float> o(n + 1, -1.f);
    ASSERT_TRUE(convert_to_f32(DType::F16, raw.data() + 1 + 2 * 15360, n, o.data()).ok());  // 0x3c00 = 1.0
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(o[i], fp16_to_float(uint16_t(15360 + i)));
    EXPECT_EQ(o[n], -1.f);  // nothing written past the end
  }
  float f32_out[2];
  const float f32_in[2] = {1.5f, -3.f};
  ASSERT_TRUE(convert_to_f32(DType::F32, reinterpret_cast<const std::byte*>(f32_in), 2, f32_out).ok());
  EXPECT_EQ(f32_out[1], -3.f);
  auto bad = convert_to_f32(DType::I32, raw.data(), 1, out.data());
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("I32"), std::string::npos);
}

// ---- Checkpoint directories ------------------------------------------------------------

TEST_F(SafetensorsTest, CheckpointSingleFile) {
  ASSERT_TRUE(write_safetensors((dir_ / "model.safetensors").string(),
                                {make_tensor("a", {2}, std::vector<float>{1, 2}, DType::F32)}).ok());
  auto c = Checkpoint::open(dir_.string());
  ASSERT_TRUE(c.ok()) << c.error();
  EXPECT_FALSE(c->sharded());
  EXPECT_TRUE(c->contains("a"));
  EXPECT_FALSE(c->contains("b"));
  auto a = c->find("a");
  ASSERT_TRUE(a.ok()) << a.error();
  EXPECT_EQ(a->info->shape, std::vector<int64_t>{2});
  auto b = c->find("b");
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.error().find("\"b\""), std::string::npos) << b.error();
  EXPECT_NE(b.error().find(dir_.string()), std::string::npos) << b.error();
}

TEST_F(SafetensorsTest, CheckpointShardsOpenLazily) {
  auto shard = [&](const std::string& file, const std::string& tensor) {
    ASSERT_TRUE(write_safetensors((dir_ / file).string(), {make_tensor(tensor, {1}, std::vector<float>{1}, DType::F32)}).ok());
  };
  shard("s1.safetensors", "x");
  shard("s2.safetensors", "y");
  const json index = {{"metadata", {{"total_size", 8}}},
                      {"weight_map", {{"x", "s1.safetensors"}, {"y", "s2.safetensors"},
                                      {"z", "s3.safetensors"}, {"w", "s1.safetensors"}}}};
  std::ofstream(dir_ / "model.safetensors.index.json") << index.dump();

  auto c = Checkpoint::open(dir_.string());  // s3 does not exist: fine until z is wanted
  ASSERT_TRUE(c.ok()) << c.error();
  EXPECT_TRUE(c->sharded());
  EXPECT_TRUE(c->open_shards().empty());
  ASSERT_TRUE(c->find("y").ok());
  EXPECT_EQ(c->open_shards(), std::vector<std::string>{"s2.safetensors"});

  auto z = c->find("z");
  ASSERT_FALSE(z.ok());
  EXPECT_NE(z.error().find("s3.safetensors"), std::string::npos) << z.error();
  EXPECT_NE(z.error().find("\"z\""), std::string::npos) << z.error();
  EXPECT_NE(z.error().find("No such file or directory"), std::string::npos) << z.error();

  auto w = c->find("w");  // the index puts it in s1, which does not hold it
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.error().find("s1.safetensors"), std::string::npos) << w.error();
  EXPECT_NE(w.error().find("\"w\""), std::string::npos) << w.error();

  auto q = c->find("q");
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.error().find("\"q\""), std::string::npos) << q.error();
  EXPECT_NE(q.error().find(dir_.string()), std::string::npos) << q.error();
}

TEST_F(SafetensorsTest, CheckpointBadIndexAndEmptyDirectory) {
  auto empty = Checkpoint::open(dir_.string());
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.error().find("model.safetensors"), std::string::npos) << empty.error();

  const std::string index = (dir_ / "model.safetensors.index.json").string();
  std::ofstream(index) << "{not json";
  auto a = Checkpoint::open(dir_.string());
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.error().find(index), std::string::npos) << a.error();

  std::ofstream(index, std::ios::trunc) << json{{"weight_map", {{"t", "../escape.safetensors"}}}}.dump();
  auto b = Checkpoint::open(dir_.string());
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.error().find("\"t\""), std::string::npos) << b.error();

  std::ofstream(index, std::ios::trunc) << json{{"weight_map", {{"t", 3}}}}.dump();
  EXPECT_FALSE(Checkpoint::open(dir_.string()).ok());

  auto none = Checkpoint::open((dir_ / "no_such_dir").string());
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.error().find("no_such_dir"), std::string::npos) << none.error();
}


// Found by fuzzing (issue 28): a header whose "shape" nested 100,000 arrays parsed, then
// overflowed the stack when the error message dump()ed the shape. Refused before that now,
// through open() and through parse_safetensors on the same bytes.
TEST_F(SafetensorsTest, DeeplyNestedHeaderIsRefused) {
  const int depth = 100000;
  const std::string h = R"({"w": {"dtype": "F32", "shape": )" + std::string(depth, '[') + std::string(depth, ']') +
                        R"(, "data_offsets": [0, 4]}})";
  const std::string path = write_raw("deep.safetensors", h, 4);
  expect_open_error(path, {"nests deeper than 64 levels"});
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto parsed = parse_safetensors(std::as_bytes(std::span(bytes.data(), bytes.size())), "deep");
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.error().find("nests deeper"), std::string::npos) << parsed.error();
}

// parse_safetensors reads only the bytes it is given: a valid file cut anywhere is refused.
TEST_F(SafetensorsTest, ParseFromMemoryRefusesEveryTruncation) {
  const std::string path = (dir_ / "t.safetensors").string();
  ASSERT_TRUE(write_safetensors(path, {make_tensor("w", {3}, std::vector<float>{1, 2, 3}, DType::F32)}).ok());
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto all = std::as_bytes(std::span(bytes.data(), bytes.size()));
  auto whole = parse_safetensors(all, "t");
  ASSERT_TRUE(whole.ok()) << whole.error();
  ASSERT_EQ(whole->size(), 1u);
  EXPECT_EQ((*whole)[0].size_bytes, 12u);
  for (size_t n = 0; n < bytes.size(); ++n) EXPECT_FALSE(parse_safetensors(all.first(n), "t").ok()) << n;
}

}  // namespace
}  // namespace conveyor
