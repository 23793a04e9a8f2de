// conveyor-bench-soak: a soak of faults. A CPU cluster of real processes on loopback (a
// coordinator, --stages x --replicas serving workers and --spares spare workers, the demo
// model models/brown-gpt2) serves a mixed load from --clients threads for --duration seconds
// while faults strike one at a time, chosen at random (bench/soak_faults.h: SIGKILL and
// SIGSTOP/SIGCONT of workers, drains, re-plans, coordinator restarts; on network namespaces
// link cuts and partitions, on loopback data-plane connection resets). Where root can make
// network namespaces (--netns auto, the default) every process runs on a node of its own
// (tests/netns/netns_cluster.h). Every seed is printed: `--seed S` repeats a run's choices.
//
// The load draws from a pool of --pool requests (seeded): greedy and seeded sampling,
// n = 3, beam search, prompts sharing a long prefix (prefix reuse), token-id prompts with stop
// strings, streamed and not; one in ten is a stream its client leaves after a few events (a
// cancellation). Each pool request's reference answer comes from a fault-free pass over the
// whole pool on the same cluster before the first fault. Every answer the load gets is
// compared with it, token ids, text and finish reason of every choice.
//
// A client whose connection is lost because the coordinator restarted sends the same request
// again (the same seed) until it is answered; any other client-visible error is a lost
// request. The report: requests, completed, lost, altered, cancelled, client-visible errors
// (those retried after a coordinator restart apart), batch-timeout replays (/metrics), epoch
// changes of the pipelines (replays, failovers, re-plans; from /v1/cluster), the longest
// pause a stream saw (between its events, from its send to its first, across its retries),
// the longest stall (requests in flight and no client receiving anything), each also with
// the coordinator restarts left out, and the faults applied by kind. Exit status 1 on any
// lost or altered answer, when a worker ended that no fault ended (a crash: noted with its
// log's last word, and replaced so the soak goes on), or when the cluster did not come back
// to its plan after a fault; 2 when the fault-free pass failed.
//
//   conveyor-bench-soak --duration 120 --seed 1 --netns off   (what CI runs: ctest -L soak)
//   conveyor-bench-soak --duration 1800 --seed 7
//   conveyor-bench-soak --duration 60 --no-faults   (the load alone)
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <utility>

#include <CLI/CLI.hpp>

#include "bench/soak_faults.h"
#include "tests/cluster/completion_client.h"

using namespace conveyor;
using namespace conveyor::soak;
using cluster_test::Answer;
using cluster_test::CallOptions;

namespace {

struct SoakOptions {
  double duration_s = 120;
  uint64_t seed = 0;
  int clients = 6, pool = 48, stages = 3, replicas = 2, spares = 2;
  double fault_gap_s = 5;  // mean time between faults (uniform in [0.5, 1.5] of it)
  bool no_faults = false;
  std::string keep_logs;  // copy the cluster's logs here (always kept on a failure)
  std::string netns = "auto";  // on | off | auto: network namespaces where the machine can
};

struct PoolItem {
  json body;
  std::string kind;
  Answer reference;
};

// A prefix the "prefix" requests share (several prefill chunks long).
std::string shared_prefix() {
  std::string p;
  for (const char* s : cluster_test::kSentences) p += std::string(s) + " ";
  return p + p;
}

// The pool of requests, drawn from `seed`: kind i % 8.
std::vector<PoolItem> make_pool(int n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const auto& sentences = cluster_test::kSentences;
  std::vector<PoolItem> pool;
  for (int i = 0; i < n; ++i) {
    json b = {{"prompt", sentences[rng() % std::size(sentences)]}, {"max_tokens", 8 + int(rng() % 25)},
              {"return_token_ids", true}, {"seed", seed % 1000000 * 1000 + uint64_t(i)}, {"temperature", 0.9},
              {"stream", (i / 8) % 2 == 1}};
    std::string kind;
    switch (i % 8) {
      case 0: kind = "greedy", b["temperature"] = 0, b["stream"] = true; break;
      case 1: kind = "sampled", b["top_k"] = 40; break;
      case 2: kind = "sampled", b["top_p"] = 0.95, b["stream"] = true; break;
      case 3: kind = "n=3", b["n"] = 3, b["temperature"] = 1.0; break;
      case 4:
        kind = "beam", b["use_beam_search"] = true, b["best_of"] = 3, b["n"] = 2, b["temperature"] = 0;
        break;
      case 5: kind = "prefix", b["prompt"] = shared_prefix() + b["prompt"].get<std::string>(); break;
      case 6:
        kind = "prefix", b["prompt"] = shared_prefix() + b["prompt"].get<std::string>(), b["temperature"] = 0,
        b["stream"] = true;
        break;
      default: {
        kind = "token ids + stop";
        std::vector<int32_t> ids(1 + rng() % 150);
        for (auto& t : ids) t = int32_t(1 + rng() % 4095);
        b["prompt"] = ids, b["stop"] = {" the", "."};
      }
    }
    pool.push_back({b, kind, {}});
  }
  return pool;
}

// What the clients saw.
struct Tally {
  std::atomic<int> requests{0}, completed{0}, lost{0}, altered{0}, cancelled{0}, retried{0};
  std::atomic<int> errors_restart{0}, errors_other{0};
  std::atomic<int> in_flight{0};
  std::atomic<int64_t> last_progress_ns{0};
  std::mutex mu;
  std::vector<std::string> notes;  // each lost or altered answer
  // [from, to] in seconds since t0, over 0.1 s: times no client received anything (stalls),
  // and gaps one stream saw between its events (from its send to its first, retries included).
  std::vector<std::pair<double, double>> stalls, stream_gaps;
  void note(std::string s) {
    std::lock_guard lk(mu);
    std::fprintf(stderr, "soak: %s\n", s.c_str());
    notes.push_back(std::move(s));
  }
};

int64_t now_ns() { return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count(); }

// Notes the gap from `before` to `now` (steady-clock ns) in `gaps` when it is over 0.1 s.
void note_gap(Tally& t, const SoakState& s, std::vector<std::pair<double, double>>& gaps, int64_t before, int64_t now) {
  if (now - before <= 100'000'000) return;
  const double t0 = double(std::chrono::duration_cast<std::chrono::nanoseconds>(s.t0.time_since_epoch()).count());
  std::lock_guard lk(t.mu);
  gaps.emplace_back((double(before) - t0) * 1e-9, (double(now) - t0) * 1e-9);
}

// A client received something: the stall since the last progress of any client ends, and
// the gap since this stream's last event (`last`, ns).
void progress(Tally& t, const SoakState& s, int64_t* last) {
  const int64_t now = now_ns();
  note_gap(t, s, t.stalls, t.last_progress_ns.exchange(now), now);
  if (last) note_gap(t, s, t.stream_gaps, std::exchange(*last, now), now);
}

// One request of the load, sent again after a coordinator restart took its connection.
void one_request(Cluster& c, SoakState& s, Tally& t, const PoolItem& item, int cancel_after) {
  CallOptions opt;
  int64_t last_event = now_ns();
  const bool stream = item.body["stream"] == true;
  opt.on_progress = [&] { progress(t, s, stream ? &last_event : nullptr); };
  opt.cancel_after_events = cancel_after;
  int generation = s.restart_generation;
  auto may_retry = [&](const std::string& error) {
    // Only a coordinator restart during this try (or one going on) excuses an error.
    const bool restart = s.coordinator_down || s.restart_generation != generation;
    (restart ? t.errors_restart : t.errors_other)++;
    if (!restart) t.note("error outside a coordinator restart: " + error + " for " + item.body.dump().substr(0, 200));
    generation = s.restart_generation;
    return restart;
  };
  ++t.requests;
  ++t.in_flight;
  int tries = 0;
  const Answer a = cluster_test::call_with_retry(c.http_host, c.http_port, item.body, opt, may_retry, tries);
  --t.in_flight;
  if (tries > 1) ++t.retried;
  if (a.cancelled) {
    ++t.cancelled;
  } else if (!a.ok()) {
    ++t.lost;
  } else if (a.choices != item.reference.choices) {
    ++t.altered;
    t.note("altered answer (" + item.kind + ") for " + item.body.dump() + "\n  got  " + a.choices.dump() +
           "\n  want " + item.reference.choices.dump());
  } else {
    ++t.completed;
  }
}

// A client thread: requests from the pool at random, one in ten a stream it leaves early.
void client(Cluster& c, SoakState& s, Tally& t, const std::vector<PoolItem>& pool, uint64_t seed) {
  std::mt19937_64 rng(seed);
  while (!s.stop) {
    const PoolItem& item = pool[rng() % pool.size()];
    const bool cancel = rng() % 10 == 0 && item.body["stream"] == true && item.kind != "beam";
    one_request(c, s, t, item, cancel ? 1 + int(rng() % 3) : -1);
  }
}

// The fault-free pass: every pool request once, from `clients` threads; false when one fails.
bool reference_pass(Cluster& c, std::vector<PoolItem>& pool, int clients) {
  std::atomic<size_t> next{0};
  std::atomic<bool> ok{true};
  std::vector<std::thread> threads;
  for (int k = 0; k < clients; ++k)
    threads.emplace_back([&] {
      for (size_t i; (i = next++) < pool.size();) {
        pool[i].reference = cluster_test::call_completion(c.http_host, c.http_port, pool[i].body);
        if (!pool[i].reference.ok()) {
          std::fprintf(stderr, "soak: the fault-free pass failed on %s: %s\n", pool[i].body.dump().c_str(),
                       pool[i].reference.error.c_str());
          ok = false;
        }
      }
    });
  for (auto& th : threads) th.join();
  return ok;
}

// The epochs of the pipelines, polled: each increase is a replay, a failover or a re-plan.
struct EpochWatch {
  std::map<int, int64_t> last;
  int64_t changes = 0;
  void poll(const json& info) {
    if (!info.is_object()) return;
    for (size_t p = 0; p < info["pipelines"].size(); ++p) {
      const int64_t e = info["pipelines"][p].value("epoch", int64_t(0));
      auto it = last.find(int(p));
      if (it != last.end() && e > it->second) changes += e - it->second;
      last[int(p)] = e;  // lower: a restarted coordinator counts from 1 again
    }
  }
};

// The faults, one after another, until the time is up.
void fault_loop(SoakState& s, FaultInjector& faults, const SoakOptions& o, const Clock::time_point end) {
  std::mt19937_64 rng(o.seed * 31 + 7);
  while (Clock::now() < end) {
    const double gap = o.fault_gap_s * (0.5 + double(rng() % 1000) / 1000.0);
    std::this_thread::sleep_for(std::chrono::milliseconds(int64_t(gap * 1000)));
    if (Clock::now() >= end) break;
    const std::string what = faults.strike();
    std::printf("soak: %7.1f s  %s\n", s.now(), what.c_str());
    std::fflush(stdout);
  }
}

// The longest of `gaps`, and the longest with no coordinator restart in it (or 5 s before it).
std::pair<double, double> longest(const std::vector<std::pair<double, double>>& gaps, SoakState& s) {
  double all = 0, no_restart = 0;
  std::lock_guard lk(s.mu);
  for (const auto& [from, to] : gaps) {
    all = std::max(all, to - from);
    const bool restart = std::any_of(s.faults.begin(), s.faults.end(), [&](const auto& f) {
      return f.second == "restart" && f.first >= from - 5 && f.first <= to;
    });
    if (!restart) no_restart = std::max(no_restart, to - from);
  }
  return {all, no_restart};
}

int report(Tally& t, SoakState& s, FaultInjector& faults, const EpochWatch& epochs, const SoakOptions& o) {
  std::lock_guard lk(t.mu);
  const auto [stall, stall_no_restart] = longest(t.stalls, s);
  const auto [gap, gap_no_restart] = longest(t.stream_gaps, s);
  const double replays = faults.batch_timeout_replays_before + faults.batch_timeout_replays();
  std::string by_kind;
  int total_faults = 0;
  for (const auto& [k, n] : faults.counts) by_kind += (by_kind.empty() ? "" : ", ") + k + " " + std::to_string(n), total_faults += n;
  std::printf("\nsoak: seed %llu, %.0f s, %d clients, %d x %d + %d spares, pool %d\n", (unsigned long long)o.seed,
              o.duration_s, o.clients, o.stages, o.replicas, o.spares, o.pool);
  std::printf("| requests | completed | lost | altered | cancelled | client errors (restart / other) | retried "
              "| batch-timeout replays | epoch changes | longest pause in a stream (restarts aside) "
              "| longest stall of all clients (restarts aside) | faults |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
  std::printf("| %d | %d | %d | %d | %d | %d / %d | %d | %.0f | %lld | %.2f s (%.2f s) | %.2f s (%.2f s) | %d: %s |\n",
              t.requests.load(), t.completed.load(), t.lost.load(), t.altered.load(), t.cancelled.load(),
              t.errors_restart.load(), t.errors_other.load(), t.retried.load(), replays, (long long)epochs.changes, gap,
              gap_no_restart, stall, stall_no_restart, total_faults, by_kind.empty() ? "none" : by_kind.c_str());
  if (faults.not_recovered) std::printf("soak: %d fault(s) after which the plan did not come back\n", faults.not_recovered);
  for (const auto& c : faults.crashes) std::printf("soak: a worker crashed: %s\n", c.c_str());
  const bool failed = t.lost > 0 || t.altered > 0 || faults.not_recovered > 0 || !faults.crashes.empty();
  std::printf("soak: %s\n", failed ? "FAILED (see the lines above)" : "nothing lost, nothing altered");
  return failed ? 1 : 0;
}

// Starts the cluster: on nodes of their own when `o.netns` allows and the machine can (one
// node more than the workers, for a fresh worker while one is down), else on loopback.
bool start_cluster(netns_test::NetnsCluster& nc, const SoakOptions& o, bool& on_nodes) {
  Cluster& cluster = nc.cluster;
  cluster.replicas = o.replicas;
  cluster.faults_expected = true;
  const int workers = o.stages * o.replicas + o.spares;
  const std::string why = o.netns == "off" ? "--netns off" : netns_test::netns_unavailable();
  on_nodes = why.empty() && workers + 2 <= 10;
  if (!on_nodes) {
    if (o.netns == "on") {
      std::fprintf(stderr, "soak: --netns on, but %s\n", why.empty() ? "at most 8 workers fit 10 nodes" : why.c_str());
      return false;
    }
    std::printf("soak: on loopback, without link cuts and partitions (%s)\n",
                why.empty() ? "more workers than namespaces" : why.c_str());
  }
  const auto r = on_nodes ? nc.start("soak", o.stages, workers, workers + 1)
                          : cluster.start("soak", o.stages, workers, "heartbeat: {interval_ms: 200, liveness_ms: 2000}\n");
  if (!r) std::fprintf(stderr, "soak: the cluster did not start: %s\n", r.message());
  else if (on_nodes) std::printf("soak: on %d network namespaces (a node each), links cut and partitioned too\n", workers + 2);
  return bool(r);
}

int run(const SoakOptions& o) {
  netns_test::NetnsCluster nc;  // its topology stays empty on loopback
  Cluster& cluster = nc.cluster;
  bool on_nodes = false;
  if (!start_cluster(nc, o, on_nodes)) return 2;
  SoakState state;
  FaultInjector faults(cluster, on_nodes ? &nc : nullptr, o.seed, state, o.stages, o.replicas);
  if (!faults.back_to_plan(std::chrono::seconds(120))) {
    std::fprintf(stderr, "soak: the cluster never served %d x %d\n", o.stages, o.replicas);
    return 2;
  }
  std::vector<PoolItem> pool = make_pool(o.pool, o.seed);
  const auto ref_start = Clock::now();
  if (!reference_pass(cluster, pool, o.clients)) return 2;
  std::printf("soak: seed %llu; fault-free pass over %d requests in %.1f s; faults every %.1f s on average for %.0f s\n",
              (unsigned long long)o.seed, o.pool, std::chrono::duration<double>(Clock::now() - ref_start).count(),
              o.fault_gap_s, o.duration_s);
  std::fflush(stdout);
  Tally tally;
  tally.last_progress_ns = now_ns();
  state.t0 = Clock::now();
  const auto end = state.t0 + std::chrono::milliseconds(int64_t(o.duration_s * 1000));
  EpochWatch epochs;
  std::vector<std::thread> threads;
  for (int k = 0; k < o.clients; ++k)
    threads.emplace_back(client, std::ref(cluster), std::ref(state), std::ref(tally), std::cref(pool), o.seed * 1000 + uint64_t(k));
  std::thread watch([&] {
    while (!state.stop) {
      if (tally.in_flight == 0) tally.last_progress_ns = now_ns();  // no demand: no pause
      epochs.poll(cluster.info());
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  });
  if (o.no_faults) std::this_thread::sleep_until(end);
  else fault_loop(state, faults, o, end);
  state.stop = true;
  for (auto& th : threads) th.join();
  watch.join();
  faults.reap_crashes();
  const int rc = report(tally, state, faults, epochs, o);
  const std::string keep = !o.keep_logs.empty() ? o.keep_logs : rc ? "/tmp/conveyor-soak-" + std::to_string(o.seed) : "";
  if (!keep.empty()) {
    std::filesystem::copy(cluster.dir, keep, std::filesystem::copy_options::recursive | std::filesystem::copy_options::overwrite_existing);
    std::printf("soak: the cluster's logs are in %s\n", keep.c_str());
  }
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  SoakOptions o;
  CLI::App app{"conveyor-bench-soak: a CPU cluster under a mixed load and random faults; every answer checked"};
  app.add_option("--duration", o.duration_s, "seconds of load and faults (after the fault-free pass)")->check(CLI::Range(1.0, 86400.0));
  app.add_option("--seed", o.seed, "the seed of the pool, the clients and the faults (default: a random one, printed)");
  app.add_option("--clients", o.clients, "client threads")->check(CLI::Range(1, 256));
  app.add_option("--pool", o.pool, "distinct requests the load draws from")->check(CLI::Range(8, 100000));
  app.add_option("--stages", o.stages, "pipeline stages of the plan")->check(CLI::Range(1, 6));
  app.add_option("--replicas", o.replicas, "pipeline replicas of the plan")->check(CLI::Range(1, 4));
  app.add_option("--spares", o.spares, "spare workers beside the serving ones")->check(CLI::Range(0, 8));
  app.add_option("--fault-gap", o.fault_gap_s, "mean seconds between faults")->check(CLI::Range(0.1, 3600.0));
  app.add_flag("--no-faults", o.no_faults, "the load alone");
  app.add_option("--netns", o.netns, "run the processes on network namespaces (link cuts, partitions): on, off, or auto "
                 "(where root can make them)")->check(CLI::IsMember({"on", "off", "auto"}));
  app.add_option("--keep-logs", o.keep_logs, "copy the cluster's logs to this folder (a failed run keeps them anyway)");
  CLI11_PARSE(app, argc, argv);
  if (o.seed == 0) o.seed = std::random_device{}() % 1000000 + 1;
  std::printf("soak: seed %llu (repeat with --seed %llu)\n", (unsigned long long)o.seed, (unsigned long long)o.seed);
  std::fflush(stdout);
  return run(o);
}
