// The coordinator's scheduler driving real stages in one process, without threads or sockets:
// every micro-batch it forms is encoded and decoded as on the wire, run through each stage's
// StageExecutor in order (activations handed on as the workers hand them), and its result
// given back; a replay (a new epoch, every stage dropping its caches) can be forced between
// micro-batches, as the coordinator's failover does. For the beam-search tests.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "coordinator/scheduler.h"
#include "model/weights.h"
#include "protocol/batch_result.h"
#include "protocol/microbatch.h"
#include "protocol/seq_state.h"
#include "stage/cpu/cpu_stage_backend.h"
#include "stage/stage_executor.h"

namespace conveyor::testing {

// Makes a stage's backend from its weights (the CPU's by default).
using BackendMaker = std::function<std::unique_ptr<StageBackend>(StageWeights weights, int64_t kv_bytes)>;

struct InprocPipeline {
  ClusterConfig cfg;
  std::vector<PipelineRun> pipelines;
  std::unique_ptr<Scheduler> scheduler;
  std::vector<std::unique_ptr<StageExecutor>> stages;
  int64_t batches_run = 0;
  int64_t forks_sent = 0;
  int64_t admissions_sent = 0;       // sequences whose state went to the last stage
  std::vector<std::string> failures;  // what stages refused (each forces a replay)

  // The model in `model_dir` cut at `cuts` (layer indices; none: one stage), CPU stages with
  // `kv_bytes` of K/V budget each; `tokenizer_dir` gives the tokenizer (text only).
  InprocPipeline(const std::string& model_dir, const std::string& tokenizer_dir, std::vector<int64_t> cuts = {},
                 int64_t kv_bytes = int64_t(256) << 20, const BackendMaker& make_backend = {}) {
    cfg.model = load_model_config(model_dir).value();
    pipelines.resize(1);
    pipelines[0].limits = {.max_sequences = 64, .max_rows = 256, .prefill_chunk = 64, .prefill_tokens = 64,
                           .max_running = 64};
    // Prefix entries in whole K/V pages of the stages, as a CPU stage describes them.
    pipelines[0].figures.kv_page_tokens = CpuStageBackend::capabilities(0, kv_bytes).kv_page_tokens;
    auto tok = Tokenizer::load(tokenizer_dir);
    EXPECT_TRUE(tok.ok()) << tok.error();
    scheduler = std::make_unique<Scheduler>(cfg, std::make_shared<const Tokenizer>(std::move(tok).value()), pipelines);
    cuts.insert(cuts.begin(), 0);
    cuts.push_back(cfg.model.n_layer);
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      auto w = load_stage_weights(model_dir, cuts[i], cuts[i + 1]);
      EXPECT_TRUE(w) << w.error();
      if (make_backend) {
        auto backend = make_backend(std::move(*w), kv_bytes);
        EXPECT_TRUE(backend != nullptr) << "stage " << i << " could not be made";
        stages.push_back(std::make_unique<StageExecutor>(std::move(backend)));
      } else {
        stages.push_back(std::make_unique<StageExecutor>(CpuStageBackend::create(std::move(*w), 1, kv_bytes).value()));
      }
    }
  }

  // One micro-batch through every stage, through the wire format.
  BatchResult run(const MicroBatch& formed) {
    auto decoded = decode_microbatch(encode(formed));
    EXPECT_TRUE(decoded) << decoded.error();
    MicroBatch b = std::move(decoded).value();
    forks_sent += int64_t(b.forks.size());
    if (auto a = decode_admissions(b.admissions); a.ok()) admissions_sent += int64_t(a->size());
    std::vector<std::byte> wire;
    BatchResult r;
    for (size_t i = 0; i < stages.size(); ++i) {
      const bool last = i + 1 == stages.size();
      std::vector<std::byte> out;
      const ActivationSink sink = [&](size_t n) -> Expected<std::span<std::byte>> {
        out.resize(n);
        return std::span<std::byte>(out);
      };
      const Status s = stages[i]->run(b, wire, sink, last ? &r : nullptr);
      if (!s.ok()) {  // as a worker reports it: the batch failed, the coordinator replays
        r = BatchResult{};
        r.batch_id = b.batch_id, r.pipeline = b.pipeline, r.epoch = b.epoch;
        r.error = s.message();
        failures.push_back(r.error);
        return r;
      }
      if (last) break;
      wire = std::move(out);
      b.activation_dtype = stages[i]->activation_dtype();
    }
    ++batches_run;
    return r;
  }

  // What the coordinator's failover does to the pipeline, and every stage dropping its caches.
  void replay() {
    PipelineRun& p = pipelines[0];
    ++p.epoch;
    p.batches.clear();
    p.in_flight = 0;
    p.pending_frees.clear();
    for (auto& s : stages) s->drop_all();
    scheduler->restart(0);
  }

  // Runs until nothing is outstanding (or max_batches). `before_batch(n)` is called before the
  // n-th micro-batch (from 0); returning true forces a replay first.
  void run_until_idle(const std::function<bool(int64_t)>& before_batch = {}, int64_t max_batches = 100000) {
    PipelineRun& p = pipelines[0];
    for (int64_t n = 0; n < max_batches && scheduler->outstanding() > 0; ++n) {
      scheduler->admit([](const PipelineRun&) { return true; }, [](const PipelineRun&) { return int64_t(1) << 40; });
      if (before_batch && before_batch(n)) replay();
      auto f = scheduler->next_step(p, 1);
      if (!f) {
        ADD_FAILURE() << "requests outstanding but no micro-batch to send";
        return;
      }
      const MicroBatch batch = to_microbatch(*f);
      Scheduler::sent(p, std::move(*f));
      const BatchResult r = run(batch);
      if (scheduler->on_result(r) != nullptr) replay();
      scheduler->deliver();
    }
    // The last frees travel on an empty micro-batch, as the coordinator sends them.
    if (auto f = scheduler->next_step(p, 1)) {
      const MicroBatch batch = to_microbatch(*f);
      Scheduler::sent(p, std::move(*f));
      scheduler->on_result(run(batch));
      scheduler->deliver();
    }
    EXPECT_EQ(scheduler->outstanding(), 0u);
    // A replay would hide a state the coordinator failed to send (the last stage refuses the
    // step, the replay sends every state again): no stage may have refused anything.
    EXPECT_TRUE(failures.empty()) << failures.size() << " micro-batches failed, the first: " << failures.front();
  }
};

// Collects a request's updates and its end.
struct Collected {
  std::vector<ChoiceUpdate> updates;
  std::vector<std::string> done;  // on_done messages
  CompletionSink sink() {
    CompletionSink s;
    s.on_update = [this](ChoiceUpdate u) { updates.push_back(std::move(u)); };
    s.on_done = [this](const std::string& e) { done.push_back(e); };
    return s;
  }
};

}  // namespace conveyor::testing
