// The libFuzzer entry point over one target of fuzz_targets.h: a violated property is a
// crash, so libFuzzer saves the input (crash-<sha1>) and stops.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#include "fuzz/fuzz_targets.h"

#define CONVEYOR_FUZZ_HARNESS(target)                                                      \
  extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {               \
    const std::string problem = conveyor::fuzz::target(std::span<const uint8_t>(data, size)); \
    if (!problem.empty()) {                                                                \
      std::fprintf(stderr, "%s: %s\n", #target, problem.c_str());                         \
      std::abort();                                                                        \
    }                                                                                      \
    return 0;                                                                              \
  }
