// UcxChannel's progress thread: the one thread that drives the UCX worker. It runs tasks
// callers queued (connect, send), progresses the worker, takes incoming messages off UCX's
// queue into buffers of the advertised size, hands finished ones to recv() in order per
// sender, reports failed peers, enforces deadlines, and sleeps in epoll when idle.
#include <spdlog/spdlog.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>

#include "transport/channel_address.h"
#include "transport/ucx_channel_impl.h"

namespace conveyor::transport {

using namespace ucx_detail;

// ------------------------------------------------------------------ the progress thread

void UcxChannel::Impl::loop() {
  if (takes_device && opt.progress_thread_init) opt.progress_thread_init();
  epoll_event events[2];
  for (;;) {
    bool busy = run_tasks();
    busy |= progress_burst();
    busy |= check_host_peers(false);
    busy |= close_failed_peers();
    busy |= probe_incoming();
    busy |= advance_incoming();
    busy |= finish_sends();
    check_deadlines(Clock::now());
    bool stop;
    {
      std::lock_guard lock(mu);
      stop = stopping;
    }
    if (stop && !shutdown_started) {
      begin_shutdown();
      busy = true;
    }
    if (shutdown_started && (shutdown_complete() || Clock::now() > shutdown_deadline)) break;
    if (busy) {
      last_progress = Clock::now();
      continue;
    }
    // A send or a receive under way: its next step (a rendezvous' reply, the data) is
    // microseconds off; polling for it costs less than a wake-up from epoll.
    const auto since = Clock::now() - last_progress;
    if (operations_under_way() && since < opt.spin_while_pending) continue;
    if (since < opt.spin_when_idle) continue;  // an answer may be microseconds off

    // Nothing to do: sleep until UCX or a caller has something, or the idle tick.
    int wait_ms = static_cast<int>(opt.idle_tick.count());
    if (arm_supported) {
      const ucs_status_t s = ucp_worker_arm(worker.get());
      if (s == UCS_ERR_BUSY) continue;
      if (s != UCS_OK) {
        spdlog::warn("ucx channel '{}': ucp_worker_arm: {}; polling every 1 ms instead", opt.name,
                     ucs_error_text(s));
        arm_supported = false;
      }
    }
    if (!arm_supported) wait_ms = 1;
    if (shutdown_started) wait_ms = std::min(wait_ms, 10);
    if (::epoll_wait(epoll_fd.get(), events, 2, wait_ms) < 0 && errno != EINTR) {
      spdlog::error("ucx channel '{}': epoll_wait: {}", opt.name, std::strerror(errno));
      std::this_thread::sleep_for(milliseconds(1));
    }
    std::uint64_t drained;
    while (::read(wake_fd.get(), &drained, sizeof(drained)) > 0) {
    }
    check_host_peers(true);  // a peer's pidfd may be what woke it
    for (int i = 0; i < kIdleProgressCalls; ++i) ucp_worker_progress(worker.get());
  }
  // Fail whatever is still queued (post() takes no more once stopping is set).
  run_tasks();
}

bool UcxChannel::Impl::operations_under_way() const {
  if (!sends.empty()) return true;
  for (const auto& [sender, queue] : incoming)
    for (const auto& in : queue)
      if (in->in_flight) return true;
  return false;
}

bool UcxChannel::Impl::run_tasks() {
  std::deque<std::function<void()>> batch;
  {
    std::lock_guard lock(mu);
    batch.swap(tasks);
  }
  for (auto& task : batch) task();
  return !batch.empty();
}

bool UcxChannel::Impl::progress_burst() {
  bool any = false;
  for (int i = 0; i < kMaxProgressBurst && ucp_worker_progress(worker.get()) != 0; ++i) any = true;
  return any;
}

// ---- sending

void UcxChannel::Impl::start_send(const std::shared_ptr<SendOp>& op) {
  Peer* peer = nullptr;
  {
    std::lock_guard lock(mu);
    peer = find_peer_locked(op->peer);
    if (!peer) {
      op->status = Status::error(disconnected.count(op->peer)
                                     ? "send: peer id " + std::to_string(op->peer) + " was disconnected"
                                     : "send: unknown peer id " + std::to_string(op->peer));
    } else if (!peer->failure.ok()) {
      op->status = Status::error("send to '" + peer->name + "': " + peer->failure.message());
    } else if (stopping) {
      op->status = Status::error("send to '" + peer->name + "': channel is closing");
    }
  }
  const bool device = op->payload.device && op->payload.bytes > 0;
  if (op->status.ok() && device && !peer->takes_device)
    op->status = Status::error("send to '" + peer->name +
                               "': a payload in device memory, and the peer does not take device memory");
  if (!op->status.ok() || !peer->ep) {
    if (op->status.ok())
      op->status = Status::error("send to '" + peer->name + "': endpoint closed");
    complete_send(*op);
    return;
  }

  // A device payload always goes as its own message (UCX moves it GPU to GPU).
  const bool inline_payload = !device && op->payload.bytes <= opt.inline_payload_bytes;
  if (peer->host_local) keep_envelope(*op, inline_payload);
  op->prefix.sender_id = channel_id;
  op->prefix.header_bytes = static_cast<std::uint32_t>(op->header.size());
  op->prefix.payload_bytes = op->payload.bytes;
  op->prefix.seq = next_seq++;
  op->prefix.flags = std::uint16_t((inline_payload ? wire::kFlagInline : 0) | (device ? wire::kFlagDevicePayload : 0) |
                                   (op->hello ? wire::kFlagHello : 0) | (op->redial ? wire::kFlagRedial : 0));
  if (peer->session && !op->hello) sign(*op, *peer, inline_payload);
  std::size_t n = 0;
  op->iov[n++] = {&op->prefix, sizeof(op->prefix)};
  if (!op->header.empty())
    op->iov[n++] = {const_cast<std::byte*>(op->header.data()), op->header.size()};
  if (inline_payload && op->payload.bytes)
    op->iov[n++] = {const_cast<void*>(op->payload.data), op->payload.bytes};

  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  param.cb.send = &Impl::on_send_done;
  param.user_data = op.get();
  param.datatype = ucp_dt_make_iov();

  auto issue = [&](const void* buffer, std::size_t count, ucp_tag_t tag) {
    ucs_status_ptr_t r = ucp_tag_send_nbx(peer->ep, buffer, count, tag, &param);
    if (UCS_PTR_IS_ERR(r)) {
      op->status = Status::error("send to '" + peer->name +
                                 "': ucp_tag_send_nbx: " + ucs_error_text(UCS_PTR_STATUS(r)));
      return false;
    }
    if (r != nullptr) {
      op->requests.emplace_back(worker.get(), r);
      ++op->pending;
    }
    return true;
  };
  bool ok =
      issue(op->iov, n, wire::envelope_tag(channel_id, op->prefix.header_bytes, inline_payload));
  if (ok && !inline_payload) {
    param.datatype = ucp_dt_make_contig(1);
    if (device) {  // said, not detected: UCX then skips its pointer lookup
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
      param.memory_type = UCS_MEMORY_TYPE_CUDA;
    }
    issue(op->payload.data, op->payload.bytes, wire::payload_tag(channel_id, op->prefix.seq));
  }
  sends.push_back(op);  // finish_sends() completes it once nothing is pending
}

void UcxChannel::Impl::keep_envelope(SendOp& op, bool inline_payload) {
  const std::size_t payload = inline_payload ? op.payload.bytes : 0;
  op.envelope_copy.resize(op.header.size() + payload);
  std::byte* at = op.envelope_copy.data();
  if (!op.header.empty()) std::memcpy(at, op.header.data(), op.header.size());
  op.header = {at, op.header.size()};
  if (payload) {
    std::memcpy(at + op.header.size(), op.payload.data, payload);
    op.payload.data = at + op.header.size();
  }
}

void UcxChannel::Impl::on_send_done(void* /*request*/, ucs_status_t status, void* user_data) {
  auto* op = static_cast<SendOp*>(user_data);
  --op->pending;
  if (status != UCS_OK && op->ucx_error == UCS_OK) op->ucx_error = status;
}

bool UcxChannel::Impl::finish_sends() {
  bool any = false;
  for (auto it = sends.begin(); it != sends.end();) {
    SendOp& op = **it;
    if (op.pending > 0) {
      ++it;
      continue;
    }
    if (op.status.ok() && op.ucx_error != UCS_OK) {
      std::lock_guard lock(mu);
      const Peer* p = find_peer_locked(op.peer);
      std::string text = "send to '" + (p ? p->name : "peer id " + std::to_string(op.peer)) +
                         "' failed: " + ucs_error_text(op.ucx_error);
      if (p && !p->failure.ok()) text += " (" + p->failure.message() + ")";
      op.status = Status::error(std::move(text));
    }
    // A failed send's envelope copy (a host-local peer's) may still be read by that peer.
    if (!op.status.ok() && !op.envelope_copy.empty()) failed_envelopes.push_back(std::move(op.envelope_copy));
    complete_send(op);
    it = sends.erase(it);
    any = true;
  }
  return any;
}

void UcxChannel::Impl::complete_send(SendOp& op) {
  op.requests.clear();  // all completed: releasing them ends UCX's use of the buffers
  std::lock_guard lock(op.mu);
  op.done = true;
  op.finished.store(true, std::memory_order_release);
  op.cv.notify_all();
}

// ---- receiving

bool UcxChannel::Impl::probe_incoming() {
  if (shutdown_started) return false;
  bool any = false;
  for (;;) {
    // Back-pressure: stop taking messages while recv() is behind (but always take one).
    const std::size_t queued = queued_bytes.load();
    if (queued != 0 && queued >= opt.max_queued_bytes) {
      probe_paused = true;
      break;
    }
    probe_paused = false;
    ucp_tag_recv_info_t info{};
    ucp_tag_message_h msg = ucp_tag_probe_nb(worker.get(), wire::kProbeTag, wire::kProbeMask,
                                             /*remove=*/1, &info);
    if (!msg) break;
    start_receive(msg, info);
    any = true;
  }
  return any;
}

void UcxChannel::Impl::start_receive(ucp_tag_message_h msg, const ucp_tag_recv_info_t& info) {
  auto in = std::make_unique<Incoming>();
  in->tag = info.sender_tag;
  const std::uint32_t sender = wire::tag_sender(info.sender_tag);
  const std::size_t header_bytes = wire::tag_header_bytes(info.sender_tag);
  const bool inline_payload = wire::tag_inline(info.sender_tag);

  std::size_t n = 0;
  if (info.length < sizeof(wire::WirePrefix) + header_bytes ||
      (!inline_payload && info.length != sizeof(wire::WirePrefix) + header_bytes)) {
    in->error = Status::error("malformed message from channel " + std::to_string(sender) + ": " +
                              std::to_string(info.length) + " bytes with a header of " +
                              std::to_string(header_bytes));
    in->scratch.resize(info.length);
    in->iov[n++] = {in->scratch.data(), in->scratch.size()};
  } else {
    try {
      in->message.header.resize(header_bytes);
      if (inline_payload)
        in->message.payload = pool.allocate(info.length - sizeof(wire::WirePrefix) - header_bytes);
      in->iov[n++] = {&in->prefix, sizeof(in->prefix)};
      if (header_bytes) in->iov[n++] = {in->message.header.data(), header_bytes};
      if (!in->message.payload.empty())
        in->iov[n++] = {in->message.payload.data(), in->message.payload.size()};
    } catch (const std::bad_alloc&) {
      // Still has to be taken off UCX's queue: into a 1-byte sink, truncated (an error).
      in->error = Status::error("out of memory receiving " + std::to_string(info.length) +
                                " bytes from channel " + std::to_string(sender));
      in->message = Message();
      in->scratch.resize(1);
      n = 0;
      in->iov[n++] = {in->scratch.data(), in->scratch.size()};
    }
  }
  in->queued_bytes = info.length;
  queued_bytes += in->queued_bytes;

  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  param.cb.recv = &Impl::on_recv_done;
  param.user_data = in.get();
  param.datatype = ucp_dt_make_iov();
  // In flight from before the call: UCX may run the callback inside it and still return the
  // request (see posted()).
  in->in_flight = true;
  posted(*in, ucp_tag_msg_recv_nbx(worker.get(), in->iov, n, msg, &param));
  incoming[sender].push_back(std::move(in));
}

// Takes what posting a receive returned. UCX 1.13 can complete a receive inside the call that
// posts it, callback included, and still return its request: a message of several eager
// fragments that had all arrived unexpected (a payload over one fragment below the
// rendezvous threshold, e.g. UCX_RNDV_THRESH=1m over TCP). So the callback alone says when
// it is done: in_flight was set before the call, and only the callback clears it.
void UcxChannel::Impl::posted(Incoming& in, ucs_status_ptr_t r) {
  if (UCS_PTR_IS_ERR(r)) {
    in.result = UCS_PTR_STATUS(r);
    in.in_flight = false;
  } else if (r == nullptr) {
    in.in_flight = false;  // completed at once, without the callback
  } else {
    in.request = ucx::Request(worker.get(), r);  // released once done (advance())
  }
}

void UcxChannel::Impl::on_recv_done(void* /*request*/, ucs_status_t status,
                                    const ucp_tag_recv_info_t* /*info*/, void* user_data) {
  auto* in = static_cast<Incoming*>(user_data);
  in->in_flight = false;
  in->result = status;
}

// "peer 'stage1' (channel 123)" when connected to that channel, else "channel 123".
std::string UcxChannel::Impl::sender_name(std::uint32_t channel) {
  std::lock_guard lock(mu);
  for (const auto& [id, peer] : peers)
    if (peer->channel_id == channel)
      return "peer '" + peer->name + "' (channel " + std::to_string(channel) + ")";
  return "channel " + std::to_string(channel);
}

// Marks a message failed. A UCX request still in flight (one UCX would not cancel: a
// rendezvous already under way) stays owned, with its buffers, until it completes or the
// worker is destroyed: advance_incoming() parks it in `abandoned`.
void UcxChannel::Impl::abandon(Incoming& in, const std::string& why) {
  if (in.finished()) return;
  const char* what = in.stage == Incoming::kEnvelope ? "envelope" : "payload";
  in.error = Status::error(std::string("receiving the ") + what + " of message " +
                           std::to_string(in.prefix.seq) + " from " +
                           sender_name(wire::tag_sender(in.tag)) + " failed: " + why);
  in.stage = Incoming::kFailed;
  if (in.in_flight) in.request.cancel();
}

// Moves one message forward once its current stage has completed.
void UcxChannel::Impl::advance(Incoming& in) {
  if (in.in_flight || in.finished()) return;
  in.request.reset();
  const std::uint32_t sender = wire::tag_sender(in.tag);
  if (in.result != UCS_OK) {
    abandon(in, ucs_error_text(in.result));
    return;
  }
  if (in.stage == Incoming::kPayload) {
    in.stage = Incoming::kDone;
    return;
  }
  // The envelope is in: check it, then fetch a separate payload if there is one.
  if (!in.error.ok()) {
    in.stage = Incoming::kFailed;
    return;
  }
  const wire::WirePrefix& p = in.prefix;
  const bool inline_payload = wire::tag_inline(in.tag);
  if (p.magic != wire::kMagic || p.version != wire::kVersion || p.sender_id != sender ||
      p.header_bytes != in.message.header.size() ||
      ((p.flags & wire::kFlagInline) != 0) != inline_payload ||
      (inline_payload && p.payload_bytes != in.message.payload.size())) {
    in.error = Status::error("malformed envelope from channel " + std::to_string(sender) +
                             " (magic/version/length mismatch)");
    in.stage = Incoming::kFailed;
    return;
  }
  if (key && !admitted(in, sender)) return;  // an authenticated channel: ucx_auth.cc
  in.message.sender_id = sender;
  in.message.seq = p.seq;
  if (inline_payload || p.payload_bytes == 0) {
    in.stage = Incoming::kDone;
    return;
  }
  const bool device = (p.flags & wire::kFlagDevicePayload) != 0 && takes_device;
  try {
    in.message.payload = device ? device_pool.allocate(p.payload_bytes) : pool.allocate(p.payload_bytes);
    in.message.payload_on_device = device;
  } catch (const std::bad_alloc&) {
    // The payload stays in UCX's unexpected queue; report the loss.
    in.error = Status::error(std::string("out of ") + (device ? "device" : "host") + " memory for a " +
                             std::to_string(p.payload_bytes) + "-byte payload from channel " +
                             std::to_string(sender));
    in.stage = Incoming::kFailed;
    return;
  }
  in.queued_bytes += p.payload_bytes;
  queued_bytes += p.payload_bytes;
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  param.cb.recv = &Impl::on_recv_done;
  param.user_data = &in;
  param.datatype = ucp_dt_make_contig(1);
  if (device) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    param.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  in.stage = Incoming::kPayload;
  in.payload_posted = Clock::now();
  in.in_flight = true;  // see posted()
  posted(in, ucp_tag_recv_nbx(worker.get(), in.message.payload.data(), p.payload_bytes,
                              wire::payload_tag(sender, p.seq), wire::kFullMask, &param));
  if (!in.in_flight) {
    advance(in);  // done (or failed) already
  } else {
    // Its envelope came on a connection the sender has since closed and dialled again
    // (ucx_auth.cc): a payload not already here will not come, and would hold every later
    // message of that sender until stalled_receive_timeout.
    if (before_redial(sender, p.seq)) {
      const std::string why = "its sender dialled this channel again, having closed the connection it came on";
      spdlog::info("ucx channel '{}': gave up the payload of message {} from {}, whose envelope came late: {}",
                   opt.name, p.seq, sender_name(sender), why);
      abandon(in, "cut off (" + why + ")");
    }
  }
}

// Advances every message and hands finished ones to recv(), in order per sender.
bool UcxChannel::Impl::advance_incoming() {
  std::vector<InboxItem> ready;
  // What a failed peer still had under way will not complete: give it up now (this runs
  // after the progress and probe of this round, so whatever did arrive is kept).
  for (const auto& [channel, why] : pending_failures) {
    auto it = incoming.find(channel);
    if (it == incoming.end()) continue;
    for (auto& in : it->second) {
      advance(*in);
      if (in->in_flight) abandon(*in, "cut off (" + why.message() + ")");
    }
  }
  for (auto& [sender, queue] : incoming) {
    for (auto& in : queue) advance(*in);
    while (!queue.empty() && queue.front()->finished()) {
      std::unique_ptr<Incoming> in = std::move(queue.front());
      queue.pop_front();
      if (in->stage == Incoming::kDropped) {  // taken by the channel: nothing for recv()
        queued_bytes -= in->queued_bytes;
        continue;
      }
      InboxItem item;
      item.queued_bytes = in->queued_bytes;
      if (in->stage == Incoming::kDone)
        item.message = std::move(in->message);
      else
        item.error = in->error;
      ready.push_back(std::move(item));
      if (in->in_flight) abandoned.push_back(std::move(in));
    }
  }
  abandoned.remove_if([](const std::unique_ptr<Incoming>& in) { return !in->in_flight; });
  std::size_t arriving = 0;
  for (const auto& [sender, queue] : incoming)
    for (const auto& in : queue) arriving += in->stage == Incoming::kPayload && in->in_flight;
  payloads_arriving = arriving;
  std::erase_if(incoming, [](const auto& kv) { return kv.second.empty(); });
  std::erase_if(pending_failures, [&](auto& failure) {
    if (incoming.count(failure.first)) return false;
    InboxItem item;
    item.error = std::move(failure.second);
    ready.push_back(std::move(item));
    return true;
  });
  if (ready.empty()) return false;
  std::lock_guard lock(mu);
  for (auto& item : ready) inbox.push_back(std::move(item));
  inbox_size.store(inbox.size(), std::memory_order_release);
  inbox_cv.notify_all();
  return true;
}

// ---- failures and timers

void UcxChannel::Impl::on_ep_error(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* peer = static_cast<Peer*>(arg);
  peer->impl->fail_peer(*peer, Status::error(ucs_error_text(status)));
}

// Marks a peer failed (once), tells recv(), and schedules its endpoint to be closed. A parked
// endpoint's failure is nobody's: it is only closed.
void UcxChannel::Impl::fail_peer(Peer& peer, const Status& why) {
  {
    std::lock_guard lock(mu);
    if (!peer.failure.ok()) return;
    peer.failure = Status::error("peer '" + peer.name + "' failed: " + why.message());
    if (peer.parked) {
      spdlog::info("ucx channel '{}': the idle connection to {} ended: {}", opt.name, peer.name, why.message());
    } else {
      spdlog::warn("ucx channel '{}': {}", opt.name, peer.failure.message());
      pending_failures.emplace_back(peer.channel_id, peer.failure);
    }
  }
  peer.close_pending = true;  // and advance_incoming() gives up its unfinished messages
}

bool UcxChannel::Impl::close_failed_peers() {
  std::vector<Peer*> to_close;
  {
    std::lock_guard lock(mu);
    for (auto& [id, peer] : peers)
      if (peer->close_pending && peer->ep) to_close.push_back(peer.get());
  }
  for (Peer* peer : to_close) {
    peer->close_pending = false;
    close_endpoint(*peer, /*force=*/true);
  }
  bool closed_parked = false;
  for (auto it = parked.begin(); it != parked.end();) {
    if (!it->second->close_pending) {
      ++it;
      continue;
    }
    close_endpoint(*it->second, /*force=*/true);
    retire(std::move(it->second));
    it = parked.erase(it);
    closed_parked = true;
  }
  closing.remove_if([](const Closing& c) { return c.request.done(); });
  closed_peers_held = size_t(std::count_if(closing.begin(), closing.end(), [](const Closing& c) { return c.owned != nullptr; }));
  return !to_close.empty() || closed_parked;
}

void UcxChannel::Impl::park_or_close(std::unique_ptr<Peer> peer) {
  // Sends queued for its id fail (it has left the id map). One under way would finish on a
  // parked endpoint, and disconnect() promises it fails at once: then the endpoint is closed.
  const bool sending = std::any_of(sends.begin(), sends.end(), [&](const auto& op) { return op->peer == peer->id; });
  bool works;
  {
    std::lock_guard lock(mu);
    works = !sending && peer->failure.ok() && peer->ep && !peer->close_pending && !parked.count(peer->channel_id);
    if (works) {
      peer->parked = true;
      parked[peer->channel_id] = std::move(peer);
      return;
    }
    if (peer->failure.ok()) peer->failure = Status::error("peer '" + peer->name + "' was disconnected");
  }
  // Failed already, or a second connection to a channel that has one parked: closed.
  close_endpoint(*peer, /*force=*/true);
  retire(std::move(peer));
}

void UcxChannel::Impl::retire(std::unique_ptr<Peer> peer) {
  closed_channels.insert(peer->channel_id);
  for (Closing& c : closing)
    if (c.peer == peer.get()) {
      c.owned = std::move(peer);
      return;
    }
}

std::unique_ptr<UcxChannel::Impl::Peer> UcxChannel::Impl::take_parked(std::uint32_t channel,
                                                                      const std::vector<std::byte>& address) {
  auto it = parked.find(channel);
  if (it == parked.end() || it->second->close_pending || !it->second->ep) return nullptr;
  if (it->second->address != address) return nullptr;  // another channel with that id: leave it
  std::unique_ptr<Peer> peer = std::move(it->second);
  parked.erase(it);
  peer->parked = false;
  return peer;
}

// Forced: every request on the endpoint completes with an error at once. Otherwise UCX
// first flushes what was sent (the close request completes when the peer has it). A host-local
// peer's endpoint cannot be forced (UCX refuses it without peer-failure handling): its process
// is no longer watched, its sends end here (abandon_sends), and the flush is not waited for.
void UcxChannel::Impl::close_endpoint(Peer& peer, bool force) {
  if (!peer.ep) return;
  if (peer.host_local) {
    if (peer.pidfd.get() >= 0) ::epoll_ctl(epoll_fd.get(), EPOLL_CTL_DEL, peer.pidfd.get(), nullptr);
    peer.pidfd = UniqueFd();
    abandon_sends(peer);
    force = false;
  }
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t r = ucp_ep_close_nbx(std::exchange(peer.ep, nullptr), &param);
  if (UCS_PTR_IS_PTR(r)) closing.push_back({ucx::Request(worker.get(), r), &peer, nullptr});
}

bool UcxChannel::Impl::check_host_peers(bool now) {
  if (!host) return false;
  const auto t = Clock::now();
  if (!now && t - last_host_check < milliseconds(1)) return false;
  last_host_check = t;
  std::vector<Peer*> watched;
  {
    std::lock_guard lock(mu);
    for (auto& [id, peer] : peers)
      if (peer->pidfd.get() >= 0 && peer->failure.ok()) watched.push_back(peer.get());
  }
  for (auto& [channel, peer] : parked)
    if (peer->pidfd.get() >= 0 && peer->failure.ok()) watched.push_back(peer.get());
  bool any = false;
  for (Peer* peer : watched) {
    pollfd p{peer->pidfd.get(), POLLIN, 0};
    if (::poll(&p, 1, 0) <= 0) continue;
    // Level-triggered: it would wake every epoll_wait from now on.
    ::epoll_ctl(epoll_fd.get(), EPOLL_CTL_DEL, peer->pidfd.get(), nullptr);
    fail_peer(*peer, Status::error("its process (pid " + std::to_string(peer->pid) + ", this host) exited"));
    any = true;
  }
  return any;
}

void UcxChannel::Impl::abandon_sends(const Peer& peer) {
  for (const std::shared_ptr<SendOp>& op : sends) {
    if (op->peer != peer.id || op->pending <= 0) continue;
    if (op->status.ok()) {
      std::lock_guard lock(mu);
      op->status = Status::error("send to '" + peer.name + "': " +
                                 (peer.failure.ok() ? std::string("endpoint closed") : peer.failure.message()));
    }
    abandoned_sends.emplace_back(op, std::move(op->requests));
    op->requests.clear();
    op->pending = 0;  // finish_sends() wakes the caller
  }
}

void UcxChannel::Impl::check_deadlines(Clock::time_point now) {
  for (auto& op : sends) {
    if (op->pending == 0 || op->timed_out || now < op->deadline) continue;
    op->timed_out = true;
    Peer* peer;
    {
      std::lock_guard lock(mu);
      peer = find_peer_locked(op->peer);
    }
    const std::string timeout_text =
        "send did not complete within " + std::to_string(op->timeout.count()) + " ms";
    op->status = Status::error("send to '" + (peer ? peer->name : std::string("?")) +
                               "': " + timeout_text + " (peer marked failed)");
    for (auto& r : op->requests) r.cancel();
    if (peer) fail_peer(*peer, Status::error(timeout_text));
  }
  for (auto& [sender, queue] : incoming) {
    for (auto& in : queue) {
      if (in->stage != Incoming::kPayload || !in->in_flight ||
          now - in->payload_posted < opt.stalled_receive_timeout)
        continue;
      const std::string why =
          "it did not arrive within " + std::to_string(opt.stalled_receive_timeout.count()) + " ms";
      spdlog::warn("ucx channel '{}': payload of message {} from {}: {}; giving it up", opt.name,
                   in->prefix.seq, sender_name(sender), why);
      abandon(*in, why);
    }
  }
}

void UcxChannel::Impl::begin_shutdown() {
  shutdown_started = true;
  shutdown_deadline = Clock::now() + opt.close_timeout;
  for (auto& [sender, queue] : incoming)
    for (auto& in : queue)
      if (in->in_flight) in->request.cancel();
  // Healthy peers get what was sent (flush, bounded by close_timeout); failed ones are
  // closed at once.
  std::vector<std::pair<Peer*, bool>> all;
  {
    std::lock_guard lock(mu);
    for (auto& [id, peer] : peers)
      if (peer->ep) all.emplace_back(peer.get(), !peer->failure.ok());
    for (auto& [channel, peer] : parked)
      if (peer->ep) all.emplace_back(peer.get(), !peer->failure.ok());
  }
  for (auto [peer, failed] : all) close_endpoint(*peer, failed);
}

bool UcxChannel::Impl::shutdown_complete() const {
  if (!sends.empty() || !closing.empty()) return false;
  for (const auto& [sender, queue] : incoming)
    for (const auto& in : queue)
      if (in->in_flight) return false;
  return true;
}

}  // namespace conveyor::transport
