// dtrain-gpt's device and precision flags (--device, --backend, --precision, --loss-scale,
// --cpu-offload): how the device is resolved (dtrain/train/session.h, every case, no GPU needed) and
// every error message of these flags, in real processes. The training runs are in
// gpt_precision_test.cpp.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include <torch/cuda.h>

#include "dtrain/train/plan.h"
#include "dtrain/train/session.h"
#include "dtrain/models/gpt.h"
#include "resume_testing.h"

using dtrain::testing::bin;
using dtrain::testing::run_command;
using namespace dtrain::testing::resume;

namespace {

// The message of the std::invalid_argument that `fn` throws ("" when it throws none).
template <class Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(GptDevice, ResolvesCpuAndCudaLocalRank) {
  EXPECT_EQ(dtrain::train::resolve_device("cpu", "gloo", 3, 1, 0), c10::Device(c10::kCPU));
  EXPECT_EQ(dtrain::train::resolve_device("cpu", "gloo", 3, 1, 8), c10::Device(c10::kCPU));
  EXPECT_EQ(dtrain::train::resolve_device("cuda", "nccl", 0, 0, 1), c10::Device(c10::kCUDA, 0));
  EXPECT_EQ(dtrain::train::resolve_device("cuda", "nccl", 5, 3, 4), c10::Device(c10::kCUDA, 3));
  // Over gloo, more local ranks than GPUs share them (Design note [ranks sharing a GPU]).
  EXPECT_EQ(dtrain::train::resolve_device("cuda", "gloo", 1, 1, 1), c10::Device(c10::kCUDA, 0));
  EXPECT_EQ(dtrain::train::resolve_device("cuda", "gloo", 5, 5, 2), c10::Device(c10::kCUDA, 1));
}

TEST(GptDevice, MissingCudaDeviceNamesTheRank) {
  const std::string none = error_of([] { dtrain::train::resolve_device("cuda", "gloo", 2, 0, 0); });
  EXPECT_TRUE(contains(none, "rank 2: --device cuda but this process sees no CUDA device")) << none;
  EXPECT_TRUE(contains(none, "use --device cpu")) << none;
  const std::string too_few = error_of([] { dtrain::train::resolve_device("cuda", "nccl", 6, 2, 2); });
  EXPECT_TRUE(contains(too_few, "rank 6: --device cuda but its LOCAL_RANK 2 has no GPU: this machine has 2 CUDA "
                                "device(s)")) << too_few;
  EXPECT_TRUE(contains(too_few, "or let ranks share the GPUs with --backend gloo")) << too_few;
  EXPECT_TRUE(contains(error_of([] { dtrain::train::resolve_device("tpu", "gloo", 0, 0, 1); }), "--device must be cpu or cuda"));
}

TEST(GptDevice, BackendAndComputeDtypeFollowTheFlags) {
  dtrain::train::TrainConfig o;
  EXPECT_EQ(dtrain::train::backend_for(o), "gloo");
  EXPECT_EQ(dtrain::train::compute_dtype(dtrain::train::precision_of(o)), at::kFloat);
  o.device = "cuda";
  EXPECT_EQ(dtrain::train::backend_for(o), "nccl");
  o.backend = "gloo";
  EXPECT_EQ(dtrain::train::backend_for(o), "gloo");
  o.precision = "bf16";
  EXPECT_EQ(dtrain::train::compute_dtype(dtrain::train::precision_of(o)), at::kBFloat16);
  o.precision = "fp16";
  EXPECT_EQ(dtrain::train::compute_dtype(dtrain::train::precision_of(o)), at::kHalf);
}

// --init-on-ranks: the deferred placeholders stay zero-stride placeholders (nothing allocated).
TEST(GptDevice, PlaceModelKeepsDeferredPlaceholders) {
  dtrain::models::GPT model(dtrain::models::GPTOptions().layers(1).d_model(32).heads(2).seq_len(16).defer_init(true));
  dtrain::train::place_model(*model, c10::Device(c10::kCPU), /*deferred=*/true);
  for (const auto& p : model->parameters()) {
    EXPECT_EQ(p.storage().nbytes(), p.element_size()) << p.sizes();
    EXPECT_EQ(p.device(), c10::Device(c10::kCPU));
  }
}

TEST(GptDevice, PlaceModelKeepsDeferredPlaceholdersOnCuda) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs CUDA";
  dtrain::models::GPT model(dtrain::models::GPTOptions().layers(1).d_model(32).heads(2).seq_len(16).defer_init(true));
  dtrain::train::place_model(*model, c10::Device(c10::kCUDA, 0), /*deferred=*/true);
  for (const auto& p : model->parameters()) {
    EXPECT_EQ(p.storage().nbytes(), p.element_size()) << p.sizes();
    EXPECT_EQ(p.device(), c10::Device(c10::kCUDA, 0));
  }
}

// Each flag error exits 2 before anything starts, with a message naming the flag and the fix.
TEST(GptDevice, FlagErrorsAreClear) {
  const std::pair<std::string, std::string> cases[] = {
      {" --device tpu", "--device must be cpu or cuda, got 'tpu'"},
      {" --precision fp8", "--precision must be fp32, bf16 or fp16, got 'fp8'"},
      {" --precision fp16", "--precision fp16 needs --device cuda (fp16 autocast is CUDA-only in libtorch); on the "
                            "CPU use --precision bf16"},
      {" --backend mpi", "--backend must be auto, gloo or nccl, got 'mpi'"},
      {" --backend nccl", "--backend nccl moves CUDA tensors only: use --device cuda, or --backend gloo"},
      {" --loss-scale static", "--loss-scale must be none or dynamic, got 'static'"},
      {" --loss-scale-growth-interval 0 --loss-scale dynamic", "--loss-scale-growth-interval expects an integer >= 1"},
      {" --loss-scale-growth-interval 10", "--loss-scale-growth-interval applies to --loss-scale dynamic"},
      {" --precision bf16 --loss-scale none --loss-scale-growth-interval 10",
       "--loss-scale-growth-interval applies to --loss-scale dynamic"},
      {" --strategy zero2 --cpu-offload", "--cpu-offload applies to --strategy fsdp or hsdp"},
  };
  for (const auto& [flags, message] : cases) {
    auto res = run_command(bin("dtrain-gpt") + flags, 30);
    EXPECT_EQ(res.exit_code, 2) << flags << "\n" << res.output;
    EXPECT_TRUE(contains(res.output, message)) << flags << "\n" << res.output;
  }
}

// --device cuda where there is no GPU: every rank stops, naming itself, before training.
TEST(GptDevice, CudaWithoutAGpuIsAnErrorNamingTheRank) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "needs a machine without CUDA";
  const GptRun one = gpt(1, " --device cuda --steps 1");
  EXPECT_EQ(one.exit_code, 1) << one.output;
  EXPECT_TRUE(contains(one.output, "dtrain-gpt [rank 0]: error: rank 0: --device cuda but this process sees no CUDA "
                                   "device")) << one.output;
  // Rank 1 of 2 as a launcher starts it: it fails before the rendezvous (nobody listens on the port).
  const GptRun rank1 = gpt(1, " --device cuda --steps 1",
                           "RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=9 ");
  EXPECT_EQ(rank1.exit_code, 1) << rank1.output;
  EXPECT_TRUE(contains(rank1.output, "dtrain-gpt [rank 1]: error: rank 1: --device cuda but")) << rank1.output;
  EXPECT_TRUE(rank1.steps.empty());
}

// The loss-scaling test hook is refused where it would train on inf.
TEST(GptDevice, InfHookNeedsDynamicLossScaling) {
  const GptRun run = gpt(1, " --steps 2", "DTRAIN_TEST_INF_GRAD_AT_STEP=1 ");
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_TRUE(contains(run.output, "DTRAIN_TEST_INF_GRAD_AT_STEP (a test hook) needs --loss-scale dynamic"))
      << run.output;
}
