// Internals of UcxChannel, shared by ucx_channel.cc (set-up, tear-down, the public API)
// and ucx_progress.cc (the progress thread). Not for use outside transport/.
// Read ucx_channel.h (threading, failures) and wire_format.h (the bytes) first.
//
// Invariants that keep buffers safe:
//  - Only the progress thread calls into the worker, and it never holds `mu` while doing so
//    (UCX callbacks run inside ucp_worker_progress and take `mu`).
//  - A send's caller is woken only after every UCX request of that send has completed and
//    been released, so its buffers are never touched after send() returns.
//  - Receive buffers live until their request has completed, or until the worker has been
//    destroyed (the destructor releases requests, destroys the worker, then the buffers). A
//    receive still under way then (a rendezvous its sender gave up) keeps the worker and its
//    buffers alive until the process exits: UCX 1.13 would abort destroying that worker.
#pragma once

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "transport/buffer_pool.h"
#include "transport/channel_address.h"
#include "transport/data_auth.h"
#include "transport/host_identity.h"
#include "transport/ucx_channel.h"
#include "transport/ucx_check.h"
#include "transport/wire_format.h"

namespace conveyor::transport {
namespace ucx_detail {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// UCX 1.13 looks at keepalive only on every 32nd ucp_worker_progress call
// (UCP_WORKER_KEEPALIVE_ITER_SKIP), so an idle wake-up progresses this many times.
inline constexpr int kIdleProgressCalls = 32;
// Bound on back-to-back ucp_worker_progress calls before the loop looks at its queues.
inline constexpr int kMaxProgressBurst = 64;
// How long a caller waits for the progress thread to run a short task (connect, info).
inline constexpr milliseconds kTaskTimeout{10000};

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    std::swap(fd_, o.fd_);
    return *this;
  }
  ~UniqueFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_ = -1;
};

inline Status errno_status(const char* call) {
  return Status::error(std::string(call) + " failed: " + std::strerror(errno));
}

inline std::string ucs_error_text(ucs_status_t s) { return ucs_status_string(s); }

}  // namespace ucx_detail

using ucx_detail::Clock;
using ucx_detail::milliseconds;
using ucx_detail::UniqueFd;

struct UcxChannel::Impl {
  // ---- one peer (an endpoint this channel created with connect) ----
  struct Peer {
    Impl* impl = nullptr;
    PeerId id = kNoPeer;
    std::string name;
    std::uint32_t channel_id = 0;
    bool takes_device = false;   // its address says it takes device payloads
    // On this host and both channels talk over shared memory (host_shared_memory): the
    // endpoint has no peer-failure handling (UCX 1.13's shared memory has none), so the
    // peer's process is watched instead, through a pidfd (readable once it has exited).
    bool host_local = false;
    std::uint32_t pid = 0;
    UniqueFd pidfd;
    // On an authenticated channel: the session key of the handshake connect() sent, and that
    // handshake's header (the nonce and proof), kept until the channel goes.
    std::optional<auth::Key> session;
    std::vector<std::byte> hello;
    std::vector<std::byte> address;  // the peer's UCX worker address (what connect() dialled)
    ucp_ep_h ep = nullptr;       // progress thread only
    Status failure;              // guarded by mu
    bool close_pending = false;  // progress thread only: failed, endpoint still to close
    bool parked = false;         // progress thread only: disconnected, endpoint kept (`parked`)
  };

  // ---- one send() in flight ----
  struct SendOp {
    PeerId peer = kNoPeer;
    std::span<const std::byte> header;
    PayloadView payload;
    // To a host-local peer: the header and an inline payload copied here (`header` and
    // `payload` then point into it), as the peer may still read them after the send is given
    // up (abandon_sends) and the caller has freed or rewritten its own.
    std::vector<std::byte> envelope_copy;
    bool hello = false;   // the handshake connect() sends first (wire::kFlagHello)
    bool redial = false;  // and the sender's earlier connections to that channel are closed (kFlagRedial)
    Clock::time_point deadline;
    milliseconds timeout{0};
    wire::WirePrefix prefix;
    ucp_dt_iov_t iov[3] = {};
    std::vector<ucx::Request> requests;  // progress thread only
    int pending = 0;                     // requests not yet completed (progress thread)
    bool timed_out = false;
    ucs_status_t ucx_error = UCS_OK;  // first error a completion callback saw
    Status status;                    // first error wins (progress thread until `done`)
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;                // guarded by mu
    std::atomic<bool> finished{false};  // `done`, for send()'s polling (opt.spin_in_calls)
  };

  // ---- one message being received ----
  struct Incoming {
    // kDropped: taken by the channel, handed to nobody (a handshake, or a refused message).
    enum Stage { kEnvelope, kPayload, kDone, kFailed, kDropped };
    bool finished() const { return stage == kDone || stage == kFailed || stage == kDropped; }
    Stage stage = kEnvelope;
    bool in_flight = false;  // a UCX request is outstanding for the current stage
    ucs_status_t result = UCS_OK;
    std::uint64_t tag = 0;
    std::size_t queued_bytes = 0;  // counted against max_queued_bytes
    wire::WirePrefix prefix;
    ucp_dt_iov_t iov[3] = {};
    Message message;
    std::vector<std::byte> scratch;  // a malformed envelope is received here and dropped
    Status error;
    Clock::time_point payload_posted;
    ucx::Request request;  // declared last: released before the buffers above
  };

  // An item recv() hands out: a message or a failure report.
  struct InboxItem {
    std::optional<Message> message;
    Status error;
    std::size_t queued_bytes = 0;
  };

  explicit Impl(UcxChannelOptions o)
      : opt(std::move(o)),
        pool(opt.buffer_cache_bytes, opt.receive_allocator),
        device_pool(opt.device_cache_bytes, opt.device_allocator, /*min_pooled_bytes=*/0) {}
  ~Impl();

  Status init();
  void loop();

  // progress-thread work
  bool run_tasks();
  bool progress_burst();
  void start_send(const std::shared_ptr<SendOp>& op);
  bool finish_sends();
  bool probe_incoming();
  void start_receive(ucp_tag_message_h msg, const ucp_tag_recv_info_t& info);
  bool advance_incoming();
  void advance(Incoming& in);
  void abandon(Incoming& in, const std::string& why);
  void check_deadlines(Clock::time_point now);
  bool operations_under_way() const;  // a send not yet complete, or a receive in flight
  // The authenticated data plane (data_auth.h), on the progress thread.
  enum class Admission { kAdmit, kConsumed, kRefused, kDefer };
  Admission admit(Incoming& in, std::uint32_t sender);
  // advance()'s question for an envelope that is in: whether it goes on to its payload and
  // recv(); a handshake or a refused message is dropped (kDropped), a deferred one waits.
  bool admitted(Incoming& in, std::uint32_t sender);
  void take_hello(Incoming& in, std::uint32_t sender);
  // Whether `peer` replaces connections to its channel this channel closed, none of them
  // working any more (the handshake's kFlagRedial). Progress thread.
  bool replaces_closed(const Peer& peer);
  // Gives up the payloads from `sender` still arriving of messages sent before `before_seq`
  // (their connection is closed).
  void cut_off_payloads(std::uint32_t sender, std::uint64_t before_seq, const std::string& why);
  // Whether message `seq` from `sender` was sent before the sender's newest redial handshake.
  bool before_redial(std::uint32_t sender, std::uint64_t seq) const;
  bool earlier_envelope_pending(std::uint32_t sender, const Incoming& in);
  void refuse(std::uint32_t sender, const std::string& why);
  void sign(SendOp& op, const Peer& peer, bool inline_payload);
  void send_hello(Peer& peer);
  // connect(): on an authenticated channel, the handshake to the channel at `to` and the
  // session key it opens; an error when only one of the two channels is authenticated.
  Status open_session(Peer& peer, const ChannelAddress& to);
  bool close_failed_peers();
  // Fails each host-local peer whose process has exited (its pidfd is readable). At most once a
  // millisecond unless `now`: the progress thread spins through here.
  bool check_host_peers(bool now);
  // The sends to a host-local peer that failed: UCX will neither finish nor cancel their requests
  // (its endpoint cannot be closed by force), so they end here, with the peer's failure; the
  // requests are kept until the channel goes (`abandoned_sends`).
  void abandon_sends(const Peer& peer);
  // Copies a send's header (and an inline payload) into the op (SendOp::envelope_copy).
  static void keep_envelope(SendOp& op, bool inline_payload);
  // disconnect(): the peer leaves the id map; a working endpoint is parked for the next
  // connect() to the same channel (see `parked`), any other is closed.
  void park_or_close(std::unique_ptr<Peer> peer);
  // A peer whose endpoint is closed or closing leaves the channel: kept with its close
  // request while that is in flight (`closing`), else destroyed; its channel is remembered.
  void retire(std::unique_ptr<Peer> peer);
  // connect(): the endpoint parked for the channel at `address`, if any (taken out of `parked`).
  std::unique_ptr<Peer> take_parked(std::uint32_t channel, const std::vector<std::byte>& address);
  std::string sender_name(std::uint32_t channel_id);
  void close_endpoint(Peer& peer, bool force);
  void fail_peer(Peer& peer, const Status& why);
  void begin_shutdown();
  bool shutdown_complete() const;
  // A receive still under way in UCX when the channel goes (the destructor's question).
  bool receive_stranded() const;
  void complete_send(SendOp& op);

  // any thread
  Status post(std::function<void()> task);
  void wake();
  Peer* find_peer_locked(PeerId id);

  static void on_send_done(void* request, ucs_status_t status, void* user_data);
  void posted(Incoming& in, ucs_status_ptr_t r);
  static void on_recv_done(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                           void* user_data);
  static void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t status);

  UcxChannelOptions opt;
  BufferPool pool;         // receive buffers
  BufferPool device_pool;  // receive buffers in device memory (device_allocator; the direct path)
  std::uint32_t channel_id = 0;
  std::vector<std::byte> address_blob;
  // This process, when opt.host_shared_memory (in the address, kAddressHostSharedMemory).
  std::optional<HostIdentity> host;
  Clock::time_point last_host_check{};
  bool cuda_memory = false;   // the context's memory types include CUDA (ucp_context_query)
  bool takes_device = false;  // cuda_memory and a device_allocator: advertised in the address
  // Set when opt.auth_secret is: the cluster's data-plane key, and this channel's nonce (in
  // its address) for the handshakes peers send it.
  std::optional<auth::Key> key;
  auth::Nonce nonce{};
  std::atomic<std::uint64_t> refused{0};  // messages dropped for want of a handshake or MAC

  // UCX resources, in creation order (destroyed in reverse by ~Impl).
  ucx::Context context;
  ucx::Worker worker;
  int worker_fd = -1;  // owned by the worker
  UniqueFd wake_fd;
  UniqueFd epoll_fd;

  // Shared between caller threads and the progress thread.
  mutable std::mutex mu;
  std::condition_variable inbox_cv;
  std::deque<std::function<void()>> tasks;
  std::deque<InboxItem> inbox;
  std::atomic<std::size_t> inbox_size{0};  // inbox.size(), for recv()'s polling (opt.spin_in_calls)
  std::map<PeerId, std::unique_ptr<Peer>> peers;  // map structure and Peer::failure: mu
  PeerId next_peer_id = 1;
  // The latest ids disconnect() took back (a send to one says so; an older one reads as
  // unknown), at most kRememberedDisconnects of them: ids only grow, so the least is the oldest.
  std::set<PeerId> disconnected;
  static constexpr std::size_t kRememberedDisconnects = 4096;
  bool stopping = false;
  std::atomic<std::size_t> queued_bytes{0};
  std::atomic<bool> probe_paused{false};
  std::atomic<std::size_t> payloads_arriving{0};  // receives_under_way()
  std::atomic<std::size_t> closed_peers_held{0};  // closing's owned peers (closed_peers_held())

  // Progress thread only.
  std::list<std::shared_ptr<SendOp>> sends;
  std::map<std::uint32_t, std::deque<std::unique_ptr<Incoming>>> incoming;  // by sender
  // Endpoint close requests in flight, each with its peer; a peer that has left the channel
  // (retire) is owned here until its close completes: it is the error handler's argument, and
  // UCX calls nothing for the endpoint after that.
  struct Closing {
    ucx::Request request;
    const Peer* peer = nullptr;
    std::unique_ptr<Peer> owned;
  };
  std::list<Closing> closing;
  // Failed messages whose UCX request is still in flight: kept (buffers included) until
  // the request completes or the worker is destroyed.
  std::list<std::unique_ptr<Incoming>> abandoned;
  // Sends to failed host-local peers, ended without UCX (abandon_sends): each op with the requests
  // UCX still holds (their callbacks point at the op), until the channel goes.
  std::list<std::pair<std::shared_ptr<SendOp>, std::vector<ucx::Request>>> abandoned_sends;
  // The envelope copies of other failed sends to host-local peers, kept unwritten until the
  // channel goes for the same reason: the peer may still read them (SendOp::envelope_copy).
  std::vector<std::vector<std::byte>> failed_envelopes;
  // Remote channels this channel closed a connection to (a later connect's handshake says it
  // redials: replaces_closed).
  std::set<std::uint32_t> closed_channels;
  // Working endpoints that disconnect() left open, one per remote channel, for connect() to
  // take again. UCX 1.13 pairs connections: a channel's first ucp_ep_create to another is
  // handed the endpoint UCX made inside it when that other channel's connection came in
  // (ucp_ep_create's reuse of an "unexpected" endpoint), so the two directions can share one
  // pair. Closing one side then breaks the other's: after a re-plan that swaps two workers'
  // roles, the first rendezvous on the new direction never completed. So a disconnect closes
  // nothing that works; a parked endpoint is closed when it fails (quietly: nobody is
  // connected through it) or when the channel goes.
  std::map<std::uint32_t, std::unique_ptr<Peer>> parked;  // by channel id
  // Peer failures not yet reported: each goes to the inbox once every message already
  // received from that peer's channel has been delivered ahead of it.
  std::vector<std::pair<std::uint32_t, Status>> pending_failures;
  std::uint64_t next_seq = 0;
  // Authenticated channel: the session keys by sender channel id (the newest first; a few
  // kept, see ucx_auth.cc), every handshake
  // nonce ever taken (a replayed handshake is refused), and what was logged of refusals.
  std::map<std::uint32_t, std::deque<auth::Key>> sessions;
  // By sender: the seq of its newest redial handshake (kFlagRedial). Every message it sent
  // before has a lower seq and went on a connection it closed; a payload of such a message that
  // is not already here never will be, though its envelope may arrive after the handshake (two
  // connections are not ordered with each other).
  std::map<std::uint32_t, std::uint64_t> redial_seq;
  std::set<auth::Nonce> seen_hellos;
  std::set<std::pair<std::uint32_t, std::string>> refusals_logged;
  bool shutdown_started = false;
  Clock::time_point shutdown_deadline;
  bool arm_supported = true;
  Clock::time_point last_progress;  // when the loop last did something (spin_while_pending)

  std::thread thread;
};

}  // namespace conveyor::transport
