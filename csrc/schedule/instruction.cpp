#include "schedule/instruction.h"

#include <algorithm>

#include "util/check.h"

namespace torchmpmd::schedule {

const char* collective_name(Op op) {
  return op == Op::kUnshard ? "unshard" : "reduce_grads";
}

std::string to_string(const Instruction& ins) {
  const char* what = ins.payload == Payload::kActivation ? "act"
                     : ins.payload == Payload::kGrad     ? "grad"
                                                         : "tied";
  switch (ins.op) {
    case Op::kCompute:
      return to_action(ins.task);
    case Op::kSend:
      return detail::str_cat("SEND_", what, "(v", ins.value, " mb",
                             ins.microbatch, " ->r", ins.peer, " #", ins.tag,
                             ")");
    case Op::kRecv:
      return detail::str_cat("RECV_", what, "(v", ins.value, " mb",
                             ins.microbatch, " <-r", ins.peer, " #", ins.tag,
                             ")");
    case Op::kReduceTied:
      return detail::str_cat("REDUCE_tied(p", ins.value, ")");
    case Op::kUnshard:
      return detail::str_cat("UNSHARD(s", ins.value, ")");
    case Op::kReduceGrads:
      return detail::str_cat("REDUCE_grads(s", ins.value, ")");
  }
  return "?";
}

bool reads(const Instruction& user, const Instruction& recv) {
  if (recv.op != Op::kRecv) return false;
  if (user.op == Op::kReduceTied) {
    return recv.payload == Payload::kTiedGrad && recv.value == user.value;
  }
  return user.op == Op::kCompute && reads(user.task, recv);
}

bool reads(const Task& task, const Instruction& recv) {
  if (recv.op != Op::kRecv) return false;
  // A fused task reads what any of its parts reads.
  for (const Task& t : task.simple_parts()) {
    if (t.microbatch != recv.microbatch) continue;
    const TaskKindInfo& kind = info(t.kind);
    switch (recv.payload) {
      case Payload::kActivation:
        if (kind.reads_activations &&
            std::find(recv.stages.begin(), recv.stages.end(), t.stage) !=
                recv.stages.end()) {
          return true;
        }
        break;
      case Payload::kGrad:
        if (kind.reads_grads && recv.src_stage == t.stage) return true;
        break;
      case Payload::kTiedGrad:
        break;
    }
  }
  return false;
}

}  // namespace torchmpmd::schedule
