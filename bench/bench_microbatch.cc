// What a step's micro-batch header costs on the wire: its encoded bytes for 1 to 512
// sequences, and the time to encode it and to decode it (which every stage does once a
// step). Issue 27 moved a request's state (sampling parameters, stop ids, logit_bias, seed,
// prompt length, log-prob settings) out of the per-step header: it rides once, in the
// admissions of the sequence's first step, which only the last stage reads.
//
//   conveyor-bench-microbatch [benchmark flags]
//
// BM_Header, per `state`:
//   0  a steady decode step: every sequence decodes one token, no admissions;
//   1  every sequence admitted in this step, with what the REST API's typical request carries
//      (temperature 0.7, top_p 0.9, a seed, the model's end-of-text stop id);
//   2  the same with a "rich" state: three more stop ids and eight logit_bias entries.
// Encode + decode_microbatch: what the coordinator and every stage pay (the admissions are
// copied as bytes, not read). BM_Admissions: encoding and reading the admissions themselves,
// what the coordinator and the last stage pay once per sequence.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "protocol/microbatch.h"
#include "protocol/seq_state.h"

namespace conveyor {
namespace {

std::vector<Admission> admissions(int64_t seqs, bool rich) {
  std::vector<Admission> out;
  for (int64_t i = 0; i < seqs; ++i) {
    Admission a{.seq_id = uint64_t(1000 + i), .state = {}};
    a.state.prompt_len = 128;
    SamplingParams& p = a.state.sampling;
    p.temperature = 0.7f;
    p.top_p = 0.9f;
    p.seed = 0x9e3779b97f4a7c15ull + uint64_t(i);
    p.stop_token_ids = {50256};
    if (rich) {
      p.stop_token_ids.insert(p.stop_token_ids.end(), {198, 628, 13});
      for (int32_t t = 0; t < 8; ++t) p.logit_bias.push_back({1000 + t, -100.0f});
    }
    out.push_back(std::move(a));
  }
  return out;
}

// Every sequence steps one token; state 1 or 2 admits them all in this step.
MicroBatch decode_batch(int64_t seqs, int64_t state) {
  MicroBatch b;
  b.batch_id = 7;
  b.activation_dtype = DType::F16;
  for (int64_t i = 0; i < seqs; ++i) {
    b.seqs.push_back({.slice = {uint64_t(1000 + i), int32_t(128 + i % 64), 1}, .sample = true});
    b.token_ids.push_back(int32_t(i % 50000));
  }
  if (state > 0) b.admissions = encode_admissions(admissions(seqs, state == 2));
  return b;
}

void BM_Header(benchmark::State& state) {
  const MicroBatch b = decode_batch(state.range(0), state.range(1));
  size_t bytes = 0;
  for (auto _ : state) {
    std::vector<uint8_t> wire = encode(b);
    Expected<MicroBatch> back = decode_microbatch(wire);
    if (!back) state.SkipWithError(back.error().c_str());
    bytes = wire.size();
    benchmark::DoNotOptimize(back);
  }
  state.counters["bytes"] = double(bytes);
  state.counters["bytes_per_seq"] = double(bytes) / double(state.range(0));
}
BENCHMARK(BM_Header)
    ->ArgNames({"seqs", "state"})
    ->ArgsProduct({{1, 64, 256, 512}, {0, 1, 2}})
    ->Unit(benchmark::kMicrosecond);

void BM_Admissions(benchmark::State& state) {
  const std::vector<Admission> a = admissions(state.range(0), state.range(1) != 0);
  for (auto _ : state) {
    std::vector<uint8_t> wire = encode_admissions(a);
    auto back = decode_admissions(wire);
    if (!back) state.SkipWithError(back.error().c_str());
    benchmark::DoNotOptimize(back);
  }
}
BENCHMARK(BM_Admissions)
    ->ArgNames({"seqs", "rich"})
    ->ArgsProduct({{1, 64, 256, 512}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace conveyor

BENCHMARK_MAIN();
