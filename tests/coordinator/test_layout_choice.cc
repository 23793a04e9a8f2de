// choose_layout: the layout for N GPUs from measured figures and the objective, the rule
// without them, and the figures file's errors.
#include <gtest/gtest.h>

#include "coordinator/layout_choice.h"

namespace conveyor {
namespace {

// Two GPUs as measured on two H200s (bench/two_gpu_table.sh, 2026-11-26): tp has the lowest
// inter-token latency at one client, replicas the most tokens/s at 256.
const char* const kTwoGpus = R"({"layout": "one", "gpus": 1, "clients": 1, "tokens_per_s": 203, "itl_ms_p50": 4.67}
{"layout": "tp", "gpus": 2, "clients": 1, "tokens_per_s": 266, "itl_ms_p50": 3.48, "device": "2 x H200"}
{"layout": "tp", "gpus": 2, "clients": 256, "tokens_per_s": 15271, "itl_ms_p50": 13.15, "device": "2 x H200"}
{"layout": "stages", "gpus": 2, "clients": 1, "tokens_per_s": 170, "itl_ms_p50": 5.22, "device": "2 x H200"}

{"layout": "stages", "gpus": 2, "clients": 256, "tokens_per_s": 17887, "itl_ms_p50": 11.53, "device": "2 x H200"}
{"layout": "replicas", "gpus": 2, "clients": 1, "tokens_per_s": 190, "itl_ms_p50": 4.98, "device": "2 x H200"}
{"layout": "replicas", "gpus": 2, "clients": 256, "tokens_per_s": 18773, "itl_ms_p50": 11.09, "device": "2 x H200"}
)";

std::vector<LayoutFigure> two_gpus() {
  auto f = parse_layout_figures(kTwoGpus, "figures.jsonl");
  EXPECT_TRUE(f.ok()) << f.error();
  return f.ok() ? *f : std::vector<LayoutFigure>{};
}

TEST(LayoutChoice, LatencyTakesTheLowestInterTokenLatencyAtOneClient) {
  const LayoutChoice c = choose_layout(Objective::Latency, 2, true, two_gpus());
  EXPECT_EQ(c.layout, "tp");
  EXPECT_EQ(c.tp, 2);
  EXPECT_EQ(c.stages, 1);
  EXPECT_EQ(c.replicas, 1);
  EXPECT_EQ(c.why, "1 stage at tp 2 measured 3.48 ms between tokens at 1 client, against 2 stages' 5.22 ms between "
                   "tokens and 2 replicas' 4.98 ms between tokens (2 x H200)");
}

TEST(LayoutChoice, ThroughputTakesTheMostTokensAtTheHighestLoad) {
  const LayoutChoice c = choose_layout(Objective::Throughput, 2, true, two_gpus());
  EXPECT_EQ(c.layout, "replicas");
  EXPECT_EQ(c.replicas, 2);
  EXPECT_EQ(c.stages, 1);
  EXPECT_EQ(c.tp, 1);
  EXPECT_NE(c.why.find("18,773 tokens/s at 256 clients"), std::string::npos) << c.why;
}

TEST(LayoutChoice, AModelTooLargeForOneGpuHasNoReplicas) {
  const LayoutChoice c = choose_layout(Objective::Throughput, 2, false, two_gpus());
  EXPECT_EQ(c.layout, "stages");
  EXPECT_EQ(c.stages, 2);
  EXPECT_NE(c.why.find("replicas are out"), std::string::npos) << c.why;
}

TEST(LayoutChoice, WithoutFiguresForThisGpuCountARuleSaidAsSuch) {
  const auto figures = two_gpus();
  for (const std::vector<LayoutFigure>& f : {std::vector<LayoutFigure>{}, figures}) {
    const LayoutChoice four = choose_layout(Objective::Throughput, 4, true, f);  // measured for 2 only
    EXPECT_EQ(four.layout, "replicas");
    EXPECT_EQ(four.replicas, 4);
    EXPECT_NE(four.why.find("the rule"), std::string::npos) << four.why;
    EXPECT_EQ(choose_layout(Objective::Throughput, 4, false, f).layout, "stages");
    EXPECT_EQ(choose_layout(Objective::Latency, 4, true, f).tp, 4);
  }
  // A layout measured at a load the others were not: no comparison, the rule.
  std::vector<LayoutFigure> uneven = {{"tp", 2, 64, 9000, 5.9, ""}, {"stages", 2, 256, 17887, 11.5, ""},
                                      {"replicas", 2, 256, 18773, 11.1, ""}};
  EXPECT_NE(choose_layout(Objective::Throughput, 2, true, uneven).why.find("the rule"), std::string::npos);
}

TEST(LayoutChoice, BadFiguresAndObjectivesAreNamed) {
  auto bad = parse_layout_figures("{\"layout\": \"tp\", \"gpus\": 2}\n", "f.jsonl");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().find("f.jsonl:1: needs layout, gpus, clients"), std::string::npos) << bad.error();
  bad = parse_layout_figures("\n{\"layout\": \"ring\", \"gpus\": 2, \"clients\": 1, \"tokens_per_s\": 1, \"itl_ms_p50\": 1}",
                             "f.jsonl");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().find("f.jsonl:2: layout 'ring'"), std::string::npos) << bad.error();
  bad = parse_layout_figures("not json", "f.jsonl");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().find("f.jsonl:1: not a JSON object"), std::string::npos) << bad.error();
  bad = parse_layout_figures("{\"layout\": \"tp\", \"gpus\": 0, \"clients\": 1, \"tokens_per_s\": 1, \"itl_ms_p50\": 1}", "f");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().find("at least 1"), std::string::npos) << bad.error();
  EXPECT_EQ(*parse_objective("latency"), Objective::Latency);
  EXPECT_EQ(*parse_objective("throughput"), Objective::Throughput);
  const auto wrong = parse_objective("speed");
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.error(), "the objective is latency or throughput, not 'speed'");
}

}  // namespace
}  // namespace conveyor
