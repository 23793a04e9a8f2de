// open_stage_checkpoint, stage_pieces, gather and read_pieces (model/stage_checkpoint.h,
// model/piece_reader.h): the host side of a GPU stage's direct load. Every rank's pieces,
// gathered and widened to fp32, are exactly what load_stage_weights + shard_layer give that
// rank, for checkpoints stored in fp32, fp16 and bf16, at tp 1, 2 and 3, in pieces of a few
// rows and in whole tensors; the reader threads hand pieces on in order through a ring smaller
// than the piece count, stop at the first error, and refuse a piece larger than a slot; and a
// checkpoint truncated (before it is opened, or while it is read) or not matching the config
// is refused naming the file and the tensor.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "model/checkpoint_writer.h"
#include "model/piece_reader.h"
#include "model/safetensors.h"
#include "model/stage_checkpoint.h"
#include "model/tp_shard.h"
#include "model/weights.h"

namespace conveyor {
namespace {

namespace fs = std::filesystem;

ModelConfig small_config() {
  ModelConfig c;
  c.n_embd = 24, c.n_head = 3, c.n_layer = 3, c.n_inner = 40, c.n_positions = 12, c.vocab_size = 30;
  c.eos_token_id = 29;
  return c;
}

class StageCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("conveyor_sc_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "_" +
            std::to_string(::getpid()));
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(DType storage) {
    const std::string d = (dir_ / dtype_name(storage)).string();
    EXPECT_TRUE(write_gpt2_checkpoint(d, config_, random_stage_weights(config_, 0, config_.n_layer, 11), storage).ok());
    return d;
  }

  ModelConfig config_ = small_config();
  fs::path dir_;
};

// What the lead rank of the stage holds (as a GPU stage's layout does), with or without an LM
// head of its own.
std::function<bool(StageTensor)> rank0_holds(const StageCheckpoint& c, bool own_head) {
  return [&c, own_head](StageTensor t) {
    if (t == StageTensor::LmHead) return own_head && c.has_head();
    return kStageTensors[size_t(t)].held_by == HeldBy::FirstStage ? c.has_embedding() : c.has_head();
  };
}

// What a rank's pieces hold, widened to fp32: (layer, tensor) -> values, placed by first_row.
using Gathered = std::map<std::pair<int64_t, uint8_t>, std::vector<float>>;

Gathered gather_all(const std::vector<TensorPiece>& pieces, PieceRead read) {
  Gathered out;
  for (const TensorPiece& p : pieces) {
    std::vector<std::byte> bytes(p.bytes());
    EXPECT_TRUE(gather(p, bytes.data(), read).ok());
    const size_t e = dtype_bytes(p.source->dtype()), row = p.row_bytes() / e;
    std::vector<float>& v = out[{p.layer, p.tensor}];
    v.resize(std::max(v.size(), size_t(p.first_row + p.rows) * row));
    EXPECT_TRUE(convert_to_f32(p.source->dtype(), bytes.data(), bytes.size() / e, v.data() + p.first_row * row).ok());
  }
  return out;
}

TEST_F(StageCheckpointTest, EveryRankGathersWhatShardLayerGives) {
  for (DType storage : {DType::F32, DType::F16, DType::BF16}) {
    const std::string dir = write(storage);
    for (auto [begin, end] : {std::pair<int64_t, int64_t>{0, 3}, {1, 3}, {0, 1}}) {
      auto w = load_stage_weights(dir, config_, begin, end);
      auto ckpt = open_stage_checkpoint(dir, config_, begin, end);
      ASSERT_TRUE(w.ok() && ckpt.ok());
      for (int ranks : {1, 2, 3})
        for (uint64_t max_bytes : {uint64_t(100), uint64_t(1) << 20}) {
          SCOPED_TRACE(std::string(dtype_name(storage)) + " layers " + std::to_string(begin) + ".." +
                       std::to_string(end) + " tp " + std::to_string(ranks) + " pieces of " +
                       std::to_string(max_bytes));
          for (int r = 0; r < ranks; ++r) {
            const TpShard shard = TpShard::of(config_, r, ranks);
            auto holds = rank0_holds(*ckpt, false);
            auto pieces = stage_pieces(*ckpt, shard, holds, max_bytes);
            ASSERT_TRUE(pieces.ok()) << pieces.error();
            int64_t last = 0;
            for (const TensorPiece& p : *pieces) {
              EXPECT_TRUE(p.bytes() <= max_bytes || p.rows == 1);
              last += p.last;
            }
            const Gathered got = gather_all(*pieces, r % 2 ? PieceRead::Map : PieceRead::Pread);
            EXPECT_EQ(got, gather_all(*pieces, r % 2 ? PieceRead::Pread : PieceRead::Map));
            EXPECT_EQ(size_t(last), got.size());  // one last piece a tensor
            for (size_t l = 0; l < w->layers.size(); ++l) {
              const LayerWeights part = shard_layer(w->layers[l], config_, shard);
              for (const LayerTensorSpec& spec : kLayerTensors) {
                const auto& want = spec.split == TpSplit::Whole ? w->layers[l].*spec.field : part.*spec.field;
                EXPECT_EQ(got.at({int64_t(l), uint8_t(spec.id)}), want) << "layer " << l << " " << spec.hf_name;
              }
            }
            for (const StageTensorSpec& spec : kStageTensors) {
              if (spec.id == StageTensor::LmHead) continue;
              const bool held = spec.held_by == HeldBy::FirstStage ? begin == 0 : end == config_.n_layer;
              if (!held) continue;
              EXPECT_EQ(got.at({-1, uint8_t(spec.id)}), (*w).*spec.field) << spec.hf_name;
            }
          }
        }
    }
  }
}

TEST_F(StageCheckpointTest, AHeadHeldFromWteWhenTiedAndRefusedWhereNotOpened) {
  const std::string dir = write(DType::F16);
  auto last = open_stage_checkpoint(dir, config_, 2, 3);
  ASSERT_TRUE(last.ok()) << last.error();
  ASSERT_NE(last->head(), nullptr);
  EXPECT_EQ(last->head()->name, "transformer.wte.weight");
  auto pieces = stage_pieces(*last, TpShard::of(config_, 0, 1), rank0_holds(*last, true), 1 << 20);
  ASSERT_TRUE(pieces.ok()) << pieces.error();
  int64_t head_bytes = 0;
  for (const TensorPiece& p : *pieces)
    if (p.layer < 0 && StageTensor(p.tensor) == StageTensor::LmHead) {
      EXPECT_EQ(p.source->name, "transformer.wte.weight");
      head_bytes += int64_t(p.bytes());
    }
  EXPECT_EQ(head_bytes, config_.vocab_size * config_.n_embd * 2);
  auto middle = open_stage_checkpoint(dir, config_, 1, 2);  // neither embedding nor head
  ASSERT_TRUE(middle.ok());
  EXPECT_EQ(middle->head(), nullptr);
  auto refused = stage_pieces(*middle, TpShard::of(config_, 0, 1), [](StageTensor t) { return t == StageTensor::Wpe; },
                              1 << 20);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().find("wpe.weight"), std::string::npos) << refused.error();
}

TEST_F(StageCheckpointTest, ReadersHandPiecesOnInOrderThroughASmallRing) {
  const std::string dir = write(DType::F16);
  auto ckpt = open_stage_checkpoint(dir, config_, 0, 3);
  ASSERT_TRUE(ckpt.ok());
  auto pieces = stage_pieces(*ckpt, TpShard::of(config_, 1, 2), [](StageTensor) { return true; }, 64);
  ASSERT_TRUE(pieces.ok());
  ASSERT_GT(pieces->size(), 50u);
  std::vector<std::byte> want;
  for (const TensorPiece& p : *pieces) {
    std::vector<std::byte> b(p.bytes());
    ASSERT_TRUE(gather(p, b.data()).ok());
    want.insert(want.end(), b.begin(), b.end());
  }
  std::vector<std::vector<std::byte>> memory(3, std::vector<std::byte>(96));
  PieceRing ring;
  ring.slot_bytes = 96;
  for (auto& m : memory) ring.slots.push_back(m.data());
  std::vector<std::byte> got;
  size_t next = 0, waits = 0;
  std::mutex mu;
  ring.wait_free = [&](size_t) {
    std::lock_guard lk(mu);
    ++waits;
    return ok_status();
  };
  ring.consume = [&](size_t i, size_t slot) {
    EXPECT_EQ(i, next++);
    EXPECT_EQ(slot, i % 3);
    got.insert(got.end(), ring.slots[slot], ring.slots[slot] + (*pieces)[i].bytes());
    return ok_status();
  };
  ASSERT_TRUE(read_pieces(*pieces, 4, ring).ok());
  EXPECT_EQ(next, pieces->size());
  EXPECT_EQ(waits, pieces->size() - 3);  // every reuse of a slot, and only those
  EXPECT_EQ(got, want);

  // The first error stops the rest and comes back.
  next = 0;
  ring.consume = [&](size_t i, size_t) {
    next = i + 1;
    return i == 7 ? Status::error("piece 7 refused") : ok_status();
  };
  Status s = read_pieces(*pieces, 4, ring);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.message(), "piece 7 refused");
  EXPECT_EQ(next, 8u);

  // A piece larger than a slot: refused before anything is read, naming the tensor.
  ring.slot_bytes = 16;
  ring.consume = [&](size_t, size_t) {
    ADD_FAILURE() << "nothing may be read";
    return ok_status();
  };
  Status big = read_pieces(*pieces, 2, ring);
  ASSERT_FALSE(big.ok());
  EXPECT_NE(big.message().find("model.safetensors: tensor \""), std::string::npos) << big.message();
  EXPECT_NE(big.message().find("does not fit"), std::string::npos) << big.message();
}

TEST_F(StageCheckpointTest, TruncatedOrIncompleteCheckpointsNameFileAndTensor) {
  const std::string dir = write(DType::F16);
  const fs::path file = fs::path(dir) / "model.safetensors";
  auto intact = SafetensorsFile::open(file.string());
  ASSERT_TRUE(intact.ok());
  std::string last_tensor;  // the tensor whose data ends the file
  uint64_t last_end = 0;
  for (const TensorInfo& t : intact->tensors())
    if (t.offset + t.size_bytes > last_end) last_end = t.offset + t.size_bytes, last_tensor = t.name;
  // Cut short after it was opened: a read of the lost bytes fails naming file and tensor.
  auto opened = open_stage_checkpoint(dir, config_, 0, 3);
  ASSERT_TRUE(opened.ok());
  fs::resize_file(file, fs::file_size(file) - 10);
  auto pieces = stage_pieces(*opened, TpShard::of(config_, 0, 1), [](StageTensor) { return true; }, 1 << 20);
  ASSERT_TRUE(pieces.ok());
  const TensorPiece* tail = nullptr;
  for (const TensorPiece& p : *pieces)
    if (p.source->name == last_tensor) tail = &p;
  ASSERT_NE(tail, nullptr);
  std::vector<std::byte> buf(tail->bytes());
  Status cut = gather(*tail, buf.data(), PieceRead::Pread);
  ASSERT_FALSE(cut.ok());
  EXPECT_NE(cut.message().find(file.string() + ": tensor \"" + last_tensor + "\""), std::string::npos) << cut.message();
  EXPECT_NE(cut.message().find("ends early"), std::string::npos) << cut.message();

  // Opened after: the header's offsets run past the end.
  auto truncated = open_stage_checkpoint(dir, config_, 0, 3);
  ASSERT_FALSE(truncated.ok());
  EXPECT_NE(truncated.error().find(file.string()), std::string::npos) << truncated.error();
  EXPECT_NE(truncated.error().find("\"" + last_tensor + "\""), std::string::npos) << truncated.error();
  EXPECT_NE(truncated.error().find("past the end of the file"), std::string::npos) << truncated.error();

  ModelConfig wider = config_;  // a config the checkpoint does not match: the first tensor it covers
  wider.n_inner = 48;
  auto mismatch = open_stage_checkpoint(write(DType::F32), wider, 1, 2);
  ASSERT_FALSE(mismatch.ok());
  EXPECT_NE(mismatch.error().find("\"transformer.h.1.mlp.c_fc.weight\" has shape [24, 40]"), std::string::npos)
      << mismatch.error();
  EXPECT_NE(mismatch.error().find("model.safetensors"), std::string::npos) << mismatch.error();
}

}  // namespace
}  // namespace conveyor
