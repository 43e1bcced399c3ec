// The measured preference table (preferences.h, written by `make tune` from benchmark runs of
// record): where FlashAttention-4 ran a call class faster on an H100, the default order takes it;
// where it ran slower, or the class was not measured, the default order stands; explicit choices
// and ASTR_BACKEND's never look at the table.
#include "preferences.h"

#include <gtest/gtest.h>

#include "resolver.h"

namespace astr::dispatch {
namespace {

std::array<BackendStatus, kNumBackends> with_flash(int version) {
  return {BackendStatus{true, "", 0}, BackendStatus{true, "", version}, BackendStatus{true, "", 0}};
}

// A bf16 causal prefill over 16-token pages on an H100: Hq 32, Hkv 8, D 128.
CallDescription prefill(int query_len_log2, int head_dim = 128, int kv_heads = 8) {
  CallDescription call;
  call.dtype = call.kv_dtype = ScalarType::kBFloat16;
  call.device = DeviceKind::kCUDA;
  call.arch = 90;
  call.q_rank = 3;
  call.head_dim = call.head_dim_v = head_dim;
  call.num_q_heads = 32;
  call.num_kv_heads = kv_heads;
  call.has_kv_cache = true;
  call.page_size = 16;
  call.mode = Mode::kPrefill;
  call.is_causal = true;
  call.query_len_log2 = query_len_log2;
  return call;
}

const Selection kDefault{SelectionSource::kDefault, ""};

TEST(Preferences, FlashFourRunsTheLongPrefillsItMeasuredFaster) {
  const Decision decision = resolve_backend(prefill(12), kDefault, with_flash(4));
  EXPECT_EQ(decision.chosen, Backend::kFlash);
  EXPECT_NE(decision.preference.find("flash"), std::string::npos) << decision.preference;
  EXPECT_FALSE(decision.fell_back);
  EXPECT_NE(decision.to_json().find("\"preference\": \"NVIDIA H100"), std::string::npos);
  // Lengths past the longest measured take the longest's entry.
  EXPECT_EQ(resolve_backend(prefill(15), kDefault, with_flash(4)).chosen, Backend::kFlash);
}

TEST(Preferences, TheCudaKernelsKeepWhatTheyRanFaster) {
  // A single prompt of 1024 tokens: FA4 ran 39 TFLOP/s against 222.
  const Decision short_prompt = resolve_backend(prefill(10), kDefault, with_flash(4));
  EXPECT_EQ(short_prompt.chosen, Backend::kCuda);
  EXPECT_NE(short_prompt.preference, "");
  // Causal D = 64 with as many kv heads as q heads: 107 against 347.
  EXPECT_EQ(resolve_backend(prefill(12, 64, 32), kDefault, with_flash(4)).chosen, Backend::kCuda);
}

TEST(Preferences, UnmeasuredClassesKeepTheDefaultOrder) {
  const Decision short_prompt = resolve_backend(prefill(9), kDefault, with_flash(4));
  EXPECT_EQ(short_prompt.chosen, Backend::kCuda);
  EXPECT_EQ(short_prompt.preference, "");
  // Measured with FlashAttention-4 only.
  EXPECT_EQ(resolve_backend(prefill(12), kDefault, with_flash(3)).chosen, Backend::kCuda);
  // On another GPU, and in decode.
  CallDescription a100 = prefill(12);
  a100.arch = 80;
  EXPECT_EQ(resolve_backend(a100, kDefault, with_flash(4)).chosen, Backend::kCuda);
  CallDescription decode = prefill(0);
  decode.mode = Mode::kDecode;
  EXPECT_EQ(resolve_backend(decode, kDefault, with_flash(4)).chosen, Backend::kCuda);
  // Flash unavailable: no entry applies.
  auto status = with_flash(4);
  status[static_cast<int>(Backend::kFlash)].available = false;
  EXPECT_EQ(resolve_backend(prefill(12), kDefault, status).preference, "");
}

TEST(Preferences, ExplicitChoicesAndAstrBackendNeverLookAtTheTable) {
  EXPECT_EQ(
      resolve_backend(prefill(12), {SelectionSource::kArgument, "cuda"}, with_flash(4)).chosen,
      Backend::kCuda);
  EXPECT_EQ(resolve_backend(prefill(12), {SelectionSource::kContext, "cuda"}, with_flash(4)).chosen,
            Backend::kCuda);
  const Decision environment =
      resolve_backend(prefill(12), {SelectionSource::kEnvironment, "cuda"}, with_flash(4));
  EXPECT_EQ(environment.chosen, Backend::kCuda);
  EXPECT_EQ(environment.preference, "");
}

TEST(Preferences, APreferredFlashThatCannotRunTheCallIsNoFallback) {
  CallDescription with_sinks = prefill(12);
  with_sinks.sinks = true;  // flash has no sink logits
  const Decision decision = resolve_backend(with_sinks, kDefault, with_flash(4));
  EXPECT_EQ(decision.chosen, Backend::kCuda);
  EXPECT_FALSE(decision.fell_back);
}

}  // namespace
}  // namespace astr::dispatch
