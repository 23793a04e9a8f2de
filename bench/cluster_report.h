// conveyor-bench-cluster's reports: its statistics, the workers' load figures from
// /v1/cluster, and the step-trace summary (the per-stage and coordinator tables it prints
// from the traces a run leaves in CONVEYOR_TRACE_DIR, and the same figures as JSON).
// Header-only: one program includes it.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/http_client.h"

namespace conveyor::bench {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// The p-th percentile (0..100, nearest rank) of `v`; 0 when empty.
inline double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = size_t(std::clamp(std::ceil(p / 100.0 * double(v.size())) - 1, 0.0, double(v.size() - 1)));
  return v[i];
}

inline double mean_of(const std::vector<double>& v) {
  return v.empty() ? 0.0 : std::accumulate(v.begin(), v.end(), 0.0) / double(v.size());
}

// Reads every JSON line of `path` ("" lines and unparsable ones skipped: a file being written).
inline std::vector<json> read_json_lines(const std::filesystem::path& path) {
  std::vector<json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    json j = json::parse(line, nullptr, false);
    if (!j.is_discarded()) out.push_back(std::move(j));
  }
  return out;
}

// The step traces of one load's window [t0, t1] (steady-clock seconds) as a table: per stage
// and for the coordinator. Returns the figures as JSON too.
inline json print_trace_summary(const std::string& dir, double t0, double t1) {
  const double window_ms = (t1 - t0) * 1e3;
  json out = {{"stages", json::array()}};
  std::map<int, std::vector<json>> by_stage;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("worker-", 0) != 0) continue;
    for (json& j : read_json_lines(entry.path())) {
      const double t = j.value("t", 0.0);
      if (t >= t0 && t <= t1) by_stage[j.value("stage", -1)].push_back(std::move(j));
    }
  }
  std::printf("  step trace over %.1f s (per micro-batch means; %% of the window unless said):\n", window_ms * 1e-3);
  std::printf("  | stage | steps | seqs | decode rows | prefill rows | mixed steps %% | compute ms | busy %% | "
              "waiting for input %% | idle, input waiting: ms a step (%% of a step) | slot wait ms | send ms | sample ms |\n");
  std::printf("  |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const auto& [stage, lines] : by_stage) {
    double seqs = 0, dec = 0, pre = 0, comp = 0, wait = 0, idle = 0, slot = 0, send = 0, sample = 0, mixed = 0;
    for (const json& j : lines) {
      mixed += j.value("prefill_rows", 0) > 0;  // with prompt rows: a GPU runs it outside its decode graphs
      seqs += j.value("seqs", 0.0), dec += j.value("decode_rows", 0.0), pre += j.value("prefill_rows", 0.0);
      comp += j.value("compute", 0.0), wait += j.value("wait_input", 0.0), idle += j.value("idle_ready", 0.0);
      slot += j.value("slot_wait", 0.0), send += j.value("send", 0.0), sample += j.value("sample", 0.0);
    }
    const double n = double(lines.size());
    const double busy = 100 * comp / window_ms, idle_step = idle / n, idle_pct = 100 * idle / comp;
    std::printf("  | %d | %.0f | %.1f | %.1f | %.1f | %.0f%% | %.3f | %.0f%% | %.0f%% | %.3f (%.1f%%) | %.3f | %.3f | %.3f |\n",
                stage, n, seqs / n, dec / n, pre / n, 100 * mixed / n, comp / n, busy, 100 * wait / window_ms, idle_step, idle_pct, slot / n,
                send / n, sample / n);
    out["stages"].push_back({{"stage", stage}, {"steps", n}, {"seqs", seqs / n}, {"decode_rows", dec / n},
                             {"prefill_rows", pre / n}, {"mixed", mixed / n}, {"compute_ms", comp / n}, {"busy", busy / 100},
                             {"wait_input", wait / window_ms}, {"idle_ready_ms", idle_step},
                             {"idle_ready_of_step", idle_pct / 100}, {"slot_wait_ms", slot / n},
                             {"send_ms", send / n}, {"sample_ms", sample / n}});
  }
  std::vector<double> gaps, form, rtt, take, in_flight, running, queue, seqs, dec, pre, kv_reserved;
  json last_send;
  for (json& j : read_json_lines(std::filesystem::path(dir) / "coordinator.jsonl")) {
    const double t = j.value("t", 0.0);
    if (t < t0 || t > t1) continue;
    if (j.value("ev", std::string()) == "send") {
      if (j.contains("gap")) gaps.push_back(j["gap"].get<double>());
      form.push_back(j.value("form", 0.0)), in_flight.push_back(j.value("in_flight", 0.0));
      running.push_back(j.value("running", 0.0)), queue.push_back(j.value("queue", 0.0));
      seqs.push_back(j.value("seqs", 0.0)), dec.push_back(j.value("decode_rows", 0.0));
      pre.push_back(j.value("prefill_rows", 0.0)), kv_reserved.push_back(j.value("kv_reserved", 0.0));
      last_send = std::move(j);
    } else {
      rtt.push_back(j.value("rtt", 0.0)), take.push_back(j.value("deliver", 0.0));
    }
  }
  if (!seqs.empty()) {
    std::printf("  coordinator: %zu micro-batches (%.1f seqs: %.1f decode + %.1f prefill rows), in flight %.2f of %d; "
                "turn-around result -> next send: mean %.3f ms, p50 %.3f, p99 %.3f (forming and sending %.3f ms); "
                "round trip %.3f ms, text and updates of a result %.3f ms (after the next send); running %.1f (limit %lld), queue %.1f (last: %s); "
                "K/V reserved %.0f (mean) of %lld tokens; micro-batch limits %lld seqs, %lld rows, %lld prompt rows\n",
                seqs.size(), mean_of(seqs), mean_of(dec), mean_of(pre), mean_of(in_flight), last_send.value("depth", 0),
                mean_of(gaps), percentile(gaps, 50), percentile(gaps, 99), mean_of(form), mean_of(rtt), mean_of(take),
                mean_of(running), (long long)last_send.value("max_running", 0LL), mean_of(queue),
                last_send.value("queue_wait", std::string("?")).c_str(), mean_of(kv_reserved),
                (long long)last_send.value("kv_capacity", 0LL), (long long)last_send.value("max_sequences", 0LL),
                (long long)last_send.value("max_rows", 0LL), (long long)last_send.value("prefill_tokens", 0LL));
    out["coordinator"] = {{"batches", seqs.size()}, {"seqs", mean_of(seqs)}, {"in_flight", mean_of(in_flight)},
                          {"gap_ms_mean", mean_of(gaps)}, {"gap_ms_p50", percentile(gaps, 50)},
                          {"gap_ms_p99", percentile(gaps, 99)}, {"form_ms", mean_of(form)}, {"rtt_ms", mean_of(rtt)},
                          {"deliver_ms", mean_of(take)}, {"running", mean_of(running)}, {"queue", mean_of(queue)},
                          {"kv_reserved", mean_of(kv_reserved)}, {"kv_capacity", last_send.value("kv_capacity", 0LL)},
                          {"max_running", last_send.value("max_running", 0LL)}};
  }
  return out;
}

// GET /v1/cluster; an empty object (and a line on stderr) when it fails.
inline json cluster_info(int port) {
  HttpRequest r;
  r.target = "/v1/cluster";
  auto resp = http_call("127.0.0.1", port, r);
  if (!resp || resp->status != 200) {
    std::fprintf(stderr, "GET /v1/cluster: %s\n", resp ? ("HTTP " + std::to_string(resp->status)).c_str() : resp.error().c_str());
    return json::object();
  }
  return json::parse(resp->body);
}

// Each serving worker's weight load (checkpoint bytes read, converted and placed on its
// device), from /v1/cluster: load_bytes_total comes from the worker's load progress,
// load_seconds from its `ready`. Both are 0 for a worker that re-used layers it already held
// (load_seconds 0) or whose record the coordinator started afresh (it registered again,
// e.g. after missing heartbeats, and then kept its layers): then the figures of its real
// load are not known, and the bench says so instead of printing "0.0 MB in 0.00 s".
inline void print_loads(int port) {
  auto known = [](const json& w) {
    return w.value("state", std::string()) == "ready" && w.value("load_seconds", 0.0) > 0 &&
           w.value("load_bytes_total", 0.0) > 0;
  };
  // The pipelines are ready when this is called; give stragglers (a replica, a repair in
  // progress) a few seconds to report.
  json workers = json::array();
  for (const auto deadline = Clock::now() + std::chrono::seconds(5);;) {
    workers = json::array();
    for (const auto& w : cluster_info(port).value("workers", json::array()))
      if (w.contains("stage")) workers.push_back(w);
    const bool all = std::all_of(workers.begin(), workers.end(), known);
    if ((all && !workers.empty()) || Clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  for (const auto& w : workers) {
    const json dp = w.value("data_plane", json::object());
    const std::string name = w.value("name", std::string());
    const double secs = w.value("load_seconds", 0.0), bytes = w.value("load_bytes_total", 0.0);
    std::printf("load: %s stage %d, ", name.c_str(), w["stage"].get<int>());
    if (known(w))
      std::printf("%.1f MB in %.2f s = %.2f GB/s", bytes / 1e6, secs, bytes / secs / 1e9);
    else
      std::printf("not known (state %s, load_seconds %.2f, load_bytes_total %.0f: it re-used layers it already held, "
                  "or registered again and kept them)",
                  w.value("state", std::string("?")).c_str(), secs, bytes);
    std::printf("; activations staged in %s memory, UCX CUDA memory: %s\n", dp.value("staging", std::string("?")).c_str(),
                dp.value("ucx_cuda_memory", false) ? "yes" : "no");
  }
}

}  // namespace conveyor::bench
