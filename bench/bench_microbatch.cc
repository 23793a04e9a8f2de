// What a decode step's micro-batch header costs on the wire: its encoded bytes for 1 to 512
// sequences, and the time to encode it and to decode it (which every stage does once a
// step). Issue 27 moves a request's state (sampling parameters, stop ids, logit_bias) out of
// the per-step header; this program measures the header before and after.
//
//   conveyor-bench-microbatch [benchmark flags]
//
// Each sequence decodes one token with what the REST API's typical request carries:
// temperature 0.7, top_p 0.9, a seed, the model's end-of-text stop id; the "rich" variant
// adds three more stop ids and eight logit_bias entries.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "model/microbatch.h"

namespace conveyor {
namespace {

MicroBatch decode_batch(int64_t seqs, bool rich) {
  MicroBatch b;
  b.batch_id = 7;
  b.activation_dtype = DType::F16;
  for (int64_t i = 0; i < seqs; ++i) {
    SeqWork w;
    w.slice = {uint64_t(1000 + i), int32_t(128 + i % 64), 1};
    w.prompt_len = 128;
    w.sample = true;
    w.sample_index = 0;
    w.sampling.temperature = 0.7f;
    w.sampling.top_p = 0.9f;
    w.sampling.seed = 0x9e3779b97f4a7c15ull + uint64_t(i);
    w.sampling.stop_token_ids = {50256};
    if (rich) {
      w.sampling.stop_token_ids.insert(w.sampling.stop_token_ids.end(), {198, 628, 13});
      for (int32_t t = 0; t < 8; ++t) w.sampling.logit_bias.push_back({1000 + t, -100.0f});
    }
    b.seqs.push_back(std::move(w));
    b.token_ids.push_back(int32_t(i % 50000));
  }
  return b;
}

void BM_Header(benchmark::State& state) {
  const MicroBatch b = decode_batch(state.range(0), state.range(1) != 0);
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
    ->ArgNames({"seqs", "rich"})
    ->ArgsProduct({{1, 64, 256, 512}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace conveyor

BENCHMARK_MAIN();
