#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "graph/stage_graph.h"

namespace py = pybind11;

namespace torchmpmd::bindings {

void bind_graph(py::module_ m) {
  using namespace graph;
  py::enum_<NodeKind>(m, "NodeKind")
      .value("input", NodeKind::kInput)
      .value("parameter", NodeKind::kParameter)
      .value("buffer", NodeKind::kBuffer)
      .value("compute", NodeKind::kCompute);
  py::enum_<SplitMode>(m, "SplitMode")
      .value("markers", SplitMode::kMarkers)
      .value("before", SplitMode::kBefore)
      .value("after", SplitMode::kAfter);

  py::class_<Node>(m, "Node")
      .def_readonly("name", &Node::name)
      .def_readonly("kind", &Node::kind)
      .def_readonly("target", &Node::target)
      .def_readonly("inputs", &Node::inputs)
      .def_readonly("module_stack", &Node::module_stack)
      .def_readonly("bytes", &Node::bytes)
      .def_property_readonly("module_path", &Node::module_path);

  py::class_<BufferUpdate>(m, "BufferUpdate")
      .def(py::init([](int32_t buffer, int32_t value) {
             return BufferUpdate{buffer, value};
           }),
           py::arg("buffer"), py::arg("value"))
      .def_readonly("buffer", &BufferUpdate::buffer)
      .def_readonly("value", &BufferUpdate::value);

  py::class_<StageGraph>(m, "StageGraph")
      .def(py::init<>())
      .def(
          "add_node",
          [](StageGraph& g, std::string name, NodeKind kind, std::string target,
             std::vector<int32_t> inputs, std::vector<std::string> module_stack,
             int64_t bytes, bool differentiable, bool replicable, bool attached,
             bool transferable) {
            Node n;
            n.name = std::move(name);
            n.kind = kind;
            n.target = std::move(target);
            n.inputs = std::move(inputs);
            n.module_stack = std::move(module_stack);
            n.bytes = bytes;
            n.differentiable = differentiable;
            n.replicable = replicable;
            n.attached = attached;
            n.transferable = transferable;
            return g.add_node(std::move(n));
          },
          "Appends a node (inputs must be earlier nodes); returns its id.",
          py::arg("name"), py::arg("kind"), py::arg("target"),
          py::arg("inputs"), py::arg("module_stack"), py::arg("bytes"),
          py::arg("differentiable"), py::arg("replicable"), py::arg("attached"),
          py::arg("transferable"))
      .def_readwrite("outputs", &StageGraph::outputs)
      .def_readwrite("buffer_updates", &StageGraph::buffer_updates)
      .def_readonly("nodes", &StageGraph::nodes)
      .def("__len__", [](const StageGraph& g) { return g.nodes.size(); });

  py::class_<SplitSpec>(m, "SplitSpec")
      .def(py::init([](SplitMode mode, std::vector<std::string> points,
                       std::vector<std::string> module_paths,
                       std::vector<int32_t> marker_positions) {
             return SplitSpec{mode, std::move(points), std::move(module_paths),
                              std::move(marker_positions)};
           }),
           py::arg("mode"), py::arg("points"), py::arg("module_paths"),
           py::arg("marker_positions"));

  py::class_<Transfer>(m, "Transfer")
      .def_readonly("value", &Transfer::value)
      .def_readonly("src_stage", &Transfer::src_stage)
      .def_readonly("dst_stages", &Transfer::dst_stages)
      .def_readonly("bytes", &Transfer::bytes)
      .def_readonly("requires_grad", &Transfer::requires_grad);

  py::class_<TiedParameter>(m, "TiedParameter")
      .def_readonly("node", &TiedParameter::node)
      .def_readonly("stages", &TiedParameter::stages);

  py::class_<StagePlan>(m, "StagePlan")
      .def_readonly("num_stages", &StagePlan::num_stages)
      .def_readonly("node_stage", &StagePlan::node_stage)
      .def_readonly("requires_grad", &StagePlan::requires_grad)
      .def_readonly("compute", &StagePlan::compute)
      .def_readonly("inputs", &StagePlan::inputs)
      .def_readonly("params", &StagePlan::params)
      .def_readonly("buffers", &StagePlan::buffers)
      .def_readonly("recvs", &StagePlan::recvs)
      .def_readonly("sends", &StagePlan::sends)
      .def_readonly("buffer_updates", &StagePlan::buffer_updates)
      .def_readonly("transfers", &StagePlan::transfers)
      .def_readonly("tied", &StagePlan::tied)
      .def_readonly("outputs", &StagePlan::outputs);

  m.def("partition", &partition,
        "Assigns nodes to stages and infers transfers; raises ValueError "
        "naming node and module when the split is invalid.",
        py::arg("graph"), py::arg("spec"),
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace torchmpmd::bindings
