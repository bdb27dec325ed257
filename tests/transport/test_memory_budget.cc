// The in-flight memory budget's own accounting: what fits is admitted and given back when
// released; what does not is refused, naming the limit.

#include "gtest/gtest.h"
#include "src/transport/memory_budget.h"

namespace verifyd {
namespace {

TEST(MemoryBudget, AdmitsWhatFitsAndTakesItBackWhenReleased) {
  MemoryBudget b(100, "--limit");
  auto a = b.Admit(60);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(b.in_flight(), 60);
  auto refused = b.Admit(41);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("(--limit)"), std::string::npos);
  {
    auto c = b.Admit(40);
    ASSERT_TRUE(c.ok());
    EXPECT_EQ(b.in_flight(), 100);
    MemoryBudget::Admission moved = std::move(*c);
    EXPECT_EQ(b.in_flight(), 100);
  }
  EXPECT_EQ(b.in_flight(), 60);
  *a = MemoryBudget::Admission();
  EXPECT_EQ(b.in_flight(), 0);
  auto too_big = b.Admit(101);
  ASSERT_FALSE(too_big.ok());
  EXPECT_NE(too_big.status().message().find("exceeds the memory budget"), std::string::npos);
  MemoryBudget unlimited(0, "--limit");
  EXPECT_TRUE(unlimited.Admit(int64_t{1} << 50).ok());
}

}  // namespace
}  // namespace verifyd
