// The resolver: precedence of choices, strict explicit choices, fallback of implicit ones, and
// the capability rules of each backend.
#include "resolver.h"

#include <gtest/gtest.h>

#include <string>

#include "../../csrc/kernels/paged_attention/config.h"
#include "../../csrc/kernels/paged_attention/plan.h"
#include "capability.h"

namespace astr::dispatch {
namespace {

std::string last_warning;
int warnings = 0;
void record_warning(const std::string& message) {
  last_warning = message;
  ++warnings;
}

std::array<BackendStatus, kNumBackends> all_available() {
  return {BackendStatus{true, "", 0}, BackendStatus{true, "", 2}, BackendStatus{true, "", 0}};
}

std::array<BackendStatus, kNumBackends> only_torch_native() {
  return {BackendStatus{false, "library built without CUDA kernels", 0},
          BackendStatus{false, "flash-attn not importable", 0}, BackendStatus{true, "", 0}};
}

// A bf16 decode over a page_size-16 cache on an H100/H200: every backend's sweet spot but flash
// (FlashAttention-2 wants 256-token pages).
CallDescription paged_decode() {
  CallDescription call;
  call.dtype = ScalarType::kBFloat16;
  call.device = DeviceKind::kCUDA;
  call.arch = 90;
  call.q_rank = 3;
  call.head_dim = call.head_dim_v = 128;
  call.num_q_heads = 32;
  call.num_kv_heads = 8;
  call.has_kv_cache = true;
  call.page_size = 16;
  call.mode = Mode::kDecode;
  return call;
}

CallDescription dense_training() {
  CallDescription call = paged_decode();
  call.q_rank = 4;
  call.has_kv_cache = false;
  call.page_size = 0;
  call.mode = Mode::kTraining;
  call.needs_grad = true;
  call.is_causal = true;
  return call;
}

bool mentions(const std::vector<std::string>& reasons, const std::string& text) {
  for (const auto& reason : reasons) {
    if (reason.find(text) != std::string::npos) return true;
  }
  return false;
}

TEST(SelectBackend, ArgumentBeatsContextBeatsEnvironment) {
  EXPECT_EQ(select_backend("flash", "cuda", "torch_native", nullptr).name, "flash");
  EXPECT_EQ(select_backend("", "cuda", "torch_native", nullptr).name, "cuda");
  EXPECT_EQ(select_backend("", std::nullopt, "torch_native", nullptr).name, "torch_native");
  EXPECT_EQ(select_backend("", std::nullopt, "", nullptr).source, SelectionSource::kDefault);
}

TEST(SelectBackend, OnlyArgumentAndContextAreStrict) {
  EXPECT_TRUE(select_backend("cuda", std::nullopt, "", nullptr).is_strict());
  EXPECT_TRUE(select_backend("", "cuda", "", nullptr).is_strict());
  EXPECT_FALSE(select_backend("", std::nullopt, "cuda", nullptr).is_strict());
}

TEST(SelectBackend, OtherNamesStandForTheBackendsName) {
  EXPECT_EQ(parse_backend("sdpa"), Backend::kTorchNative);
  EXPECT_EQ(parse_backend("torch_native"), Backend::kTorchNative);
  EXPECT_EQ(parse_backend("sdp"), std::nullopt);
  EXPECT_EQ(parse_backend(""), std::nullopt);
  EXPECT_EQ(select_backend("sdpa", std::nullopt, "", nullptr).name, "torch_native");
  EXPECT_EQ(select_backend("", std::nullopt, "sdpa", nullptr).name, "torch_native");
  EXPECT_EQ(select_backend("", std::nullopt, "sdpa", nullptr).source,
            SelectionSource::kEnvironment);
  EXPECT_NE(valid_backend_names().find("torch_native (or sdpa)"), std::string::npos);
}

TEST(SelectBackend, UnknownArgumentThrows) {
  EXPECT_THROW(select_backend("fast", std::nullopt, "", nullptr), std::invalid_argument);
}

TEST(SelectBackend, UnknownEnvironmentValueWarnsOnceNamingValidBackends) {
  warnings = 0;
  Selection first = select_backend("", std::nullopt, "cudaa", &record_warning);
  Selection second = select_backend("", std::nullopt, "cudaa", &record_warning);
  EXPECT_EQ(first.source, SelectionSource::kDefault);
  EXPECT_EQ(second.source, SelectionSource::kDefault);
  EXPECT_EQ(warnings, 1);
  EXPECT_NE(last_warning.find("cuda, flash, torch_native"), std::string::npos);
}

void throwing_warning(const std::string&) { throw std::runtime_error("warning as error"); }

TEST(SelectBackend, AWarningThatThrowsIsNotMarkedGiven) {
  // A warnings filter that makes it an error: every call raises, none is silent after the first.
  EXPECT_THROW(select_backend("", std::nullopt, "cudab", &throwing_warning), std::runtime_error);
  EXPECT_THROW(select_backend("", std::nullopt, "cudab", &throwing_warning), std::runtime_error);
  warnings = 0;
  select_backend("", std::nullopt, "cudab", &record_warning);
  select_backend("", std::nullopt, "cudab", &record_warning);
  EXPECT_EQ(warnings, 1);
}

TEST(ResolveBackend, DefaultPriorityPicksCudaForPagedDecode) {
  Decision decision = resolve_backend(paged_decode(), {}, all_available());
  ASSERT_TRUE(decision.chosen.has_value());
  EXPECT_EQ(*decision.chosen, Backend::kCuda);
  EXPECT_FALSE(decision.fell_back);
}

TEST(ResolveBackend, TrainingSkipsCacheOnlyCudaAndPrefersFlash) {
  Decision decision = resolve_backend(dense_training(), {}, all_available());
  ASSERT_TRUE(decision.chosen.has_value());
  EXPECT_EQ(*decision.chosen, Backend::kFlash);
  EXPECT_TRUE(mentions(decision.reasons[0], "needs a paged KV cache"));
}

TEST(ResolveBackend, MaskedTrainingFallsBackToTorchNative) {
  CallDescription call = dense_training();
  call.mask = MaskForm::kBoolean;
  Decision decision = resolve_backend(call, {}, all_available());
  ASSERT_TRUE(decision.chosen.has_value());
  EXPECT_EQ(*decision.chosen, Backend::kTorchNative);
  EXPECT_TRUE(mentions(decision.reasons[1], "custom attention mask"));
}

TEST(ResolveBackend, EnvironmentChoiceFallsBackWhenIncapable) {
  CallDescription call = paged_decode();
  call.dtype = ScalarType::kFloat32;
  Selection env{SelectionSource::kEnvironment, "cuda"};
  Decision decision = resolve_backend(call, env, all_available());
  ASSERT_TRUE(decision.chosen.has_value());
  EXPECT_EQ(*decision.chosen, Backend::kTorchNative);
  EXPECT_TRUE(decision.fell_back);
}

TEST(ResolveBackend, ExplicitChoiceNeverFallsBackAndListsEveryBackend) {
  CallDescription call = paged_decode();
  call.dtype = ScalarType::kFloat32;
  Selection context{SelectionSource::kContext, "cuda"};
  Decision decision = resolve_backend(call, context, all_available());
  EXPECT_FALSE(decision.chosen.has_value());
  EXPECT_NE(decision.error.find("Explicitly-set backend 'cuda'"), std::string::npos);
  EXPECT_NE(decision.error.find("dtype float32 not supported"), std::string::npos);
  EXPECT_NE(decision.error.find("flash:"), std::string::npos);
  EXPECT_NE(decision.error.find("torch_native: can run it"), std::string::npos);
}

TEST(ResolveBackend, ExplicitPythonBackendCannotRunInCpp) {
  Selection context{SelectionSource::kContext, "python:Mine"};
  Decision decision = resolve_backend(paged_decode(), context, all_available());
  EXPECT_FALSE(decision.chosen.has_value());
  EXPECT_NE(decision.error.find("written in Python"), std::string::npos);
}

TEST(ResolveBackend, StrictChoiceOfAnUnknownNameIsAnErrorNotACrash) {
  // Callers validate names first; a name that slips through must not be dereferenced as a backend.
  for (const char* name : {"nope", ""}) {
    Selection context{SelectionSource::kContext, name};
    Decision decision = resolve_backend(paged_decode(), context, all_available());
    EXPECT_FALSE(decision.chosen.has_value());
    EXPECT_NE(decision.error.find("is not a backend"), std::string::npos) << decision.error;
  }
}

TEST(ResolveBackend, UnavailableBackendsAreSkippedWithTheirReason) {
  Decision decision = resolve_backend(paged_decode(), {}, only_torch_native());
  ASSERT_TRUE(decision.chosen.has_value());
  EXPECT_EQ(*decision.chosen, Backend::kTorchNative);
  EXPECT_TRUE(mentions(decision.reasons[0], "built without CUDA"));
  EXPECT_FALSE(decision.fell_back);  // nothing present was skipped
}

TEST(ResolveBackend, DecisionSerialisesToJson) {
  Decision decision = resolve_backend(paged_decode(), {}, all_available());
  std::string json = decision.to_json();
  EXPECT_NE(json.find("\"backend\": \"cuda\""), std::string::npos);
  EXPECT_NE(json.find("\"source\": \"default\""), std::string::npos);
}

TEST(Json, EveryControlCharacterIsEscaped) {
  EXPECT_EQ(json_escape("a\tb\x1b[31m\"q\"\\\x7f\x01\n"),
            "a\\u0009b\\u001b[31m\\\"q\\\"\\\\\\u007f\\u0001\\u000a");
  EXPECT_EQ(json_escape("caf\xc3\xa9"), "caf\xc3\xa9");  // UTF-8 passes through
  const BackendStatus status{false, "import failed:\tred\x1b[0m", 3};
  EXPECT_EQ(status.to_json(),
            "{\"available\": false, \"reason\": \"import failed:\\u0009red\\u001b[0m\", "
            "\"version\": 3}");
}

TEST(ResolveBackend, AReasonWithControlCharactersStaysValidJson) {
  auto status = only_torch_native();
  status[static_cast<int>(Backend::kFlash)].reason = "bad\timport";
  const std::string json = resolve_backend(paged_decode(), {}, status).to_json();
  EXPECT_NE(json.find("bad\\u0009import"), std::string::npos);
  EXPECT_EQ(json.find('\t'), std::string::npos);
}

TEST(CudaCapability, RejectsWhatTheKernelsCannotRun) {
  BackendStatus ok{true, "", 0};
  CallDescription call = paged_decode();
  EXPECT_TRUE(rejection_reasons(Backend::kCuda, call, ok, Checks::kAll).empty());
  call.head_dim = call.head_dim_v = 80;
  EXPECT_TRUE(mentions(rejection_reasons(Backend::kCuda, call, ok, Checks::kAll),
                       astr::kernels::unsupported_head_dim_message(80)));
  call.head_dim = call.head_dim_v = 96;  // config.h lists it
  EXPECT_TRUE(rejection_reasons(Backend::kCuda, call, ok, Checks::kAll).empty());
  call = paged_decode();
  call.page_size = 24;
  EXPECT_TRUE(mentions(rejection_reasons(Backend::kCuda, call, ok, Checks::kAll), "page_size 24"));
  call = paged_decode();
  call.arch = 75;
  EXPECT_TRUE(mentions(rejection_reasons(Backend::kCuda, call, ok, Checks::kAll), "sm_80"));
  call = paged_decode();
  call.mask = MaskForm::kAdditive;
  EXPECT_TRUE(mentions(rejection_reasons(Backend::kCuda, call, ok, Checks::kAll), "additive"));
  call = paged_decode();
  call.needs_grad = true;
  EXPECT_TRUE(mentions(rejection_reasons(Backend::kCuda, call, ok, Checks::kAll), "no backward"));
}

TEST(CudaCapability, PassesOverALayoutItsCopiesCannotRead) {
  BackendStatus ok{true, "", 0};
  CallDescription call = paged_decode();
  call.cuda_layout = "k_cache strides [4352, 272, 68, 1] must be multiples of 8 elements";
  EXPECT_TRUE(mentions(rejection_reasons(Backend::kCuda, call, ok, Checks::kAll),
                       "k_cache strides [4352, 272, 68, 1]"));
  EXPECT_TRUE(rejection_reasons(Backend::kTorchNative, call, ok, Checks::kAll).empty());
  // Implicit: the default priority passes cuda by (flash wants 256-token pages here).
  Decision implicit = resolve_backend(call, {}, all_available());
  ASSERT_TRUE(implicit.chosen.has_value());
  EXPECT_EQ(*implicit.chosen, Backend::kTorchNative);
  // Explicit: strict, and the reason is the layout.
  Decision strict = resolve_backend(call, {SelectionSource::kArgument, "cuda"}, all_available());
  EXPECT_FALSE(strict.chosen.has_value());
  EXPECT_TRUE(mentions(strict.reasons[0], "must be multiples of 8 elements"));
}

TEST(ResolveBackendCached, ALayoutProblemIsNeverMixedUpWithAPlainCall) {
  const Selection strict{SelectionSource::kArgument, "cuda"};
  const BackendStatusTable& table = BackendStatusTable::instance();
  CallDescription bad = paged_decode();
  bad.cuda_layout = "k_cache must start on a 16-byte boundary (storage offset 1 elements)";
  const CallDescription plain = paged_decode();
  const auto reasons_of = [&](const CallDescription& call) {
    return resolve_backend_cached(call, strict, table).reasons[0];
  };
  // Either order: the memo must not answer one call with the other's reasons.
  EXPECT_TRUE(mentions(reasons_of(bad), "16-byte boundary"));
  EXPECT_FALSE(mentions(reasons_of(plain), "16-byte boundary"));
  EXPECT_TRUE(mentions(reasons_of(bad), "16-byte boundary"));
  EXPECT_FALSE(mentions(reasons_of(plain), "16-byte boundary"));
}

TEST(CudaCapability, FormChecksIgnorePlacement) {
  BackendStatus missing{false, "library built without CUDA kernels", 0};
  CallDescription call = paged_decode();
  call.device = DeviceKind::kCPU;
  EXPECT_TRUE(rejection_reasons(Backend::kCuda, call, missing, Checks::kForm).empty());
  EXPECT_FALSE(rejection_reasons(Backend::kCuda, call, missing, Checks::kAll).empty());
}

TEST(FlashCapability, FlashAttention2PagedPathNeeds256TokenPages) {
  BackendStatus fa2{true, "", 2};
  BackendStatus fa3{true, "", 3};
  CallDescription call = paged_decode();
  EXPECT_TRUE(
      mentions(rejection_reasons(Backend::kFlash, call, fa2, Checks::kAll), "multiple of 256"));
  EXPECT_TRUE(rejection_reasons(Backend::kFlash, call, fa3, Checks::kAll).empty());
  call.page_size = 256;
  EXPECT_TRUE(rejection_reasons(Backend::kFlash, call, fa2, Checks::kAll).empty());
}

TEST(FlashCapability, FlashAttention3NeedsHopper) {
  BackendStatus fa3{true, "", 3};
  CallDescription call = dense_training();
  call.arch = 80;
  EXPECT_TRUE(mentions(rejection_reasons(Backend::kFlash, call, fa3, Checks::kAll), "sm_90"));
}

TEST(FlashCapability, CausalWithUnequalLengthsIsRejected) {
  BackendStatus fa2{true, "", 2};
  CallDescription call = dense_training();
  call.q_len_equals_kv_len = false;
  EXPECT_TRUE(mentions(rejection_reasons(Backend::kFlash, call, fa2, Checks::kAll), "top-left"));
}

// Gemma 4's global layers (512) and DeepSeek's MHA form (q/k 192, v 128) are rows of config.h:
// cuda takes them on sm_90; a pair that is no row is named as a pair; 512 needs sm_90.
TEST(CudaCapability, TakesHeadDim512AndQk192WithV128OnSm90) {
  BackendStatus ok{true, "", 0};
  CallDescription call = paged_decode();
  call.head_dim = call.head_dim_v = 512;
  EXPECT_TRUE(rejection_reasons(Backend::kCuda, call, ok, Checks::kAll).empty());
  call.mode = Mode::kPrefill;
  EXPECT_TRUE(rejection_reasons(Backend::kCuda, call, ok, Checks::kAll).empty());
  call.arch = 80;
  EXPECT_TRUE(mentions(rejection_reasons(Backend::kCuda, call, ok, Checks::kAll),
                       "head_dim 512 needs sm_90 or newer"));
  call = paged_decode();
  call.head_dim = 192;
  call.head_dim_v = 128;
  EXPECT_TRUE(rejection_reasons(Backend::kCuda, call, ok, Checks::kAll).empty());
  call.arch = 80;
  EXPECT_TRUE(rejection_reasons(Backend::kCuda, call, ok, Checks::kAll).empty());
  call.head_dim_v = 192;  // not a row
  EXPECT_TRUE(mentions(rejection_reasons(Backend::kCuda, call, ok, Checks::kAll),
                       astr::kernels::unsupported_head_dim_message(192)));
  call.head_dim = 128;
  call.head_dim_v = 64;
  EXPECT_TRUE(mentions(rejection_reasons(Backend::kCuda, call, ok, Checks::kAll),
                       "unsupported head_dim 128 with v head_dim 64 (supported: "));
}

TEST(CudaCapability, TopkIndicesOnEveryRowWithTopkKernels) {
  BackendStatus ok{true, "", 0};
  CallDescription call = paged_decode();
  call.topk = true;
  call.topk_entries = 64;
  for (const astr::kernels::HeadDimForms& row : astr::kernels::kPagedHeadDims) {
    if (!astr::kernels::paged_head_dim_built(row.head_dim)) continue;
    call.head_dim = row.head_dim;
    call.head_dim_v = row.head_dim_v;
    EXPECT_EQ(rejection_reasons(Backend::kCuda, call, ok, Checks::kAll).empty(), row.topk)
        << row.head_dim << "/" << row.head_dim_v;
  }
}

TEST(ResolveBackend, PagedHeadDim512AndQk192WithV128RunOnCudaOnSm90) {
  std::array<BackendStatus, kNumBackends> status = only_torch_native();
  status[static_cast<int>(Backend::kCuda)] = BackendStatus{true, "", 0};
  CallDescription call = paged_decode();
  auto chosen = [&] {
    const Decision decision = resolve_backend(call, {}, status);
    return decision.chosen.has_value() ? *decision.chosen : Backend::kTorchNative;
  };
  call.head_dim = call.head_dim_v = 512;
  EXPECT_EQ(chosen(), Backend::kCuda);
  call.head_dim = 192;
  call.head_dim_v = 128;
  EXPECT_EQ(chosen(), Backend::kCuda);
  call.mode = Mode::kPrefill;
  EXPECT_EQ(chosen(), Backend::kCuda);
  call.head_dim_v = 96;  // no row: the reference
  EXPECT_EQ(chosen(), Backend::kTorchNative);
}

TEST(FlashCapability, UnequalQkAndVHeadDimsAsEachFlashAttentionTakesThem) {
  BackendStatus fa2{true, "", 2}, fa3{true, "", 3}, fa4{true, "", 4};
  CallDescription call = dense_training();
  call.needs_grad = false;
  call.mode = Mode::kPrefill;
  call.head_dim = 192;
  call.head_dim_v = 128;
  EXPECT_TRUE(mentions(rejection_reasons(Backend::kFlash, call, fa2, Checks::kAll),
                       "FlashAttention-2 takes equal q/k and v head dims only"));
  EXPECT_TRUE(rejection_reasons(Backend::kFlash, call, fa3, Checks::kAll).empty());
  EXPECT_TRUE(rejection_reasons(Backend::kFlash, call, fa4, Checks::kAll).empty());
  call.arch = 100;  // FA4 off Hopper: (192, 128) only
  EXPECT_TRUE(rejection_reasons(Backend::kFlash, call, fa4, Checks::kAll).empty());
  call.head_dim_v = 64;
  EXPECT_TRUE(mentions(rejection_reasons(Backend::kFlash, call, fa4, Checks::kAll),
                       "v head_dim 64 with q/k head_dim 192 not supported"));
  call.arch = 90;
  EXPECT_TRUE(mentions(rejection_reasons(Backend::kFlash, call, fa3, Checks::kAll),
                       "FlashAttention-3 takes"));
  call.head_dim_v = 128;
  call.needs_grad = true;
  EXPECT_TRUE(mentions(rejection_reasons(Backend::kFlash, call, fa3, Checks::kAll),
                       "gradients with v head_dim 128"));
}

TEST(VariantColumns, TopkIndicesRunOnCudaAndTorchNativeNotFlash) {
  BackendStatus ok{true, "", 3};
  CallDescription call = paged_decode();
  call.topk = true;
  call.topk_entries = 2048;
  EXPECT_TRUE(rejection_reasons(Backend::kCuda, call, ok, Checks::kAll).empty());
  EXPECT_TRUE(mentions(rejection_reasons(Backend::kFlash, call, ok, Checks::kAll),
                       "topk_indices not supported by the flash backend"));
  EXPECT_TRUE(rejection_reasons(Backend::kTorchNative, call, ok, Checks::kAll).empty());
  std::vector<std::string> missing;
  check_variants(Backend::kCuda, call, missing);
  EXPECT_TRUE(missing.empty());
  Decision implicit = resolve_backend(call, {}, all_available());
  ASSERT_TRUE(implicit.chosen.has_value());
  EXPECT_EQ(*implicit.chosen, Backend::kCuda);
}

TEST(VariantColumns, RowsOfMoreTopkEntriesThanTheListingTableHoldsGoToTorchNative) {
  BackendStatus ok{true, "", 3};
  CallDescription call = paged_decode();
  call.topk = true;
  call.topk_entries = astr::kernels::kTopkMaxEntries;
  EXPECT_EQ(*resolve_backend(call, {}, all_available()).chosen, Backend::kCuda);
  call.topk_entries = astr::kernels::kTopkMaxEntries + 1;
  EXPECT_TRUE(mentions(rejection_reasons(Backend::kCuda, call, ok, Checks::kAll),
                       "topk_indices: 16384 entries per query row (the kernels take at most "
                       "16383)"));
  EXPECT_EQ(*resolve_backend(call, {}, all_available()).chosen, Backend::kTorchNative);
}

TEST(TorchNativeCapability, RunsEveryFloatingCallOnAnyDevice) {
  BackendStatus ok{true, "", 0};
  CallDescription call = dense_training();
  call.dtype = ScalarType::kFloat64;
  call.device = DeviceKind::kCPU;
  call.mask = MaskForm::kAdditive;
  EXPECT_TRUE(rejection_reasons(Backend::kTorchNative, call, ok, Checks::kAll).empty());
  call.num_kv_heads = 5;
  EXPECT_TRUE(mentions(rejection_reasons(Backend::kTorchNative, call, ok, Checks::kAll),
                       "multiple of kv heads"));
}

}  // namespace
}  // namespace astr::dispatch
