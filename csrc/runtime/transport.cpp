#include "runtime/transport.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <thread>

namespace torchmpmd::runtime {

namespace {

using Clock = std::chrono::steady_clock;

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
// wait(); device (NCCL) works only order streams in wait(), so they are
// polled for completion against our deadline instead.
class C10dRequest : public Request {
 public:
  C10dRequest(c10::intrusive_ptr<c10d::Work> work, at::Tensor tensor)
      : work_(std::move(work)), tensor_(std::move(tensor)) {}

  bool test() override {
    if (!work_->isCompleted()) return false;
    finish();
    return true;
  }

  void wait(std::chrono::milliseconds timeout) override {
    if (done_) return;
    const auto start = Clock::now();
    if (tensor_.is_cpu()) {
      try {
        work_->wait(timeout);
      } catch (const std::exception& e) {
        const bool late = Clock::now() - start >= timeout * 0.98;
        throw TransportError(e.what(), late);
      }
      done_ = true;
      return;
    }
    auto pause = std::chrono::microseconds(1);
    while (!work_->isCompleted()) {
      if (Clock::now() - start >= timeout) {
        throw TransportError("no progress before the timeout", true);
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(500));
    }
    finish();
  }

 private:
  void finish() {
    if (done_) return;
    if (!work_->isSuccess()) {
      throw TransportError(describe_exception(work_->exception()), false);
    }
    work_->wait();  // orders the current stream after the transfer (CUDA)
    done_ = true;
  }

  c10::intrusive_ptr<c10d::Work> work_;
  at::Tensor tensor_;
  bool done_ = false;
};

}  // namespace

C10dTransport::C10dTransport(c10::intrusive_ptr<c10d::ProcessGroup> group)
    : group_(std::move(group)) {
  TORCH_CHECK(group_, "torchmpmd: the process group is None");
}

C10dTransport::~C10dTransport() = default;

int C10dTransport::rank() const { return group_->getRank(); }
int C10dTransport::size() const { return group_->getSize(); }
std::string C10dTransport::name() const { return group_->getBackendName(); }

std::unique_ptr<Request> C10dTransport::isend(const at::Tensor& tensor,
                                              int peer, int64_t tag) {
  std::vector<at::Tensor> tensors{tensor};
  auto work = group_->send(tensors, peer, static_cast<int>(tag));
  return std::make_unique<C10dRequest>(std::move(work), tensor);
}

std::unique_ptr<Request> C10dTransport::irecv(const at::Tensor& tensor,
                                              int peer, int64_t tag) {
  std::vector<at::Tensor> tensors{tensor};
  auto work = group_->recv(tensors, peer, static_cast<int>(tag));
  return std::make_unique<C10dRequest>(std::move(work), tensor);
}

// --------------------------------------------------------------------------
// In-memory transport

class LocalTransport : public Transport {
 public:
  LocalTransport(std::shared_ptr<LocalWorld> world, int rank)
      : world_(std::move(world)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return world_->size(); }
  std::string name() const override { return "local"; }
  std::unique_ptr<Request> isend(const at::Tensor& tensor, int peer,
                                 int64_t tag) override;
  std::unique_ptr<Request> irecv(const at::Tensor& tensor, int peer,
                                 int64_t tag) override;

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
        throw TransportError("no message before the timeout", true);
      }
    }
  }

 private:
  // Called with the world's lock held.
  bool take(std::unique_lock<std::mutex>&) {
    if (done_) return true;
    auto it = world_->mailbox_.find(key_);
    if (it == world_->mailbox_.end() || it->second.empty()) {
      const int src = std::get<0>(key_);
      if (world_->dead_.count(src)) {
        throw TransportError("peer rank " + std::to_string(src) + " is gone",
                             false);
      }
      return false;
    }
    out_.copy_(it->second.front());
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
  {
    std::lock_guard<std::mutex> lock(world_->mutex_);
    world_->mailbox_[{rank_, peer, tag}].push_back(tensor.clone());
  }
  world_->arrived_.notify_all();
  return std::make_unique<DoneRequest>();
}

std::unique_ptr<Request> LocalTransport::irecv(const at::Tensor& tensor,
                                               int peer, int64_t tag) {
  return std::make_unique<LocalRecv>(world_, LocalWorld::Key{peer, rank_, tag},
                                     tensor);
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
