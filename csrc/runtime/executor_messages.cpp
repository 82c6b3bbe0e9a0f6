#include "runtime/executor_internal.h"

namespace torchmpmd::runtime {

using namespace internal;

void Executor::post_recv(size_t index, State& st) {
  const Instruction& ins = code_[index];
  at::Tensor buffer;
  if (ins.payload == Payload::kTiedGrad) {
    buffer = at::empty_like(tied_.at(ins.value), at::MemoryFormat::Contiguous);
  } else {
    const ValueInfo& v = value(ins.value);
    buffer =
        at::empty(shape_of(v.id, ins.microbatch, st),
                  at::TensorOptions().dtype(v.dtype).device(options_.device));
  }
  received_bytes_ += static_cast<int64_t>(buffer.nbytes());
  State::Posted posted;
  posted.request = transport_->irecv(buffer, ins.peer, ins.tag);
  posted.buffer = buffer;
  st.recvs.emplace(index, std::move(posted));
  st.issued[index] = true;
}

void Executor::post_early(size_t pc, State& st) {
  // Peers with an earlier message not yet issued: on a pair-ordered
  // transport (NCCL) a receive waits behind them; Gloo matches by tag, so a
  // receive is posted as early as the budget allows, and the sender's data
  // goes out as soon as it is sent instead of a round trip after the
  // receiver gets to it.
  const bool ordered = transport_->issues_in_pair_order();
  std::set<int32_t> blocked;
  const size_t end = std::min(code_.size(), pc + 256);
  for (size_t j = pc; j < end; ++j) {
    if (st.early_outstanding >= options_.max_early_recvs) return;
    const Instruction& ins = code_[j];
    if (ins.op != Op::kSend && ins.op != Op::kRecv) continue;
    if (st.issued[j]) continue;
    if (ins.op == Op::kRecv && !(ordered && blocked.count(ins.peer))) {
      post_recv(j, st);
      st.recvs.at(j).early = true;
      ++st.early_outstanding;
    } else {
      blocked.insert(ins.peer);
    }
  }
}

void Executor::wait_recv(size_t index, State& st, const Instruction& user) {
  const Instruction& ins = code_[index];
  // Its own range in torch.profiler, before the range of the task it feeds.
  const ProfilerRange range([&] { return wait_name(ins); });
  if (!st.issued[index]) post_recv(index, st);
  auto& posted = st.recvs.at(index);
  const std::string task = user.op == Op::kCompute
                               ? schedule::to_string(user.task)
                               : std::string("the tied-gradient sum");
  try {
    const Unlocked waiting(st);
    posted.request->wait(options_.timeout);
  } catch (const TransportError& e) {
    std::ostringstream msg;
    msg << "torchmpmd: rank " << rank_ << " ";
    if (e.aborted()) {
      msg << "stopped waiting for " << describe(ins) << " from rank "
          << ins.peer << ", needed by " << task << ", because " << e.what();
    } else {
      msg << (e.timed_out() ? "timed out after " : "failed ")
          << (e.timed_out() ? seconds(options_.timeout) + " " : std::string())
          << "waiting for " << describe(ins) << " from rank " << ins.peer
          << ", needed by " << task << " (" << transport_->name()
          << "): " << e.what() << ". Rank " << ins.peer
          << " may have died or be stuck"
          << (e.timed_out() ? "; if it is only slow, raise the timeout" : "");
    }
    throw ExecutorError(msg.str());
  }
  at::Tensor buffer = std::move(posted.buffer);
  if (posted.early) --st.early_outstanding;
  st.recvs.erase(index);
  const auto replied = delivered_by_.find(index);
  if (replied != delivered_by_.end()) {
    st.delivered.insert(replied->second.begin(), replied->second.end());
  }
  switch (ins.payload) {
    case Payload::kActivation:
      // From here it is the reading stage's input (kept if its backward
      // needs it), no longer a posted receive.
      if (st.memory && user.op == Op::kCompute) {
        // The part of a fused task that reads it.
        int32_t reader = user.task.stage;
        for (const Task& part : user.task.simple_parts()) {
          if (schedule::info(part.kind).reads_activations &&
              part.microbatch == ins.microbatch &&
              std::count(ins.stages.begin(), ins.stages.end(), part.stage)) {
            reader = part.stage;
            break;
          }
        }
        st.memory->adopt(buffer.storage().data_ptr().get(),
                         {reader, ins.microbatch});
      }
      st.acts[{ins.value, ins.microbatch}] = {
          buffer, static_cast<int32_t>(ins.stages.size())};
      break;
    case Payload::kGrad:
      st.grad_parts[{ins.value, ins.microbatch}][ins.stages.front()] = buffer;
      break;
    case Payload::kTiedGrad:
      st.tied_parts[ins.value][ins.peer] = buffer;
      break;
  }
}

void Executor::reap_sends(State& st, bool all) {
  auto& sends = st.sends;
  for (size_t i = 0; i < sends.size();) {
    const Instruction& ins = code_[sends[i].index];
    bool done = false;
    try {
      done = !all && sends[i].request->test();
      // Gloo's send reports completion only to a wait: one the peer's
      // reply proved delivered is waited for now (it returns at once), so
      // its tensor is freed here, not at the end of the step.
      if (!done && (all || st.delivered.count(sends[i].index))) {
        sends[i].request->wait(options_.timeout);
        done = true;
      }
    } catch (const TransportError& e) {
      std::ostringstream msg;
      msg << "torchmpmd: rank " << rank_ << " ";
      if (e.aborted()) {
        msg << "stopped sending " << describe(ins) << " to rank " << ins.peer
            << ", because " << e.what();
      } else {
        msg << (e.timed_out() ? "timed out sending " : "failed sending ")
            << describe(ins) << " to rank " << ins.peer << " ("
            << transport_->name() << "): " << e.what() << ". Rank " << ins.peer
            << " may have died or be stuck";
      }
      throw ExecutorError(msg.str());
    }
    if (done) {
      sends[i] = std::move(sends.back());
      sends.pop_back();
    } else {
      ++i;
    }
  }
}

void Executor::send(const Instruction& ins, State& st) {
  at::Tensor payload;
  switch (ins.payload) {
    case Payload::kActivation:
      payload = take_activation(ins.value, ins.microbatch, st).detach();
      break;
    case Payload::kGrad: {
      auto& parts = st.grad_parts.at({ins.value, ins.microbatch});
      for (const int32_t s : ins.stages) {
        at::Tensor part = parts.at(s);
        payload = payload.defined() ? payload.add(part) : part;
        parts.erase(s);
      }
      if (parts.empty()) st.grad_parts.erase({ins.value, ins.microbatch});
      break;
    }
    case Payload::kTiedGrad: {
      const at::Tensor& param = tied_.at(ins.value);
      payload = param.grad().defined() ? param.grad().detach().clone()
                                       : at::zeros_like(param);
      break;
    }
  }
  payload = payload.contiguous();
  sent_bytes_ += static_cast<int64_t>(payload.nbytes());
  State::Sending sending;
  sending.request = transport_->isend(payload, ins.peer, ins.tag);
  sending.index = static_cast<size_t>(&ins - code_.data());
  st.sends.push_back(std::move(sending));
}

void Executor::reduce_tied(const Instruction& ins, State& st) {
  at::Tensor param = tied_.at(ins.value);
  auto parts = std::move(st.tied_parts[ins.value]);
  st.tied_parts.erase(ins.value);
  parts[rank_] =
      param.grad().defined() ? param.grad().detach() : at::zeros_like(param);
  // The sum in ascending rank order, equal on every holder. It accumulates
  // in place into a received buffer (ours to write), never into our own
  // part, which may still be on its way to the other holders: with two
  // parts, into the other one (a + b == b + a exactly); with more, into the
  // first when it was received, else into a copy.
  at::Tensor total;
  auto it = parts.begin();
  if (it->first != rank_) {
    total = it->second;
    ++it;
  } else if (parts.size() == 2) {
    total = std::next(it)->second;
    total.add_(it->second);
    it = parts.end();
  } else {
    total = it->second.clone();
    ++it;
  }
  for (; it != parts.end(); ++it) total.add_(it->second);
  parts.clear();
  // Earlier steps' gradient, equal on every holder, goes back on top.
  const auto before = st.tied_before.find(ins.value);
  if (before != st.tied_before.end()) {
    total.add_(before->second);
    st.tied_before.erase(before);
  }
  param.mutable_grad() = total;
}

}  // namespace torchmpmd::runtime
