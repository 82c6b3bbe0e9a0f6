#include "schedule/task.h"

#include <cctype>
#include <cstring>

#include "util/check.h"

namespace torchmpmd::schedule {

namespace {

std::string simple_string(const Task& task) {
  return detail::str_cat(kind_letter(task.kind), "(stage=", task.stage,
                         ", mb=", task.microbatch, ")");
}

std::string simple_action(const Task& task) {
  return detail::str_cat(task.stage, kind_letter(task.kind), task.microbatch);
}

// Joins the parts' texts: "(a;b)OVERLAP_F_B" style with `sep` between them.
template <typename Fn>
std::string join_parts(const Task& task, const char* sep, Fn fn) {
  std::string out;
  for (const Task& p : task.simple_parts()) {
    if (!out.empty()) out += sep;
    out += fn(p);
  }
  return out;
}

Task parse_simple(const std::string& text, const std::string& whole) {
  const std::string expected =
      detail::str_cat("': expected <stage><", kind_letters(),
                      "><microbatch>, e.g. '2F5', or fused parts '(2F5;3B1)",
                      kFusedActionType, "'");
  size_t i = 0;
  const auto number = [&]() {
    const size_t start = i;
    while (i < text.size() &&
           std::isdigit(static_cast<unsigned char>(text[i]))) {
      ++i;
    }
    MPMD_CHECK(i > start && i - start <= 9, "schedule: cannot read action '",
               whole, expected);
    return static_cast<int32_t>(std::stol(text.substr(start, i - start)));
  };
  Task task;
  task.stage = number();
  MPMD_CHECK(i < text.size(), "schedule: cannot read action '", whole,
             expected);
  const char letter = text[i++];
  MPMD_CHECK(is_kind_letter(letter), "schedule: cannot read action '", whole,
             "': unknown task kind '", letter, "'; use ", kind_list());
  task.kind = kind_from_letter(letter);
  task.microbatch = number();
  MPMD_CHECK(i == text.size(), "schedule: cannot read action '", whole,
             "': unexpected characters after the microbatch");
  return task;
}

}  // namespace

Task fuse(std::vector<Task> parts) {
  MPMD_CHECK(parts.size() >= 2, "schedule: a fused task needs two or more ",
             "parts, got ", parts.size(),
             "; schedule a single task as itself, not fused");
  for (size_t k = 0; k < parts.size(); ++k) {
    MPMD_CHECK(!parts[k].fused(), "schedule: part ", k + 1,
               " of a fused task is fused itself (", to_string(parts[k]),
               "); fused tasks do not nest: list its parts in the outer one");
  }
  Task task(parts.front().kind, parts.front().stage, parts.front().microbatch);
  task.parts = std::move(parts);
  return task;
}

std::string to_string(const Task& task) {
  if (!task.fused()) return simple_string(task);
  return join_parts(task, "+", simple_string);
}

std::string to_action(const Task& task) {
  if (!task.fused()) return simple_action(task);
  return detail::str_cat("(", join_parts(task, ";", simple_action), ")",
                         kFusedActionType);
}

std::vector<int32_t> lanes(const Task& task) {
  const Task::Parts parts = task.simple_parts();
  std::vector<int32_t> out(parts.size(), 0);
  bool forward = false;
  bool other = false;
  for (const Task& part : parts) {
    (part.kind == TaskKind::kForward ? forward : other) = true;
  }
  if (!(task.fused() && forward && other)) return out;
  for (size_t k = 0; k < parts.size(); ++k) {
    out[k] = parts.begin()[k].kind == TaskKind::kForward ? 1 : 0;
  }
  return out;
}

std::string fused_cost_key(const Task& task) {
  return join_parts(task, ";", [](const Task& p) {
    return detail::str_cat(p.stage, kind_letter(p.kind));
  });
}

Task parse_action(const std::string& text) {
  if (text.empty() || text[0] != '(') return parse_simple(text, text);
  const size_t close = text.find(')');
  MPMD_CHECK(close != std::string::npos, "schedule: cannot read action '", text,
             "': a fused action is '(2F5;3B1)", kFusedActionType,
             "', its parts between parentheses");
  MPMD_CHECK(text.compare(close + 1, std::string::npos, kFusedActionType) == 0,
             "schedule: cannot read action '", text, "': expected ",
             kFusedActionType, " after the parts, got '",
             text.substr(close + 1), "'");
  std::vector<Task> parts;
  size_t start = 1;
  while (start <= close) {
    size_t end = text.find(';', start);
    if (end == std::string::npos || end > close) end = close;
    parts.push_back(parse_simple(text.substr(start, end - start), text));
    start = end + 1;
  }
  MPMD_CHECK(parts.size() >= 2, "schedule: cannot read action '", text,
             "': a fused action has two or more parts, separated by ';'");
  return fuse(std::move(parts));
}

}  // namespace torchmpmd::schedule
