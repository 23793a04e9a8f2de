// The operator's plan body (POST /v1/cluster/plan): what parse_plan_body accepts and how it
// refuses the rest.
#include "coordinator/rest/admin_api.h"

#include <gtest/gtest.h>

namespace conveyor {
namespace {

using nlohmann::json;

TEST(AdminApi, PlanBodyFields) {
  ApiError error;
  auto plan = parse_plan_body(json::parse(R"({"stages": 2, "replicas": 1, "layers": [[0, 3], [3, 6]]})"), &error);
  ASSERT_TRUE(plan.ok()) << plan.error();
  EXPECT_EQ(plan->stages, 2);
  EXPECT_EQ(plan->replicas, 1);
  ASSERT_TRUE(plan->layers.has_value());
  EXPECT_EQ(plan->layers->size(), 2u);

  EXPECT_FALSE(parse_plan_body(json::parse(R"({"stage": 2})"), &error).ok());
  EXPECT_EQ(error.param, "stage");
  EXPECT_FALSE(parse_plan_body(json::parse(R"({"layers": [[0, 1, 2]]})"), &error).ok());
  EXPECT_EQ(error.param, "layers");
  EXPECT_NE(error.message.find("[0,1,2]"), std::string::npos) << error.message;
}

// Found by fuzz/fuzz_completion (issue 28), which feeds its bodies to the plan parser too: a
// "layers" entry nesting 100,000 arrays overflowed the stack when the refusal dump()ed it,
// so one request to the admin endpoint could kill the coordinator.
TEST(AdminApi, DeeplyNestedPlanIsRefusedNotPrinted) {
  const int depth = 100000;
  const json body = json::parse(R"({"layers": [)" + std::string(depth, '[') + std::string(depth, ']') + "]}");
  ApiError error;
  auto plan = parse_plan_body(body, &error);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(error.http_status, 400);
  EXPECT_NE(error.message.find("nests deeper than 64 levels"), std::string::npos) << error.message;
}

}  // namespace
}  // namespace conveyor
