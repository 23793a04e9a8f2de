// libFuzzer harness for fuzz_microbatch (fuzz/fuzz_targets.h); fuzz/README.md says how to run it.
#include "fuzz/fuzz_harness.h"

CONVEYOR_FUZZ_HARNESS(fuzz_microbatch)
