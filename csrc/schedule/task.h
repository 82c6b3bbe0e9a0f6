// Tasks: the unit a schedule orders. A schedule is, per rank, an ordered list
// of tasks (JaxPP's model), each the forward or a backward piece of one stage
// on one microbatch.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>

namespace torchmpmd::schedule {

enum class TaskKind : uint8_t {
  kForward,     // F
  kBackward,    // B: full backward (input and weight gradients)
  kInputGrad,   // I: backward to the stage inputs only; keeps what W needs
  kWeightGrad,  // W: backward to the weights, from what I kept
};

char kind_letter(TaskKind kind);
// 'F', 'B', 'I', 'W' -> kind; throws torchmpmd::Error for anything else.
TaskKind kind_from_letter(char letter);

struct Task {
  TaskKind kind = TaskKind::kForward;
  int32_t stage = 0;
  int32_t microbatch = 0;

  bool operator==(const Task& o) const {
    return kind == o.kind && stage == o.stage && microbatch == o.microbatch;
  }
  bool operator!=(const Task& o) const { return !(*this == o); }
  bool operator<(const Task& o) const {
    return std::tie(stage, microbatch, kind) <
           std::tie(o.stage, o.microbatch, o.kind);
  }
  bool is_backward() const { return kind != TaskKind::kForward; }
};

// "F(stage=2, mb=5)": for messages.
std::string to_string(const Task& task);
// "2F5": torch.distributed.pipelining's action format (stage, kind, mb).
std::string to_action(const Task& task);
// Parses "2F5"; throws torchmpmd::Error naming the text when malformed.
Task parse_action(const std::string& text);

}  // namespace torchmpmd::schedule
