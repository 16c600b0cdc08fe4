// Issue 32: a steady-state DDP step allocates no large buffer of the library's (Design note
// [buffers reused], util/block_pool.h: ZeRO's buffers are transient by choice). Counted by the
// library's counting allocator, every rank's thread at once.
#include <gtest/gtest.h>

#include <functional>

#include <ATen/ATen.h>
#include <torch/optim/sgd.h>

#include "dtrain/comm.h"
#include "dtrain/comm/barrier.h"
#include "dtrain/ddp/comm_hook.h"
#include "dtrain/ddp/distributed_data_parallel.h"
#include "dtrain/models/gpt.h"
#include "dtrain/util/memory.h"
#include "testing/testing.h"

namespace dtrain {
namespace {

constexpr int64_t kLarge = int64_t(1) << 20;  // the 1 MiB

// Every tensor under 1 MiB (so autograd's outputs are), the buckets (25 MiB cap) over it.
models::GPTOptions model_options() {
  return models::GPTOptions().vocab_size(32).seq_len(8).layers(3).d_model(192).heads(4).seed(3);
}

std::pair<at::Tensor, at::Tensor> batch(int step, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7000 + 10 * step + rank);
  auto opts = at::TensorOptions().dtype(at::kLong);
  return {at::randint(0, 32, {2, 8}, gen, opts), at::randint(0, 32, {2, 8}, gen, opts)};
}

// Allocations of 1 MiB or more in each of four steps of `step` (every rank between barriers).
std::vector<int64_t> large_allocations(comm::ProcessGroup& pg, const std::function<void(int)>& step) {
  std::vector<int64_t> counts;
  for (int t = 0; t < 4; ++t) {
    comm::barrier(pg).wait();
    const int64_t before = util::cpu_allocations_of_at_least(kLarge);
    comm::barrier(pg).wait();
    step(t);
    comm::barrier(pg).wait();
    counts.push_back(util::cpu_allocations_of_at_least(kLarge) - before);
    comm::barrier(pg).wait();
  }
  return counts;
}

// Four SGD steps of `model` on rank 0 checked, after `warmup` unchecked ones (a hook makes its
// buffers in its first step): none allocates a buffer of 1 MiB or more.
void expect_steady_steps_allocate_nothing_large(comm::ProcessGroup& pg, ddp::DistributedDataParallel<models::GPT>& model,
                                               int warmup = 0) {
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  auto step = [&](int t) {
    opt.zero_grad();
    auto [x, y] = batch(t, pg.rank());
    models::gpt_loss(model->forward(x), y).backward();
    opt.step();
  };
  for (int t = 0; t < warmup; ++t) step(100 + t);
  const std::vector<int64_t> n = large_allocations(pg, step);
  if (pg.rank() != 0) return;
  for (size_t t = 0; t < n.size(); ++t) EXPECT_EQ(n[t], 0) << "step " << t << " allocated " << n[t] << " buffers of 1 MiB or more";
}

class DataParallelBuffers : public ::testing::TestWithParam<int> {};

TEST_P(DataParallelBuffers, ASteadyStepAllocatesNoLargeBuffer) {
  const int W = GetParam();
  util::count_cpu_allocations();
  testing::run_ranks(W, [&](comm::ProcessGroup& pg) {
    models::GPT net(model_options());
    int64_t bytes = 0;
    for (const auto& it : net->named_parameters()) {
      ASSERT_LT(it.value().nbytes(), kLarge) << it.key() << ": the model must keep every tensor under 1 MiB";
      bytes += it.value().nbytes();
    }
    ASSERT_GT(bytes, 2 * kLarge) << "the buckets (the first of 1 MiB, the rest) must be 1 MiB or more";
    auto model = ddp::DistributedDataParallel<models::GPT>(net, pg);
    expect_steady_steps_allocate_nothing_large(pg, model);
  });
}

// --hierarchical-all-reduce (Design note [two-level all-reduce]): 4 ranks on two nodes, the
// buckets' workspaces kept by the reducer, the parts reduced in place.
TEST(DataParallelBuffersTwoLevel, ASteadyStepAllocatesNoLargeBuffer) {
  util::count_cpu_allocations();
  testing::run_ranks(
      4,
      [&](comm::ProcessGroup& pg) {
        auto model = ddp::DistributedDataParallel<models::GPT>(
            models::GPT(model_options()), pg, ddp::DistributedDataParallelOptions().hierarchical_all_reduce(true));
        expect_steady_steps_allocate_nothing_large(pg, model);
      },
      60000, {0, 0, 1, 1});
}

// --grad-compression bf16 (Design note [gradient compression], ddp/comm_hook.h): the hook keeps
// each bucket's narrow buffers and the collectives' workspaces (made in its first step), flat
// (W = 2, 3: uneven parts, 4) and in two levels (4 ranks on two nodes).
TEST(DataParallelBuffersCompressed, ASteadyStepAllocatesNoLargeBuffer) {
  util::count_cpu_allocations();
  for (const int W : {2, 3, 4}) {  // (4: the narrow rows summed in fp32 a slice at a time stay small)
    SCOPED_TRACE("W = " + std::to_string(W));
    testing::run_ranks(W, [&](comm::ProcessGroup& pg) {
      auto model = ddp::DistributedDataParallel<models::GPT>(
          models::GPT(model_options()), pg, ddp::DistributedDataParallelOptions().comm_hook(ddp::cast_hook(at::kBFloat16)));
      expect_steady_steps_allocate_nothing_large(pg, model, /*warmup=*/1);
    });
  }
  SCOPED_TRACE("two levels");
  testing::run_ranks(
      4,
      [&](comm::ProcessGroup& pg) {
        auto model = ddp::DistributedDataParallel<models::GPT>(
            models::GPT(model_options()), pg,
            ddp::DistributedDataParallelOptions().hierarchical_all_reduce(true).comm_hook(ddp::cast_hook(at::kBFloat16)));
        expect_steady_steps_allocate_nothing_large(pg, model, /*warmup=*/1);
      },
      60000, {0, 0, 1, 1});
}

INSTANTIATE_TEST_SUITE_P(Worlds, DataParallelBuffers, ::testing::Values(2, 3),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

}  // namespace
}  // namespace dtrain
