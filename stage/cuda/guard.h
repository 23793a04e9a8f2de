// The one error rule of stage/cuda: every public call returns Status or Expected, and
// nothing of ours throws. CUDA faults are the exception (CUDA_CHECK, device_alloc and the
// cuBLAS checks throw conveyor::Error, kernels/cuda/check.h): each public entry of GpuStage,
// TpStage and KvCache runs its body through guard() exactly once, which turns them into a
// failed Status. Callers above (GpuStageBackend, the benches, the tests) only propagate.
#pragma once

#include <exception>
#include <string>

#include "common/status.h"

namespace conveyor::cuda {

// f() returns Status or Expected<T>. An exception thrown inside comes back as a failed
// result: "<who>: <what>", or <what> alone when `who` is empty (creation, whose faults name
// the stage already: device_alloc says who asked; TpStage's rank threads, where the rank's
// own entry has named it).
template <class F>
auto guard(const std::string& who, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::exception& e) {
    return Status::error(who.empty() ? std::string(e.what()) : who + ": " + e.what());
  }
}

}  // namespace conveyor::cuda
