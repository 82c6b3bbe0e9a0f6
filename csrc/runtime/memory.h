// Measuring what a step holds for its backward, from the allocator itself.
//
// HeldMemory is the allocator's per-thread memory reporter (the hook
// torch.profiler's memory profiling uses) for the span of one step: every
// allocation and free on the step's device, on the executor's thread and on
// the autograd threads it starts, reaches it. An allocation belongs to the
// (stage, microbatch) the executor says is running: its forward (F, R) and
// input-gradient (I) tasks own what they allocate, so what outlives them is
// exactly what the stage keeps for its backward (saved activations, the
// split stages' saved tensors, outputs until sent). A received activation
// is owned by the stage that reads it from the moment it reads it (before,
// it is a posted receive buffer, counted apart). Backward (B, W) allocations
// (gradients) belong to nobody and are not counted.
//
// Measured this way, not estimated: no hook in the stage's code, nothing
// the model saves can be missed, and a tensor counts until its memory is
// actually freed.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/profiler/orchestration/observer.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>

namespace torchmpmd::runtime {

// A profiler state in torch's eyes (torch reads the slot as one, e.g.
// torch.autograd._profiler_enabled()): a disabled profiler that only
// profiles memory.
class HeldMemory final : public torch::profiler::impl::ProfilerStateBase {
 public:
  using Owner = std::pair<int32_t, int32_t>;  // (stage, microbatch)

  explicit HeldMemory(c10::Device device)
      : ProfilerStateBase(torch::profiler::impl::ProfilerConfig(
            torch::profiler::impl::ProfilerState::Disabled)),
        device_(device) {}

  void reportMemoryUsage(void* ptr, int64_t alloc_size, size_t total_allocated,
                         size_t total_reserved, c10::Device device) override;
  bool memoryProfilingEnabled() const override { return true; }
  torch::profiler::impl::ActiveProfilerType profilerType() override {
    return torch::profiler::impl::ActiveProfilerType::NONE;
  }

  // Allocations from now on belong to `owner` (nullopt: to nobody).
  void own(std::optional<Owner> owner);
  // The allocation at `ptr` (made while nobody owned allocations, e.g. a
  // receive buffer) now belongs to `owner`.
  void adopt(const void* ptr, Owner owner);
  // The allocation at `ptr` belongs to nobody from now on (an input
  // gradient an I task made: not kept for W).
  void disown(const void* ptr);

  // Live bytes with an owner; of one owner; without one (receive buffers
  // and gradients).
  int64_t held() const;
  int64_t of(Owner owner) const;
  int64_t peak_held() const;
  // Records the current held bytes into the peak; returns them.
  int64_t sample();

 private:
  struct Block {
    int64_t bytes = 0;
    std::optional<Owner> owner;
  };
  // Stops counting `block` (under mu_).
  void release(const Block& block);
  const c10::Device device_;
  mutable std::mutex mu_;
  std::optional<Owner> current_;
  std::unordered_map<const void*, Block> live_;
  std::map<Owner, int64_t> by_owner_;
  int64_t held_ = 0;
  int64_t peak_ = 0;
};

// Installs a HeldMemory as the thread's memory reporter for its lifetime,
// unless a profiler already holds that slot (then `get()` is null: the
// step is not measured rather than the profiler disturbed).
class HeldMemoryScope {
 public:
  explicit HeldMemoryScope(c10::Device device);
  ~HeldMemoryScope();
  HeldMemoryScope(const HeldMemoryScope&) = delete;
  HeldMemoryScope& operator=(const HeldMemoryScope&) = delete;

  HeldMemory* get() const { return memory_.get(); }

 private:
  std::shared_ptr<HeldMemory> memory_;
  std::optional<c10::DebugInfoGuard> guard_;
};

}  // namespace torchmpmd::runtime
