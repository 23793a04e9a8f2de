// The request log's line (coordinator/request_log.h) in both formats, and log.format: json
// making every line the process logs through spdlog one JSON object.
#include <gtest/gtest.h>

#include <sstream>

#include <nlohmann/json.hpp>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include "coordinator/request_log.h"

namespace conveyor {
namespace {

using nlohmann::json;

RequestRecord record() {
  RequestRecord r;
  r.id = "cmpl-abc";
  r.outcome = RequestOutcome::Cancelled;
  r.error = "the client closed \"its\" connection";
  r.prompt_tokens = 12, r.completion_tokens = 4, r.cached_tokens = 8, r.choices = 2;
  r.ttft_ms = 21.44, r.total_ms = 96.06;
  r.pipeline = 1, r.stages = {"w0", "w1"}, r.replays = 1;
  return r;
}

TEST(RequestLog, TextLineHasEveryField) {
  EXPECT_EQ(request_log_text(record()),
            "id=cmpl-abc status=cancelled prompt_tokens=12 completion_tokens=4 cached_tokens=8 choices=2 ttft_ms=21.4 "
            "total_ms=96.1 pipeline=1 stages=w0,w1 replays=1 error=\"the client closed \\\"its\\\" connection\"");
  RequestRecord never = record();
  never.outcome = RequestOutcome::Ok, never.ttft_ms.reset(), never.pipeline = -1, never.stages.clear();
  EXPECT_EQ(request_log_text(never),
            "id=cmpl-abc status=ok prompt_tokens=12 completion_tokens=4 cached_tokens=8 choices=2 ttft_ms=- "
            "total_ms=96.1 pipeline=- stages=- replays=1");
}

TEST(RequestLog, JsonFormatMakesEveryLineAnObject) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("coordinator", sink));
  set_log_format(LogFormat::Json);
  spdlog::info("coordinator: a \"quoted\" message");
  log_request(record());
  RequestRecord ok = record();
  ok.outcome = RequestOutcome::Ok;
  log_request(ok);
  std::istringstream lines(out.str());
  std::vector<json> got;
  for (std::string line; std::getline(lines, line);) got.push_back(json::parse(line));
  ASSERT_EQ(got.size(), 3u) << out.str();
  EXPECT_EQ(got[0]["logger"], "coordinator");
  EXPECT_EQ(got[0]["level"], "info");
  EXPECT_EQ(got[0]["msg"], "coordinator: a \"quoted\" message");
  EXPECT_TRUE(got[0]["ts"].get<std::string>().ends_with("Z"));
  EXPECT_EQ(got[1]["logger"], "request");
  EXPECT_FALSE(got[1].contains("msg"));
  EXPECT_EQ(got[1]["id"], "cmpl-abc");
  EXPECT_EQ(got[1]["status"], "cancelled");
  EXPECT_EQ(got[1]["stages"], json::array({"w0", "w1"}));
  EXPECT_EQ(got[1]["ttft_ms"], 21.4);
  EXPECT_EQ(got[1]["error"], "the client closed \"its\" connection");
  EXPECT_EQ(got[2]["status"], "ok");
  EXPECT_FALSE(got[2].contains("error"));
}

}  // namespace
}  // namespace conveyor
