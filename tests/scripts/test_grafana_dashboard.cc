// The Grafana dashboard shipped in scripts/grafana/ is valid JSON and names only metric
// families the coordinator exports (coordinator/metrics.h), so a renamed metric cannot leave
// a panel silently empty; it charts every family docs/OPERATIONS.md tells operators to
// watch; and a panel shows 0, not "No data", when a filter matches no series (issue 29).
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

nlohmann::json load_dashboard() {
  const std::string path = testing::source_dir() + "/scripts/grafana/conveyor-dashboard.json";
  std::ifstream in(path);
  EXPECT_TRUE(in) << "cannot open " << path;
  return nlohmann::json::parse(in, nullptr, false);
}

// Every family the coordinator exports has a "# TYPE name kind" line, histograms included.
std::set<std::string> exported_families() {
  Metrics metrics;
  std::set<std::string> exported;
  std::istringstream rendered(metrics.render());
  for (std::string line; std::getline(rendered, line);)
    if (line.rfind("# TYPE ", 0) == 0) exported.insert(line.substr(7, line.find(' ', 7) - 7));
  return exported;
}

// The metric families `text` names, histogram series (_bucket, _sum, _count) as their family.
std::set<std::string> families_named(const std::string& text, const std::set<std::string>& exported) {
  const std::regex name("conveyor_[a-z_]+");
  std::set<std::string> out;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), name); it != std::sregex_iterator(); ++it) {
    std::string family = it->str();
    for (const char* suffix : {"_bucket", "_sum", "_count"})
      if (!exported.count(family) && family.size() > std::strlen(suffix) &&
          family.compare(family.size() - std::strlen(suffix), std::string::npos, suffix) == 0)
        family.resize(family.size() - std::strlen(suffix));
    out.insert(family);
  }
  return out;
}

TEST(GrafanaDashboard, ParsesAndNamesOnlyExportedMetrics) {
  const nlohmann::json dashboard = load_dashboard();
  ASSERT_FALSE(dashboard.is_discarded()) << "the dashboard is not valid JSON";
  ASSERT_TRUE(dashboard.contains("panels"));
  const std::set<std::string> exported = exported_families();
  ASSERT_FALSE(exported.empty());
  const std::set<std::string> used = families_named(dashboard.dump(), exported);
  for (const std::string& family : used)
    EXPECT_TRUE(exported.count(family)) << family << " in the dashboard is not a metric the coordinator exports";
  EXPECT_GE(used.size(), 8u) << "the dashboard should chart the coordinator's metrics";
}

// The families docs/OPERATIONS.md's "Metrics" section names ("conveyor_pipeline_*": each
// exported family of that prefix) and the prefix cache's hits each have a panel.
TEST(GrafanaDashboard, ChartsWhatOperationsTellsOperatorsToWatch) {
  const nlohmann::json dashboard = load_dashboard();
  ASSERT_FALSE(dashboard.is_discarded());
  std::ifstream in(testing::source_dir() + "/docs/OPERATIONS.md");
  std::stringstream doc;
  doc << in.rdbuf();
  const std::string text = doc.str();
  const size_t begin = text.find("\n## Metrics\n");
  ASSERT_NE(begin, std::string::npos) << "docs/OPERATIONS.md has no Metrics section";
  const std::string section = text.substr(begin, text.find("\n## ", begin + 1) - begin);
  const std::set<std::string> exported = exported_families();
  std::set<std::string> watched = families_named(section, exported);
  if (section.find("conveyor_pipeline_*") != std::string::npos)
    for (const std::string& f : exported)
      if (f.rfind("conveyor_pipeline_", 0) == 0) watched.insert(f);
  watched.erase("conveyor_pipeline_");
  watched.insert("conveyor_prefix_cache_hits_total");
  const std::set<std::string> charted = families_named(dashboard.dump(), exported);
  EXPECT_GE(watched.size(), 10u);
  for (const std::string& f : watched) EXPECT_TRUE(charted.count(f)) << f << " has no panel";
}

// A query whose selector filters on a label other than the instance (code=~"5..") matches
// nothing while no such series exists: it carries "or vector(0)" so the panel shows 0, and
// every stat panel shows 0 when its query has no value.
TEST(GrafanaDashboard, NoDataShowsZero) {
  const nlohmann::json dashboard = load_dashboard();
  ASSERT_FALSE(dashboard.is_discarded());
  const std::regex selector("\\{([^}]*)\\}"), matcher("([a-z_]+)\\s*(=~|!~|!=|=)");
  for (const auto& panel : dashboard["panels"]) {
    const std::string title = panel.value("title", "");
    if (panel.value("type", "") == "stat") {
      EXPECT_EQ(panel["fieldConfig"]["defaults"].value("noValue", ""), "0") << title;
    }
    for (const auto& target : panel.value("targets", nlohmann::json::array())) {
      const std::string expr = target.value("expr", "");
      bool filtered = false;
      for (auto s = std::sregex_iterator(expr.begin(), expr.end(), selector); s != std::sregex_iterator(); ++s) {
        const std::string inside = (*s)[1].str();
        for (auto m = std::sregex_iterator(inside.begin(), inside.end(), matcher); m != std::sregex_iterator(); ++m)
          filtered = filtered || ((*m)[1].str() != "instance" && (*m)[1].str() != "le");
      }
      if (filtered) {
        EXPECT_NE(expr.find("or vector(0)"), std::string::npos) << title << ": " << expr;
      }
    }
  }
}

}  // namespace
}  // namespace conveyor
