// UcxChannel: set-up, tear-down and the public API (which hands work to the progress
// thread in ucx_progress.cc). Internals and invariants: ucx_channel_impl.h.
#include "transport/ucx_channel.h"

#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <future>

#include "common/options.h"
#include "transport/channel_address.h"
#include "transport/ucx_channel_impl.h"

namespace conveyor::transport {

using namespace ucx_detail;

// ------------------------------------------------------------------ set-up and tear-down

namespace {

// Polls `ready` for up to `window` (UcxChannelOptions::spin_in_calls) before a caller takes
// its lock and blocks, if it still must.
template <class F>
void spin_until(std::chrono::microseconds window, F&& ready) {
  if (window.count() <= 0) return;
  const auto until = Clock::now() + window;
  while (!ready() && Clock::now() < until) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
}

// UCX's configuration from the channel's options. The operator's UCX_* (declared in
// common/options.h as UCX's own) win over these choices.
Status configure(ucp_config_t* config, const UcxChannelOptions& opt) {
  if (!ucx_variable(UcxVariable::Tls) && !opt.transports.empty())
    CONVEYOR_UCX_CHECK(ucp_config_modify(config, "TLS", opt.transports.c_str()));
  if (!ucx_variable(UcxVariable::NetDevices) && !opt.net_devices.empty())
    CONVEYOR_UCX_CHECK(ucp_config_modify(config, "NET_DEVICES", opt.net_devices.c_str()));
  // UCX's endpoint keepalive stays off unless asked for (transport/README.md, "Closing an
  // endpoint"): its check of an endpoint this side has closed makes UCX 1.13's TCP transport
  // read freed state (SIGSEGV in uct_tcp_iface_progress, issue 28).
  const std::optional<std::string> env_keepalive = ucx_variable(UcxVariable::KeepaliveInterval);
  if (!env_keepalive) {
    const std::string interval =
        opt.keepalive_interval.count() > 0 ? std::to_string(opt.keepalive_interval.count()) + "ms" : "inf";
    CONVEYOR_UCX_CHECK(ucp_config_modify(config, "KEEPALIVE_INTERVAL", interval.c_str()));
  } else if (*env_keepalive != "inf") {
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true))
      spdlog::warn("UCX_KEEPALIVE_INTERVAL={} turns UCX's endpoint keepalive on: with UCX 1.13 over TCP a peer "
                   "that resumes after this process closed its endpoint (a stop, a healed link cut) can crash "
                   "it (issue 28); unset, it stays off",
                   *env_keepalive);
  }
  // Non-blocking TCP connects: UCX 1.13 otherwise dials with a blocking connect() on the
  // progress thread, which a peer whose SYNs are dropped holds for the kernel's SYN retries
  // (about 2 minutes), stalling the whole data plane (issue 28, an unreachable peer). A
  // transport's key goes by its name in that transport's table: UCX applies it to every
  // interface whose table has it (only tcp's), and "TCP_CONN_NB" would match none.
  if (!ucx_variable(UcxVariable::TcpConnNb)) CONVEYOR_UCX_CHECK(ucp_config_modify(config, "CONN_NB", "y"));
  // One TCP event a wait: UCX 1.13 handles the events of one epoll_wait in turn, and when one
  // of them fails an endpoint (UCX then closes the other endpoints of that peer), a later
  // event of the same batch belongs to a closed endpoint and UCX aborts on its assertion
  // (tcp_iface.c:307, issue 28: 6 runs of UcxStoppedPeer in 75 with UCX's default, 0 in 137
  // with 1). The progress thread calls progress again while there is work, so nothing waits.
  if (!ucx_variable(UcxVariable::TcpMaxPoll)) CONVEYOR_UCX_CHECK(ucp_config_modify(config, "MAX_POLL", "1"));
  return ok_status();
}

}  // namespace

Status UcxChannel::Impl::init() {
  channel_id = opt.channel_id ? opt.channel_id : random_channel_id();
  if (!opt.auth_secret.empty()) {
    key = auth::derive_key(opt.auth_secret);
    nonce = auth::random_nonce();
  }

  ucp_config_t* raw_config = nullptr;
  CONVEYOR_UCX_CHECK(ucp_config_read(nullptr, nullptr, &raw_config));
  ucx::Config config(raw_config);
  if (Status s = configure(config.get(), opt); !s.ok()) return s;
  const std::optional<std::string> env_tls = ucx_variable(UcxVariable::Tls);

  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  params.name = opt.name.c_str();
  ucp_context_h raw_context = nullptr;
  CONVEYOR_UCX_CHECK(ucp_init(&params, config.get(), &raw_context));
  context = ucx::Context(raw_context);
  {
    ucp_context_attr_t attr{};
    attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
    CONVEYOR_UCX_CHECK(ucp_context_query(context.get(), &attr));
    cuda_memory = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  }
  // UCX detects CUDA memory even when UCX_TLS leaves out the transports that move it
  // (cuda_copy, cuda_ipc); such a channel must not send or take device payloads.
  {
    const std::string tls = env_tls ? *env_tls : opt.transports;
    if (!tls.empty() && tls[0] != '^' && tls.find("cuda") == std::string::npos && tls.find("all") == std::string::npos)
      cuda_memory = false;
  }
  takes_device = cuda_memory && static_cast<bool>(opt.device_allocator.allocate);
  if (opt.host_shared_memory) {
    auto me = this_process_identity();
    if (me) host = *me;
    else spdlog::warn("ucx channel '{}': no shared memory with this host's channels: {}", opt.name, me.error());
  }

  ucp_worker_params_t wparams{};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_NAME;
  wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
  wparams.name = opt.name.c_str();
  ucp_worker_h raw_worker = nullptr;
  CONVEYOR_UCX_CHECK(ucp_worker_create(context.get(), &wparams, &raw_worker));
  worker = ucx::Worker(raw_worker);

  {
    ucp_address_t* raw_address = nullptr;
    std::size_t address_bytes = 0;
    CONVEYOR_UCX_CHECK(ucp_worker_get_address(worker.get(), &raw_address, &address_bytes));
    ucx::WorkerAddress address(worker.get(), raw_address, address_bytes);
    address_blob = encode_channel_address(ChannelKind::kUcx, channel_id, address.bytes(),
                                          takes_device ? kAddressTakesDeviceMemory : 0, key ? &nonce : nullptr,
                                          host ? &*host : nullptr);
  }

  CONVEYOR_UCX_CHECK(ucp_worker_get_efd(worker.get(), &worker_fd));
  wake_fd = UniqueFd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (wake_fd.get() < 0) return errno_status("eventfd");
  epoll_fd = UniqueFd(::epoll_create1(EPOLL_CLOEXEC));
  if (epoll_fd.get() < 0) return errno_status("epoll_create1");
  for (int fd : {worker_fd, wake_fd.get()}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (::epoll_ctl(epoll_fd.get(), EPOLL_CTL_ADD, fd, &ev) != 0) return errno_status("epoll_ctl");
  }
  thread = std::thread([this] { loop(); });
  return ok_status();
}

UcxChannel::Impl::~Impl() {
  if (thread.joinable()) {
    {
      std::lock_guard lock(mu);
      stopping = true;
    }
    wake();
    thread.join();
  }
  // Requests first (cancelled if still in flight), then endpoints and the worker, then the
  // buffers UCX may have been writing into, then the context (a member: destroyed last).
  const bool stranded = receive_stranded();
  for (auto& [sender, queue] : incoming)
    for (auto& in : queue) in->request.reset();
  for (auto& in : abandoned) in->request.reset();
  for (auto& op : sends) op->requests.clear();
  for (auto& [op, requests] : abandoned_sends) requests.clear();
  closing.clear();
  auto force_close = [](Peer& peer) {
    if (!peer.ep) return;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = peer.host_local ? 0 : UCP_EP_CLOSE_FLAG_FORCE;  // UCX refuses to force a NONE endpoint
    ucs_status_ptr_t r = ucp_ep_close_nbx(std::exchange(peer.ep, nullptr), &param);
    if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);
  };
  for (auto& [id, peer] : peers) force_close(*peer);
  for (auto& [channel, peer] : parked) force_close(*peer);
  if (stranded) {
    // UCX 1.13's ucp_worker_destroy aborts (an assertion) on an endpoint that still holds a
    // receive: a rendezvous whose sender gave it up (closed its endpoint) without this side
    // hearing of it. Leave the worker, its context and those buffers to the process's exit.
    spdlog::warn("ucx channel '{}': a receive UCX can neither finish nor cancel is still under way (its sender "
                 "gave it up); the UCX worker is left to the process's exit",
                 opt.name);
    (void)worker.release();
    (void)context.release();
    for (auto& [sender, queue] : incoming)
      for (auto& in : queue) (void)in.release();
    for (auto& in : abandoned) (void)in.release();
  }
  worker.reset();
  for (auto& op : sends) {  // none unless UCX ignored a forced close: fail them now
    if (op->status.ok()) op->status = Status::error("channel closed");
    std::lock_guard lock(op->mu);
    op->done = true;
    op->finished.store(true, std::memory_order_release);
    op->cv.notify_all();
  }
  incoming.clear();
  abandoned.clear();
}

bool UcxChannel::Impl::receive_stranded() const {
  auto stuck = [](const std::unique_ptr<Incoming>& in) { return in->request && !in->request.done(); };
  for (const auto& [sender, queue] : incoming)
    if (std::any_of(queue.begin(), queue.end(), stuck)) return true;
  return std::any_of(abandoned.begin(), abandoned.end(), stuck);
}

void UcxChannel::Impl::wake() {
  const std::uint64_t one = 1;
  // EAGAIN (counter saturated) still leaves the fd readable: nothing to do.
  [[maybe_unused]] ssize_t n = ::write(wake_fd.get(), &one, sizeof(one));
}

Status UcxChannel::Impl::post(std::function<void()> task) {
  {
    std::lock_guard lock(mu);
    if (stopping) return Status::error("channel is closing");
    tasks.push_back(std::move(task));
  }
  wake();
  return ok_status();
}

Status UcxChannel::Impl::open_session(Peer& peer, const ChannelAddress& to) {
  const bool theirs = (to.flags & kAddressAuthenticated) != 0;
  if (!key) {
    if (theirs) return Status::error("the peer's channel is authenticated and this one has no cluster secret");
    return ok_status();
  }
  if (!theirs) return Status::error("the peer's channel is not authenticated (started without the cluster's secret)");
  const auth::Handshake h{.sender_id = channel_id, .receiver_id = to.channel_id, .receiver_nonce = to.nonce,
                          .sender_nonce = auth::random_nonce()};
  const auth::Proof proof = auth::hello_proof(*key, h);
  peer.session = auth::session_key(*key, h);
  peer.hello.resize(auth::kHelloBytes);
  std::memcpy(peer.hello.data(), h.sender_nonce.data(), h.sender_nonce.size());
  std::memcpy(peer.hello.data() + h.sender_nonce.size(), proof.data(), proof.size());
  return ok_status();
}

UcxChannel::Impl::Peer* UcxChannel::Impl::find_peer_locked(PeerId id) {
  auto it = peers.find(id);
  return it == peers.end() ? nullptr : it->second.get();
}

// ------------------------------------------------------------------ public API

UcxChannel::UcxChannel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
UcxChannel::~UcxChannel() = default;

Expected<std::unique_ptr<UcxChannel>> UcxChannel::create(UcxChannelOptions options) {
  auto impl = std::make_unique<Impl>(std::move(options));
  if (Status s = impl->init(); !s.ok())
    return Status::error("ucx channel '" + impl->opt.name + "': " + s.message());
  return std::unique_ptr<UcxChannel>(new UcxChannel(std::move(impl)));
}

std::uint32_t UcxChannel::id() const { return impl_->channel_id; }
std::vector<std::byte> UcxChannel::address() const { return impl_->address_blob; }

Expected<PeerId> UcxChannel::connect(std::span<const std::byte> peer_address, std::string name) {
  auto parsed = parse_channel_address(peer_address);
  if (!parsed.ok()) return Status::error("connect to '" + name + "': " + parsed.error());
  if (parsed->kind != ChannelKind::kUcx)
    return Status::error("connect to '" + name + "': not a UCX channel address (in-process?)");
  auto peer = std::make_unique<Impl::Peer>();
  peer->impl = impl_.get();
  peer->name = std::move(name);
  peer->channel_id = parsed->channel_id;
  peer->takes_device = (parsed->flags & kAddressTakesDeviceMemory) != 0;
  if (impl_->host && (parsed->flags & kAddressHostSharedMemory) && impl_->host->same_host(parsed->host)) {
    // Both ends decide alike (each names the other's process), as UCX wants the same error
    // mode at both ends of a connection.
    if (auto fd = open_process(*impl_->host, parsed->host)) {
      peer->host_local = true;
      peer->pid = parsed->host.pid;
      peer->pidfd = UniqueFd(*fd);
    } else {
      spdlog::info("ucx channel '{}': {} is on this host but not over shared memory: {}", impl_->opt.name, peer->name,
                   fd.error());
    }
  }
  peer->address.assign(parsed->body.begin(), parsed->body.end());
  if (Status s = impl_->open_session(*peer, *parsed); !s.ok()) return Status::error("connect to '" + peer->name + "': " + s.message());

  auto result = std::make_shared<std::promise<Status>>();
  auto future = result->get_future();
  Impl* impl = impl_.get();
  {
    std::lock_guard lock(impl->mu);
    peer->id = impl->next_peer_id++;
  }
  const PeerId id = peer->id;
  const std::string peer_name = peer->name;
  auto shared_peer = std::make_shared<std::unique_ptr<Impl::Peer>>(std::move(peer));
  Status posted = impl->post([impl, shared_peer, result] {
    std::unique_ptr<Impl::Peer>& fresh = *shared_peer;
    // An endpoint this channel parked for that channel works: take it again, with this
    // connect's id, name and handshake (ucx_channel_impl.h, `parked`).
    if (std::unique_ptr<Impl::Peer> kept = impl->take_parked(fresh->channel_id, fresh->address)) {
      kept->id = fresh->id;
      kept->name = std::move(fresh->name);
      kept->session = std::move(fresh->session);
      kept->hello = std::move(fresh->hello);
      Impl::Peer* raw = kept.get();
      {
        std::lock_guard lock(impl->mu);
        impl->peers[raw->id] = std::move(kept);
      }
      if (raw->session) impl->send_hello(*raw);
      result->set_value(ok_status());
      return;
    }
    Impl::Peer* raw = fresh.get();
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_NAME;
    params.address = reinterpret_cast<const ucp_address_t*>(raw->address.data());
    // A host-local peer's death is seen through its pidfd (check_host_peers), not by UCX.
    params.err_mode = raw->host_local ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = &Impl::on_ep_error;
    params.err_handler.arg = raw;
    params.name = raw->name.c_str();
    const ucs_status_t s = ucp_ep_create(impl->worker.get(), &params, &raw->ep);
    if (s != UCS_OK) {
      std::string text = "ucp_ep_create: " + ucs_error_text(s);
      if (s == UCS_ERR_UNREACHABLE)
        text +=
            " (no transport in common that detects peer failure: in UCX 1.13 shared "
            "memory cannot, so UCX_TLS needs tcp or an RDMA transport)";
      result->set_value(Status::error(std::move(text)));
      return;
    }
    if (raw->host_local) {  // its exit wakes the progress thread
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.fd = raw->pidfd.get();
      if (::epoll_ctl(impl->epoll_fd.get(), EPOLL_CTL_ADD, raw->pidfd.get(), &ev) != 0)
        spdlog::warn("ucx channel '{}': epoll_ctl on {}'s pidfd: {}; its exit is seen within a millisecond of "
                     "progress instead",
                     impl->opt.name, raw->name, std::strerror(errno));
    }
    {
      std::lock_guard lock(impl->mu);
      impl->peers[raw->id] = std::move(fresh);
    }
    if (raw->session) impl->send_hello(*raw);  // before anything else on this endpoint
    result->set_value(ok_status());
  });
  if (!posted.ok()) return Status::error("connect to '" + peer_name + "': " + posted.message());
  if (future.wait_for(kTaskTimeout) != std::future_status::ready)
    return Status::error("connect: the progress thread did not answer within 10 s");
  if (Status s = future.get(); !s.ok()) return Status::error("connect: " + s.message());
  return id;
}

Status UcxChannel::disconnect(PeerId peer) {
  auto result = std::make_shared<std::promise<Status>>();
  auto future = result->get_future();
  Impl* impl = impl_.get();
  Status posted = impl->post([impl, peer, result] {
    std::unique_ptr<Impl::Peer> owned;
    {
      std::lock_guard lock(impl->mu);
      auto it = impl->peers.find(peer);
      if (it == impl->peers.end()) {
        result->set_value(Status::error("disconnect: unknown peer id " + std::to_string(peer)));
        return;
      }
      owned = std::move(it->second);
      impl->peers.erase(it);
      impl->disconnected.insert(peer);  // sends still queued for it fail, naming why
      if (impl->disconnected.size() > Impl::kRememberedDisconnects) impl->disconnected.erase(impl->disconnected.begin());
    }
    impl->park_or_close(std::move(owned));
    result->set_value(ok_status());
  });
  if (!posted.ok()) return posted;
  if (future.wait_for(kTaskTimeout) != std::future_status::ready)
    return Status::error("disconnect: the progress thread did not answer within 10 s");
  return future.get();
}

Status UcxChannel::send(PeerId peer, std::span<const std::byte> header, PayloadView payload,
                        std::chrono::milliseconds timeout) {
  if (header.size() > wire::kMaxHeaderBytes)
    return Status::error("send: header of " + std::to_string(header.size()) +
                         " bytes exceeds the limit of " + std::to_string(wire::kMaxHeaderBytes));
  if (payload.bytes && !payload.data) return Status::error("send: payload with no data pointer");
  if (payload.device && payload.bytes && !impl_->cuda_memory)
    return Status::error("send: a payload in device memory, and this UCX cannot move CUDA memory");
  auto op = std::make_shared<Impl::SendOp>();
  op->peer = peer;
  op->header = header;
  op->payload = payload;
  op->timeout = timeout;
  op->deadline = Clock::now() + timeout;
  Impl* impl = impl_.get();
  if (Status s = impl->post([impl, op] { impl->start_send(op); }); !s.ok())
    return Status::error("send: " + s.message());
  // The progress thread completes every send by its deadline (a forced endpoint close
  // cancels what the peer does not take), so this wait is bounded by `timeout` plus the
  // time UCX needs to cancel.
  spin_until(impl->opt.spin_in_calls, [&] { return op->finished.load(std::memory_order_acquire); });
  std::unique_lock lock(op->mu);
  op->cv.wait(lock, [&] { return op->done; });
  return op->status;
}

Expected<std::optional<Message>> UcxChannel::recv(std::chrono::milliseconds timeout) {
  Impl& impl = *impl_;
  Impl::InboxItem item;
  spin_until(std::min<std::chrono::microseconds>(impl.opt.spin_in_calls, timeout), [&] {
    return impl.inbox_size.load(std::memory_order_acquire) > 0 || interrupt_seen_.load(std::memory_order_acquire);
  });
  {
    std::unique_lock lock(impl.mu);
    const bool ready = impl.inbox_cv.wait_for(lock, timeout, [&] { return !impl.inbox.empty() || interrupted_; });
    interrupted_ = false;  // consumed by this recv, with a message or without
    interrupt_seen_.store(false, std::memory_order_release);
    if (!ready || impl.inbox.empty()) return std::optional<Message>();
    item = std::move(impl.inbox.front());
    impl.inbox.pop_front();
    impl.inbox_size.store(impl.inbox.size(), std::memory_order_release);
    if (item.message) {
      for (const auto& [id, peer] : impl.peers)
        if (peer->channel_id == item.message->sender_id) item.message->from = id;
    }
  }
  impl.queued_bytes -= item.queued_bytes;
  if (impl.probe_paused) impl.wake();
  if (!item.message) return item.error;
  return std::move(item.message);
}

void UcxChannel::interrupt() {
  {
    std::lock_guard lock(impl_->mu);
    interrupted_ = true;
    interrupt_seen_.store(true, std::memory_order_release);
  }
  impl_->inbox_cv.notify_all();
}

Status UcxChannel::peer_status(PeerId peer) const {
  std::lock_guard lock(impl_->mu);
  auto it = impl_->peers.find(peer);
  if (it == impl_->peers.end()) return Status::error("unknown peer id " + std::to_string(peer));
  return it->second->failure;
}

std::uint64_t UcxChannel::refused_messages() const { return impl_->refused.load(); }

std::size_t UcxChannel::receives_under_way() const { return impl_->payloads_arriving.load(); }

std::size_t UcxChannel::closed_peers_held() const { return impl_->closed_peers_held.load(); }

bool UcxChannel::supports_cuda_memory() const { return impl_->cuda_memory; }
bool UcxChannel::takes_device_memory() const { return impl_->takes_device; }

bool UcxChannel::peer_takes_device_memory(PeerId peer) const {
  std::lock_guard lock(impl_->mu);
  auto it = impl_->peers.find(peer);
  return it != impl_->peers.end() && it->second->takes_device;
}

bool UcxChannel::peer_reads_failed_payloads(PeerId peer, bool device) const {
  std::lock_guard lock(impl_->mu);
  auto it = impl_->peers.find(peer);
  return it != impl_->peers.end() && (device || it->second->host_local);
}

Expected<std::string> UcxChannel::transport_info(PeerId peer) {
  auto result = std::make_shared<std::promise<Expected<std::string>>>();
  auto future = result->get_future();
  Impl* impl = impl_.get();
  Status posted = impl->post([impl, peer, result] {
    ucp_ep_h ep = nullptr;
    {
      std::lock_guard lock(impl->mu);
      if (auto* p = impl->find_peer_locked(peer)) ep = p->ep;
    }
    if (!ep) {
      result->set_value(
          Status::error("transport_info: no open endpoint for peer id " + std::to_string(peer)));
      return;
    }
    char* text = nullptr;
    std::size_t size = 0;
    FILE* stream = open_memstream(&text, &size);
    if (!stream) {
      result->set_value(errno_status("open_memstream"));
      return;
    }
    ucp_ep_print_info(ep, stream);
    std::fclose(stream);
    std::string s(text, size);
    std::free(text);
    result->set_value(std::move(s));
  });
  if (!posted.ok()) return posted;
  if (future.wait_for(kTaskTimeout) != std::future_status::ready)
    return Status::error("transport_info: the progress thread did not answer within 10 s");
  return future.get();
}

}  // namespace conveyor::transport
