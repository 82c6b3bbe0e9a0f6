// Errors for the torch-free layers (graph, schedule).
//
// Every message starts with its context ("graph: ...", "schedule: rank 1 ...")
// so a user can find the offending stage, task or module. The bindings map
// Error to Python's ValueError: these errors always mean the input (model
// annotations, schedule) is wrong, never that the library is broken.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace torchmpmd {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
template <typename... Args>
std::string str_cat(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}
}  // namespace detail

}  // namespace torchmpmd

// Throws torchmpmd::Error with the concatenated message when cond is false.
#define MPMD_CHECK(cond, ...)                                              \
  do {                                                                     \
    if (!(cond)) {                                                         \
      throw ::torchmpmd::Error(::torchmpmd::detail::str_cat(__VA_ARGS__)); \
    }                                                                      \
  } while (false)

// Internal invariant of the library itself (a bug here, not in user input).
#define MPMD_INTERNAL_ASSERT(cond, ...)                                  \
  do {                                                                   \
    if (!(cond)) {                                                       \
      throw std::logic_error(::torchmpmd::detail::str_cat(               \
          "torchmpmd internal error at ", __FILE__, ":", __LINE__, ": ", \
          #cond, " ", ##__VA_ARGS__));                                   \
    }                                                                    \
  } while (false)
