#include "schedule/task.h"

#include <cctype>

#include "util/check.h"

namespace torchmpmd::schedule {

std::string to_string(const Task& task) {
  return detail::str_cat(kind_letter(task.kind), "(stage=", task.stage,
                         ", mb=", task.microbatch, ")");
}

std::string to_action(const Task& task) {
  return detail::str_cat(task.stage, kind_letter(task.kind), task.microbatch);
}

Task parse_action(const std::string& text) {
  const std::string expected = detail::str_cat(
      "': expected <stage><", kind_letters(), "><microbatch>, e.g. '2F5'");
  size_t i = 0;
  const auto number = [&]() {
    const size_t start = i;
    while (i < text.size() &&
           std::isdigit(static_cast<unsigned char>(text[i]))) {
      ++i;
    }
    MPMD_CHECK(i > start && i - start <= 9, "schedule: cannot read action '",
               text, expected);
    return static_cast<int32_t>(std::stol(text.substr(start, i - start)));
  };
  Task task;
  task.stage = number();
  MPMD_CHECK(i < text.size(), "schedule: cannot read action '", text, expected);
  const char letter = text[i++];
  MPMD_CHECK(is_kind_letter(letter), "schedule: cannot read action '", text,
             "': unknown task kind '", letter, "'; use ", kind_list());
  task.kind = kind_from_letter(letter);
  task.microbatch = number();
  MPMD_CHECK(i == text.size(), "schedule: cannot read action '", text,
             "': unexpected characters after the microbatch");
  return task;
}

}  // namespace torchmpmd::schedule
