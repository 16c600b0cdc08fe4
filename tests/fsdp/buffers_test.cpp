// Issue 32: a steady-state FSDP step allocates no large buffer (Design note [buffers reused],
// util/block_pool.h). Counted by the library's counting allocator, every rank's thread at once.
#include <gtest/gtest.h>

#include <torch/optim/sgd.h>

#include "dtrain/comm/barrier.h"
#include "dtrain/compat.h"
#include "dtrain/util/memory.h"
#include "fsdp_testing.h"

namespace dtrain::fsdp_testing {
namespace {

constexpr int64_t kLarge = int64_t(1) << 20;  // the 1 MiB

// Every tensor of this GPT (so autograd's gradient outputs and activations) is under 1 MiB, and
// every block's flat buffers (gathered parameters, flat gradients) over it: any allocation of
// 1 MiB or more in a step is one of FSDP's buffers.
models::GPTOptions model_options() { return tiny_gpt_options(3, 3).d_model(192).heads(4); }

class FsdpBuffers : public ::testing::TestWithParam<std::tuple<fsdp::ShardingStrategy, int>> {};

void expect_steady_steps_allocate_nothing_large(fsdp::ShardingStrategy st, int W, const fsdp::Quantization& q = {},
                                               bool per_block = true);

TEST_P(FsdpBuffers, ASteadyStepAllocatesNoLargeBuffer) {
  const auto [st, W] = GetParam();
  expect_steady_steps_allocate_nothing_large(st, W);
}

// --gather-quant int8 --reduce-quant int8 (Design note [block quantization], comm/quantized.h):
// the fp32 temporaries a slice's (under 1 MiB), the packed buffers (a byte a value) from FSDP's
// pool. The model is one unit, so that its packed buffers (1.3 MB) are over 1 MiB too.
TEST(FsdpBuffersQuantized, ASteadyStepAllocatesNoLargeBuffer) {
  expect_steady_steps_allocate_nothing_large(fsdp::ShardingStrategy::FullShard, 2,
                                             fsdp::Quantization().gathers(true).reductions(true), /*per_block=*/false);
}

void expect_steady_steps_allocate_nothing_large(fsdp::ShardingStrategy st, int W, const fsdp::Quantization& q,
                                               bool per_block) {
  util::count_cpu_allocations();
  testing::run_ranks(W, [&](comm::ProcessGroup& pg) {
    const auto options = fsdp::FullyShardedOptions().sharding(st).quantization(q);
    auto model = fsdp::FullyShardedDataParallel<models::GPT>(models::GPT(model_options()), pg,
                                                             per_block ? by_block(options) : options);
    const auto& state = model->state();
    for (const auto& it : models::GPT(model_options())->named_parameters()) {
      ASSERT_LT(it.value().nbytes(), kLarge) << it.key() << ": the model must keep every tensor under 1 MiB";
    }
    for (size_t i = 1; i < state.units().size(); ++i) {
      ASSERT_GE(state.units()[i]->full_bytes(), kLarge) << "every block's buffers must be 1 MiB or more";
    }
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    auto in_step = [&](auto&& fn) {  // every rank between two barriers, so rank 0's count is everyone's
      comm::barrier(pg).wait();
      const int64_t before = util::cpu_allocations_of_at_least(kLarge);
      comm::barrier(pg).wait();
      fn();
      comm::barrier(pg).wait();
      const int64_t n = util::cpu_allocations_of_at_least(kLarge) - before;
      comm::barrier(pg).wait();
      return n;
    };
    for (int t = 0; t < 4; ++t) {
      const int64_t n = in_step([&] {
        compat::zero_grad_in_place(opt);  // (as the library loop: 2.x would free the gradients, and allocate them again)
        auto b = global_batch(Data::Gpt, t, 2 * W).slice(2 * pg.rank(), 2);
        loss_of(model->forward(b.x), b.y).backward();
        opt.step();
      });
      if (pg.rank() == 0 && t == 0) EXPECT_GT(n, 0) << "the first step allocates the buffers (else nothing is counted)";
      if (pg.rank() == 0 && t > 0) EXPECT_EQ(n, 0) << "step " << t << " allocated " << n << " buffers of 1 MiB or more";
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Strategies, FsdpBuffers,
                         ::testing::Values(std::make_tuple(fsdp::ShardingStrategy::FullShard, 2),
                                           std::make_tuple(fsdp::ShardingStrategy::FullShard, 3),
                                           std::make_tuple(fsdp::ShardingStrategy::ShardGradOp, 2)),
                         StrategyWorldName());

}  // namespace
}  // namespace dtrain::fsdp_testing
