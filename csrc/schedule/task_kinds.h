// The task kinds, in one table: per kind its letter, what it needs before it
// can start, which messages it reads and emits, which cost it takes and what
// it does to the activation memory of its rank. Validation, lowering,
// simulation, the action format and the Python enum read this table instead
// of switching over kinds themselves. Two places name kinds, each mapping
// its own names onto the table: Costs::uniform (its forward, backward,
// input_grad and weight_grad arguments give F, B, I and W; any other kind
// takes its `default_cost`) and the executor (Executor::task_fn, the method
// that runs each kind). A fused task is not a kind: it holds simple tasks
// (task.h), and each part reads its own row.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace torchmpmd::schedule {

enum class TaskKind : uint8_t {
  kForward,     // F
  kBackward,    // B: full backward (input and weight gradients)
  kInputGrad,   // I: backward to the stage inputs only; keeps what W needs
  kWeightGrad,  // W: backward to the weights, from what I kept
  // R: the forward again, from inputs F kept, now keeping what the backward
  // needs (activation checkpointing); F of that (stage, mb) keeps nothing.
  kRecompute,
};
constexpr int kNumTaskKinds = 5;

// What a task needs to have finished before it starts, relative to its own
// (stage, microbatch).
enum class Need : uint8_t {
  kOwn,               // task `kind` of the same stage and microbatch
  kOwnIfScheduled,    // the same, but only when the schedule has that task
  kProducerForwards,  // F of every stage whose values this stage reads
  // The task that emits input gradients (a kind with `emits_input_grads`)
  // of every stage that reads this stage's values with a gradient; not in
  // forward-only programs.
  kConsumerInputGrads,
};

struct Dependency {
  Need need = Need::kOwn;
  TaskKind kind = TaskKind::kForward;
};

// Change of a rank's live activation bytes when a task ends, in units of the
// stage's activation bytes, of its W-only bytes (what stays after I) and,
// for a recomputed (stage, microbatch), of the inputs its forward keeps for
// the recompute (the activations the stage reads from other stages).
struct MemoryEffect {
  int8_t activation = 0;
  int8_t weight_only = 0;
  int8_t kept_inputs = 0;
};

// The parts of a (stage, microbatch)'s backward a kind computes. A program
// with a backward must compute each part exactly once per (stage,
// microbatch): with one kind holding both (B) or kinds holding one each (I
// and W).
enum BackwardPart : uint8_t {
  kNoBackwardPart = 0,
  kInputGradPart = 1,   // the gradients of the stage's inputs
  kWeightGradPart = 2,  // the gradients of the stage's weights
  kWholeBackward = kInputGradPart | kWeightGradPart,
};

struct TaskKindInfo {
  TaskKind kind = TaskKind::kForward;
  char letter = '?';
  const char* name = "";
  // Whose time (Costs::time) a task of this kind takes: its own, or another
  // kind's (R: F's).
  TaskKind charged_as = TaskKind::kForward;
  // Its time where a cost model gives none of its own: the sum of these
  // kinds' times, each times its factor (B = 2 F, I = W = B / 2). Listed
  // kinds come before it in the table.
  std::vector<std::pair<TaskKind, double>> default_cost;
  std::vector<Dependency> needs;
  // A kind every (stage, microbatch) must have.
  bool required = false;
  // Part of the backward pass.
  bool backward = false;
  // Which parts of the backward it computes (BackwardPart bits).
  uint8_t backward_parts = kNoBackwardPart;
  // May run in a forward-only (evaluation) program.
  bool in_forward_only = false;
  // Receives it reads: activations of its stage's inputs, gradients of its
  // stage's outputs.
  bool reads_activations = false;
  bool reads_grads = false;
  // Messages its completion emits: its stage's activations; the gradients of
  // its stage's inputs; and the weight gradients of (stage, microbatch) are
  // final, which counts toward the tied-gradient exchange.
  bool emits_activations = false;
  bool emits_input_grads = false;
  bool finishes_weight_grads = false;
  // Its presence for (stage, microbatch) makes the forward drop what the
  // backward needs; it rebuilds that instead.
  bool recomputes = false;
  MemoryEffect memory;
  MemoryEffect memory_if_recomputed;  // when (stage, mb) has a recompute
};

// All kinds, in enum order.
const std::vector<TaskKindInfo>& task_kinds();
const TaskKindInfo& info(TaskKind kind);

char kind_letter(TaskKind kind);
// A kind's letter -> kind; throws torchmpmd::Error for anything else.
TaskKind kind_from_letter(char letter);
bool is_kind_letter(char letter);
// "F (forward), B (backward), ...": for error messages.
std::string kind_list();
// "F|B|I|W": for error messages.
std::string kind_letters();

}  // namespace torchmpmd::schedule
