#include "coordinator/metrics.h"

#include <cmath>
#include <cstring>
#include <map>
#include <regex>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

namespace conveyor {
namespace {

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// The value of the sample line that starts with `series` + " ".
double value_of(const std::string& text, const std::string& series) {
  for (const std::string& l : lines_of(text))
    if (l.starts_with(series + " ")) return std::stod(l.substr(series.size() + 1));
  ADD_FAILURE() << "no sample " << series;
  return NAN;
}

bool has_line(const std::string& text, const std::string& line) {
  for (const std::string& l : lines_of(text))
    if (l == line) return true;
  return false;
}

// Checks the text exposition format 0.0.4 as Prometheus parses it: every sample belongs to
// a family announced by HELP then TYPE before its first sample, names and label syntax are
// valid, values parse, histogram buckets are cumulative and end with +Inf == _count.
void expect_valid_exposition(const std::string& text) {
  ASSERT_FALSE(text.empty());
  ASSERT_EQ(text.back(), '\n');
  const std::regex help(R"(# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) .+)");
  const std::regex type(R"(# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram|summary|untyped))");
  const std::regex sample(
      R"(([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\\n]|\\["\\n])*")(,[a-zA-Z_][a-zA-Z0-9_]*="([^"\\\n]|\\["\\n])*")*\})? (\S+))");
  std::map<std::string, std::string> types;
  std::string last_help;
  std::map<std::string, double> last_bucket;  // histogram family -> last cumulative bucket
  std::map<std::string, double> inf_bucket;
  for (const std::string& l : lines_of(text)) {
    std::smatch m;
    if (std::regex_match(l, m, help)) {
      last_help = m[1];
      EXPECT_FALSE(types.count(last_help)) << "family announced twice: " << l;
      continue;
    }
    if (std::regex_match(l, m, type)) {
      EXPECT_EQ(m[1], last_help) << "TYPE without HELP just before it: " << l;
      types[m[1]] = m[2];
      continue;
    }
    ASSERT_TRUE(std::regex_match(l, m, sample)) << "not a valid sample line: '" << l << "'";
    std::string name = m[1];
    const std::string value = m[m.size() - 1];
    double v = 0;
    if (value == "+Inf") v = INFINITY;
    else if (value == "-Inf") v = -INFINITY;
    else if (value != "NaN") {
      size_t used = 0;
      v = std::stod(value, &used);
      EXPECT_EQ(used, value.size()) << l;
    }
    std::string family = name;
    for (const char* suffix : {"_bucket", "_sum", "_count"})
      if (name.ends_with(suffix) && types.count(name.substr(0, name.size() - std::strlen(suffix))) &&
          types[name.substr(0, name.size() - std::strlen(suffix))] == "histogram")
        family = name.substr(0, name.size() - std::strlen(suffix));
    ASSERT_TRUE(types.count(family)) << "sample before its TYPE line: " << l;
    if (types[family] == "counter") {
      EXPECT_TRUE(name.ends_with("_total")) << l;
    }
    if (name.ends_with("_bucket")) {
      EXPECT_GE(v, last_bucket[family]) << "buckets must be cumulative: " << l;
      last_bucket[family] = v;
      if (l.find("le=\"+Inf\"") != std::string::npos) inf_bucket[family] = v;
    }
    if (name.ends_with("_count") && types[family] == "histogram") {
      ASSERT_TRUE(inf_bucket.count(family)) << "no +Inf bucket before " << l;
      EXPECT_EQ(inf_bucket[family], v) << "+Inf bucket must equal _count: " << l;
    }
  }
}

TEST(Metrics, EmptyRegistryIsValidAndAnnouncesEveryFamily) {
  Metrics m;
  const std::string text = m.render();
  expect_valid_exposition(text);
  for (const char* family :
       {"conveyor_requests_total", "conveyor_prompt_tokens_total", "conveyor_generated_tokens_total",
        "conveyor_time_to_first_token_seconds", "conveyor_inter_token_latency_seconds", "conveyor_queue_depth",
        "conveyor_running_sequences", "conveyor_stage_busy_fraction", "conveyor_kv_cache_used_tokens",
        "conveyor_kv_cache_capacity_tokens"})
    EXPECT_NE(text.find(std::string("# TYPE ") + family + " "), std::string::npos) << family;
  EXPECT_TRUE(has_line(text, "# TYPE conveyor_time_to_first_token_seconds histogram"));
  EXPECT_TRUE(has_line(text, "conveyor_time_to_first_token_seconds_bucket{le=\"+Inf\"} 0"));
  EXPECT_TRUE(has_line(text, "conveyor_time_to_first_token_seconds_sum 0"));
  EXPECT_TRUE(has_line(text, "conveyor_time_to_first_token_seconds_count 0"));
  EXPECT_TRUE(has_line(text, "conveyor_queue_depth 0"));
}

TEST(Metrics, RequestCountersByCode) {
  Metrics m;
  m.count_request(200);
  m.count_request(200);
  m.count_request(429);
  const std::string text = m.render();
  expect_valid_exposition(text);
  EXPECT_TRUE(has_line(text, "# TYPE conveyor_requests_total counter"));
  EXPECT_TRUE(has_line(text, "conveyor_requests_total{code=\"200\"} 2"));
  EXPECT_TRUE(has_line(text, "conveyor_requests_total{code=\"429\"} 1"));
  EXPECT_EQ(m.requests_with_code(200), 2u);
  EXPECT_EQ(m.requests_with_code(500), 0u);
}

// conveyor_requests_total counts what clients asked of the API: probes and scrapes are not
// requests (a /health answered 503 while the cluster loads is not a refused client).
TEST(Metrics, ProbesAndScrapesAreNotRequests) {
  Metrics m;
  m.count_request("/health", 503);
  m.count_request("/health?verbose=1", 503);
  m.count_request("/metrics", 200);
  m.count_request("/v1/completions", 503);
  m.count_request("/v1/models", 200);
  m.count_request("", 400);  // malformed: no target was read, still a client's request
  EXPECT_EQ(m.requests_with_code(503), 1u);
  EXPECT_EQ(m.requests_with_code(200), 1u);
  EXPECT_EQ(m.requests_with_code(400), 1u);
  EXPECT_FALSE(Metrics::counts_as_request("/health"));
  EXPECT_TRUE(Metrics::counts_as_request("/healthz"));
  EXPECT_FALSE(Metrics::counts_as_request("/"));
  const std::string text = m.render();
  expect_valid_exposition(text);
  EXPECT_TRUE(has_line(text, "conveyor_requests_total{code=\"503\"} 1"));
}

TEST(Metrics, HistogramBucketsAreCumulativeWithLessOrEqualBounds) {
  Metrics m;
  m.observe_time_to_first_token(0.003);
  m.observe_time_to_first_token(0.005);  // exactly on a bound: counted in that bucket
  m.observe_time_to_first_token(0.3);
  m.observe_time_to_first_token(1000);   // past every bound: only +Inf
  const std::string text = m.render();
  expect_valid_exposition(text);
  EXPECT_TRUE(has_line(text, "conveyor_time_to_first_token_seconds_bucket{le=\"0.005\"} 2"));
  EXPECT_TRUE(has_line(text, "conveyor_time_to_first_token_seconds_bucket{le=\"0.01\"} 2"));
  EXPECT_TRUE(has_line(text, "conveyor_time_to_first_token_seconds_bucket{le=\"0.25\"} 2"));
  EXPECT_TRUE(has_line(text, "conveyor_time_to_first_token_seconds_bucket{le=\"0.5\"} 3"));
  EXPECT_TRUE(has_line(text, "conveyor_time_to_first_token_seconds_bucket{le=\"60\"} 3"));
  EXPECT_TRUE(has_line(text, "conveyor_time_to_first_token_seconds_bucket{le=\"+Inf\"} 4"));
  EXPECT_TRUE(has_line(text, "conveyor_time_to_first_token_seconds_count 4"));
  EXPECT_DOUBLE_EQ(value_of(text, "conveyor_time_to_first_token_seconds_sum"), 1000.308);
}

TEST(Metrics, InterTokenLatencyCountsEveryToken) {
  Metrics m;
  m.observe_inter_token_latency(0.02, 3);  // three tokens 20 ms apart each
  EXPECT_EQ(m.inter_token_latency_count(), 3u);
  const std::string text = m.render();
  expect_valid_exposition(text);
  EXPECT_TRUE(has_line(text, "conveyor_inter_token_latency_seconds_bucket{le=\"0.01\"} 0"));
  EXPECT_TRUE(has_line(text, "conveyor_inter_token_latency_seconds_bucket{le=\"0.02\"} 3"));
  EXPECT_TRUE(has_line(text, "conveyor_inter_token_latency_seconds_count 3"));
  EXPECT_DOUBLE_EQ(value_of(text, "conveyor_inter_token_latency_seconds_sum"), 0.06);
}

TEST(Metrics, TokenCountersAndGauges) {
  Metrics m;
  m.add_prompt_tokens(10);
  m.add_prompt_tokens(5);
  m.add_generated_tokens(7);
  m.set_queue_depth(3);
  m.set_running_sequences(12);
  m.set_stage_busy_fraction(0, 1, "node-a", 0.75);
  m.set_kv_cache_tokens(0, 1, 1024, 65536);
  const std::string text = m.render();
  expect_valid_exposition(text);
  EXPECT_TRUE(has_line(text, "conveyor_prompt_tokens_total 15"));
  EXPECT_TRUE(has_line(text, "conveyor_generated_tokens_total 7"));
  EXPECT_TRUE(has_line(text, "conveyor_queue_depth 3"));
  EXPECT_TRUE(has_line(text, "conveyor_running_sequences 12"));
  EXPECT_TRUE(has_line(text, "conveyor_stage_busy_fraction{pipeline=\"0\",stage=\"1\",worker=\"node-a\"} 0.75"));
  EXPECT_TRUE(has_line(text, "conveyor_kv_cache_used_tokens{pipeline=\"0\",stage=\"1\"} 1024"));
  EXPECT_TRUE(has_line(text, "conveyor_kv_cache_capacity_tokens{pipeline=\"0\",stage=\"1\"} 65536"));
}

// Replays after a micro-batch was taken for lost (scheduler.batch_timeout_ms, issue 28): a
// counter present at 0 from the start, so that any rise shows.
TEST(Metrics, BatchTimeoutReplaysAreCounted) {
  Metrics m;
  EXPECT_TRUE(has_line(m.render(), "# TYPE conveyor_batch_timeout_replays_total counter"));
  EXPECT_TRUE(has_line(m.render(), "conveyor_batch_timeout_replays_total 0"));
  m.count_batch_timeout_replay();
  m.count_batch_timeout_replay();
  const std::string text = m.render();
  expect_valid_exposition(text);
  EXPECT_TRUE(has_line(text, "conveyor_batch_timeout_replays_total 2"));
  EXPECT_EQ(m.batch_timeout_replays(), 2u);
}

TEST(Metrics, StageMovingToAnotherWorkerReplacesItsSeriesAndClearDropsAll) {
  Metrics m;
  m.set_stage_busy_fraction(0, 0, "a", 0.5);
  m.set_stage_busy_fraction(0, 0, "b", 0.25);
  m.set_stage_busy_fraction(1, 0, "a", 0.1);
  std::string text = m.render();
  EXPECT_FALSE(has_line(text, "conveyor_stage_busy_fraction{pipeline=\"0\",stage=\"0\",worker=\"a\"} 0.5"));
  EXPECT_TRUE(has_line(text, "conveyor_stage_busy_fraction{pipeline=\"0\",stage=\"0\",worker=\"b\"} 0.25"));
  EXPECT_TRUE(has_line(text, "conveyor_stage_busy_fraction{pipeline=\"1\",stage=\"0\",worker=\"a\"} 0.1"));
  m.set_kv_cache_tokens(0, 0, 1, 2);
  m.clear_stage_gauges();
  text = m.render();
  expect_valid_exposition(text);
  EXPECT_EQ(text.find("conveyor_stage_busy_fraction{"), std::string::npos);
  EXPECT_EQ(text.find("conveyor_kv_cache_used_tokens{"), std::string::npos);
}

TEST(Metrics, LabelValuesAreEscaped) {
  Metrics m;
  m.set_stage_busy_fraction(0, 0, "we\"ird\\name\nx", 1);
  const std::string text = m.render();
  expect_valid_exposition(text);
  EXPECT_TRUE(has_line(text, R"(conveyor_stage_busy_fraction{pipeline="0",stage="0",worker="we\"ird\\name\nx"} 1)"));
}

TEST(Metrics, NumbersInPrometheusSyntax) {
  EXPECT_EQ(prometheus_number(0.005), "0.005");
  EXPECT_EQ(prometheus_number(1), "1");
  EXPECT_EQ(prometheus_number(-2.5), "-2.5");
  EXPECT_EQ(prometheus_number(INFINITY), "+Inf");
  EXPECT_EQ(prometheus_number(-INFINITY), "-Inf");
  EXPECT_EQ(prometheus_number(NAN), "NaN");
  EXPECT_EQ(std::stod(prometheus_number(0.1 + 0.2)), 0.1 + 0.2);  // round-trips
}

TEST(Metrics, ConcurrentRecordingLosesNothing) {
  Metrics m;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 2000; ++i) {
        m.count_request(200);
        m.observe_inter_token_latency(0.01);
        m.add_generated_tokens(1);
        if (i % 100 == 0) (void)m.render();
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(m.requests_with_code(200), 8000u);
  EXPECT_EQ(m.inter_token_latency_count(), 8000u);
  const std::string text = m.render();
  expect_valid_exposition(text);
  EXPECT_TRUE(has_line(text, "conveyor_generated_tokens_total 8000"));
}

}  // namespace
}  // namespace conveyor
