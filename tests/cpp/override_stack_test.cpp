// The thread-local override stack: nesting, validation, and one stack per thread.
#include "override_stack.h"

#include <gtest/gtest.h>

#include <barrier>
#include <stdexcept>
#include <string>
#include <thread>

namespace astr::dispatch {
namespace {

class OverrideStackTest : public ::testing::Test {
 protected:
  void SetUp() override { OverrideStack::current().clear(); }
  void TearDown() override { OverrideStack::current().clear(); }
};

TEST_F(OverrideStackTest, EmptyStackHasNoTop) {
  EXPECT_FALSE(OverrideStack::current().top().has_value());
}

TEST_F(OverrideStackTest, InnermostPushWinsAndPopRestoresOuter) {
  auto& stack = OverrideStack::current();
  stack.push("torch_native");
  stack.push("cuda");
  EXPECT_EQ(stack.top(), "cuda");
  stack.pop();
  EXPECT_EQ(stack.top(), "torch_native");
  stack.pop();
  EXPECT_FALSE(stack.top().has_value());
}

TEST_F(OverrideStackTest, UnknownNameIsRejectedAndNotPushed) {
  auto& stack = OverrideStack::current();
  EXPECT_THROW(stack.push("sdp"), std::invalid_argument);
  EXPECT_EQ(stack.depth(), 0u);
}

TEST_F(OverrideStackTest, AnotherNameIsPushedAsTheBackendsName) {
  auto& stack = OverrideStack::current();
  stack.push("sdpa");
  EXPECT_EQ(stack.top(), "torch_native");
}

TEST_F(OverrideStackTest, PythonBackendMarkerIsAccepted) {
  OverrideStack::current().push("python:MyBackend");
  EXPECT_EQ(OverrideStack::current().top(), "python:MyBackend");
  EXPECT_THROW(OverrideStack::current().push("python:"), std::invalid_argument);
}

TEST_F(OverrideStackTest, PopOnEmptyStackThrows) {
  EXPECT_THROW(OverrideStack::current().pop(), std::logic_error);
}

TEST_F(OverrideStackTest, RemoveTakesItsOwnEntryWhereverItIs) {
  // Tasks sharing a thread exit their contexts interleaved: the entry to remove is not the top.
  auto& stack = OverrideStack::current();
  const uint64_t outer = stack.push("torch_native");
  const uint64_t middle = stack.push("cuda");
  const uint64_t inner = stack.push("flash");
  EXPECT_TRUE(stack.remove(middle));
  EXPECT_EQ(stack.depth(), 2u);
  EXPECT_EQ(stack.top(), "flash");
  EXPECT_TRUE(stack.remove(inner));
  EXPECT_EQ(stack.top(), "torch_native");
  EXPECT_TRUE(stack.remove(outer));
  EXPECT_FALSE(stack.top().has_value());
}

TEST_F(OverrideStackTest, RemovingAnUnknownOrRemovedIdChangesNothing) {
  auto& stack = OverrideStack::current();
  const uint64_t id = stack.push("cuda");
  EXPECT_FALSE(stack.remove(id + 1000));
  EXPECT_TRUE(stack.remove(id));
  stack.push("torch_native");
  EXPECT_FALSE(stack.remove(id));  // removed once already
  EXPECT_EQ(stack.top(), "torch_native");
}

TEST_F(OverrideStackTest, IdsAreUniqueAcrossThreads) {
  // An id from another thread never names an entry of this one.
  uint64_t other = 0;
  std::thread thread([&] {
    other = OverrideStack::current().push("cuda");
    OverrideStack::current().clear();
  });
  thread.join();
  const uint64_t mine = OverrideStack::current().push("torch_native");
  EXPECT_NE(mine, other);
  EXPECT_FALSE(OverrideStack::current().remove(other));
  EXPECT_EQ(OverrideStack::current().top(), "torch_native");
}

TEST_F(OverrideStackTest, EachThreadSeesOnlyItsOwnPushes) {
  std::barrier both_pushed(2);
  std::string seen_a, seen_b;
  std::thread a([&] {
    OverrideStack::current().push("cuda");
    both_pushed.arrive_and_wait();
    seen_a = OverrideStack::current().top().value_or("");
    OverrideStack::current().pop();
  });
  std::thread b([&] {
    OverrideStack::current().push("torch_native");
    both_pushed.arrive_and_wait();
    seen_b = OverrideStack::current().top().value_or("");
    OverrideStack::current().pop();
  });
  a.join();
  b.join();
  EXPECT_EQ(seen_a, "cuda");
  EXPECT_EQ(seen_b, "torch_native");
  EXPECT_FALSE(OverrideStack::current().top().has_value());  // the main thread pushed nothing
}

}  // namespace
}  // namespace astr::dispatch
