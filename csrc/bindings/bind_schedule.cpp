#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "schedule/program.h"
#include "schedule/simulate.h"

namespace py = pybind11;

namespace torchmpmd::bindings {

void bind_schedule(py::module_ m) {
  using namespace schedule;
  // Members named by letter, from the task-kind table.
  py::enum_<TaskKind> kinds(m, "TaskKind");
  for (const TaskKindInfo& k : task_kinds()) {
    kinds.value(std::string(1, k.letter).c_str(), k.kind, k.name);
  }

  // The table itself, for Python's readers (schedule/kinds.py).
  py::class_<TaskKindInfo>(m, "TaskKindInfo")
      .def_property_readonly(
          "letter",
          [](const TaskKindInfo& k) { return std::string(1, k.letter); })
      .def_property_readonly(
          "name", [](const TaskKindInfo& k) { return std::string(k.name); })
      .def_readonly("required", &TaskKindInfo::required)
      .def_readonly("backward", &TaskKindInfo::backward)
      .def_readonly("backward_parts", &TaskKindInfo::backward_parts)
      .def_readonly("in_forward_only", &TaskKindInfo::in_forward_only)
      .def_readonly("emits_input_grads", &TaskKindInfo::emits_input_grads)
      .def_readonly("finishes_weight_grads",
                    &TaskKindInfo::finishes_weight_grads)
      .def_readonly("recomputes", &TaskKindInfo::recomputes)
      .def_property_readonly("charged_as",
                             [](const TaskKindInfo& k) {
                               return std::string(1, kind_letter(k.charged_as));
                             })
      .def_property_readonly(
          "default_cost",
          [](const TaskKindInfo& k) {
            // (letter, factor) terms of its default time.
            std::vector<std::pair<std::string, double>> out;
            for (const auto& [kind, factor] : k.default_cost) {
              out.emplace_back(std::string(1, kind_letter(kind)), factor);
            }
            return out;
          })
      .def_property_readonly("after_own", [](const TaskKindInfo& k) {
        // Letters of the kinds of its own (stage, microbatch) it waits for
        // (those only the schedule may have included).
        std::string out;
        for (const Dependency& d : k.needs) {
          if (d.need == Need::kOwn || d.need == Need::kOwnIfScheduled) {
            out += kind_letter(d.kind);
          }
        }
        return out;
      });
  m.def("task_kind_table", &task_kinds,
        "The task kinds, in enum order, with what each does.");

  py::class_<Task>(m, "Task")
      .def(py::init([](TaskKind kind, int32_t stage, int32_t microbatch) {
             return Task{kind, stage, microbatch};
           }),
           py::arg("kind"), py::arg("stage"), py::arg("microbatch"))
      .def_readonly("kind", &Task::kind)
      .def_readonly("stage", &Task::stage)
      .def_readonly("microbatch", &Task::microbatch)
      .def_readonly("parts", &Task::parts,
                    "A fused task's parts, in order; empty for a simple task.")
      .def("__repr__", [](const Task& t) { return to_string(t); });

  m.def("fuse", &fuse, py::arg("parts"),
        "A fused task of simple tasks, run in this order as one step.");
  m.def("to_action", &to_action, py::arg("task"));
  m.def("parse_action", &parse_action, py::arg("text"));
  m.def("fused_cost_key", &fused_cost_key, py::arg("task"),
        "A fused task's key in Costs.fused_time: its parts' stages and "
        "kinds, '0F;3B'.");

  py::class_<Edge>(m, "Edge")
      .def(py::init([](int32_t value, int32_t src, int32_t dst, int64_t bytes,
                       bool requires_grad) {
             return Edge{value, src, dst, bytes, requires_grad};
           }),
           py::arg("value"), py::arg("src"), py::arg("dst"), py::arg("bytes"),
           py::arg("requires_grad"))
      .def_readonly("value", &Edge::value)
      .def_readonly("src", &Edge::src)
      .def_readonly("dst", &Edge::dst)
      .def_readonly("bytes", &Edge::bytes)
      .def_readonly("requires_grad", &Edge::requires_grad);

  py::class_<TiedGroup>(m, "TiedGroup")
      .def(py::init([](int32_t id, std::vector<int32_t> stages, int64_t bytes) {
             return TiedGroup{id, std::move(stages), bytes};
           }),
           py::arg("id"), py::arg("stages"), py::arg("bytes"))
      .def_readonly("id", &TiedGroup::id)
      .def_readonly("stages", &TiedGroup::stages)
      .def_readonly("bytes", &TiedGroup::bytes);

  py::class_<PipelineGraph>(m, "PipelineGraph")
      .def(py::init([](int32_t num_stages, std::vector<Edge> edges,
                       std::vector<TiedGroup> tied) {
             PipelineGraph g;
             g.num_stages = num_stages;
             g.edges = std::move(edges);
             g.tied = std::move(tied);
             g.finalize();
             return g;
           }),
           py::arg("num_stages"), py::arg("edges"), py::arg("tied"))
      .def_static("from_plan", &PipelineGraph::from_plan, py::arg("plan"))
      .def_static("chain", &PipelineGraph::chain, py::arg("num_stages"),
                  py::arg("bytes") = 1)
      .def_readonly("num_stages", &PipelineGraph::num_stages)
      .def_readonly("edges", &PipelineGraph::edges)
      .def_readonly("tied", &PipelineGraph::tied);

  py::class_<StageCollectives>(m, "StageCollectives")
      .def(py::init([](bool unshard, bool reduce_grads) {
             return StageCollectives{unshard, reduce_grads};
           }),
           py::arg("unshard") = false, py::arg("reduce_grads") = false)
      .def_readonly("unshard", &StageCollectives::unshard)
      .def_readonly("reduce_grads", &StageCollectives::reduce_grads);

  py::class_<ScheduleSpec>(m, "ScheduleSpec")
      .def(py::init([](int32_t num_ranks, int32_t num_microbatches,
                       std::vector<int32_t> placement,
                       std::vector<std::vector<Task>> tasks, bool forward_only,
                       std::vector<StageCollectives> collectives) {
             return ScheduleSpec{
                 num_ranks,        num_microbatches, std::move(placement),
                 std::move(tasks), forward_only,     std::move(collectives)};
           }),
           py::arg("num_ranks"), py::arg("num_microbatches"),
           py::arg("placement"), py::arg("tasks"),
           py::arg("forward_only") = false,
           py::arg("collectives") = std::vector<StageCollectives>{})
      .def_readonly("num_ranks", &ScheduleSpec::num_ranks)
      .def_readonly("num_microbatches", &ScheduleSpec::num_microbatches)
      .def_readonly("placement", &ScheduleSpec::placement)
      .def_readonly("tasks", &ScheduleSpec::tasks)
      .def_readonly("forward_only", &ScheduleSpec::forward_only)
      .def_readonly("collectives", &ScheduleSpec::collectives);

  py::class_<Costs>(m, "Costs")
      .def(py::init<>())
      .def_static("uniform", &Costs::uniform, py::arg("num_stages"),
                  py::arg("forward") = 1.0, py::arg("backward") = 2.0,
                  py::arg("input_grad") = 1.0, py::arg("weight_grad") = 1.0)
      .def_readwrite("time", &Costs::time,
                     "Per task kind (enum order), per stage: a task's time.")
      .def_readwrite("fused_time", &Costs::fused_time,
                     "Measured times of fused tasks by fused_cost_key(); "
                     "others take the sum of their parts'.")
      .def_readwrite("activation_bytes", &Costs::activation_bytes)
      .def_readwrite("weight_grad_bytes", &Costs::weight_grad_bytes)
      .def_readwrite("unshard", &Costs::unshard)
      .def_readwrite("reduce_grads", &Costs::reduce_grads)
      .def_readwrite("unsharded_bytes", &Costs::unsharded_bytes)
      .def_readwrite("latency", &Costs::latency)
      .def_readwrite("bytes_per_unit", &Costs::bytes_per_unit)
      .def_readwrite("overlap_comm", &Costs::overlap_comm)
      .def_readwrite("comm", &Costs::comm,
                     "Communication inside tasks, per kind and stage, part "
                     "of their time")
      .def_readwrite("overlap_sides", &Costs::overlap_sides,
                     "A fused task's two sides run at once")
      .def_readwrite("shared_cores", &Costs::shared_cores,
                     "Cores the ranks compute on (0: a device per rank)")
      .def_readwrite("demand_per_rank", &Costs::demand_per_rank,
                     "Cores one rank's compute takes");

  py::enum_<Op>(m, "Op")
      .value("compute", Op::kCompute)
      .value("send", Op::kSend)
      .value("recv", Op::kRecv)
      .value("reduce_tied", Op::kReduceTied)
      .value("unshard", Op::kUnshard)
      .value("reduce_grads", Op::kReduceGrads);
  py::enum_<Payload>(m, "Payload")
      .value("activation", Payload::kActivation)
      .value("grad", Payload::kGrad)
      .value("tied_grad", Payload::kTiedGrad);

  py::class_<Instruction>(m, "Instruction")
      .def_readonly("op", &Instruction::op)
      .def_readonly("task", &Instruction::task)
      .def_readonly("payload", &Instruction::payload)
      .def_readonly("peer", &Instruction::peer)
      .def_readonly("value", &Instruction::value)
      .def_readonly("microbatch", &Instruction::microbatch)
      .def_readonly("src_stage", &Instruction::src_stage)
      .def_readonly("stages", &Instruction::stages)
      .def_readonly("bytes", &Instruction::bytes)
      .def_readonly("tag", &Instruction::tag)
      .def("__repr__",
           [](const Instruction& i) { return schedule::to_string(i); });

  py::class_<Program>(m, "Program")
      .def_readonly("spec", &Program::spec)
      .def_readonly("graph", &Program::graph)
      .def_readonly("ranks", &Program::ranks)
      .def_readonly("order", &Program::order)
      .def_property_readonly("num_ranks", &Program::num_ranks)
      .def_property_readonly("num_stages", &Program::num_stages);

  py::enum_<EventKind>(m, "EventKind")
      .value("compute", EventKind::kCompute)
      .value("transfer", EventKind::kTransfer)
      .value("wait", EventKind::kWait)
      .value("collective", EventKind::kCollective);
  py::class_<Event>(m, "Event")
      .def_readonly("kind", &Event::kind)
      .def_readonly("rank", &Event::rank)
      .def_readonly("task", &Event::task)
      .def_readonly("peer", &Event::peer)
      .def_readonly("label", &Event::label)
      .def_readonly("start", &Event::start)
      .def_readonly("end", &Event::end);
  py::class_<Timeline>(m, "Timeline")
      .def_readonly("num_ranks", &Timeline::num_ranks)
      .def_readonly("events", &Timeline::events)
      .def_readonly("peak_activation_bytes", &Timeline::peak_activation_bytes)
      .def_readonly("peak_bytes", &Timeline::peak_bytes);

  m.def("validate", &validate, py::arg("graph"), py::arg("spec"),
        py::call_guard<py::gil_scoped_release>());
  m.def("lower", &lower, py::arg("graph"), py::arg("spec"), py::arg("costs"),
        py::call_guard<py::gil_scoped_release>());
  m.def("simulate", &simulate, py::arg("program"), py::arg("costs"),
        py::call_guard<py::gil_scoped_release>());
  m.def(
      "timeline_stats",
      [](const std::vector<int32_t>& ranks, const std::vector<double>& starts,
         const std::vector<double>& ends, const std::vector<bool>& busy) {
        const TimelineStats s = timeline_stats(ranks, starts, ends, busy);
        return std::make_pair(s.step_time, s.bubble_fraction);
      },
      "(step time, bubble fraction) of task intervals: last end - first "
      "start, and 1 - busy / (step time * distinct ranks); (0, 0) for none. "
      "Intervals whose `busy` flag is False (data-parallel collectives) "
      "count toward the step time only.",
      py::arg("ranks"), py::arg("starts"), py::arg("ends"),
      py::arg("busy") = std::vector<bool>{});
  m.def("render_grid", &render_grid, py::arg("spec"), py::arg("marks"));
}

}  // namespace torchmpmd::bindings
