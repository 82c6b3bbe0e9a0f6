#include "schedule/task.h"

#include <cctype>

#include "util/check.h"

namespace torchmpmd::schedule {

char kind_letter(TaskKind kind) {
  switch (kind) {
    case TaskKind::kForward:
      return 'F';
    case TaskKind::kBackward:
      return 'B';
    case TaskKind::kInputGrad:
      return 'I';
    case TaskKind::kWeightGrad:
      return 'W';
  }
  return '?';
}

TaskKind kind_from_letter(char letter) {
  switch (letter) {
    case 'F':
      return TaskKind::kForward;
    case 'B':
      return TaskKind::kBackward;
    case 'I':
      return TaskKind::kInputGrad;
    case 'W':
      return TaskKind::kWeightGrad;
    default:
      break;
  }
  MPMD_CHECK(false, "schedule: unknown task kind '", letter,
             "'; use F (forward), B (backward), I (input grad) or W (weight "
             "grad)");
  return TaskKind::kForward;
}

std::string to_string(const Task& task) {
  return detail::str_cat(kind_letter(task.kind), "(stage=", task.stage,
                         ", mb=", task.microbatch, ")");
}

std::string to_action(const Task& task) {
  return detail::str_cat(task.stage, kind_letter(task.kind), task.microbatch);
}

Task parse_action(const std::string& text) {
  size_t i = 0;
  const auto number = [&]() {
    const size_t start = i;
    while (i < text.size() &&
           std::isdigit(static_cast<unsigned char>(text[i]))) {
      ++i;
    }
    MPMD_CHECK(i > start && i - start <= 9, "schedule: cannot read action '",
               text, "': expected <stage><F|B|I|W><microbatch>, e.g. '2F5'");
    return static_cast<int32_t>(std::stol(text.substr(start, i - start)));
  };
  Task task;
  task.stage = number();
  MPMD_CHECK(i < text.size(), "schedule: cannot read action '", text,
             "': expected <stage><F|B|I|W><microbatch>, e.g. '2F5'");
  const char letter = text[i++];
  MPMD_CHECK(std::string("FBIW").find(letter) != std::string::npos,
             "schedule: cannot read action '", text, "': unknown task kind '",
             letter,
             "'; use F (forward), B (backward), I (input grad) or W (weight "
             "grad)");
  task.kind = kind_from_letter(letter);
  task.microbatch = number();
  MPMD_CHECK(i == text.size(), "schedule: cannot read action '", text,
             "': unexpected characters after the microbatch");
  return task;
}

}  // namespace torchmpmd::schedule
