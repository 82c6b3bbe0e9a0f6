#include "runtime/heap.h"

#include <climits>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace torchmpmd::runtime {

bool keep_freed_memory(std::size_t mmap_threshold, std::size_t trim_threshold) {
#if defined(__GLIBC__)
  if (mmap_threshold > INT_MAX || trim_threshold > INT_MAX) return false;
  // The trim threshold first: setting either one stops glibc adapting both.
  return mallopt(M_TRIM_THRESHOLD, static_cast<int>(trim_threshold)) == 1 &&
         mallopt(M_MMAP_THRESHOLD, static_cast<int>(mmap_threshold)) == 1;
#else
  (void)mmap_threshold;
  (void)trim_threshold;
  return false;
#endif
}

}  // namespace torchmpmd::runtime
