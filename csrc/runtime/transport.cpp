#include "runtime/transport.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <future>
#include <thread>

namespace torchmpmd::runtime {

using Clock = std::chrono::steady_clock;
using Kind = TransportError::Kind;

bool AbortState::set(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (set_.load(std::memory_order_relaxed)) return false;
  reason_ = reason;
  set_.store(true, std::memory_order_release);
  return true;
}

std::optional<std::string> AbortState::reason() const {
  if (!is_set()) return std::nullopt;
  std::lock_guard<std::mutex> lock(mutex_);
  return reason_;
}

void AbortState::check() const {
  if (is_set()) throw TransportError(*reason(), Kind::kAborted);
}

void Transport::abort(const std::string& reason) {
  if (abort_->set(reason)) on_abort();
}

namespace {

// A posted operation that abort() can wake from its wait.
class Interruptible {
 public:
  virtual ~Interruptible() = default;
  virtual void interrupt() = 0;
};

}  // namespace

struct C10dTransport::Live {
  std::mutex mutex;
  std::set<Interruptible*> requests;
  void interrupt_all() {
    std::lock_guard<std::mutex> lock(mutex);
    for (Interruptible* r : requests) r->interrupt();
  }
};

namespace {

std::string describe_exception(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "unknown error";
  }
}

// A c10d Work. CPU (Gloo) works block on a condition variable inside
// wait(), which abort() interrupts (Work::abort). Device (NCCL) works are
// stream-ordered: wait() makes the current stream wait for the transfer and
// returns at once, so the host keeps queueing work ahead of the data; the
// executor bounds the step's device work by its timeout at the end of the
// step (Executor::finish_on_device), and wait_on_host() polls test().
class C10dRequest : public Request, public Interruptible {
 public:
  C10dRequest(c10::intrusive_ptr<c10d::Work> work, at::Tensor tensor,
              std::shared_ptr<C10dTransport::Live> live,
              std::shared_ptr<AbortState> abort)
      : work_(std::move(work)),
        tensor_(std::move(tensor)),
        live_(std::move(live)),
        abort_(std::move(abort)) {
    std::lock_guard<std::mutex> lock(live_->mutex);
    live_->requests.insert(this);
  }

  ~C10dRequest() override {
    std::lock_guard<std::mutex> lock(live_->mutex);
    live_->requests.erase(this);
  }

  // Called with the live set's lock held, from any thread.
  void interrupt() override {
    if (tensor_.is_cpu()) work_->abort();
  }

  bool test() override {
    if (done_) return true;
    abort_->check();
    if (!work_->isCompleted()) return false;
    finish();
    return true;
  }

  void wait(std::chrono::milliseconds timeout) override {
    if (done_) return;
    abort_->check();
    const auto start = Clock::now();
    if (tensor_.is_cpu()) {
      bool completed = false;
      try {
        completed = work_->wait(timeout);
      } catch (const std::exception& e) {
        abort_->check();  // an abort is the cause of what followed it
        const bool late = Clock::now() - start >= timeout * 0.98;
        throw TransportError(e.what(), late ? Kind::kTimedOut : Kind::kFailed);
      }
      if (!completed) {
        abort_->check();
        throw TransportError("the operation was aborted", Kind::kAborted);
      }
      done_ = true;
      return;
    }
    try {
      work_->wait();  // the current stream waits; the host does not
    } catch (const std::exception& e) {
      abort_->check();
      throw TransportError(e.what(), Kind::kFailed);
    }
    done_ = true;
  }

 private:
  void finish() {
    if (done_) return;
    // Not isSuccess(): NCCL's work throws on it (deprecated there).
    if (const std::exception_ptr e = work_->exception()) {
      throw TransportError(describe_exception(e), Kind::kFailed);
    }
    work_->wait();  // orders the current stream after the transfer (CUDA)
    done_ = true;
  }

  c10::intrusive_ptr<c10d::Work> work_;
  at::Tensor tensor_;
  std::shared_ptr<C10dTransport::Live> live_;
  std::shared_ptr<AbortState> abort_;
  bool done_ = false;
};

// Posting an operation can fail at once (Gloo: the pair's connection was
// closed by a peer that died): a TransportError like any other failure, so
// callers name the peer instead of passing on a raw c10::Error.
template <typename Post>
c10::intrusive_ptr<c10d::Work> start(const std::shared_ptr<AbortState>& abort,
                                     Post post) {
  try {
    return post();
  } catch (const TransportError&) {
    throw;
  } catch (const std::exception& e) {
    abort->check();  // an abort is the cause of what followed it
    throw TransportError(e.what(), TransportError::Kind::kFailed);
  }
}

}  // namespace

// The store watch. Its thread holds only shared state (never the
// transport), so the transport can go away while the thread is blocked in
// a store call: it is detached and ends at its next look at `stop`.
struct C10dTransport::Watch {
  c10::intrusive_ptr<c10d::Store> store;
  std::string key;
  std::chrono::milliseconds poll;
  std::mutex mutex;
  std::condition_variable wake;
  int armed = 0;
  bool started = false;
  bool stop = false;

  static void loop(std::shared_ptr<Watch> w, std::shared_ptr<AbortState> abort,
                   std::shared_ptr<Live> live) {
    std::unique_lock<std::mutex> lock(w->mutex);
    while (!w->stop) {
      if (w->armed == 0 || abort->is_set()) {
        w->wake.wait(lock);
        continue;
      }
      lock.unlock();
      std::optional<std::string> reason;
      try {
        if (w->store->check({w->key})) {
          const auto value = w->store->get(w->key);
          reason = std::string(value.begin(), value.end());
        }
      } catch (const std::exception&) {
        // The store is unreachable (its host died): the transport's own
        // errors and timeouts still end every wait.
      }
      if (reason && abort->set(*reason)) live->interrupt_all();
      lock.lock();
      if (!w->stop) w->wake.wait_for(lock, w->poll);
    }
  }
};

C10dTransport::C10dTransport(c10::intrusive_ptr<c10d::ProcessGroup> group,
                             c10::intrusive_ptr<c10d::Store> store,
                             std::string key,
                             std::chrono::milliseconds poll_interval)
    : group_(std::move(group)), live_(std::make_shared<Live>()) {
  TORCH_CHECK(group_, "torchmpmd: the process group is None");
  if (store) {
    TORCH_CHECK(!key.empty(), "torchmpmd: a store needs a key to watch");
    watch_ = std::make_shared<Watch>();
    watch_->store = std::move(store);
    watch_->key = std::move(key);
    watch_->poll = poll_interval;
  }
}

C10dTransport::~C10dTransport() {
  if (!watch_) return;
  {
    std::lock_guard<std::mutex> lock(watch_->mutex);
    watch_->stop = true;
  }
  watch_->wake.notify_all();
}

void C10dTransport::arm() {
  if (!watch_) return;
  {
    std::lock_guard<std::mutex> lock(watch_->mutex);
    ++watch_->armed;
    if (!watch_->started) {
      std::thread(Watch::loop, watch_, abort_state(), live_).detach();
      watch_->started = true;
    }
  }
  watch_->wake.notify_all();
}

void C10dTransport::disarm() {
  if (!watch_) return;
  std::lock_guard<std::mutex> lock(watch_->mutex);
  watch_->armed = std::max(0, watch_->armed - 1);
}

void C10dTransport::on_abort() { live_->interrupt_all(); }

void C10dTransport::fail(const std::string& reason) {
  if (watch_ && !abort_state()->is_set()) {
    // Tell the others (the first reason written stays). Bounded: a store
    // whose host died must not hold this rank's error back.
    auto w = watch_;
    auto written = std::make_shared<std::promise<void>>();
    auto done = written->get_future();
    std::thread([w, reason, written] {
      try {
        w->store->compareSet(
            w->key, {}, std::vector<uint8_t>(reason.begin(), reason.end()));
      } catch (const std::exception&) {
      }
      written->set_value();
    }).detach();
    done.wait_for(std::chrono::seconds(2));
  }
  abort(reason);
}

int C10dTransport::rank() const { return group_->getRank(); }
int C10dTransport::size() const { return group_->getSize(); }
std::string C10dTransport::name() const { return group_->getBackendName(); }
bool C10dTransport::issues_in_pair_order() const { return name() != "gloo"; }
bool C10dTransport::completion_means_delivered() const {
  return name() == "gloo";
}
c10::DeviceType C10dTransport::device_type() const {
  // CUDA tensors when CUDA's backend is NCCL: an NCCL group, or one made
  // without naming a backend (Gloo for the CPU, NCCL for CUDA). A Gloo group
  // also takes CUDA tensors, but exchanges them through the host: its
  // runner computes on the CPU unless told otherwise.
  constexpr auto kCuda = c10::DeviceType::CUDA;
  if (!at::hasCUDA() || !group_->hasBackendForDeviceType(kCuda)) {
    return c10::DeviceType::CPU;
  }
  return group_->getBackend(kCuda)->getBackendName() == "nccl"
             ? kCuda
             : c10::DeviceType::CPU;
}

std::unique_ptr<Request> C10dTransport::isend(const at::Tensor& tensor,
                                              int peer, int64_t tag) {
  abort_state()->check();
  std::vector<at::Tensor> tensors{tensor};
  auto work = start(abort_state(), [&] {
    return group_->send(tensors, peer, static_cast<int>(tag));
  });
  return std::make_unique<C10dRequest>(std::move(work), tensor, live_,
                                       abort_state());
}

std::unique_ptr<Request> C10dTransport::irecv(const at::Tensor& tensor,
                                              int peer, int64_t tag) {
  abort_state()->check();
  std::vector<at::Tensor> tensors{tensor};
  auto work = start(abort_state(), [&] {
    return group_->recv(tensors, peer, static_cast<int>(tag));
  });
  return std::make_unique<C10dRequest>(std::move(work), tensor, live_,
                                       abort_state());
}

// --------------------------------------------------------------------------
// In-memory transport

class LocalTransport : public Transport {
 public:
  LocalTransport(std::shared_ptr<LocalWorld> world, int rank)
      : Transport(world->abort_), world_(std::move(world)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return world_->size(); }
  std::string name() const override { return "local"; }
  std::unique_ptr<Request> isend(const at::Tensor& tensor, int peer,
                                 int64_t tag) override;
  std::unique_ptr<Request> irecv(const at::Tensor& tensor, int peer,
                                 int64_t tag) override;

 protected:
  // Every rank's waits share the world's condition variable.
  void on_abort() override {
    { std::lock_guard<std::mutex> lock(world_->mutex_); }
    world_->arrived_.notify_all();
  }

 private:
  std::shared_ptr<LocalWorld> world_;
  int rank_;
};

namespace {
class DoneRequest : public Request {
 public:
  bool test() override { return true; }
  void wait(std::chrono::milliseconds) override {}
};
}  // namespace

class LocalRecv : public Request {
 public:
  LocalRecv(std::shared_ptr<LocalWorld> world, LocalWorld::Key key,
            at::Tensor out)
      : world_(std::move(world)), key_(key), out_(std::move(out)) {}

  bool test() override {
    std::unique_lock<std::mutex> lock(world_->mutex_);
    return take(lock);
  }

  void wait(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(world_->mutex_);
    const auto deadline = Clock::now() + timeout;
    while (!take(lock)) {
      if (world_->arrived_.wait_until(lock, deadline) ==
              std::cv_status::timeout &&
          !take(lock)) {
        throw TransportError("no message before the timeout", Kind::kTimedOut);
      }
    }
  }

 private:
  // Called with the world's lock held.
  bool take(std::unique_lock<std::mutex>&) {
    if (done_) return true;
    world_->abort_->check();
    auto it = world_->mailbox_.find(key_);
    if (it == world_->mailbox_.end() || it->second.empty()) {
      const int src = std::get<0>(key_);
      if (world_->dead_.count(src)) {
        throw TransportError("peer rank " + std::to_string(src) + " is gone",
                             Kind::kFailed);
      }
      return false;
    }
    LocalWorld::Message& message = it->second.front();
    if (message.ready) {
      // Ranks as threads may run on different streams: this one waits for
      // the sender's copy, and the copy's memory is not reused before this
      // stream is done reading it (it is freed here, on another thread).
      const c10::impl::VirtualGuardImpl impl(out_.device().type());
      const c10::Stream stream = impl.getStream(out_.device());
      message.ready->block(stream);
      impl.recordDataPtrOnStream(message.tensor.storage().data_ptr(), stream);
    }
    out_.copy_(message.tensor);
    it->second.pop_front();
    if (it->second.empty()) world_->mailbox_.erase(it);
    done_ = true;
    return true;
  }

  std::shared_ptr<LocalWorld> world_;
  LocalWorld::Key key_;
  at::Tensor out_;
  bool done_ = false;
};

std::unique_ptr<Request> LocalTransport::isend(const at::Tensor& tensor,
                                               int peer, int64_t tag) {
  abort_state()->check();
  LocalWorld::Message message{tensor.clone(), std::nullopt};
  if (!tensor.is_cpu() && !tensor.is_meta()) {
    const c10::impl::VirtualGuardImpl impl(tensor.device().type());
    message.ready.emplace(tensor.device().type());
    message.ready->record(impl.getStream(tensor.device()));
  }
  {
    std::lock_guard<std::mutex> lock(world_->mutex_);
    world_->mailbox_[{rank_, peer, tag}].push_back(std::move(message));
  }
  world_->arrived_.notify_all();
  return std::make_unique<DoneRequest>();
}

std::unique_ptr<Request> LocalTransport::irecv(const at::Tensor& tensor,
                                               int peer, int64_t tag) {
  return std::make_unique<LocalRecv>(world_, LocalWorld::Key{peer, rank_, tag},
                                     tensor);
}

void wait_on_host(Request& request, const at::Tensor& tensor,
                  std::chrono::milliseconds timeout) {
  if (tensor.is_cpu()) {
    request.wait(timeout);
    return;
  }
  if (!poll_until([&] { return request.test(); }, Clock::now() + timeout)) {
    throw TransportError("no progress before the timeout", Kind::kTimedOut);
  }
}

LocalWorld::LocalWorld(int size) : size_(size) {
  TORCH_CHECK(size > 0, "torchmpmd: a local world needs at least one rank");
}

std::shared_ptr<Transport> LocalWorld::transport(int rank) {
  TORCH_CHECK(rank >= 0 && rank < size_, "torchmpmd: rank ", rank,
              " outside 0..", size_ - 1);
  return std::make_shared<LocalTransport>(shared_from_this(), rank);
}

void LocalWorld::kill(int rank) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    dead_.insert(rank);
  }
  arrived_.notify_all();
}

}  // namespace torchmpmd::runtime
