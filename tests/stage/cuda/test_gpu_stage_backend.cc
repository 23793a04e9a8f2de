// The GPU backend of the stage worker (stage/cuda/gpu_stage_backend.h) behind the
// StageExecutor, against the CPU backend: the demo model split in two stages, three
// sequences prefilled in one micro-batch and decoded greedily together with activations
// handed between the stages as the workers hand them (fp16/bf16 rows from a GPU stage, fp32
// from a CPU stage). The GPU pipeline must pick
// the CPU pipeline's token wherever the CPU's top-2 log-prob gap is decisive, and report
// log-probs close to the CPU's. Errors come back as Status, never as exceptions.
//
// Skips cleanly when built without CUDA or run where no GPU is present.
#include <gtest/gtest.h>

#ifndef CONVEYOR_HAVE_CUDA

TEST(GpuStageBackend, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }

#else

#include <cuda_runtime.h>

#include <array>
#include <cmath>

#include "stage/cpu/cpu_stage_backend.h"
#include "stage/cuda/gpu_stage_backend.h"
#include "model/tokenizer.h"
#include "model/weights.h"
#include "protocol/seq_state.h"
#include "stage/stage_executor.h"
#include "tests/gpu_test_util.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

using testing::have_gpu;

std::string model_dir() { return testing::source_dir() + "/models/brown-gpt2"; }

struct Pipeline {
  std::vector<std::unique_ptr<StageExecutor>> stages;
  // Runs one micro-batch through every stage, as the workers do: each stage's activations
  // leave in its own dtype through memory from its backend (page-locked for a GPU) and the
  // header says which. Returns the last stage's result.
  BatchResult run(MicroBatch b) {
    std::shared_ptr<std::byte[]> wire;
    size_t bytes = 0;
    BatchResult r;
    for (size_t i = 0; i < stages.size(); ++i) {
      const bool last = i + 1 == stages.size();
      std::shared_ptr<std::byte[]> out;
      size_t out_bytes = 0;
      const ActivationSink sink = [&](size_t n) -> Expected<std::span<std::byte>> {
        out = stages[i]->backend().allocate_host(n);
        out_bytes = n;
        return std::span<std::byte>(out.get(), n);
      };
      const Status s = stages[i]->run(b, {wire.get(), bytes}, sink, last ? &r : nullptr);
      EXPECT_TRUE(s.ok()) << "stage " << i << ": " << s.message();
      if (last) break;
      wire = std::move(out), bytes = out_bytes;
      b.activation_dtype = stages[i]->activation_dtype();
    }
    return r;
  }
};

// The demo model in two stages, stage i on the GPU where on_gpu[i].
Pipeline make_pipeline(std::array<bool, 2> on_gpu, DType dtype) {
  Pipeline p;
  int i = 0;
  for (auto [b, e] : {std::pair<int64_t, int64_t>{0, 3}, {3, 6}}) {
    auto w = load_stage_weights(model_dir(), b, e);
    EXPECT_TRUE(w) << w.error();
    if (!on_gpu[size_t(i++)]) {
      p.stages.push_back(std::make_unique<StageExecutor>(CpuStageBackend::create(std::move(*w), 1, 64 << 20).value()));
      continue;
    }
    cuda::GpuStageOptions o;
    o.dtype = dtype;
    o.name = "stage " + std::to_string(b);
    o.max_tokens = 256;
    o.kv_cache_max_bytes = int64_t(64) << 20;
    auto backend = cuda::GpuStageBackend::create(*w, {0}, o);
    EXPECT_TRUE(backend) << backend.error();
    p.stages.push_back(std::make_unique<StageExecutor>(std::move(backend).value()));
  }
  return p;
}
Pipeline make_pipeline(bool gpu, DType dtype) { return make_pipeline({gpu, gpu}, dtype); }

// Step `step` of every sequence as one micro-batch: the whole prompt first, then the last
// token; `state(i, st)` sets sequence i's state, which the batch (re)admits every step.
template <class F>
MicroBatch step_batch(int step, const std::vector<std::vector<int32_t>>& seqs, const std::vector<int32_t>& prompt_lens,
                      F&& state) {
  MicroBatch b;
  b.batch_id = uint64_t(step);
  std::vector<Admission> admitted;
  for (size_t i = 0; i < seqs.size(); ++i) {
    SeqStep w;
    const int32_t start = step == 0 ? 0 : int32_t(seqs[i].size()) - 1;
    w.slice = {i + 1, start, int32_t(seqs[i].size()) - start};
    w.sample = true;
    b.seqs.push_back(w);
    b.token_ids.insert(b.token_ids.end(), seqs[i].begin() + start, seqs[i].end());
    Admission a{.seq_id = i + 1, .state = {}};
    a.state.prompt_len = prompt_lens[i];
    state(i, a.state);
    admitted.push_back(a);
  }
  b.admissions = encode_admissions(admitted);
  return b;
}

// The whole demo model as one GPU stage (it embeds and samples), decode steps from CUDA graphs
// or eager.
std::unique_ptr<StageExecutor> one_stage(DType dtype, bool graphs) {
  auto w = load_stage_weights(model_dir(), 0, 6);
  EXPECT_TRUE(w) << w.error();
  cuda::GpuStageOptions o;
  o.dtype = dtype;
  o.max_tokens = 256;
  o.kv_cache_max_bytes = int64_t(64) << 20;
  o.cuda_graphs = graphs;
  auto backend = cuda::GpuStageBackend::create(*w, {0}, o);
  EXPECT_TRUE(backend) << backend.error();
  return backend ? std::make_unique<StageExecutor>(std::move(backend).value()) : nullptr;
}

class GpuStageBackendTest : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this host";
  }
  void check_against_cpu(std::array<bool, 2> arrangement);
};

// Every arrangement: both stages on the GPU (fp16/bf16 on the wire), and a GPU stage feeding
// a CPU stage or fed by one (the receiver converts what the header says it got).
TEST_P(GpuStageBackendTest, TwoStagePipelineMatchesCpu) {
  for (std::array<bool, 2> arrangement : {std::array{true, true}, {true, false}, {false, true}}) {
    SCOPED_TRACE(std::string("stages on ") + (arrangement[0] ? "gpu" : "cpu") + "," + (arrangement[1] ? "gpu" : "cpu"));
    check_against_cpu(arrangement);
    if (HasFatalFailure()) return;
  }
}

void GpuStageBackendTest::check_against_cpu(std::array<bool, 2> arrangement) {
  auto tok = Tokenizer::load(model_dir());
  ASSERT_TRUE(tok) << tok.error();
  Pipeline cpu = make_pipeline(false, GetParam()), gpu = make_pipeline(arrangement, GetParam());
  const std::vector<std::string> texts = {"The jury said", "In the morning the old man walked down to the river",
                                          "Mr. Brown"};
  std::vector<std::vector<int32_t>> seqs;
  std::vector<int32_t> prompt_lens;
  for (const auto& t : texts) seqs.push_back(tok->encode(t)), prompt_lens.push_back(int32_t(seqs.back().size()));

  const double tol = GetParam() == DType::F16 ? 0.05 : 0.15;
  int decisive = 0, agreed = 0;
  for (int step = 0; step < 24; ++step) {
    const MicroBatch b = step_batch(step, seqs, prompt_lens, [](size_t, SeqState& st) {
      st.top_logprobs = 2;
      st.sampling.temperature = 0;
    });
    const BatchResult rc = cpu.run(b), rg = gpu.run(b);
    ASSERT_EQ(rc.seqs.size(), seqs.size());
    ASSERT_EQ(rg.seqs.size(), seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i) {
      const SeqResult &c = rc.seqs[i], &g = rg.seqs[i];
      ASSERT_EQ(c.top.size(), 2u);
      EXPECT_NEAR(g.logprob, c.logprob, tol) << "sequence " << i << " step " << step;
      if (c.top[0].second - c.top[1].second > 0.1) {
        ++decisive;
        agreed += g.token == c.token;
        EXPECT_EQ(g.token, c.token) << "sequence " << i << " step " << step;
      }
      seqs[i].push_back(c.token);  // both continue with the CPU's choice
    }
  }
  EXPECT_GT(decisive, 30);
  std::cout << "[backend] " << (GetParam() == DType::F16 ? "fp16" : "bf16") << ": " << agreed << " of " << decisive
            << " decisive steps agree\n";
  if (arrangement != std::array{true, true}) return;
  // The GPU stages hold the same sequences as the CPU stages and free them the same way.
  EXPECT_EQ(gpu.stages[0]->backend().num_sequences(), 3);
  gpu.stages[0]->free_sequence(1);
  EXPECT_EQ(gpu.stages[0]->backend().num_sequences(), 2);
  EXPECT_GT(gpu.stages[1]->backend().kv_used_tokens(), 0);
  gpu.stages[1]->drop_all();
  EXPECT_EQ(gpu.stages[1]->backend().kv_used_tokens(), 0);
}

// create() warms the stage up: every decode bucket's graph is captured before the first
// request (1, 2, 4, ..., 128 for 128 sequences), a step captures nothing more, and the
// graphs the warm-up captured from padding rows give the bits of the same steps run eagerly.
TEST_P(GpuStageBackendTest, WarmUpCapturesTheDecodeGraphsBeforeTheFirstStep) {
  auto tok = Tokenizer::load(model_dir());
  ASSERT_TRUE(tok) << tok.error();
  auto make = [&](bool graphs) { return one_stage(GetParam(), graphs); };
  Pipeline replayed, eager;
  replayed.stages.push_back(make(true));
  eager.stages.push_back(make(false));
  ASSERT_TRUE(replayed.stages[0] && eager.stages[0]);
  auto captured = [](Pipeline& p) {
    return static_cast<cuda::GpuStageBackend&>(p.stages[0]->backend()).stage().lead().captured_graphs();
  };
  EXPECT_EQ(captured(replayed), 8u);
  EXPECT_EQ(captured(eager), 0u);

  std::vector<std::vector<int32_t>> seqs;
  std::vector<int32_t> prompt_lens;
  for (const char* t : {"The jury said", "In the morning", "Mr. Brown"})
    seqs.push_back(tok->encode(t)), prompt_lens.push_back(int32_t(seqs.back().size()));
  for (int step = 0; step < 6; ++step) {
    const MicroBatch b = step_batch(step, seqs, prompt_lens, [](size_t, SeqState& st) { st.sampling.temperature = 0; });
    const BatchResult r = replayed.run(b), e = eager.run(b);
    ASSERT_EQ(r.seqs.size(), seqs.size());
    ASSERT_EQ(e.seqs.size(), seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i) {
      EXPECT_EQ(r.seqs[i].token, e.seqs[i].token) << "sequence " << i << " step " << step;
      EXPECT_EQ(r.seqs[i].logprob, e.seqs[i].logprob) << "sequence " << i << " step " << step;
      seqs[i].push_back(e.seqs[i].token);
    }
  }
  EXPECT_EQ(captured(replayed), 8u) << "a step captured a graph the warm-up had not";
}

// A step ahead (SeqStep::own_token) on a stage that samples in place: the step on the tokens
// the stage chose itself gives the bits of the same step told those tokens, greedy, sampled
// and with a repetition penalty (which reads the history the own token joins).
TEST_P(GpuStageBackendTest, AStepAheadOnItsOwnTokensGivesTheToldStepsBits) {
  auto tok = Tokenizer::load(model_dir());
  ASSERT_TRUE(tok) << tok.error();
  Pipeline ahead, told;
  ahead.stages.push_back(one_stage(GetParam(), true));
  told.stages.push_back(one_stage(GetParam(), true));
  ASSERT_TRUE(ahead.stages[0] && told.stages[0]);
  ASSERT_TRUE(ahead.stages[0]->backend().samples_in_place());
  std::vector<std::vector<int32_t>> seqs;
  std::vector<int32_t> prompt_lens;
  for (const char* t : {"The jury said", "In the morning", "Mr. Brown"})
    seqs.push_back(tok->encode(t)), prompt_lens.push_back(int32_t(seqs.back().size()));
  auto sampling = [](size_t i, SeqState& st) {
    st.sampling.temperature = i == 1 ? 0.8f : 0.f;
    st.sampling.seed = 11;
    if (i == 2) st.sampling.repetition_penalty = 1.3f;
  };
  for (int step = 0; step < 8; ++step) {
    const MicroBatch b = step_batch(step, seqs, prompt_lens, sampling);
    MicroBatch own = b;
    if (step > 0)
      for (size_t i = 0; i < seqs.size(); ++i) {
        own.seqs[i].own_token = true;  // a decode slice: token i of the batch
        own.token_ids[i] = kOwnTokenPlaceholder;
      }
    const BatchResult a = ahead.run(own), t = told.run(b);
    ASSERT_EQ(a.seqs.size(), seqs.size());
    ASSERT_EQ(t.seqs.size(), seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i) {
      EXPECT_EQ(a.seqs[i].token, t.seqs[i].token) << "sequence " << i << " step " << step;
      EXPECT_EQ(a.seqs[i].logprob, t.seqs[i].logprob) << "sequence " << i << " step " << step;
      seqs[i].push_back(t.seqs[i].token);
    }
  }
}

// The last stage samples on the GPU (HeadOutput::Tokens; decode steps replayed from
// CUDA graphs, GpuStage::decode) unless a slice asks for top log-probs (then the ordinary
// forward and logits run, and the host samples): both ways must choose the same tokens
// (greedy, seeded temperature sampling, a repetition penalty, which makes the GPU sampler
// mutate its logits, and logit_bias on a greedy and a sampled row) and report the same log-prob of the chosen token. Untimed
// GEMM plans, so both pipelines compute the same logits.
TEST_P(GpuStageBackendTest, SamplingOnTheGpuMatchesTheHostPath) {
  auto tok = Tokenizer::load(model_dir());
  ASSERT_TRUE(tok) << tok.error();
  Pipeline on_gpu = make_pipeline(true, GetParam()), on_host = make_pipeline(true, GetParam());
  for (Pipeline* p : {&on_gpu, &on_host})
    for (auto& st : p->stages) static_cast<cuda::GpuStageBackend&>(st->backend()).stage().lead().gemm().set_tuning(false);
  ASSERT_TRUE(on_gpu.stages.back()->backend().samples_in_place());
  const std::vector<std::string> texts = {"The jury said", "It was a cold", "Mr. Brown", "In the morning"};
  std::vector<std::vector<int32_t>> seqs;
  std::vector<int32_t> prompt_lens;
  for (const auto& t : texts) seqs.push_back(tok->encode(t)), prompt_lens.push_back(int32_t(seqs.back().size()));
  int sampled = 0;
  for (int step = 0; step < 16; ++step) {
    auto sampling = [](size_t i, SeqState& st) {
      SamplingParams& p = st.sampling;
      p.temperature = i == 0 ? 0.f : 0.8f;
      p.seed = 7 + i;
      if (i == 2) p.repetition_penalty = 1.3f;
      if (i == 3) p.temperature = 0.f, p.logit_bias = {{13, kLogitBiasBan}, {262, 3.f}, {290, 1.5f}};
      if (i == 1) p.logit_bias = {{11, -2.f}, {262, 1.f}};
    };
    const BatchResult g = on_gpu.run(step_batch(step, seqs, prompt_lens, sampling));
    // The same batch, sampled on the host: the states ask for a top log-prob.
    const BatchResult h = on_host.run(step_batch(step, seqs, prompt_lens, [&](size_t i, SeqState& st) {
      sampling(i, st);
      st.top_logprobs = 1;
    }));
    ASSERT_EQ(g.seqs.size(), seqs.size());
    ASSERT_EQ(h.seqs.size(), seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i) {
      EXPECT_EQ(g.seqs[i].token, h.seqs[i].token) << "sequence " << i << " step " << step;
      EXPECT_NEAR(g.seqs[i].logprob, h.seqs[i].logprob, 1e-3) << "sequence " << i << " step " << step;
      seqs[i].push_back(h.seqs[i].token);
      ++sampled;
    }
  }
  EXPECT_EQ(sampled, 64);
}

TEST_P(GpuStageBackendTest, ErrorsAreStatusesAndChangeNothing) {
  auto w = load_stage_weights(model_dir(), 2, 4);  // a middle stage: activations in and out
  ASSERT_TRUE(w) << w.error();
  cuda::GpuStageOptions o;
  o.dtype = GetParam();
  o.max_tokens = 16;
  o.kv_cache_max_bytes = int64_t(16) << 20;
  auto bad_device = cuda::GpuStageBackend::create(*w, {4096}, o);
  ASSERT_FALSE(bad_device);
  EXPECT_NE(bad_device.error().find("device 4096"), std::string::npos) << bad_device.error();
  auto b = cuda::GpuStageBackend::create(*w, {0}, o);
  ASSERT_TRUE(b) << b.error();
  StageBackend& s = **b;
  std::vector<float> hidden(size_t(32 * 256), 0.01f);
  auto rows = [&](int64_t n) { return ActivationsView{DType::F32, std::as_bytes(std::span(hidden.data(), size_t(n * 256)))}; };
  std::vector<std::byte> out(4 * 256 * 2);
  size_t room = out.size();  // what the sink offers
  auto step = [&](const SeqSlice& slice, const ActivationsView& in) {
    StepInput si;
    si.slices = {&slice, 1};
    si.activations = in;
    StepOutput so;
    so.activations = [&](size_t) -> Expected<std::span<std::byte>> { return std::span(out).first(room); };
    return s.step(si, so);
  };
  Status st = step({1, 0, 32}, rows(32));  // more rows than max_tokens
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("exceeds"), std::string::npos) << st.message();
  st = step({1, 5, 1}, rows(1));  // starts past the cached length
  EXPECT_FALSE(st.ok());
  const SeqSlice ok{1, 0, 4};
  st = step(ok, rows(3));  // a row short
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("expected 4 tokens x 256"), std::string::npos) << st.message();
  st = step(ok, {DType::I32, rows(4).bytes});  // not an activation type
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("I32"), std::string::npos) << st.message();
  EXPECT_EQ(s.num_sequences(), 0);
  room = 100;  // too small for the rows the stage hands on
  st = step(ok, rows(4));
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("cannot hold"), std::string::npos) << st.message();
  s.clear();
  room = out.size();
  EXPECT_TRUE(step(ok, rows(4)).ok());
  EXPECT_EQ(s.num_sequences(), 1);
}

// K/V forks on GPU stages: children of 21, 16 and 9 tokens of a 21-token parent (one full
// page and a partial one), the parent freed in the same batch, then decoded (the graph path,
// tokens chosen on the GPU) and decoded again with log-probs (the host path): the same tokens
// and log-probs as sequences that prefilled the same prefix themselves and decoded the same
// steps. Full pages are shared, not copied; every page is free again once all are freed.
TEST_P(GpuStageBackendTest, ForkedSequencesMatchSequencesThatPrefilledTheirPrefix) {
  const std::vector<int32_t> prompt = {464, 1578, 531, 818, 262, 3329, 262, 1468, 11, 290, 339, 1110, 13, 383, 2010,
                                       257, 1244, 318, 7, 42, 99};
  const std::vector<int32_t> prefix = {21, 16, 9};
  const std::vector<std::vector<int32_t>> steps = {{5, 77, 1000}, {6, 8, 10}};  // per step, each child's token
  // A step of sequence `id`, with its (re)admission reporting its top `top` (0: the graph
  // path, tokens chosen on the GPU; > 0: the host path).
  auto work = [&](MicroBatch& b, uint64_t id, int32_t start, int32_t n, int top) {
    SeqStep w;
    w.slice = {id, start, n};
    w.sample = true;
    b.seqs.push_back(w);
    std::vector<Admission> admitted = decode_admissions(b.admissions).value();
    Admission a{.seq_id = id, .state = {}};
    a.state.prompt_len = int32_t(prompt.size());
    a.state.top_logprobs = top;
    a.state.sampling.temperature = 0;
    admitted.push_back(a);
    b.admissions = encode_admissions(admitted);
  };
  Pipeline forked = make_pipeline(true, GetParam());
  auto& lead = static_cast<cuda::GpuStageBackend&>(forked.stages[0]->backend()).stage().lead();
  const int64_t free_at_start = lead.kv_free_tokens();
  MicroBatch first;
  work(first, 1, 0, int32_t(prompt.size()), 0);
  first.token_ids = prompt;
  forked.run(first);
  EXPECT_EQ(lead.kv_free_tokens(), free_at_start - 2 * cuda::kPageTokens);
  std::vector<std::vector<BatchResult>> got(prefix.size());
  for (size_t step = 0; step < steps.size(); ++step) {
    MicroBatch b;
    b.batch_id = 2 + step;
    if (step == 0) b.forks = {{1, 2, 21}, {1, 3, 16}, {1, 4, 9}}, b.free_seq_ids = {1};
    for (size_t i = 0; i < prefix.size(); ++i) {
      b.token_ids.push_back(steps[step][i]);
      if (step == 0) {  // the fork brought the parent's state (top 0)
        b.seqs.push_back({.slice = {2 + i, prefix[i], 1}, .sample = true});
        continue;
      }
      work(b, 2 + i, prefix[i] + int32_t(step), 1, 5);
    }
    const BatchResult r = forked.run(b);
    ASSERT_EQ(r.seqs.size(), prefix.size());
    for (size_t i = 0; i < prefix.size(); ++i) {
      BatchResult one = r;
      one.seqs = {r.seqs[i]};
      got[i].push_back(one);
    }
    if (step == 0) {  // children 2 and 3 share the parent's full page; 2 and 4 got copies of a partial page
      EXPECT_EQ(lead.kv_cache().pages(2)[0], lead.kv_cache().pages(3)[0]);
      EXPECT_EQ(lead.kv_cache().page_refs(lead.kv_cache().pages(2)[0]), 2);
      EXPECT_NE(lead.kv_cache().pages(4)[0], lead.kv_cache().pages(2)[0]);
      // Pages held: the shared one, 2's copy, 3's new page (position 16), 4's copy.
      EXPECT_EQ(lead.kv_free_tokens(), free_at_start - 4 * cuda::kPageTokens);
    }
  }
  for (uint64_t id : {2, 3, 4})
    for (auto& st : forked.stages) st->free_sequence(id);
  EXPECT_EQ(lead.kv_free_tokens(), free_at_start);

  for (size_t i = 0; i < prefix.size(); ++i) {
    Pipeline ref = make_pipeline(true, GetParam());
    MicroBatch pre;
    work(pre, 7, 0, prefix[i], 0);
    pre.token_ids.assign(prompt.begin(), prompt.begin() + prefix[i]);
    ref.run(pre);
    for (size_t step = 0; step < steps.size(); ++step) {
      MicroBatch b;
      b.batch_id = 2 + step;
      work(b, 7, prefix[i] + int32_t(step), 1, step == 0 ? 0 : 5);
      b.token_ids = {steps[step][i]};
      const BatchResult want = ref.run(b);
      ASSERT_EQ(want.seqs.size(), 1u);
      const SeqResult& g = got[i][step].seqs[0];
      EXPECT_EQ(g.token, want.seqs[0].token) << "child " << i << " step " << step;
      EXPECT_EQ(g.logprob, want.seqs[0].logprob) << "child " << i << " step " << step;
      EXPECT_EQ(g.top, want.seqs[0].top) << "child " << i << " step " << step;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuStageBackendTest, ::testing::Values(DType::F16, DType::BF16),
                         [](const auto& info) { return std::string(info.param == DType::F16 ? "F16" : "BF16"); });

}  // namespace
}  // namespace conveyor

#endif
