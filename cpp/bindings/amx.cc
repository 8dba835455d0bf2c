// corelm._core.amx_available / amx_info: whether the real AMX kernels can run here, and why not.
// Their tile-level test hooks are in testing_kernels.cc.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "bindings/bindings.h"
#include "kernels/amx/amx.h"
#include "kernels/kernels.h"

namespace py = pybind11;
using namespace corelm;

py::dict corelm::amx_info() {
  const amx::Status& s = amx::status();
  py::dict d;
  d["available"] = amx::available();
  d["cpu"] = s.cpu;
  d["os"] = s.os;
  d["permission"] = s.permission;
  d["compiled"] = s.compiled;
  d["reason"] = s.reason;
  // What the AMX kernels serve in the forward pass: through the "amx" kernel table (the default where AMX
  // runs), bf16 weights and a prompt's quantized and sparse ones as bf16; never int8 (q8's blocks of 32
  // have a scale each, TDPBSSD sums 64 at a time).
  const bool in_use = std::string(kernels().name) == "amx";
  py::dict serves;
  serves["bf16_gemm"] = in_use ? "bf16 weights; a prompt's quantized and sparse weights as bf16 (kernel table amx)"
                        : amx::available() ? "not in use (CORELM_ISA chose another table)" : "emulated only";
  serves["int8_gemm"] = amx::available() ? "kernel entry point only" : "emulated only";
  d["kernels"] = serves;
  d["in_use"] = in_use;
  return d;
}

void corelm::register_amx(py::module_& m) {
  m.def("amx_available", &amx::available,
        "True when CPUID, XCR0 and the OS permission (arch_prctl) allow the real AMX kernels.");
  m.def("amx_info", &amx_info, "AMX detection details and the reason when it is unavailable.");
}
