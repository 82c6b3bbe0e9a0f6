#include "runtime/heap.h"

#include <climits>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace torchmpmd::runtime {

HeapPolicy keep_freed_memory(std::size_t mmap_threshold,
                             std::size_t trim_threshold) {
  HeapPolicy policy;
#if defined(__GLIBC__)
  if (mmap_threshold > INT_MAX || trim_threshold > INT_MAX) {
    policy.reason = "thresholds above INT_MAX bytes (mallopt takes an int)";
    return policy;
  }
  // The trim threshold first: setting either one stops glibc adapting both.
  if (mallopt(M_TRIM_THRESHOLD, static_cast<int>(trim_threshold)) != 1) {
    policy.reason = "glibc refused M_TRIM_THRESHOLD";
    return policy;
  }
  if (mallopt(M_MMAP_THRESHOLD, static_cast<int>(mmap_threshold)) != 1) {
    policy.reason = "glibc refused M_MMAP_THRESHOLD (above its maximum?)";
    return policy;
  }
  policy.applied = true;
#else
  (void)mmap_threshold;
  (void)trim_threshold;
  policy.reason = "not glibc's malloc";
#endif
  return policy;
}

}  // namespace torchmpmd::runtime
