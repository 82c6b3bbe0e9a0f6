// The one pybind11 module, torchmpmd._C. Each layer adds its own submodule.
#include <pybind11/pybind11.h>

#include "bindings/bindings.h"
#include "util/check.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "torchmpmd native core (private: use the torchmpmd package)";
  // Errors of the torch-free layers mean the user's input is wrong.
  pybind11::register_exception<torchmpmd::Error>(m, "Error", PyExc_ValueError);
  torchmpmd::bindings::bind_graph(m.def_submodule("graph"));
  torchmpmd::bindings::bind_schedule(m.def_submodule("schedule"));
  torchmpmd::bindings::bind_runtime(m.def_submodule("runtime"));
}
