// The process heap's policy on the CPU (glibc's malloc).
//
// glibc hands freed memory back to the kernel (a heap top over its trim
// threshold is trimmed, a block over its mmap threshold is unmapped) and
// adapts both thresholds to the sizes it sees freed. A training step frees
// and allocates the same large tensors microbatch after microbatch, so the
// memory goes back and forth: every page comes back as a page fault that
// zeroes it. keep_freed_memory() fixes both thresholds high: freed memory
// stays in the heap for the next allocation, as a GPU caching allocator
// keeps its blocks.
#pragma once

#include <cstddef>

namespace torchmpmd::runtime {

// Blocks up to `mmap_threshold` bytes come from the heap (glibc caps it
// at 32 MiB on 64-bit systems); up to `trim_threshold` free bytes at the
// heap's top stay in the process. Process-wide and for good: glibc has no
// way back to its adaptive thresholds. False where malloc is not glibc's,
// a value is over INT_MAX (mallopt takes an int) or glibc refused it.
bool keep_freed_memory(std::size_t mmap_threshold, std::size_t trim_threshold);

}  // namespace torchmpmd::runtime
