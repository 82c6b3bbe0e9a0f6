// The only binding that includes torch: Tensor, dtype, device and
// ProcessGroup arguments go through torch's own pybind11 casters.
#include <torch/python.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "bindings/bindings.h"
#include "runtime/executor.h"
#include "runtime/heap.h"
#include "runtime/profiling.h"

namespace py = pybind11;

namespace torchmpmd::bindings {

namespace {

// A Python callable held by the executor; dropped with the GIL held.
std::shared_ptr<py::object> hold(py::object fn) {
  return std::shared_ptr<py::object>(new py::object(std::move(fn)),
                                     [](py::object* o) {
                                       py::gil_scoped_acquire gil;
                                       delete o;
                                     });
}

// Calls a Python stage callable from the executor's thread, taking the GIL
// only for the call; Python errors become C++ errors with their message.
template <typename... Args>
std::vector<at::Tensor> call_tensors(const py::object& fn, Args&&... args) {
  py::gil_scoped_acquire gil;
  try {
    py::object out = fn(std::forward<Args>(args)...);
    if (out.is_none()) return {};
    return out.cast<std::vector<at::Tensor>>();
  } catch (py::error_already_set& e) {
    throw std::runtime_error(e.what());
  } catch (const py::cast_error& e) {
    throw std::runtime_error(
        std::string("a stage callable must return a list of tensors: ") +
        e.what());
  }
}

runtime::StageFunctions wrap_functions(py::function forward,
                                       py::object input_grad,
                                       py::object weight_grad) {
  runtime::StageFunctions fns;
  auto f = hold(std::move(forward));
  fns.forward = [f](int32_t stage, int32_t mb,
                    const std::vector<at::Tensor>& inputs) {
    return call_tensors(*f, stage, mb, inputs);
  };
  if (!input_grad.is_none()) {
    auto i = hold(std::move(input_grad));
    fns.input_grad = [i](int32_t stage, int32_t mb,
                         const std::vector<at::Tensor>& saved,
                         const std::vector<at::Tensor>& grads) {
      return call_tensors(*i, stage, mb, saved, grads);
    };
  }
  if (!weight_grad.is_none()) {
    auto w = hold(std::move(weight_grad));
    fns.weight_grad = [w](int32_t stage, int32_t mb,
                          const std::vector<at::Tensor>& saved) {
      call_tensors(*w, stage, mb, saved);
    };
  }
  return fns;
}

}  // namespace

void bind_runtime(py::module_ m) {
  using namespace runtime;
  py::register_exception<PipelineError>(m, "PipelineError", PyExc_RuntimeError);
  py::register_exception<TransportError>(m, "TransportError",
                                         PyExc_RuntimeError);

  py::class_<Transport, std::shared_ptr<Transport>>(m, "Transport")
      .def(
          "send",
          [](Transport& t, const at::Tensor& tensor, int peer, int64_t tag,
             double timeout_s) {
            const at::Tensor data = tensor.contiguous();
            wait_on_host(*t.isend(data, peer, tag), data,
                         std::chrono::milliseconds(
                             static_cast<int64_t>(timeout_s * 1000)));
          },
          "Sends and waits for completion (blocks, without the GIL).",
          py::arg("tensor"), py::arg("peer"), py::arg("tag"),
          py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>())
      .def(
          "recv",
          [](Transport& t, const at::Tensor& tensor, int peer, int64_t tag,
             double timeout_s) {
            wait_on_host(*t.irecv(tensor, peer, tag), tensor,
                         std::chrono::milliseconds(
                             static_cast<int64_t>(timeout_s * 1000)));
          },
          "Receives into a contiguous tensor (blocks, without the GIL).",
          py::arg("tensor"), py::arg("peer"), py::arg("tag"),
          py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rank", &Transport::rank)
      .def_property_readonly("size", &Transport::size)
      .def_property_readonly("name", &Transport::name)
      .def_property_readonly(
          "device_type",
          [](const Transport& t) {
            return c10::DeviceTypeName(t.device_type(), /*lower_case=*/true);
          },
          "The device whose tensors it exchanges ('cpu', 'cuda').")
      .def("fail", &Transport::fail,
           "This rank failed: tell the other ranks and abort.",
           py::arg("reason"), py::call_guard<py::gil_scoped_release>())
      .def("abort", &Transport::abort,
           "Fail every wait of this transport, now and later, with `reason`.",
           py::arg("reason"), py::call_guard<py::gil_scoped_release>())
      .def("arm", &Transport::arm,
           "Start watching for another rank's failure (nestable).")
      .def("disarm", &Transport::disarm, "Undo one arm().")
      .def_property_readonly("abort_reason", &Transport::abort_reason);
  py::class_<C10dTransport, Transport, std::shared_ptr<C10dTransport>>(
      m, "C10dTransport")
      .def(py::init([](c10::intrusive_ptr<c10d::ProcessGroup> group,
                       std::optional<c10::intrusive_ptr<c10d::Store>> store,
                       std::string key, double poll_interval_s) {
             // The last reference may go with the GIL held (a Python
             // object's deallocation, e.g. at exit). The process group's
             // destructor then joins its worker threads, which may need the
             // GIL to drop a tensor's Python object: a deadlock. So it is
             // destroyed without the GIL, as torch's own bindings do
             // (IntrusivePtrNoGilDestructor).
             return std::shared_ptr<C10dTransport>(
                 new C10dTransport(
                     std::move(group), store.value_or(nullptr), std::move(key),
                     std::chrono::milliseconds(
                         static_cast<int64_t>(poll_interval_s * 1000))),
                 [](C10dTransport* transport) {
                   if (PyGILState_Check()) {
                     py::gil_scoped_release release;
                     delete transport;
                   } else {
                     delete transport;
                   }
                 });
           }),
           py::arg("group"), py::arg("store") = py::none(), py::arg("key") = "",
           py::arg("poll_interval_s") = 0.05);
  py::class_<LocalWorld, std::shared_ptr<LocalWorld>>(m, "LocalWorld")
      .def(py::init<int>(), py::arg("size"))
      .def_property_readonly("size", &LocalWorld::size)
      .def("transport", &LocalWorld::transport, py::arg("rank"))
      .def("kill", &LocalWorld::kill, py::arg("rank"));

  py::class_<ValueInfo>(m, "ValueInfo")
      .def(py::init([](int32_t id, std::string name, std::vector<int64_t> shape,
                       at::ScalarType dtype, bool requires_grad) {
             return ValueInfo{id, std::move(name), std::move(shape), dtype,
                              requires_grad};
           }),
           py::arg("id"), py::arg("name"), py::arg("shape"), py::arg("dtype"),
           py::arg("requires_grad"));
  py::class_<StageInfo>(m, "StageInfo")
      .def(
          py::init([](int32_t id, std::vector<int32_t> inputs,
                      std::vector<int32_t> outputs, bool has_loss, bool split) {
            return StageInfo{id, std::move(inputs), std::move(outputs),
                             has_loss, split};
          }),
          py::arg("id"), py::arg("inputs"), py::arg("outputs"),
          py::arg("has_loss"), py::arg("split") = false)
      .def_readonly("id", &StageInfo::id)
      .def_readonly("inputs", &StageInfo::inputs)
      .def_readonly("outputs", &StageInfo::outputs)
      .def_readonly("has_loss", &StageInfo::has_loss)
      .def_readonly("split", &StageInfo::split);

  py::class_<Executor>(m, "Executor")
      .def(py::init([](int32_t rank, const schedule::Program& program,
                       std::vector<StageInfo> stages,
                       std::vector<ValueInfo> values,
                       std::shared_ptr<Transport> transport,
                       std::map<int32_t, at::Tensor> tied, double timeout_s,
                       int32_t max_early_recvs, bool training,
                       c10::Device device, bool measure_memory) {
             ExecutorOptions options;
             options.timeout = std::chrono::milliseconds(
                 static_cast<int64_t>(timeout_s * 1000));
             options.max_early_recvs = max_early_recvs;
             options.training = training;
             options.device = device;
             options.measure_memory = measure_memory;
             return std::make_unique<Executor>(
                 rank, program, std::move(stages), std::move(values),
                 std::move(transport), std::move(tied), options);
           }),
           py::arg("rank"), py::arg("program"), py::arg("stages"),
           py::arg("values"), py::arg("transport"), py::arg("tied"),
           py::arg("timeout_s"), py::arg("max_early_recvs"),
           py::arg("training"), py::arg("device"),
           py::arg("measure_memory") = false)
      .def(
          "run",
          [](Executor& e, py::function forward, py::object input_grad,
             py::object weight_grad,
             std::map<std::pair<int32_t, int32_t>, std::vector<int64_t>> shapes,
             py::object stage_done, py::object unshard, bool replay_rng,
             py::object grads_start, bool overlap,
             std::set<int32_t> backward_rng) {
            runtime::StageFunctions fns =
                wrap_functions(std::move(forward), std::move(input_grad),
                               std::move(weight_grad));
            fns.shapes = std::move(shapes);
            fns.replay_rng = replay_rng;
            fns.overlap = overlap;
            fns.backward_rng = std::move(backward_rng);
            if (!stage_done.is_none()) {
              auto done = hold(std::move(stage_done));
              fns.stage_done = [done](int32_t stage) {
                call_tensors(*done, stage);
              };
            }
            if (!unshard.is_none()) {
              auto gather = hold(std::move(unshard));
              fns.unshard = [gather](int32_t stage) {
                call_tensors(*gather, stage);
              };
            }
            if (!grads_start.is_none()) {
              auto start = hold(std::move(grads_start));
              fns.grads_start = [start](int32_t stage) {
                call_tensors(*start, stage);
              };
            }
            py::gil_scoped_release release;
            e.run(fns);
          },
          "Runs one step with this step's stage callables; blocks (without "
          "the GIL) until it is done. `shapes` maps (value, microbatch) to "
          "the shape that microbatch has where it differs from the plan's; "
          "`unshard(stage)` and `stage_done(stage)` run at the program's "
          "UNSHARD and REDUCE_grads of a local stage (its data parallelism: "
          "before its first task; after the task that finishes its weight "
          "gradients). `grads_start(stage)` runs right before that task "
          "(or fused part), to reduce each gradient as it becomes final. "
          "`replay_rng=False`: a recompute leaves the random "
          "generator to the forward callable. `overlap`: a fused task of "
          "forward and backward parts runs its two sides at once (the "
          "forward side on a thread of its own, `current_lane()` 1), results "
          "unchanged. `backward_rng`: stages whose backward sets the random "
          "generator (a checkpoint's replay): with `overlap`, their backward "
          "counts as drawing random numbers.",
          py::arg("forward"), py::arg("input_grad") = py::none(),
          py::arg("weight_grad") = py::none(),
          py::arg("shapes") =
              std::map<std::pair<int32_t, int32_t>, std::vector<int64_t>>{},
          py::arg("stage_done") = py::none(), py::arg("unshard") = py::none(),
          py::arg("replay_rng") = true, py::arg("grads_start") = py::none(),
          py::arg("overlap") = false,
          py::arg("backward_rng") = std::set<int32_t>{})
      .def_property_readonly("rank", &Executor::rank)
      .def_property_readonly("step_start_unix_ns",
                             &Executor::step_start_unix_ns)
      .def_property_readonly(
          "peak_held_bytes", &Executor::peak_held_bytes,
          "The most bytes the last run held for backward at once, or -1 "
          "(not measured)")
      .def_property_readonly(
          "sent_bytes", &Executor::sent_bytes,
          "The bytes the last run sent to its peers (every message)")
      .def_property_readonly(
          "received_bytes", &Executor::received_bytes,
          "The bytes the last run received from its peers (every message)")
      .def(
          "records",
          [](const Executor& e) {
            using Part = std::tuple<int64_t, int64_t, int32_t>;
            std::vector<
                std::tuple<std::string, int32_t, int32_t, int64_t, int64_t,
                           int64_t, int64_t, int64_t, std::vector<Part>>>
                out;
            for (const auto& r : e.records()) {
              // A fused task by its action, "(0F3;1B2)OVERLAP_F_B".
              const std::string kind =
                  r.op != schedule::Op::kCompute
                      ? std::string(schedule::collective_name(r.op))
                  : r.task.fused()
                      ? schedule::to_action(r.task)
                      : std::string(1, schedule::kind_letter(r.task.kind));
              std::vector<Part> parts;
              for (const auto& p : r.parts) {
                parts.emplace_back(p.start_ns, p.end_ns, p.lane);
              }
              out.emplace_back(kind, r.task.stage, r.task.microbatch,
                               r.start_ns, r.end_ns, r.waited_ns, r.held_bytes,
                               r.kept_bytes, std::move(parts));
            }
            return out;
          },
          "The tasks of the last run: (kind, stage, microbatch, start_ns, "
          "end_ns, waited_ns, held_bytes, kept_bytes, parts); parts: a fused "
          "task's parts as they ran on CPU, (start_ns, end_ns, lane) each "
          "in the task's order (else empty); bytes -1 when not "
          "measured. Data-parallel collectives have kind 'unshard' or "
          "'reduce_grads' and microbatch -1; a fused task has one record, "
          "with its action as kind ('(0F3;1B2)OVERLAP_F_B'), its first "
          "part's stage and microbatch, and kept_bytes -1.");

  py::class_<ProfilerContext>(
      m, "ProfilerContext",
      "The profiler a thread records into (torch.profiler's thread-local "
      "callbacks and state), to record other threads' work into it too.")
      .def_static("current", &ProfilerContext::current, "The calling thread's.")
      .def_property_readonly(
          "active", &ProfilerContext::active,
          "Whether a profiler records on that thread (thread-locally).")
      .def(
          "run",
          [](const ProfilerContext& context, const py::function& fn) {
            ProfilerContextGuard guard(context);
            return fn();
          },
          "fn() on the calling thread, recording into this context's "
          "profiler; the thread's own comes back afterwards.",
          py::arg("fn"));

  m.def("current_lane", &runtime::current_lane,
        "The side of a fused task the calling thread runs: 1 for the "
        "forward parts of a fused task with forward and backward parts, 0 "
        "otherwise (collectives inside a stage pick their process group by "
        "it).");

  m.def("keep_freed_memory", &keep_freed_memory, py::arg("mmap_threshold"),
        py::arg("trim_threshold"),
        "Fixes glibc malloc's mmap and trim thresholds (process-wide, for "
        "good): freed memory stays in the heap. Whether it did.");
}

}  // namespace torchmpmd::bindings
