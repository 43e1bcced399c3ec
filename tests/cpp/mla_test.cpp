// Latent attention (astr::mla_attention) in the torch-free tiers: the capability rules of a
// latent call (cuda takes the kernel's dims, dtypes and pages; flash none; torch_native any), the
// memo key that keeps latent and plain calls apart, and the cuda kernel's plan.
#include <gtest/gtest.h>

#include <string>

#include "../../csrc/kernels/mla/plan.h"
#include "capability.h"
#include "resolver.h"

namespace astr::dispatch {
namespace {

std::array<BackendStatus, kNumBackends> all_available() {
  return {BackendStatus{true, "", 0}, BackendStatus{true, "", 3}, BackendStatus{true, "", 0}};
}

// A bf16 DeepSeek decode on an H100: 128 heads over latent 512 + rope 64, pages of 64.
CallDescription latent_decode() {
  CallDescription call;
  call.latent = true;
  call.dtype = ScalarType::kBFloat16;
  call.device = DeviceKind::kCUDA;
  call.arch = 90;
  call.q_rank = 3;
  call.head_dim = 576;
  call.head_dim_v = 512;
  call.num_q_heads = 128;
  call.num_kv_heads = 1;
  call.has_kv_cache = true;
  call.page_size = 64;
  call.mode = Mode::kDecode;
  call.kv_dtype = ScalarType::kBFloat16;
  return call;
}

bool mentions(const std::vector<std::string>& reasons, const std::string& text) {
  for (const auto& reason : reasons) {
    if (reason.find(text) != std::string::npos) return true;
  }
  return false;
}

std::vector<std::string> cuda_reasons(const CallDescription& call) {
  return rejection_reasons(Backend::kCuda, call, {true, "", 0}, Checks::kAll);
}

TEST(LatentCapability, CudaRunsADeepSeekDecodeAndFlashNever) {
  const Decision decision = resolve_backend(latent_decode(), {}, all_available());
  ASSERT_TRUE(decision.chosen.has_value());
  EXPECT_EQ(*decision.chosen, Backend::kCuda);
  const auto& flash = decision.reasons[static_cast<int>(Backend::kFlash)];
  ASSERT_EQ(flash.size(), 1u);
  EXPECT_EQ(flash[0], "latent attention (mla_attention) not supported by the flash backend");
  EXPECT_TRUE(decision.reasons[static_cast<int>(Backend::kTorchNative)].empty());
}

TEST(LatentCapability, CudaTakesTheKernelsDimsDtypesAndPages) {
  for (int page_size : {1, 16, 64, 256, 48}) {
    CallDescription call = latent_decode();
    call.page_size = page_size;
    EXPECT_TRUE(cuda_reasons(call).empty()) << page_size;
  }
  CallDescription call = latent_decode();
  call.page_size = 512;
  EXPECT_TRUE(mentions(cuda_reasons(call), "page_size 512 not supported (supported: 1 to 256)"));
  call = latent_decode();
  call.head_dim = 256 + 32;
  call.head_dim_v = 256;
  EXPECT_TRUE(mentions(cuda_reasons(call),
                       "latent dim 256 and rope dim 32 not supported (supported: 512 and 64)"));
  call = latent_decode();
  call.dtype = call.kv_dtype = ScalarType::kFloat32;
  EXPECT_TRUE(mentions(cuda_reasons(call), "dtype float32 not supported"));
  call = latent_decode();
  call.arch = 75;
  EXPECT_TRUE(mentions(cuda_reasons(call), "needs sm_80 or newer"));
  call = latent_decode();
  call.needs_grad = true;
  EXPECT_TRUE(mentions(cuda_reasons(call), "has no backward"));
  call = latent_decode();
  call.kv_dtype = ScalarType::kFloat8E4M3;
  call.kv_scales = true;
  EXPECT_TRUE(cuda_reasons(call).empty());
  call.num_q_heads = 24;  // a partial head group of the kernel: fine
  EXPECT_TRUE(cuda_reasons(call).empty());
}

TEST(LatentCapability, TorchNativeRunsAnyLatentShapeOnAnyDevice) {
  CallDescription call = latent_decode();
  call.device = DeviceKind::kCPU;
  call.arch = 0;
  call.dtype = call.kv_dtype = ScalarType::kFloat32;
  call.head_dim = 40;
  call.head_dim_v = 32;
  const Decision decision = resolve_backend(call, {}, all_available());
  ASSERT_TRUE(decision.chosen.has_value());
  EXPECT_EQ(*decision.chosen, Backend::kTorchNative);
}

TEST(LatentCapability, TheMemoKeepsLatentAndPlainCallsApart) {
  // A plain paged call of the same sizes is one the cuda paged kernels refuse (head dim 576);
  // the memoised decision of the latent call must not answer it.
  CallDescription latent = latent_decode();
  CallDescription plain = latent;
  plain.latent = false;
  BackendStatusTable& table = BackendStatusTable::instance();
  table.set(Backend::kCuda, {true, "", 0});
  const Selection selection{SelectionSource::kArgument, "cuda"};
  EXPECT_TRUE(resolve_backend_cached(latent, selection, table).chosen.has_value());
  EXPECT_FALSE(resolve_backend_cached(plain, selection, table).chosen.has_value());
}

}  // namespace
}  // namespace astr::dispatch

namespace astr::kernels {
namespace {

TEST(MlaPlan, OneBlockPerRowAndHeadGroup) {
  const MlaPlan decode = plan_mla_attention(64, 1, 128, /*decode=*/true);
  EXPECT_TRUE(decode.error.empty());
  EXPECT_EQ(decode.grid_rows, 64);
  EXPECT_EQ(decode.grid_heads, 8);
  EXPECT_FALSE(decode.poison_unplaced_rows);
  const MlaPlan prefill = plan_mla_attention(3, 40, 24, /*decode=*/false);
  EXPECT_EQ(prefill.grid_rows, 120);
  EXPECT_EQ(prefill.grid_heads, 2);  // 16 + a partial group of 8
  EXPECT_TRUE(prefill.poison_unplaced_rows);
  // The query rows and one tile of positions as float32, under every sm_80+ GPU's limit.
  EXPECT_EQ(decode.smem_bytes, (16 + 16) * 577 * 4);
  EXPECT_LE(decode.smem_bytes, 163 * 1024);
}

TEST(MlaPlan, RefusesGridsItCannotLaunch) {
  EXPECT_FALSE(plan_mla_attention(1 << 20, 1 << 12, 16, false).error.empty());
  EXPECT_FALSE(plan_mla_attention(2, 0, 16, false).error.empty());
}

}  // namespace
}  // namespace astr::kernels
