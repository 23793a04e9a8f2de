#include "coordinator/request_log.h"

#include <atomic>
#include <cstdio>
#include <ctime>
#include <mutex>

#include <spdlog/formatter.h>
#include <spdlog/spdlog.h>

namespace conveyor {

using nlohmann::json;

const char* outcome_name(RequestOutcome outcome) {
  switch (outcome) {
    case RequestOutcome::Ok: return "ok";
    case RequestOutcome::Cancelled: return "cancelled";
    case RequestOutcome::Timeout: return "timeout";
    case RequestOutcome::Unavailable: return "unavailable";
    case RequestOutcome::QueueFull: return "queue_full";
    case RequestOutcome::Invalid: return "invalid";
    case RequestOutcome::Failed: return "failed";
  }
  return "?";
}

RequestOutcome outcome_of(CoreError e) {
  switch (e) {
    case CoreError::Timeout: return RequestOutcome::Timeout;
    case CoreError::QueueFull: return RequestOutcome::QueueFull;
    case CoreError::Invalid: return RequestOutcome::Invalid;
    default: return RequestOutcome::Unavailable;
  }
}

RequestRecord request_record(const CompletionRequest& r, RequestOutcome outcome, std::string error) {
  RequestRecord rec;
  rec.id = r.id;
  rec.outcome = outcome;
  rec.error = std::move(error);
  for (const auto& p : r.prompts) rec.prompt_tokens += int64_t(p.size());
  rec.choices = r.num_choices();
  rec.total_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - r.arrival).count();
  return rec;
}

namespace {

constexpr const char* kRequestLogger = "request";
std::atomic<LogFormat> g_format{LogFormat::Text};

// Milliseconds with a tenth.
double tenths(double ms) { return double(int64_t(ms * 10 + 0.5)) / 10; }

std::string stages_text(const std::vector<std::string>& stages) {
  std::string out;
  for (const std::string& s : stages) out += (out.empty() ? "" : ",") + (s.empty() ? std::string("-") : s);
  return out.empty() ? "-" : out;
}

// One JSON object a line: {"ts", "level", "logger", "msg"}; the request logger's message is
// a JSON object already (log_request), whose fields follow "logger" instead of "msg".
class JsonLineFormatter final : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    const auto since_epoch = msg.time.time_since_epoch();
    const std::time_t secs = std::chrono::duration_cast<std::chrono::seconds>(since_epoch).count();
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(since_epoch).count() % 1000;
    std::tm utc{};
    gmtime_r(&secs, &utc);
    char ts[64];
    std::snprintf(ts, sizeof ts, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", utc.tm_year + 1900, utc.tm_mon + 1,
                  utc.tm_mday, utc.tm_hour, utc.tm_min, utc.tm_sec, int(ms));
    const std::string_view level(spdlog::level::to_string_view(msg.level).data(),
                                 spdlog::level::to_string_view(msg.level).size());
    const std::string_view logger(msg.logger_name.data(), msg.logger_name.size());
    const std::string_view payload(msg.payload.data(), msg.payload.size());
    auto dump = [](std::string_view s) { return json(s).dump(-1, ' ', false, json::error_handler_t::replace); };
    std::string line = "{\"ts\":\"" + std::string(ts) + "\",\"level\":" + dump(level) + ",\"logger\":" + dump(logger);
    if (logger == kRequestLogger && payload.size() > 2 && payload.front() == '{')
      line += "," + std::string(payload.substr(1));  // the record's fields, and its closing brace
    else
      line += ",\"msg\":" + dump(payload) + "}";
    line += "\n";
    dest.append(line.data(), line.data() + line.size());
  }
  std::unique_ptr<spdlog::formatter> clone() const override { return std::make_unique<JsonLineFormatter>(); }
};

// The request logger: the default logger's sinks (so its formatter), its level.
std::shared_ptr<spdlog::logger> request_logger() {
  static std::mutex mu;
  std::lock_guard lk(mu);
  if (auto l = spdlog::get(kRequestLogger)) return l;
  const auto& base = spdlog::default_logger();
  auto l = std::make_shared<spdlog::logger>(kRequestLogger, base->sinks().begin(), base->sinks().end());
  l->set_level(base->level());
  spdlog::register_logger(l);
  return l;
}

}  // namespace

json request_log_json(const RequestRecord& r) {
  json j = {{"id", r.id},
            {"status", outcome_name(r.outcome)},
            {"prompt_tokens", r.prompt_tokens},
            {"completion_tokens", r.completion_tokens},
            {"cached_tokens", r.cached_tokens},
            {"choices", r.choices},
            {"ttft_ms", r.ttft_ms ? json(tenths(*r.ttft_ms)) : json(nullptr)},
            {"total_ms", tenths(r.total_ms)},
            {"pipeline", r.pipeline >= 0 ? json(r.pipeline) : json(nullptr)},
            {"stages", r.stages},
            {"replays", r.replays}};
  if (r.outcome != RequestOutcome::Ok) j["error"] = r.error;
  return j;
}

std::string request_log_text(const RequestRecord& r) {
  char ttft[32] = "-";
  if (r.ttft_ms) std::snprintf(ttft, sizeof ttft, "%.1f", tenths(*r.ttft_ms));
  char total[32];
  std::snprintf(total, sizeof total, "%.1f", tenths(r.total_ms));
  std::string out = "id=" + r.id + " status=" + outcome_name(r.outcome) +
                    " prompt_tokens=" + std::to_string(r.prompt_tokens) +
                    " completion_tokens=" + std::to_string(r.completion_tokens) +
                    " cached_tokens=" + std::to_string(r.cached_tokens) + " choices=" + std::to_string(r.choices) +
                    " ttft_ms=" + ttft + " total_ms=" + total +
                    " pipeline=" + (r.pipeline >= 0 ? std::to_string(r.pipeline) : "-") +
                    " stages=" + stages_text(r.stages) + " replays=" + std::to_string(r.replays);
  if (r.outcome != RequestOutcome::Ok) out += " error=" + json(r.error).dump(-1, ' ', false, json::error_handler_t::replace);
  return out;
}

void set_log_format(LogFormat format) {
  g_format = format;
  if (format == LogFormat::Json) spdlog::default_logger()->set_formatter(std::make_unique<JsonLineFormatter>());
}

void log_request(const RequestRecord& record) {
  const auto logger = request_logger();
  if (!logger->should_log(spdlog::level::info)) return;
  if (g_format == LogFormat::Json)
    logger->info("{}", request_log_json(record).dump(-1, ' ', false, json::error_handler_t::replace));
  else
    logger->info("{}", request_log_text(record));
}

void log_refused(const CompletionRequest& request, const CoreStatus& why) {
  log_request(request_record(request, outcome_of(why.error), why.message));
}

}  // namespace conveyor
