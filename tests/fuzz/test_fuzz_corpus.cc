// Replays fuzz/corpus/<target>/* through the fuzz targets (fuzz/fuzz_targets.h), built with
// the normal compiler: the seeds and every crash reproducer saved there (crash-*) run in the
// ordinary suite, without clang or libFuzzer. A target's answer names the broken property.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include "fuzz/fuzz_targets.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

namespace fs = std::filesystem;

std::vector<uint8_t> read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

class FuzzCorpus : public ::testing::TestWithParam<fuzz::NamedTarget> {};

TEST_P(FuzzCorpus, EveryFileKeepsTheTargetsProperties) {
  const fs::path dir = fs::path(testing::source_dir()) / "fuzz" / "corpus" / GetParam().name;
  ASSERT_TRUE(fs::is_directory(dir)) << dir << " is missing: every target keeps seeds there";
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file()) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  EXPECT_FALSE(files.empty()) << dir;
  for (const fs::path& f : files) {
    const std::vector<uint8_t> bytes = read_bytes(f);
    EXPECT_EQ(GetParam().run(bytes), "") << f;
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, FuzzCorpus, ::testing::ValuesIn(fuzz::all_targets().begin(), fuzz::all_targets().end()),
                         [](const ::testing::TestParamInfo<fuzz::NamedTarget>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace conveyor
