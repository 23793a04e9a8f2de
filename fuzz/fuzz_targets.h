// The fuzz targets: one entry point per parser that takes bytes from outside the process.
// Each feeds `data` to the real parser and checks what must hold for ANY input: no crash,
// no exception, an error that says something when the input is refused, and, where the
// parser has an encoder, that what it accepted survives encode -> decode unchanged.
//
// Two drivers call them: the libFuzzer harnesses fuzz/fuzz_<name>.cc (clang, with ASan and
// UBSan; fuzz/README.md), which abort on a non-empty answer, and the gtest
// tests/fuzz/test_fuzz_corpus.cc (the normal gcc build), which replays every file of
// fuzz/corpus/<name>/ through the same entry point so that the corpus and the crash
// reproducers saved there keep running in CI.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace conveyor::fuzz {

// "" when every property held; otherwise what was violated (the driver reports it).
using FuzzTarget = std::string (*)(std::span<const uint8_t> data);

std::string fuzz_microbatch(std::span<const uint8_t> data);      // decode_microbatch, decode_batch_result
std::string fuzz_control(std::span<const uint8_t> data);         // a control frame [JSON] 0x00 [blob]
std::string fuzz_cluster_config(std::span<const uint8_t> data);  // parse_cluster_config (YAML)
std::string fuzz_model_config(std::span<const uint8_t> data);    // parse_model_config (config.json)
std::string fuzz_safetensors(std::span<const uint8_t> data);     // parse_safetensors (a whole file)
std::string fuzz_tokenizer(std::span<const uint8_t> data);       // encode any bytes; decode any ids
std::string fuzz_completion(std::span<const uint8_t> data);      // POST /v1/completions, /v1/cluster/plan bodies

struct NamedTarget {
  const char* name;  // the corpus folder: fuzz/corpus/<name>/
  FuzzTarget run;
};
// Every target, by corpus name.
std::span<const NamedTarget> all_targets();

// The model the tokenizer and REST targets use (models/brown-gpt2): $CONVEYOR_SOURCE_DIR
// when set, else the source tree the targets were built from.
std::string fuzz_model_dir();

}  // namespace conveyor::fuzz
