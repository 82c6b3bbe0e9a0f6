// One bind_<layer>() per layer, each in its own translation unit so that
// only the runtime's pulls in the (slow to compile) torch headers.
#pragma once

#include <pybind11/pybind11.h>

namespace torchmpmd::bindings {

void bind_graph(pybind11::module_ m);
void bind_schedule(pybind11::module_ m);
void bind_runtime(pybind11::module_ m);

}  // namespace torchmpmd::bindings
