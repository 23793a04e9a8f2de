// libFuzzer harness for fuzz_cluster_config (fuzz/fuzz_targets.h); fuzz/README.md says how to run it.
#include "fuzz/fuzz_harness.h"

CONVEYOR_FUZZ_HARNESS(fuzz_cluster_config)
