// One completion as a client sees it, whatever its shape (streamed or not, n choices, beams):
// its choices by index (text, token ids, finish reason), or the error the client met. A
// client may also go away mid-stream (a cancellation), and may send the same request again
// (same body, same seed) when its connection was lost, as a client does when the coordinator
// it talked to restarts. Used by the cluster tests and by conveyor-bench-soak.
#pragma once

#include <chrono>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli/http_client.h"

namespace conveyor::cluster_test {

struct Answer {
  nlohmann::json choices = nlohmann::json::array();  // [{index, text, token_ids, finish_reason}], by index
  std::string error;                                   // what the client met; "" when the answer is whole
  bool cancelled = false;                              // the client went away on purpose
  int events = 0;                                      // stream events with choices
  nlohmann::json usage;                                // a whole answer's, when not streamed
  bool ok() const { return error.empty() && !cancelled; }
};

struct CallOptions {
  std::function<void()> on_progress;  // each streamed event with tokens, and a whole answer
  int cancel_after_events = -1;       // >= 0: close the connection after that many stream events
  std::chrono::milliseconds timeout{120000};
};

namespace completion_detail {

// The choice of `index` in `choices` (made when absent, kept sorted by index).
inline nlohmann::json& choice_at(nlohmann::json& choices, int index) {
  while (int(choices.size()) <= index)
    choices.push_back({{"index", int(choices.size())}, {"text", ""}, {"token_ids", nlohmann::json::array()},
                       {"finish_reason", nullptr}});
  return choices[size_t(index)];
}

// Adds one streamed chunk's choices to `out`; false (with out.error) when it is an error.
inline bool add_chunk(const nlohmann::json& chunk, Answer& out) {
  if (chunk.contains("error")) {
    out.error = "the stream ended with an error: " + chunk["error"].dump();
    return false;
  }
  for (const auto& ch : chunk.value("choices", nlohmann::json::array())) {
    nlohmann::json& c = choice_at(out.choices, ch.value("index", 0));
    c["text"] = c["text"].get<std::string>() + ch.value("text", std::string());
    for (const auto& t : ch.value("token_ids", nlohmann::json::array())) c["token_ids"].push_back(t);
    if (ch.contains("finish_reason") && !ch["finish_reason"].is_null()) c["finish_reason"] = ch["finish_reason"];
  }
  return true;
}

}  // namespace completion_detail

// POST /v1/completions with `body` (the caller sets return_token_ids to compare token ids).
inline Answer call_completion(const std::string& host, int port, const nlohmann::json& body, const CallOptions& opt = {}) {
  using nlohmann::json;
  Answer out;
  HttpRequest r;
  r.method = "POST";
  r.target = "/v1/completions";
  r.body = body.dump();
  r.timeout = opt.timeout;
  const bool stream = body.value("stream", false);
  bool done = false;
  SseParser sse([&](std::string_view data) {
    if (data == "[DONE]") {
      done = true;
      return;
    }
    const json chunk = json::parse(data, nullptr, false);
    if (chunk.is_discarded()) {
      out.error = "a stream event is not JSON: " + std::string(data.substr(0, 200));
      return;
    }
    if (!completion_detail::add_chunk(chunk, out)) return;
    if (opt.on_progress) opt.on_progress();
    if (!chunk.value("choices", json::array()).empty()) ++out.events;
    if (opt.cancel_after_events >= 0 && out.events >= opt.cancel_after_events) {
      out.cancelled = true;
      throw std::runtime_error("the client goes away");  // http_call closes the connection
    }
  });
  if (stream) r.on_body = [&](std::string_view b) { sse.feed(b); };
  auto resp = http_call(host, port, r);
  if (out.cancelled) return out;
  if (!resp) return out.error = resp.error(), out;
  if (resp->status != 200) return out.error = "HTTP " + std::to_string(resp->status) + " " + resp->body.substr(0, 300), out;
  if (stream) {
    if (out.error.empty() && !done) out.error = "the stream ended without [DONE]";
    return out;
  }
  const json j = json::parse(resp->body, nullptr, false);
  if (j.is_discarded() || !j.contains("choices")) return out.error = "not an answer: " + resp->body.substr(0, 300), out;
  for (const auto& ch : j["choices"]) {
    json& c = completion_detail::choice_at(out.choices, ch.value("index", 0));
    c["text"] = ch.value("text", std::string());
    c["token_ids"] = ch.value("token_ids", json::array());
    c["finish_reason"] = ch.value("finish_reason", json());
  }
  out.usage = j.value("usage", json());
  if (opt.on_progress) opt.on_progress();
  return out;
}

// Sends `body` until its answer is whole: after an error, again (the same body: the same
// seed) while `may_retry(error)` says so, waiting `pause` between tries. `tries` counts them.
inline Answer call_with_retry(const std::string& host, int port, const nlohmann::json& body, const CallOptions& opt,
                              const std::function<bool(const std::string&)>& may_retry, int& tries,
                              std::chrono::milliseconds pause = std::chrono::milliseconds(200)) {
  for (tries = 1;; ++tries) {
    Answer a = call_completion(host, port, body, opt);
    if (a.ok() || a.cancelled || !may_retry(a.error)) return a;
    std::this_thread::sleep_for(pause);
  }
}

}  // namespace conveyor::cluster_test
