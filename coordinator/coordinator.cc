#include "coordinator/coordinator.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <unordered_map>

#include <spdlog/spdlog.h>

#include "coordinator/openai_api.h"
#include "coordinator/text_stream.h"
#include "model/microbatch.h"
#include "transport/control_plane.h"
#include "transport/ucx_channel.h"

namespace conveyor {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using transport::ControlMessage;
using transport::PeerId;

namespace {

constexpr auto kSendTimeout = std::chrono::milliseconds(10000);

struct WorkerInfo {
  std::string name, host, backend;
  int64_t pid = 0, memory_bytes = 0, kv_cache_bytes = 0;
  json gpus = json::array();
  std::vector<std::byte> data_address;
  // joined (no stage: a spare) | loading | ready | dead | failed (its load failed) | drained
  std::string state = "joined";
  bool leaving = false;  // it asked to go (SIGTERM) and nobody can take its stage yet
  int pipeline = -1, stage = -1;
  uint32_t epoch = 0;
  std::pair<int64_t, int64_t> layers{0, 0};
  double load_fraction = 0;
  int64_t load_bytes_done = 0, load_bytes_total = 0;
  double load_seconds = 0;  // of its last load (0 when it kept its layers)
  double busy_fraction = 0;
  double busy_seconds_total = 0, clock_seconds = 0;  // the worker's cumulative busy time, at its clock
  int64_t kv_used_tokens = 0, kv_capacity_tokens = 0, sequences = 0;
  json holding;  // what a re-registering worker says it still has loaded
  json data_plane;  // how its activations travel (staging memory, UCX CUDA support)
  bool int8_weights = false;  // a GPU worker that stores the layers' matrices as int8
  std::string last_error;
  Clock::time_point last_seen = Clock::now();
};

struct Request;

// Times a sequence's micro-batches may fail on a stage (each failure replays its pipeline)
// before the request is failed.
constexpr int kMaxFailedBatches = 3;

struct Sequence {
  uint64_t id = 0;
  Request* request = nullptr;
  size_t choice = 0;
  int pipeline = -1;
  std::vector<int32_t> all;  // prompt then generated tokens
  size_t prompt_len = 0;
  size_t fed = 0;            // tokens of `all` sent to the pipeline in its current epoch
  bool in_flight = false;
  bool finished = false;
  std::unique_ptr<TextStream> text;
  std::vector<TokenOut> prompt_lp;  // echo + logprobs: entry 0 is the first prompt token (NaN)
  bool prompt_lp_sent = false;
  int failed_batches = 0;    // micro-batches of it that a stage could not run or hand on

  size_t generated() const { return all.size() - prompt_len; }
};

struct Request {
  std::shared_ptr<const CompletionRequest> req;
  CompletionSink sink;
  std::vector<uint64_t> seq_ids;
  size_t unfinished = 0;
  int64_t kv_need = 0;  // tokens reserved on its pipeline
  int pipeline = -1;
  bool failed = false;
};

struct InFlightBatch {
  uint32_t epoch = 0;
  std::vector<uint64_t> seq_ids;
  Clock::time_point sent;
};

struct Pipeline {
  int index = 0;
  uint32_t epoch = 1;
  std::vector<std::string> workers;  // per stage; "" = unfilled
  PeerId first_peer = transport::kNoPeer, last_peer = transport::kNoPeer;
  std::vector<std::byte> first_address, last_address;  // whom first_peer / last_peer reach
  bool wired = false;
  int in_flight = 0;
  std::vector<uint64_t> pending_frees;
  int64_t kv_reserved = 0;
  int64_t admitted = 0;  // requests given to it, for the balance between replicas
  std::unordered_map<uint64_t, InFlightBatch> batches;
  std::string down_reason;
};

}  // namespace

struct Coordinator::Impl {
  ClusterConfig cfg;
  std::shared_ptr<const Tokenizer> tokenizer;
  Metrics* metrics = nullptr;
  std::unique_ptr<transport::ControlServer> control;
  std::unique_ptr<transport::UcxChannel> channel;

  mutable std::mutex mu;
  std::condition_variable work_cv;
  std::map<std::string, WorkerInfo> workers;
  std::vector<Pipeline> pipelines;
  std::unordered_map<uint64_t, Sequence> seqs;
  std::deque<std::unique_ptr<Request>> queue;             // accepted, not yet admitted
  std::unordered_map<Request*, std::unique_ptr<Request>> running;
  uint64_t next_seq_id = 1, next_batch_id = 1;

  std::atomic<bool> stopping{false};
  bool accepting = true;            // false once a shutdown drain began (quiesce)
  std::condition_variable idle_cv;  // a request finished
  std::thread control_thread, engine_thread;

  // The plan's shape. `target` is what the operator asked for (the cluster file, then
  // POST /v1/cluster/plan); cfg.stages/replicas/layers is what runs. While workers are
  // missing the coordinator may run a smaller shape over the survivors, and it grows back
  // when workers join. Reshaping happens at the top of the control and engine loops
  // (reshape_pending), never while something iterates over `pipelines`.
  struct Shape {
    int stages = 1, replicas = 1;
    std::vector<std::pair<int64_t, int64_t>> layers;
    bool operator==(const Shape&) const = default;
    json to_json() const {
      json l = json::array();
      for (auto [b, e] : layers) l.push_back({b, e});
      return {{"stages", stages}, {"replicas", replicas}, {"layers", l}};
    }
  };
  Shape target;
  bool reshape_pending = false;
  bool ever_whole = false;  // a plan is not shrunk while its workers are still joining

  // ---------------------------------------------------------------- helpers (mu held)

  int64_t max_tokens_of(const CompletionRequest& r, size_t prompt_len) const {
    return std::min<int64_t>(r.max_tokens, cfg.model.n_positions - int64_t(prompt_len));
  }

  bool pipeline_ready(const Pipeline& p) const {
    if (!p.wired) return false;
    for (const std::string& w : p.workers) {
      auto it = workers.find(w);
      if (w.empty() || it == workers.end() || it->second.state != "ready" || it->second.epoch != p.epoch) return false;
    }
    return true;
  }

  int64_t pipeline_kv_capacity(const Pipeline& p) const {
    int64_t cap = std::numeric_limits<int64_t>::max();
    for (const std::string& w : p.workers) {
      auto it = workers.find(w);
      cap = std::min(cap, it == workers.end() ? 0 : it->second.kv_capacity_tokens);
    }
    return cap;
  }

  int in_flight_depth() const { return std::max(1, cfg.in_flight_auto ? cfg.stages : cfg.in_flight); }

  bool has_spare() const {
    for (const auto& [_, w] : workers)
      if (w.state == "joined") return true;
    return false;
  }

  // A pipeline is recoverable when each missing stage can be filled by a spare or is loading.
  bool pipeline_recoverable(const Pipeline& p) const {
    int missing = 0;
    for (const std::string& w : p.workers)
      if (w.empty() || !workers.count(w) || workers.at(w).state == "dead") ++missing;
    int spares = 0;
    for (const auto& [_, w] : workers) spares += w.state == "joined";
    return missing <= spares;
  }

  // ---------------------------------------------------------------- the plan's shape

  // May be given a stage: alive, not failed, not drained, not on its way out.
  static bool plannable(const WorkerInfo& w) {
    return !w.leaving && (w.state == "joined" || w.state == "loading" || w.state == "ready");
  }

  Shape current_shape() const { return {cfg.stages, cfg.replicas, cfg.layers}; }

  // A shape of `stages` x `replicas`: the target's layer ranges when it has that many
  // stages (they may be the operator's), else the balanced split.
  Shape shape_of(int stages, int replicas) const {
    return {stages, replicas, stages == target.stages ? target.layers : balanced_layer_split(cfg.model, stages)};
  }

  // Room for a stage's weights: a GPU's memory (less a tenth for workspaces), or the host's
  // less the K/V budget the CPU worker was started with. Unknown (0): no limit is known.
  static int64_t weight_room(const WorkerInfo& w) {
    if (w.memory_bytes <= 0) return std::numeric_limits<int64_t>::max();
    return w.backend == "cpu" ? w.memory_bytes - w.kv_cache_bytes : w.memory_bytes / 10 * 9;
  }
  int64_t weight_bytes(const WorkerInfo& w, std::pair<int64_t, int64_t> layers) const {
    return stage_weight_bytes(cfg.model, layers, w.backend == "cpu" ? 4 : 2, w.int8_weights);
  }

  // Whether `w` has `layers` of this model loaded (or loading), so it can serve them at once.
  bool holds(const WorkerInfo& w, std::pair<int64_t, int64_t> layers) const {
    if (w.state == "ready" || w.state == "loading") return w.stage >= 0 && w.layers == layers;
    return w.state == "joined" && w.holding.is_object() && w.holding.value("model", "") == cfg.model_path &&
           w.holding.value("layers", json::array()) == json::array({layers.first, layers.second});
  }

  // Places the slots of `shape` (replica-major) on plannable workers other than `without`:
  // a worker that holds a slot's layers keeps them (no reload); the other slots go largest
  // stage first to the roomiest worker left. Nothing when the workers are too few or a
  // stage does not fit in memory; `why` says which.
  std::optional<std::vector<std::string>> place(const Shape& shape, const std::string& without, std::string& why) const {
    std::vector<const WorkerInfo*> pool;
    for (const auto& [name, w] : workers)
      if (plannable(w) && name != without) pool.push_back(&w);
    const size_t S = size_t(shape.stages), n = S * size_t(shape.replicas);
    if (pool.size() < n) {
      why = std::to_string(shape.stages) + " stage(s) x " + std::to_string(shape.replicas) + " replica(s) need " +
            std::to_string(n) + " workers and " + std::to_string(pool.size()) + " can serve";
      return std::nullopt;
    }
    std::vector<std::string> out(n);
    std::vector<bool> used(pool.size(), false);
    auto fits = [&](const WorkerInfo& w, size_t slot) { return weight_bytes(w, shape.layers[slot % S]) <= weight_room(w); };
    for (size_t slot = 0; slot < n; ++slot)
      for (size_t i = 0; i < pool.size(); ++i)
        if (!used[i] && holds(*pool[i], shape.layers[slot % S]) && fits(*pool[i], slot)) {
          out[slot] = pool[i]->name;
          used[i] = true;
          break;
        }
    std::vector<size_t> slots, free;
    for (size_t slot = 0; slot < n; ++slot)
      if (out[slot].empty()) slots.push_back(slot);
    for (size_t i = 0; i < pool.size(); ++i)
      if (!used[i]) free.push_back(i);
    auto size_of = [&](size_t slot) { return stage_weight_bytes(cfg.model, shape.layers[slot % S], 1); };
    std::stable_sort(slots.begin(), slots.end(), [&](size_t a, size_t b) { return size_of(a) > size_of(b); });
    std::stable_sort(free.begin(), free.end(), [&](size_t a, size_t b) { return weight_room(*pool[a]) > weight_room(*pool[b]); });
    for (size_t k = 0; k < slots.size(); ++k) {
      const WorkerInfo& w = *pool[free[k]];
      const auto layers = shape.layers[slots[k] % S];
      if (!fits(w, slots[k])) {
        why = "layers [" + std::to_string(layers.first) + ", " + std::to_string(layers.second) + ") need " +
              std::to_string(weight_bytes(w, layers) >> 20) + " MiB and worker '" + w.name + "' has " +
              std::to_string(weight_room(w) >> 20) + " MiB";
        return std::nullopt;
      }
      out[slots[k]] = w.name;
    }
    return out;
  }

  // The largest shape the plannable workers (other than `without`) can run: the target,
  // else as many of its replicas as possible, each with as many of its stages as the workers
  // and their memory allow.
  std::optional<std::pair<Shape, std::vector<std::string>>> feasible_shape(const std::string& without, std::string& why) const {
    std::string first_why;
    for (int r = target.replicas; r >= 1; --r)
      for (int st = target.stages; st >= 1; --st) {
        const Shape sh = shape_of(st, r);
        std::string w;
        if (auto placement = place(sh, without, w)) return std::pair{sh, std::move(*placement)};
        if (first_why.empty()) first_why = w;
      }
    why = first_why;
    return std::nullopt;
  }

  bool whole() const {
    for (const Pipeline& p : pipelines)
      for (const std::string& w : p.workers)
        if (w.empty()) return false;
    return true;
  }

  // Runs `shape` with the workers `placement` names: new pipelines in a new epoch, workers
  // that keep their layers only re-wire, the others load, workers left out become spares
  // (told to drop their stage), and every running sequence is replayed from its first
  // token on the pipeline with the fewest reserved tokens.
  void apply_shape(const Shape& shape, const std::vector<std::string>& placement, const std::string& why) {
    uint32_t epoch = 0;
    for (const Pipeline& p : pipelines) epoch = std::max(epoch, p.epoch);
    std::vector<Pipeline> next(size_t(shape.replicas));
    for (size_t r = 0; r < next.size(); ++r) {
      Pipeline& p = next[r];
      p.index = int(r);
      p.epoch = epoch + 1;
      p.workers.assign(size_t(shape.stages), "");
      if (r < pipelines.size()) {  // keep the data-plane endpoints: wire() reuses those still right
        Pipeline& old = pipelines[r];
        p.first_peer = old.first_peer, p.last_peer = old.last_peer;
        p.first_address = std::move(old.first_address), p.last_address = std::move(old.last_address);
        p.admitted = old.admitted;
      }
    }
    for (size_t r = next.size(); r < pipelines.size(); ++r)
      for (PeerId peer : {pipelines[r].first_peer, pipelines[r].last_peer})
        if (peer != transport::kNoPeer) (void)channel->disconnect(peer);
    const std::set<std::string> placed(placement.begin(), placement.end());
    for (auto& [name, w] : workers)
      if (w.stage >= 0 && !placed.count(name)) {
        w.pipeline = w.stage = -1;
        if (plannable(w)) {
          w.state = "joined";
          send_control(name, ControlMessage::make("unassign"));
        }
      }
    cfg.stages = shape.stages, cfg.replicas = shape.replicas, cfg.layers = shape.layers;
    pipelines = std::move(next);
    for (size_t slot = 0; slot < placement.size(); ++slot)
      assign(pipelines[slot / size_t(shape.stages)], int(slot % size_t(shape.stages)), workers.at(placement[slot]));
    for (Pipeline& p : pipelines) p.kv_reserved = 0, p.down_reason = why;
    for (auto& [rp, _] : running) {
      Pipeline& p = *std::min_element(pipelines.begin(), pipelines.end(),
                                      [](const Pipeline& a, const Pipeline& b) { return a.kv_reserved < b.kv_reserved; });
      rp->pipeline = p.index;
      p.kv_reserved += rp->kv_need;
      for (uint64_t id : rp->seq_ids)
        if (auto it = seqs.find(id); it != seqs.end()) {
          it->second.pipeline = p.index;
          it->second.fed = 0;
          it->second.in_flight = false;
        }
    }
    spdlog::info("coordinator: the plan is now {} stage(s) x {} replica(s) ({})", shape.stages, shape.replicas, why);
    for (Pipeline& p : pipelines) send_assignments(p);
    work_cv.notify_all();
  }

  // Called at the top of the control and engine loops: when a pipeline misses a stage that
  // no spare can fill, or the plan runs smaller than the target, runs the largest shape the
  // workers allow.
  void reshape_if_pending() {
    if (!reshape_pending) return;
    reshape_pending = false;
    const bool is_whole = whole();
    if (!ever_whole || (is_whole && current_shape() == target)) return;
    std::string why;
    auto shape = feasible_shape("", why);
    if (!shape) {
      for (Pipeline& p : pipelines)
        if (std::count(p.workers.begin(), p.workers.end(), "")) p.down_reason += "; no smaller plan fits either: " + why;
      return;
    }
    if (is_whole && shape->first == current_shape()) return;
    apply_shape(shape->first, shape->second,
                is_whole ? "grown back toward the requested plan" : "re-planned over the surviving workers");
  }

  // ---------------------------------------------------------------- control plane

  void send_control(const std::string& peer, ControlMessage m) {
    if (Status s = control->send(peer, m); !s)
      spdlog::warn("coordinator: cannot send '{}' to {}: {}", m.type(), peer, s.message());
  }

  void assign(Pipeline& p, int stage, WorkerInfo& w) {
    w.pipeline = p.index;
    w.stage = stage;
    w.epoch = p.epoch;
    w.layers = cfg.layers[size_t(stage)];
    w.state = "loading";
    w.load_fraction = 0;
    w.holding = json();  // from now on `layers` says what it holds
    p.workers[size_t(stage)] = w.name;
    spdlog::info("coordinator: pipeline {} stage {} (layers [{}, {})) -> {}", p.index, stage, w.layers.first,
                 w.layers.second, w.name);
  }

  // Sends `assign` to every worker of a pipeline whose stages are all filled, with the
  // neighbours' addresses. Workers that already hold the layers only re-wire.
  void send_assignments(Pipeline& p) {
    for (const std::string& name : p.workers)
      if (name.empty()) return;
    const int S = int(p.workers.size());
    const std::string coord = transport::to_base64(channel->address());
    for (int s = 0; s < S; ++s) {
      WorkerInfo& w = workers.at(p.workers[size_t(s)]);
      json body = {{"epoch", p.epoch}, {"pipeline", p.index}, {"stage", s}, {"num_stages", S},
                   {"layers", {w.layers.first, w.layers.second}}, {"model", cfg.model_path},
                   {"coordinator", coord},
                   {"next", s + 1 < S ? transport::to_base64(workers.at(p.workers[size_t(s + 1)]).data_address) : ""},
                   {"prev", s > 0 ? transport::to_base64(workers.at(p.workers[size_t(s - 1)]).data_address) : coord}};
      w.epoch = p.epoch;
      if (w.state == "ready") w.state = "loading";  // until it confirms the new epoch
      send_control(w.name, ControlMessage::make("assign", body));
    }
    wire(p);
  }

  // Connects the first and last stages, keeping endpoints to workers that keep their place
  // (transport::keep_or_connect), so one repair does not cascade into the next.
  void wire(Pipeline& p) {
    p.wired = false;
    const std::string &first = p.workers.front(), &last = p.workers.back();
    Status s = transport::keep_or_connect(*channel, p.first_peer, p.first_address, workers.at(first).data_address, first);
    if (s) s = transport::keep_or_connect(*channel, p.last_peer, p.last_address, workers.at(last).data_address, last);
    if (!s) {
      p.down_reason = "cannot connect the data plane: " + s.message();
      return;
    }
    p.wired = true;
  }

  // Fills every empty stage from the spares; a worker that says it holds a stage's layers
  // is preferred for that stage (a coordinator restart then needs no reload). What spares
  // cannot fix (a stage nobody can take, a plan below its target) is left to
  // reshape_if_pending. Never called while iterating over `pipelines`' elements' slots.
  void plan() {
    for (Pipeline& p : pipelines) {
      bool changed = false;
      for (int s = 0; s < int(p.workers.size()); ++s) {
        if (!p.workers[size_t(s)].empty()) continue;
        WorkerInfo* pick = nullptr;
        for (auto& [_, w] : workers) {
          if (w.state != "joined" || w.leaving) continue;
          const bool held = holds(w, cfg.layers[size_t(s)]);
          if (!pick || held) pick = &w;
          if (held) break;
        }
        if (!pick) break;
        assign(p, s, *pick);
        changed = true;
      }
      if (changed) send_assignments(p);
    }
    const bool is_whole = whole();
    ever_whole = ever_whole || is_whole;
    reshape_pending = reshape_pending || !is_whole || current_shape() != target;
  }

  // A stage of `p` is lost: new epoch, the work in flight is void, sequences restart.
  // Surviving workers keep their layers; they get the new epoch's wiring once the stage is
  // filled (the caller runs plan() when it is done with `pipelines`).
  void fail_stage(Pipeline& p, const std::string& worker, const std::string& why) {
    spdlog::warn("coordinator: pipeline {} loses {}: {}", p.index, worker, why);
    for (std::string& w : p.workers)
      if (w == worker) w.clear();
    p.down_reason = worker + ": " + why;
    restart_pipeline(p);
  }

  void restart_pipeline(Pipeline& p) {
    ++p.epoch;
    p.batches.clear();
    p.in_flight = 0;
    p.pending_frees.clear();  // every stage drops its whole cache on the new assignment
    p.wired = false;
    for (auto& [_, s] : seqs)
      if (s.pipeline == p.index) {
        s.fed = 0;
        s.in_flight = false;
      }
  }

  void handle_control(const std::string& peer, const ControlMessage& m) {
    const std::string type = m.type();
    const json& b = m.body;
    if (type == "register") {
      if (b.value("token", std::string()) != cfg.join_token) {
        spdlog::warn("coordinator: refusing worker '{}': wrong join token", peer);
        send_control(peer, ControlMessage::make("rejected", {{"reason", "wrong join token"}}));
        return;
      }
      if (m.blob.empty()) {
        send_control(peer, ControlMessage::make("rejected", {{"reason", "register carries no data-plane address"}}));
        return;
      }
      auto it = workers.find(peer);
      if (it != workers.end() && it->second.pid == b.value("pid", int64_t(0)) && it->second.stage >= 0 &&
          (it->second.state == "loading" || (it->second.state == "ready" && b.contains("holding") &&
                                             b["holding"].value("layers", json::array()) ==
                                                 json::array({it->second.layers.first, it->second.layers.second})))) {
        // The same process, still on its stage (it thought us silent, or its registers
        // queued while we were unreachable): nothing to repair.
        it->second.last_seen = Clock::now();
        send_control(peer, ControlMessage::make("welcome", {{"heartbeat_ms", cfg.heartbeat_interval_ms}}));
        return;
      }
      if (it != workers.end() && it->second.state != "dead" && it->second.state != "joined") {
        // A worker we think is serving registers again: it lost us. Its stage is void.
        for (Pipeline& p : pipelines)
          if (it->second.pipeline == p.index && it->second.stage >= 0 &&
              p.workers[size_t(it->second.stage)] == peer)
            fail_stage(p, peer, "re-registered");
      }
      WorkerInfo w;
      w.name = peer;
      w.host = b.value("host", std::string());
      w.pid = b.value("pid", int64_t(0));
      w.backend = b.value("backend", std::string("cpu"));
      w.gpus = b.value("gpus", json::array());
      w.memory_bytes = b.value("memory_bytes", int64_t(0));
      w.kv_cache_bytes = b.value("kv_cache_bytes", int64_t(0));
      w.holding = b.value("holding", json());
      w.data_plane = b.value("data_plane", json());
      w.int8_weights = b.value("int8_weights", false);
      w.data_address = m.blob;
      workers[peer] = std::move(w);
      send_control(peer, ControlMessage::make("welcome", {{"heartbeat_ms", cfg.heartbeat_interval_ms}}));
      spdlog::info("coordinator: worker {} joined (pid {})", peer, workers[peer].pid);
      plan();
      return;
    }
    auto it = workers.find(peer);
    if (it == workers.end() || it->second.state == "dead") {
      // Unknown (e.g. we restarted): ask it to register by saying nothing useful; it
      // re-registers when it hears no welcome. Tell it explicitly.
      send_control(peer, ControlMessage::make("heartbeat", {{"register", true}}));
      return;
    }
    WorkerInfo& w = it->second;
    w.last_seen = Clock::now();
    if (type == "heartbeat") {
      w.busy_fraction = b.value("busy_fraction", 0.0);
      w.busy_seconds_total = b.value("busy_seconds_total", 0.0);
      w.clock_seconds = b.value("clock_seconds", 0.0);
      w.kv_used_tokens = b.value("kv_used_tokens", int64_t(0));
      w.sequences = b.value("sequences", int64_t(0));
      if (b.contains("kv_capacity_tokens")) w.kv_capacity_tokens = b.value("kv_capacity_tokens", int64_t(0));
      send_control(peer, ControlMessage::make("heartbeat"));
    } else if (type == "load_progress") {
      w.load_fraction = b.value("fraction", 0.0);
      w.load_bytes_done = b.value("bytes_done", int64_t(0));
      w.load_bytes_total = b.value("bytes_total", int64_t(0));
    } else if (type == "ready") {
      if (b.value("epoch", uint32_t(0)) != w.epoch) return;  // a stale confirmation
      w.state = "ready";
      w.load_fraction = 1;
      w.kv_capacity_tokens = b.value("kv_capacity_tokens", int64_t(0));
      w.load_seconds = b.value("load_seconds", 0.0);
      spdlog::info("coordinator: {} ready (stage {}, {:.2f} s)", peer, w.stage, b.value("load_seconds", 0.0));
      work_cv.notify_all();
    } else if (type == "load_failed") {
      w.last_error = b.value("error", std::string("?"));
      spdlog::error("coordinator: {} failed to load: {}", peer, w.last_error);
      for (Pipeline& p : pipelines)
        if (w.pipeline == p.index) {
          for (std::string& s : p.workers)
            if (s == peer) s.clear();
          p.down_reason = peer + " failed to load: " + w.last_error;
        }
      w.state = "failed";
      w.pipeline = w.stage = -1;
      plan();
    } else if (type == "data_error") {
      w.last_error = b.value("error", std::string("?"));
      spdlog::warn("coordinator: {} reports a data-plane error: {}", peer, w.last_error);
      // A running pipeline broke (a connection reset, a lost result): replay it on fresh
      // connections, once per epoch. A wiring failure leaves the pipeline not ready and is
      // not retried here: the dead neighbour behind it is found by its silence.
      if (w.pipeline >= 0 && size_t(w.pipeline) < pipelines.size()) {
        Pipeline& p = pipelines[size_t(w.pipeline)];
        // First what our own endpoints say: a re-wire would replace a failed endpoint to a
        // dead worker with a fresh one that has not failed yet, and hide the death.
        if (check_own_endpoints(p, w.last_error)) return;
        if (b.value("epoch", uint32_t(0)) == p.epoch && pipeline_ready(p)) {
          p.down_reason = "replaying after a data-plane error at " + peer + ": " + w.last_error;
          restart_pipeline(p);
          send_assignments(p);
        }
      }
    } else if (type == "draining") {
      auto [status, body] = take_out(w, true, "asked to go (" + b.value("reason", std::string("?")) + ")");
      spdlog::info("coordinator: {} asks to go: {}", peer, body.dump());
    } else if (type == "leaving") {
      mark_dead(w, "left (" + b.value("reason", std::string("?")) + ")");
    }
  }

  // The coordinator's own endpoint to a pipeline's first or last stage failed: that worker
  // is dead to us (if it is alive it registers again and becomes a spare). Returns whether
  // one was found.
  bool check_own_endpoints(Pipeline& p, const std::string& why) {
    for (PeerId peer : {p.first_peer, p.last_peer})
      if (peer != transport::kNoPeer && !channel->peer_status(peer).ok()) {
        const std::string name = peer == p.first_peer ? p.workers.front() : p.workers.back();
        if (workers.count(name) && workers.at(name).state != "dead") {
          mark_dead(workers.at(name), "data plane: " + why);
          return true;
        }
      }
    return false;
  }

  void mark_dead(WorkerInfo& w, const std::string& why) {
    const std::string name = w.name;
    w.state = "dead";
    w.last_error = why;
    w.leaving = false;
    for (Pipeline& p : pipelines)
      for (const std::string& s : p.workers)
        if (s == name) {
          fail_stage(p, name, why);
          break;
        }
    w.pipeline = w.stage = -1;
    plan();
    work_cv.notify_all();
  }

  void control_loop() {
    const auto liveness = std::chrono::milliseconds(cfg.liveness_ms);
    while (!stopping) {
      auto m = control->recv(std::chrono::milliseconds(20));
      std::lock_guard lk(mu);
      if (!m) spdlog::warn("coordinator: control plane: {}", m.error());
      else if (m->has_value()) handle_control((*m)->peer, (*m)->message);
      const auto now = Clock::now();
      for (auto& [name, w] : workers)
        if (w.state != "dead" && w.state != "failed" && now - w.last_seen > liveness)
          mark_dead(w, "missed heartbeats for " + std::to_string(cfg.liveness_ms) + " ms");
      release_leavers();
      reshape_if_pending();
      update_gauges();
    }
  }

  void update_gauges() {
    if (!metrics) return;
    metrics->set_queue_depth(int64_t(queue.size()));
    int64_t running_seqs = 0;
    for (const auto& [_, s] : seqs) running_seqs += !s.finished;
    metrics->set_running_sequences(running_seqs);
    metrics->clear_stage_gauges();
    for (const Pipeline& p : pipelines)
      for (size_t s = 0; s < p.workers.size(); ++s) {
        auto it = workers.find(p.workers[s]);
        if (it == workers.end()) continue;
        metrics->set_stage_busy_fraction(p.index, int(s), it->first, it->second.busy_fraction);
        metrics->set_kv_cache_tokens(p.index, int(s), it->second.kv_used_tokens, it->second.kv_capacity_tokens);
      }
  }

  // ---------------------------------------------------------------- taking workers out

  using Served = std::vector<std::pair<Pipeline*, size_t>>;
  using Placement = std::optional<std::pair<Shape, std::vector<std::string>>>;

  // The pipelines and stages `name` serves.
  Served stages_served_by(const std::string& name) {
    Served served;
    for (Pipeline& p : pipelines)
      if (auto slot = std::find(p.workers.begin(), p.workers.end(), name); slot != p.workers.end())
        served.emplace_back(&p, size_t(slot - p.workers.begin()));
    return served;
  }

  // Takes `w` out of service without failing anything (the operator's drain, a worker's
  // SIGTERM): a spare takes its stage, or else the plan shrinks over the other workers when
  // their memory allows; every running sequence of its pipeline is replayed. When neither
  // can be done: 409, or with `wait` its pipeline takes no new requests and it is let go
  // once its running ones are done (release_leavers). Returns (HTTP status, body).
  std::pair<int, json> take_out(WorkerInfo& w, bool wait, const std::string& why) {
    const std::string name = w.name;
    if (w.state == "drained") return {200, {{"worker", name}, {"state", "drained"}}};
    Served served = stages_served_by(name);
    if (wait && !accepting && running.empty() && queue.empty()) served.clear();  // we stop too: no re-plan
    Placement smaller;
    std::string why_not;
    if (!served.empty() && !has_spare() && !(smaller = feasible_shape(name, why_not))) {
      const std::string msg = "worker '" + name + "' serves pipeline " + std::to_string(served[0].first->index) +
                              " stage " + std::to_string(served[0].second) +
                              ", no spare worker can take it and the others cannot run the model without it (" +
                              why_not + "): start another worker first";
      if (!wait) return {409, error_json(api_error(409, msg, {}, "conflict_error"))};
      if (!w.leaving) spdlog::warn("coordinator: {}; its pipeline takes no new requests until it can go", msg);
      w.leaving = true;
      return {202, {{"worker", name}, {"state", "leaving"}, {"reason", msg}}};
    }
    return {200, retire(w, why, served, smaller)};
  }

  // Takes `w` off the stages it serves for good (state "drained": never planned again; a
  // re-registration makes it a spare) and tells it to drop them; the stages go to the
  // smaller plan when one is given, else to spares (plan()). Returns the drain's body.
  json retire(WorkerInfo& w, const std::string& why, const Served& served, const Placement& smaller) {
    const std::string name = w.name;
    json body = {{"worker", name}, {"state", "drained"}};
    w.state = "drained";
    w.leaving = false;
    for (auto [p, stage] : served) fail_stage(*p, name, why);
    w.pipeline = w.stage = -1;
    send_control(name, ControlMessage::make("unassign"));
    if (smaller) {
      apply_shape(smaller->first, smaller->second, "re-planned without " + name);
      body["replanned"] = smaller->first.to_json();
    } else {
      plan();
      for (auto [p, stage] : served)
        if (!p->workers[stage].empty()) body["replaced_by"] = p->workers[stage];
    }
    spdlog::info("coordinator: {} drained ({}): {}", name, why, body.dump());
    return body;
  }

  bool has_leaver(const Pipeline& p) const {
    return std::any_of(p.workers.begin(), p.workers.end(), [&](const std::string& n) {
      auto it = workers.find(n);
      return it != workers.end() && it->second.leaving;
    });
  }

  // Lets go of workers waiting to leave once a spare or a smaller plan can take over, or
  // once their pipeline has no running sequence.
  void release_leavers() {
    for (auto& [name, w] : workers) {
      if (!w.leaving || w.state == "dead") continue;
      const Served served = stages_served_by(name);
      const bool busy = std::any_of(seqs.begin(), seqs.end(), [&](const auto& e) {
        const Sequence& s = e.second;
        return !s.finished && std::any_of(served.begin(), served.end(), [&](const auto& ps) { return ps.first->index == s.pipeline; });
      });
      if (busy) take_out(w, true, "leaving");
      else retire(w, "left when its work was done", served, std::nullopt);
    }
  }

  // ---------------------------------------------------------------- requests

  // Sends the choice's last update, then releases the sequence; the last choice of a
  // request finishes the request (which destroys it and its sequences).
  void finish_sequence(Sequence& s, const std::string& reason, ChoiceUpdate update) {
    s.finished = true;
    s.in_flight = false;
    update.text += s.text->flush();
    update.finish_reason = reason;
    Request& r = *s.request;
    r.sink.on_update(std::move(update));
    if (s.pipeline >= 0) pipelines[size_t(s.pipeline)].pending_frees.push_back(s.id);
    if (--r.unfinished == 0) finish_request(r, "");
  }

  void finish_request(Request& r, const std::string& error) {
    if (r.pipeline >= 0) pipelines[size_t(r.pipeline)].kv_reserved -= r.kv_need;
    for (uint64_t id : r.seq_ids) {
      auto it = seqs.find(id);
      if (it == seqs.end()) continue;
      if (!it->second.finished && it->second.pipeline >= 0)
        pipelines[size_t(it->second.pipeline)].pending_frees.push_back(id);
      seqs.erase(it);
    }
    r.sink.on_done(error);
    running.erase(&r);  // destroys r
    idle_cv.notify_all();
  }

  // Moves queued requests onto pipelines while their KV budget allows (FIFO).
  void admit() {
    while (!queue.empty()) {
      Request& r = *queue.front();
      Pipeline* best = nullptr;
      int64_t max_cap = 0;
      for (Pipeline& p : pipelines) {
        if (!pipeline_ready(p) || has_leaver(p)) continue;
        const int64_t cap = pipeline_kv_capacity(p);
        max_cap = std::max(max_cap, cap);
        if (p.kv_reserved + r.kv_need <= cap && (!best || p.kv_reserved < best->kv_reserved)) best = &p;
      }
      int64_t running_seqs = 0;
      for (const auto& [_, s] : seqs) running_seqs += !s.finished;
      if (max_cap > 0 && r.kv_need > max_cap && !best) {
        std::unique_ptr<Request> owned = std::move(queue.front());
        queue.pop_front();
        owned->sink.on_done("the request needs " + std::to_string(owned->kv_need) +
                            " KV-cache tokens, more than a pipeline holds (" + std::to_string(max_cap) + ")");
        continue;
      }
      if (!best || running_seqs + int64_t(r.req->num_choices()) > cfg.max_running) return;
      std::unique_ptr<Request> owned = std::move(queue.front());
      queue.pop_front();
      Request* rp = owned.get();
      rp->pipeline = best->index;
      best->kv_reserved += rp->kv_need;
      ++best->admitted;
      const CompletionRequest& cr = *rp->req;
      for (size_t c = 0; c < cr.num_choices(); ++c) {
        Sequence s;
        s.id = next_seq_id++;
        s.request = rp;
        s.choice = c;
        s.pipeline = best->index;
        s.all = cr.prompts[c / size_t(cr.n)];
        s.prompt_len = s.all.size();
        s.text = std::make_unique<TextStream>(*tokenizer, cr.stop);
        if (cr.echo && cr.logprobs >= 0)
          s.prompt_lp.push_back({s.all[0], std::numeric_limits<float>::quiet_NaN(), {}});
        rp->seq_ids.push_back(s.id);
        seqs.emplace(s.id, std::move(s));
      }
      rp->unfinished = cr.num_choices();
      running.emplace(rp, std::move(owned));
    }
  }

  // ---------------------------------------------------------------- engine loop

  SamplingParams sampling_for(const CompletionRequest& r) const {
    SamplingParams p = r.sampling;
    if (!r.ignore_eos && cfg.model.eos_token_id >= 0 &&
        std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), int32_t(cfg.model.eos_token_id)) ==
            p.stop_token_ids.end())
      p.stop_token_ids.push_back(int32_t(cfg.model.eos_token_id));
    return p;
  }

  // Forms and sends micro-batches for `p` while it has room in flight.
  void launch(Pipeline& p) {
    const int depth = in_flight_depth();
    while (p.in_flight < depth && pipeline_ready(p)) {
      std::vector<Sequence*> decode, prefill;
      int64_t active = 0;
      for (auto& [_, s] : seqs) {
        if (s.pipeline != p.index || s.finished) continue;
        ++active;
        if (s.in_flight || s.fed >= s.all.size()) continue;
        (s.all.size() - s.fed == 1 ? decode : prefill).push_back(&s);
      }
      if (decode.empty() && prefill.empty() && p.pending_frees.empty()) return;
      // Spread the live sequences over the in-flight slots so every stage has work.
      const int64_t cap_seqs = std::min<int64_t>(cfg.max_sequences_per_batch, std::max<int64_t>(1, (active + depth - 1) / depth));
      auto by_id = [](const Sequence* a, const Sequence* b) { return a->id < b->id; };
      std::sort(decode.begin(), decode.end(), by_id);
      std::sort(prefill.begin(), prefill.end(), by_id);
      MicroBatch b;
      b.batch_id = next_batch_id++;
      b.pipeline = uint32_t(p.index);
      b.epoch = p.epoch;
      b.free_seq_ids = std::move(p.pending_frees);
      p.pending_frees.clear();
      int64_t tokens = 0;
      InFlightBatch rec{p.epoch, {}, Clock::now()};
      auto add = [&](Sequence& s, int64_t n) {
        const CompletionRequest& r = *s.request->req;
        SeqWork w;
        w.slice = {s.id, int32_t(s.fed), int32_t(n)};
        w.prompt_len = int32_t(s.prompt_len);
        w.sample = s.fed + size_t(n) == s.all.size();
        w.prompt_logprobs = !s.prompt_lp.empty() && s.prompt_lp.size() < s.prompt_len && s.fed < s.prompt_len;
        w.lookahead_token = s.fed + size_t(n) < s.all.size() ? s.all[s.fed + size_t(n)] : -1;
        w.top_logprobs = std::max(0, r.logprobs);
        w.sample_index = s.choice % size_t(r.n);
        w.sampling = sampling_for(r);
        b.token_ids.insert(b.token_ids.end(), s.all.begin() + int64_t(s.fed), s.all.begin() + int64_t(s.fed) + n);
        b.seqs.push_back(std::move(w));
        s.fed += size_t(n);
        s.in_flight = true;
        rec.seq_ids.push_back(s.id);
        tokens += n;
      };
      for (Sequence* s : decode) {
        if (int64_t(b.seqs.size()) >= cap_seqs || tokens + 1 > cfg.max_batch_tokens) break;
        add(*s, 1);
      }
      for (Sequence* s : prefill) {
        if (int64_t(b.seqs.size()) >= cap_seqs || tokens >= cfg.max_batch_tokens) break;
        const int64_t n = std::min<int64_t>({cfg.prefill_chunk, int64_t(s->all.size() - s->fed), cfg.max_batch_tokens - tokens});
        add(*s, n);
      }
      const std::vector<uint8_t> header = encode(b);
      Status sent = channel->send(p.first_peer, std::as_bytes(std::span(header)), {}, kSendTimeout);
      if (!sent) {
        const std::string first = p.workers.front();
        spdlog::warn("coordinator: cannot send to pipeline {} stage 0: {}", p.index, sent.message());
        if (workers.count(first)) mark_dead(workers.at(first), "data plane: " + sent.message());
        return;
      }
      p.batches.emplace(b.batch_id, std::move(rec));
      ++p.in_flight;
    }
  }

  void on_result(const BatchResult& res) {
    if (res.pipeline >= pipelines.size()) return;
    Pipeline& p = pipelines[res.pipeline];
    auto bit = p.batches.find(res.batch_id);
    if (res.epoch != p.epoch || bit == p.batches.end()) return;  // from before a restart
    const InFlightBatch rec = std::move(bit->second);
    p.batches.erase(bit);
    --p.in_flight;
    if (!res.error.empty()) {
      // A stage could not run or hand on the batch (most often: its neighbour went away).
      // The pipeline restarts in a new epoch and replays every sequence; a sequence whose
      // batches keep failing (an error that a replay cannot cure) is failed with the message.
      spdlog::warn("coordinator: pipeline {} batch {} failed: {}", p.index, res.batch_id, res.error);
      bool replay = false;
      for (uint64_t id : rec.seq_ids) {
        auto it = seqs.find(id);
        if (it == seqs.end() || it->second.finished || it->second.request->failed) continue;
        if (++it->second.failed_batches <= kMaxFailedBatches) {
          replay = true;
          continue;
        }
        Request& r = *it->second.request;
        r.failed = true;
        finish_request(r, "the pipeline failed this request " + std::to_string(kMaxFailedBatches + 1) +
                              " times: " + res.error);
      }
      if (replay) {
        p.down_reason = "replaying after: " + res.error;
        restart_pipeline(p);
        send_assignments(p);  // every stage learns the new epoch, drops its cache, re-wires
      }
      return;
    }
    for (const SeqResult& sr : res.seqs) {
      auto it = seqs.find(sr.seq_id);
      if (it == seqs.end() || it->second.finished) continue;
      Sequence& s = it->second;
      s.in_flight = false;
      const CompletionRequest& r = *s.request->req;
      // Prompt log-probs: entry j predicts the token at position start + 1 + j.
      if (!s.prompt_lp.empty()) {
        size_t pos = s.prompt_lp.size();
        for (size_t j = 0; j < sr.prompt_logprobs.size() && pos < s.prompt_len; ++j, ++pos)
          s.prompt_lp.push_back({s.all[pos], sr.prompt_logprobs[j], j < sr.prompt_top.size() ? sr.prompt_top[j] : std::vector<std::pair<int32_t, float>>{}});
      }
      if (sr.token < 0) continue;
      ChoiceUpdate u;
      u.choice = s.choice;
      if (!s.prompt_lp.empty() && !s.prompt_lp_sent) {
        u.prompt_tokens = s.prompt_lp;
        s.prompt_lp_sent = true;
      }
      s.all.push_back(sr.token);
      u.tokens.push_back({sr.token, sr.logprob, sr.top});
      const SamplingParams sp = sampling_for(r);
      const bool is_stop_token = int(s.generated()) > r.sampling.min_tokens - 1 &&
                                 std::find(sp.stop_token_ids.begin(), sp.stop_token_ids.end(), sr.token) !=
                                     sp.stop_token_ids.end();
      if (!is_stop_token) u.text = s.text->push(sr.token);
      if (is_stop_token || s.text->stopped()) {
        finish_sequence(s, "stop", std::move(u));  // may destroy s and its request
      } else if (int64_t(s.generated()) >= max_tokens_of(r, s.prompt_len) ||
                 int64_t(s.all.size()) >= cfg.model.n_positions) {
        finish_sequence(s, "length", std::move(u));
      } else {
        s.request->sink.on_update(std::move(u));
      }
    }
  }

  void engine_loop() {
    while (!stopping) {
      auto got = channel->recv(std::chrono::milliseconds(2));
      std::unique_lock lk(mu);
      if (!got) {
        spdlog::warn("coordinator: data plane: {}", got.error());
        for (Pipeline& p : pipelines) check_own_endpoints(p, got.error());
      } else if (got->has_value()) {
        const auto& h = (**got).header;
        auto res = decode_batch_result(std::span(reinterpret_cast<const uint8_t*>(h.data()), h.size()));
        if (!res) spdlog::error("coordinator: {}", res.error());
        else on_result(*res);
      }
      reshape_if_pending();
      admit();
      for (Pipeline& p : pipelines) launch(p);
    }
  }

  std::pair<bool, json> health() const {
    std::lock_guard lk(mu);
    json pj = json::array();
    bool any = false;
    for (const Pipeline& p : pipelines) {
      const bool ready = pipeline_ready(p);
      any = any || ready;
      json e = {{"pipeline", p.index}, {"ready", ready}};
      if (!ready) {
        int missing = 0;
        for (const std::string& w : p.workers) missing += w.empty();
        e["reason"] = missing ? std::to_string(missing) + " stage(s) without a worker" +
                                    (p.down_reason.empty() ? "" : " (" + p.down_reason + ")")
                              : "stages loading";
        if (!pipeline_recoverable(p)) e["recoverable"] = false;
      }
      pj.push_back(e);
    }
    if (!accepting) return {false, {{"status", "shutting down"}, {"pipelines", pj}}};
    return {any, {{"status", any ? "ok" : "unavailable"}, {"pipelines", pj}}};
  }

  json cluster() const {
    std::lock_guard lk(mu);
    json wj = json::array();
    for (const auto& [name, w] : workers) {
      json e = {{"name", name}, {"host", w.host}, {"pid", w.pid}, {"backend", w.backend}, {"gpus", w.gpus},
                {"state", w.state == "joined" ? "spare" : w.state}, {"busy_fraction", w.busy_fraction},
                {"busy_seconds_total", w.busy_seconds_total}, {"clock_seconds", w.clock_seconds},
                {"kv_used_tokens", w.kv_used_tokens}, {"kv_capacity_tokens", w.kv_capacity_tokens},
                {"load_progress", w.load_fraction}, {"load_bytes_done", w.load_bytes_done},
                {"load_bytes_total", w.load_bytes_total}, {"load_seconds", w.load_seconds},
                {"memory_bytes", w.memory_bytes}};
      if (w.leaving) e["leaving"] = true;
      if (!w.data_plane.is_null()) e["data_plane"] = w.data_plane;
      if (w.stage >= 0) {
        e["pipeline"] = w.pipeline;
        e["stage"] = w.stage;
        e["layers"] = {w.layers.first, w.layers.second};
      }
      if (!w.last_error.empty()) e["last_error"] = w.last_error;
      wj.push_back(e);
    }
    json pj = json::array();
    for (const Pipeline& p : pipelines) {
      json stages = json::array();
      for (size_t s = 0; s < p.workers.size(); ++s)
        stages.push_back({{"stage", s}, {"layers", {cfg.layers[s].first, cfg.layers[s].second}},
                          {"worker", p.workers[s].empty() ? json(nullptr) : json(p.workers[s])}});
      pj.push_back({{"pipeline", p.index}, {"epoch", p.epoch}, {"ready", pipeline_ready(p)},
                    {"in_flight", p.in_flight}, {"kv_reserved_tokens", p.kv_reserved}, {"admitted", p.admitted},
                    {"stages", stages}});
    }
    return {{"model", cfg.model_name}, {"workers", wj}, {"pipelines", pj}, {"queue", queue.size()},
            {"in_flight_depth", in_flight_depth()}, {"plan", current_shape().to_json()}, {"target", target.to_json()}};
  }

  SubmitResult submit(std::shared_ptr<const CompletionRequest> req, CompletionSink sink) {
    std::lock_guard lk(mu);
    if (stopping || !accepting) return {SubmitError::Unavailable, "the coordinator is shutting down"};
    bool serviceable = false;
    for (const Pipeline& p : pipelines) serviceable = serviceable || pipeline_ready(p) || pipeline_recoverable(p);
    if (!serviceable) return {SubmitError::Unavailable, "no pipeline can serve: " + health_reason()};
    if (int64_t(queue.size()) >= cfg.max_queue)
      return {SubmitError::QueueFull, "the queue is full (" + std::to_string(cfg.max_queue) + " requests waiting)"};
    auto r = std::make_unique<Request>();
    r->req = std::move(req);
    r->sink = std::move(sink);
    for (const auto& pr : r->req->prompts)
      r->kv_need += int64_t(r->req->n) * (int64_t(pr.size()) + max_tokens_of(*r->req, pr.size()));
    queue.push_back(std::move(r));
    work_cv.notify_all();
    return {};
  }

  std::string health_reason() const {
    std::string why;
    for (const Pipeline& p : pipelines)
      why += (why.empty() ? "" : "; ") + ("pipeline " + std::to_string(p.index) + ": " +
                                          (p.down_reason.empty() ? "waiting for workers" : p.down_reason));
    return why;
  }

  void stop() {
    if (stopping.exchange(true)) return;
    if (engine_thread.joinable()) engine_thread.join();
    if (control_thread.joinable()) control_thread.join();
    std::lock_guard lk(mu);
    // Workers keep their layers for the next coordinator; one waiting to hand its stage
    // over need not wait any longer.
    for (auto& [name, w] : workers)
      if (w.state != "dead") (void)control->send(name, ControlMessage::make("goodbye", {{"reason", "the coordinator is stopping"}}));
    while (!queue.empty()) {
      queue.front()->sink.on_done("the coordinator is shutting down");
      queue.pop_front();
    }
    while (!running.empty()) finish_request(*running.begin()->first, "the coordinator is shutting down");
  }
};

Coordinator::Coordinator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Coordinator::~Coordinator() { stop(); }

Expected<std::unique_ptr<Coordinator>> Coordinator::start(ClusterConfig config,
                                                          std::shared_ptr<const Tokenizer> tokenizer,
                                                          Metrics* metrics) {
  auto impl = std::make_unique<Impl>();
  transport::ControlServerOptions copt;
  copt.curve_secret_key = config.curve_secret_key;
  const std::string endpoint = "tcp://" + config.control_host + ":" + std::to_string(config.control_port);
  auto server = transport::ControlServer::bind(endpoint, copt);
  if (!server) return Status::error("coordinator: cannot bind the control plane on " + endpoint + ": " + server.error());
  transport::UcxChannelOptions uopt;
  uopt.name = "coordinator";
  auto ch = transport::UcxChannel::create(uopt);
  if (!ch) return Status::error("coordinator: cannot create the UCX data plane: " + ch.error());
  impl->cfg = std::move(config);
  impl->tokenizer = std::move(tokenizer);
  impl->metrics = metrics;
  impl->control = std::move(server).value();
  impl->channel = std::move(ch).value();
  impl->target = {impl->cfg.stages, impl->cfg.replicas, impl->cfg.layers};
  for (int r = 0; r < impl->cfg.replicas; ++r) {
    Pipeline p;
    p.index = r;
    p.workers.assign(size_t(impl->cfg.stages), "");
    impl->pipelines.push_back(std::move(p));
  }
  Impl* raw = impl.get();
  impl->control_thread = std::thread([raw] { raw->control_loop(); });
  impl->engine_thread = std::thread([raw] { raw->engine_loop(); });
  return std::unique_ptr<Coordinator>(new Coordinator(std::move(impl)));
}

SubmitResult Coordinator::submit(std::shared_ptr<const CompletionRequest> request, CompletionSink sink) {
  return impl_->submit(std::move(request), std::move(sink));
}
int Coordinator::control_port() const { return impl_->control->port(); }
std::pair<int, json> Coordinator::drain(const std::string& name) {
  Impl& m = *impl_;
  std::lock_guard lk(m.mu);
  auto it = m.workers.find(name);
  if (it == m.workers.end() || it->second.state == "dead")
    return {404, error_json(api_error(404, "no live worker named '" + name + "'", {}, "not_found_error"))};
  return m.take_out(it->second, false, "drained by the operator");
}

std::pair<int, json> Coordinator::replan(const json& body) {
  Impl& m = *impl_;
  auto bad = [](const std::string& msg, const std::string& param) {
    return std::pair<int, json>{400, error_json(api_error(400, msg, param))};
  };
  if (!body.is_object()) return bad("the plan must be a JSON object with stages, replicas and/or layers", "");
  for (const auto& [key, _] : body.items())
    if (key != "stages" && key != "replicas" && key != "layers")
      return bad("unknown field '" + key + "' (a plan has stages, replicas and layers)", key);
  if (body.empty()) return bad("the plan is empty: give stages, replicas and/or layers", "");
  std::lock_guard lk(m.mu);
  Impl::Shape shape = m.target;
  const int64_t L = m.cfg.model.n_layer;
  if (body.contains("stages")) {
    const json& v = body.at("stages");
    if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > L)
      return bad("stages must be an integer from 1 to " + std::to_string(L) + " (the model's layers)", "stages");
    shape.stages = v.get<int>();
  }
  if (body.contains("replicas")) {
    const json& v = body.at("replicas");
    if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > 64)
      return bad("replicas must be an integer from 1 to 64", "replicas");
    shape.replicas = v.get<int>();
  }
  if (body.contains("layers")) {
    const json& v = body.at("layers");
    std::vector<std::pair<int64_t, int64_t>> layers;
    if (!v.is_array()) return bad("layers must be a list of [begin, end] ranges", "layers");
    for (const json& r : v) {
      if (!r.is_array() || r.size() != 2 || !r[0].is_number_integer() || !r[1].is_number_integer())
        return bad("layers must be a list of [begin, end] ranges of integers; got " + r.dump(), "layers");
      layers.emplace_back(r[0].get<int64_t>(), r[1].get<int64_t>());
    }
    if (!body.contains("stages")) shape.stages = int(layers.size());
    if (Status s = check_layer_split(layers, shape.stages, L); !s) return bad(s.message(), "layers");
    shape.layers = std::move(layers);
  } else if (body.contains("stages") && shape.stages != m.target.stages) {
    shape.layers = balanced_layer_split(m.cfg.model, shape.stages);
  }
  std::string why;
  auto placement = m.place(shape, "", why);
  if (!placement) return {409, error_json(api_error(409, "cannot run that plan: " + why, {}, "conflict_error"))};
  m.target = shape;
  json out = {{"plan", shape.to_json()}, {"workers", *placement}};
  if (shape == m.current_shape() && m.whole()) {
    out["changed"] = false;
    return {200, out};
  }
  m.apply_shape(shape, *placement, "re-planned by the operator");
  out["changed"] = true;
  return {200, out};
}

size_t Coordinator::quiesce(std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  std::unique_lock lk(m.mu);
  m.accepting = false;
  m.idle_cv.wait_for(lk, timeout, [&] { return m.queue.empty() && m.running.empty(); });
  return m.queue.size() + m.running.size();
}

std::pair<bool, json> Coordinator::health() const { return impl_->health(); }
json Coordinator::cluster() const { return impl_->cluster(); }
void Coordinator::stop() { impl_->stop(); }

}  // namespace conveyor
