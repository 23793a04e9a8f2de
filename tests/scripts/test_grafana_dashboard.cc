// The Grafana dashboard shipped in scripts/grafana/ is valid JSON and names only metric
// families the coordinator exports (coordinator/metrics.h), so a renamed metric cannot leave
// a panel silently empty.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "coordinator/metrics.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

TEST(GrafanaDashboard, ParsesAndNamesOnlyExportedMetrics) {
  const std::string path = testing::source_dir() + "/scripts/grafana/conveyor-dashboard.json";
  std::ifstream in(path);
  ASSERT_TRUE(in) << "cannot open " << path;
  nlohmann::json dashboard;
  ASSERT_NO_THROW(dashboard = nlohmann::json::parse(in)) << path;
  ASSERT_TRUE(dashboard.contains("panels")) << path;

  // Every family the coordinator exports has a "# TYPE name kind" line, histograms included.
  Metrics metrics;
  std::set<std::string> exported;
  std::istringstream rendered(metrics.render());
  for (std::string line; std::getline(rendered, line);)
    if (line.rfind("# TYPE ", 0) == 0) exported.insert(line.substr(7, line.find(' ', 7) - 7));
  ASSERT_FALSE(exported.empty());

  const std::string text = dashboard.dump();
  const std::regex name("conveyor_[a-z_]+");
  int used = 0;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), name); it != std::sregex_iterator(); ++it) {
    std::string family = it->str();
    for (const char* suffix : {"_bucket", "_sum", "_count"})
      if (!exported.count(family) && family.size() > std::strlen(suffix) &&
          family.compare(family.size() - std::strlen(suffix), std::string::npos, suffix) == 0)
        family.resize(family.size() - std::strlen(suffix));
    EXPECT_TRUE(exported.count(family)) << it->str() << " in " << path << " is not a metric the coordinator exports";
    ++used;
  }
  EXPECT_GE(used, 8) << "the dashboard should chart the coordinator's metrics";
}

}  // namespace
}  // namespace conveyor
