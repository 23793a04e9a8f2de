// The HuggingFace conformance fixtures shared by the CPU and GPU conformance tests: every
// directory holding config.json + model.safetensors + golden.json under
// tests/data/hf_fixtures/ and in $CONVEYOR_HF_FIXTURES (colon-separated; a directory there
// may also hold fixtures one level down). golden.json = {"cases": [{"prompt": [ids],
// "greedy": [ids], "top5_ids": [[5 ids] per step], "top5_logprobs": [[5 floats] per step]}]}.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace conveyor::testing {

inline bool is_hf_fixture(const std::filesystem::path& dir) {
  return std::filesystem::is_regular_file(dir / "golden.json") && std::filesystem::is_regular_file(dir / "config.json");
}

inline std::vector<std::filesystem::path> hf_fixture_dirs() {
  namespace fs = std::filesystem;
  std::vector<fs::path> out;
  auto add_tree = [&](const fs::path& root) {
    std::error_code ec;
    if (is_hf_fixture(root)) {
      out.push_back(root);
      return;
    }
    if (!fs::is_directory(root, ec)) return;
    std::vector<fs::path> found;
    for (const auto& e : fs::directory_iterator(root, ec))
      if (e.is_directory() && is_hf_fixture(e.path())) found.push_back(e.path());
    std::sort(found.begin(), found.end());
    out.insert(out.end(), found.begin(), found.end());
  };
  add_tree(fs::path(source_dir()) / "tests" / "data" / "hf_fixtures");
  if (const char* extra = std::getenv("CONVEYOR_HF_FIXTURES")) {
    std::stringstream ss(extra);
    std::string item;
    while (std::getline(ss, item, ':'))
      if (!item.empty()) add_tree(item);
  }
  return out;
}

// The beam-search goldens (scripts/make_hf_beam_fixtures.py): beam_golden.json beside each HF
// fixture (its draws run on that fixture) and tests/data/beam_golden/*.json (each names its model
// folder, relative to the source root, in "model"; see that folder's README.md). `missing` names
// what should exist and does not: a fixture's beam_golden.json, or any .json in
// tests/data/beam_golden once that folder exists.
struct BeamGoldens {
  std::vector<std::filesystem::path> files;
  std::vector<std::string> missing;
};

inline BeamGoldens beam_golden_files() {
  namespace fs = std::filesystem;
  BeamGoldens out;
  for (const fs::path& dir : hf_fixture_dirs()) {
    if (fs::is_regular_file(dir / "beam_golden.json"))
      out.files.push_back(dir / "beam_golden.json");
    else
      out.missing.push_back((dir / "beam_golden.json").string() +
                            ": make it with python3 scripts/make_hf_beam_fixtures.py " + dir.parent_path().string());
  }
  const fs::path trained = fs::path(source_dir()) / "tests" / "data" / "beam_golden";
  std::error_code ec;
  if (fs::is_directory(trained, ec)) {
    std::vector<fs::path> found;
    for (const auto& e : fs::directory_iterator(trained, ec))
      if (e.is_regular_file() && e.path().extension() == ".json") found.push_back(e.path());
    std::sort(found.begin(), found.end());
    if (found.empty())
      out.missing.push_back(trained.string() + " holds no .json: make one with python3 scripts/make_hf_beam_fixtures.py "
                                               "--model models/brown-gpt2 --out tests/data/beam_golden/brown-gpt2.json");
    out.files.insert(out.files.end(), found.begin(), found.end());
  }
  return out;
}

}  // namespace conveyor::testing
