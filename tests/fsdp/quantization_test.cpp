// FSDP with block-quantized gathers and reductions (fsdp/quantization.h, Design note [block
// quantization], comm/quantized.h) against the formula computed on one process: the parameters
// every rank computes with are each shard's values quantized by its owner, and each rank's reduced
// gradient is the mean over the ranks of their gradients' parts, each quantized by its sender. W =
// 2 with each flag alone and both, W = 3 (uneven: the tiny GPT's parameters do not split evenly),
// W = 4 on two "nodes" (the reduce-scatter in two levels: each node's sums quantized again), and
// W = 3 with fp8 gathers.
#include <gtest/gtest.h>

#include <vector>

#include "dtrain/comm/quantized.h"
#include "fsdp_testing.h"

using namespace dtrain;
using namespace dtrain::fsdp_testing;
using dtrain::testing::run_ranks;

namespace {

struct QuantCase {
  int world;
  bool gathers, reductions;
  bool two_nodes = false;  // ranks on two "nodes" (first half, second half): the two-level reduce-scatter
  bool fp8 = false;        // gathers as fp8 blocks (Design note [fp8 blocks])
};

void PrintTo(const QuantCase& c, std::ostream* os) {
  *os << "W" << c.world << (c.gathers ? "_gathers" : "") << (c.reductions ? "_reductions" : "")
      << (c.two_nodes ? "_two_nodes" : "") << (c.fp8 ? "_fp8" : "");
}

constexpr int64_t kBlock = 64;  // (the tiny GPT's shards span dozens of blocks)

// Each row of `parts` (W x chunk) quantized and dequantized as its owner sends it.
at::Tensor round_trip(const at::Tensor& parts, comm::QuantFormat format = comm::QuantFormat::Int8) {
  at::Tensor out = at::empty_like(parts);
  comm::dequantize_blocks(comm::quantize_blocks(parts, kBlock, format), kBlock, out, format);
  return out;
}

// The distinct parameters (or their gradients, zeros where none) end to end, padded to W x chunk.
at::Tensor flat_of(const std::vector<at::Tensor>& params, int world, bool grads) {
  int64_t numel = 0;
  for (const auto& p : params) numel += p.numel();
  const int64_t chunk = (numel + world - 1) / world;
  at::Tensor flat = at::zeros({world * chunk});
  int64_t at = 0;
  for (const auto& p : params) {
    const at::Tensor v = grads ? (p.grad().defined() ? p.grad() : at::zeros_like(p)) : p.detach();
    flat.narrow(0, at, p.numel()).copy_(v.reshape({-1}));
    at += p.numel();
  }
  return flat.view({world, chunk});
}

// The mean gradient each rank should end with (row r: rank r's part), computed on one process.
at::Tensor expected_mean_gradient(const QuantCase& c, const Batch& global, int64_t per_rank) {
  models::GPT ref = make_gpt();
  std::vector<at::Tensor> params = unique_params(*ref);
  const at::Tensor values = flat_of(params, c.world, false);
  const at::Tensor used = c.gathers ? round_trip(values, c.fp8 ? comm::QuantFormat::Fp8 : comm::QuantFormat::Int8) : values;
  {
    at::NoGradGuard no_grad;
    int64_t at = 0;
    const at::Tensor flat = used.reshape({-1});
    for (auto& p : params) {
      p.copy_(flat.narrow(0, at, p.numel()).view(p.sizes()));
      at += p.numel();
    }
  }
  at::Tensor sum = at::zeros_like(values);
  std::vector<at::Tensor> node_sum(2, at::zeros_like(values));  // (two_nodes: each node's inner sums)
  for (int r = 0; r < c.world; ++r) {
    for (auto& p : params) p.mutable_grad() = at::Tensor();
    const Batch b = global.slice(r * per_rank, per_rank);
    loss_of(ref->forward(b.x), b.y).backward();
    const at::Tensor g = flat_of(params, c.world, true);
    if (c.two_nodes) {
      node_sum[2 * r / c.world] = node_sum[2 * r / c.world] + round_trip(g);
    } else {
      sum += c.reductions ? round_trip(g) : g;
    }
  }
  if (c.two_nodes) sum = (at::zeros_like(values) + round_trip(node_sum[0])) + round_trip(node_sum[1]);
  return sum / c.world;
}

}  // namespace

class FsdpQuantization : public ::testing::TestWithParam<QuantCase> {};

TEST_P(FsdpQuantization, ReducedGradientsEqualTheFormula) {
  const QuantCase c = GetParam();
  const int64_t per_rank = 2;
  const Batch global = global_batch(Data::Gpt, 0, c.world * per_rank);
  const at::Tensor expected = expected_mean_gradient(c, global, per_rank);
  const at::Tensor plain = expected_mean_gradient({c.world, false, false}, global, per_rank);
  const double scale = expected.abs().max().item<double>();
  // The quantization must show: without it the gradients differ by far more than the tolerance.
  ASSERT_GT((expected - plain).abs().max().item<double>(), 1e-4 * scale);
  std::vector<int> nodes;
  for (int r = 0; c.two_nodes && r < c.world; ++r) nodes.push_back(2 * r / c.world);
  run_ranks(c.world, [&](comm::ProcessGroup& pg) {
    auto opts = fsdp::FullyShardedOptions().wrap_policy(fsdp::WrapPolicy::none()).quantization(
        fsdp::Quantization().gathers(c.gathers).reductions(c.reductions).block(kBlock).gather_format(
            c.fp8 ? comm::QuantFormat::Fp8 : comm::QuantFormat::Int8));
    auto model = fsdp::FullyShardedDataParallel<models::GPT>(make_gpt(), pg, opts);
    const std::vector<at::Tensor> shards = model->parameters();
    ASSERT_EQ(shards.size(), 1u) << "one unit, one FlatParam";
    const Batch b = global.slice(pg.rank() * per_rank, per_rank);
    loss_of(model->forward(b.x), b.y).backward();
    const at::Tensor got = shards[0].grad();
    ASSERT_TRUE(got.defined());
    const at::Tensor want = expected[pg.rank()];
    EXPECT_LE((got - want).abs().max().item<double>(), 1e-6 * scale)
        << "rank " << pg.rank() << ": worst at " << (got - want).abs().argmax().item<int64_t>() << " of " << want.numel();
    EXPECT_EQ(model->state().groups().shard_nodes.two_level(), c.two_nodes && c.reductions);
  }, 20000, nodes);
}

INSTANTIATE_TEST_SUITE_P(Worlds, FsdpQuantization,
                         ::testing::Values(QuantCase{2, true, false}, QuantCase{2, false, true}, QuantCase{2, true, true},
                                           QuantCase{3, true, true}, QuantCase{4, true, true, true},
                                           QuantCase{3, true, true, false, true}),
                         [](const auto& info) {
                           const QuantCase& c = info.param;
                           return "W" + std::to_string(c.world) + (c.gathers ? "_gathers" : "") +
                                  (c.reductions ? "_reductions" : "") + (c.two_nodes ? "_two_nodes" : "") +
                                  (c.fp8 ? "_fp8" : "");
                         });

TEST(FsdpQuantization, RefusesABlockOfTheWrongSize) {
  // (the plan refuses the strategies without FSDP's collectives: tests/parallel/plan_test.cpp)
  run_ranks(1, [](comm::ProcessGroup& pg) {
    auto opts = fsdp::FullyShardedOptions().quantization(fsdp::Quantization().gathers(true).block(6));
    EXPECT_THROW(fsdp::FullyShardedDataParallel<models::GPT>(make_gpt(), pg, opts), c10::Error);
  });
}

// HSDP, replicate 2 x shard 2 (shard groups {0, 1} and {2, 3}, replicate groups {0, 2} and {1, 3}):
// the reduce-scatter inside each shard group as above, then the all-reduce across replicas
// quantized too (comm::quantized_all_reduce: each replica's part padded to 2 parts, reduced from
// its senders' quantized values, quantized again by its owner).
TEST(FsdpQuantization, HybridShardsAndReplicasEqualTheFormula) {
  constexpr int kWorld = 4, kShard = 2, kReplicas = 2;
  const int64_t per_rank = 2;
  const Batch global = global_batch(Data::Gpt, 0, kWorld * per_rank);
  models::GPT ref = make_gpt();
  std::vector<at::Tensor> params = unique_params(*ref);
  const at::Tensor used = round_trip(flat_of(params, kShard, false));
  {
    at::NoGradGuard no_grad;
    int64_t at = 0;
    for (auto& p : params) {
      p.copy_(used.reshape({-1}).narrow(0, at, p.numel()).view(p.sizes()));
      at += p.numel();
    }
  }
  const int64_t chunk = used.size(1), q = (chunk + kReplicas - 1) / kReplicas;
  // Per replica k, row s: the mean its shard group's reduce-scatter leaves on shard rank s (summed
  // in rank order, then divided, as comm::quantized_reduce_scatter does: the same bits).
  std::vector<at::Tensor> shard_mean(kReplicas, at::zeros({kShard, chunk}));
  for (int r = 0; r < kWorld; ++r) {
    for (auto& p : params) p.mutable_grad() = at::Tensor();
    const Batch b = global.slice(r * per_rank, per_rank);
    loss_of(ref->forward(b.x), b.y).backward();
    shard_mean[r / kShard] = shard_mean[r / kShard] + round_trip(flat_of(params, kShard, true));
  }
  for (auto& m : shard_mean) m = m / kShard;
  std::vector<at::Tensor> expected(kShard);  // per shard rank s: the gradient both replicas end with
  for (int s = 0; s < kShard; ++s) {
    at::Tensor sum = at::zeros({kReplicas, q});
    for (int k = 0; k < kReplicas; ++k) {
      at::Tensor padded = at::zeros({kReplicas * q});
      padded.narrow(0, 0, chunk).copy_(shard_mean[k][s]);
      sum += round_trip(padded.view({kReplicas, q}));
    }
    expected[s] = round_trip(sum / kReplicas).reshape({-1}).narrow(0, 0, chunk);
  }
  const double scale = expected[0].abs().max().item<double>();
  run_ranks(kWorld, [&](comm::ProcessGroup& pg) {
    auto opts = fsdp::FullyShardedOptions()
                    .sharding(fsdp::ShardingStrategy::HybridShard)
                    .hybrid_layout(fsdp::MeshLayout{kReplicas, kShard})
                    .wrap_policy(fsdp::WrapPolicy::none())
                    .quantization(fsdp::Quantization().gathers(true).reductions(true).block(kBlock));
    auto model = fsdp::FullyShardedDataParallel<models::GPT>(make_gpt(), pg, opts);
    const Batch b = global.slice(pg.rank() * per_rank, per_rank);
    loss_of(model->forward(b.x), b.y).backward();
    const at::Tensor got = model->parameters().at(0).grad();
    const at::Tensor& want = expected[pg.rank() % kShard];
    EXPECT_LE((got - want).abs().max().item<double>(), 1e-6 * scale) << "rank " << pg.rank();
  });
}

// --sharding none (each rank holds everything) with quantized reductions: the gradients'
// all-reduce quantized (comm::quantized_all_reduce): padded to W parts, each reduced from its
// senders' quantized values and quantized again by its owner.
TEST(FsdpQuantization, NoShardAllReduceEqualsTheFormula) {
  constexpr int kWorld = 2;
  const int64_t per_rank = 2;
  const Batch global = global_batch(Data::Gpt, 0, kWorld * per_rank);
  models::GPT ref = make_gpt();
  std::vector<at::Tensor> params = unique_params(*ref);
  at::Tensor sum;
  int64_t n = 0, q = 0;
  for (int r = 0; r < kWorld; ++r) {
    for (auto& p : params) p.mutable_grad() = at::Tensor();
    const Batch b = global.slice(r * per_rank, per_rank);
    loss_of(ref->forward(b.x), b.y).backward();
    const at::Tensor g = flat_of(params, 1, true).reshape({-1});
    n = g.numel();
    q = (n + kWorld - 1) / kWorld;
    at::Tensor padded = at::zeros({kWorld * q});
    padded.narrow(0, 0, n).copy_(g);
    sum = r == 0 ? at::zeros({kWorld, q}) + round_trip(padded.view({kWorld, q})) : sum + round_trip(padded.view({kWorld, q}));
  }
  const at::Tensor expected = round_trip(sum / kWorld).reshape({-1}).narrow(0, 0, n);
  const double scale = expected.abs().max().item<double>();
  run_ranks(kWorld, [&](comm::ProcessGroup& pg) {
    auto opts = fsdp::FullyShardedOptions()
                    .sharding(fsdp::ShardingStrategy::NoShard)
                    .wrap_policy(fsdp::WrapPolicy::none())
                    .quantization(fsdp::Quantization().reductions(true).block(kBlock));
    auto model = fsdp::FullyShardedDataParallel<models::GPT>(make_gpt(), pg, opts);
    const Batch b = global.slice(pg.rank() * per_rank, per_rank);
    loss_of(model->forward(b.x), b.y).backward();
    const at::Tensor got = model->parameters().at(0).grad().reshape({-1}).narrow(0, 0, n);
    EXPECT_LE((got - expected).abs().max().item<double>(), 1e-6 * scale) << "rank " << pg.rank();
  });
}
