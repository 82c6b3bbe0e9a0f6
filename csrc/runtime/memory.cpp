#include "runtime/memory.h"

#include <algorithm>

namespace torchmpmd::runtime {

void HeldMemory::reportMemoryUsage(void* ptr, int64_t alloc_size,
                                   size_t /*total_allocated*/,
                                   size_t /*total_reserved*/,
                                   c10::Device device) {
  if (device.type() != device_.type() || alloc_size == 0) return;
  if (device.has_index() && device_.has_index() &&
      device.index() != device_.index()) {
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (alloc_size > 0) {
    // Memory freed where we did not see it (a thread without this
    // reporter), now handed out again: the old block is gone.
    const auto stale = live_.find(ptr);
    if (stale != live_.end()) release(stale->second);
    live_[ptr] = {alloc_size, current_};
    if (current_) {
      by_owner_[*current_] += alloc_size;
      held_ += alloc_size;
    }
    return;
  }
  // A free; one of memory allocated before the step is not ours to count.
  const auto it = live_.find(ptr);
  if (it == live_.end()) return;
  release(it->second);
  live_.erase(it);
}

void HeldMemory::release(const Block& block) {
  if (!block.owner) return;
  const auto owned = by_owner_.find(*block.owner);
  owned->second -= block.bytes;
  if (owned->second == 0) by_owner_.erase(owned);
  held_ -= block.bytes;
}

void HeldMemory::disown(const void* ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = live_.find(ptr);
  if (it == live_.end()) return;
  release(it->second);
  it->second.owner.reset();
}

void HeldMemory::own(std::optional<Owner> owner) {
  std::lock_guard<std::mutex> lock(mu_);
  current_ = owner;
}

void HeldMemory::adopt(const void* ptr, Owner owner) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = live_.find(ptr);
  if (it == live_.end() || it->second.owner) return;
  it->second.owner = owner;
  by_owner_[owner] += it->second.bytes;
  held_ += it->second.bytes;
}

int64_t HeldMemory::held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_;
}

int64_t HeldMemory::of(Owner owner) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = by_owner_.find(owner);
  return it == by_owner_.end() ? 0 : it->second;
}

int64_t HeldMemory::peak_held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_;
}

int64_t HeldMemory::sample() {
  std::lock_guard<std::mutex> lock(mu_);
  peak_ = std::max(peak_, held_);
  return held_;
}

HeldMemoryScope::HeldMemoryScope(c10::Device device) {
  if (c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE)) {
    return;  // a profiler's: leave it be
  }
  memory_ = std::make_shared<HeldMemory>(device);
  guard_.emplace(c10::DebugInfoKind::PROFILER_STATE, memory_);
}

HeldMemoryScope::~HeldMemoryScope() = default;

}  // namespace torchmpmd::runtime
