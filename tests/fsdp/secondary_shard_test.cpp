// FSDP's secondary shard (Design note [secondary shards], fsdp/secondary_shard.h): 4 ranks on two
// "nodes" ({0, 0, 1, 1}), one unit per GPT block. Training with it is bit-identical to training
// without (the backward gathers the very values the forward used), with and without quantized
// gathers; the backward's gathers move inside the node: the within-node group sends exactly the
// nested units' node copies, and the bytes across nodes fall by those gathers. Between forward
// and backward the nested units hold NodeSharded copies of 1 / 2 of their parameters; a forward
// whose backward never comes drops them before the optimizer's step, so none is used stale. On
// one node it changes nothing.
#include <gtest/gtest.h>

#include <mutex>
#include <vector>

#include "dtrain/comm/traffic.h"
#include "dtrain/recompute/checkpoint.h"
#include "fsdp_testing.h"

using namespace dtrain;
using namespace dtrain::fsdp_testing;
using dtrain::testing::run_ranks;

namespace {

const std::vector<int> kTwoNodes{0, 0, 1, 1};
constexpr int kWorld = 4, kSteps = 3;

struct RankRun {
  std::vector<at::Tensor> shards;  // this rank's master shards after training
  int64_t within_sent = 0, across = 0;  // bytes in the within-node groups and across nodes (all ranks)
  int64_t node_copy_bytes = 0;          // owned bytes of NodeSharded FlatParams between forward and backward
  int64_t expected_within = 0;          // (L - 1) x 1 / L of every nested unit's gathered bytes, per step
};

fsdp::FullyShardedOptions options(bool secondary, bool quant) {
  return by_block().secondary_shard(secondary ? fsdp::SecondaryShard::Node : fsdp::SecondaryShard::None)
      .quantization(fsdp::Quantization().gathers(quant).block(64));
}

// kSteps of SGD with momentum, with (first step only) a forward whose backward never comes just
// before the optimizer's step: the copies it kept must not serve the next step's forward.
std::vector<RankRun> train_on_two_nodes(bool secondary, bool quant, std::vector<int> nodes = kTwoNodes,
                                       bool recompute = false) {
  std::vector<RankRun> runs(kWorld);
  std::mutex mu;
  run_ranks(
      kWorld,
      [&](comm::ProcessGroup& pg) {
        models::GPT gpt = make_gpt(3, 3);
        if (recompute) recompute::checkpoint_modules(*gpt, recompute::of_type<models::GPTBlockImpl>());
        auto model = fsdp::FullyShardedDataParallel<models::GPT>(gpt, pg, options(secondary, quant));
        auto opt = make_opt(Opt::SgdMomentum, model->parameters());
        RankRun& run = runs[static_cast<size_t>(pg.rank())];
        const auto& units = model->state().units();
        for (size_t u = 1; u < units.size(); ++u) run.expected_within += units[u]->full_bytes() / 2;
        const comm::Traffic t0 = dtrain::testing::traffic_at_rest(pg);
        for (int t = 0; t < kSteps; ++t) {
          opt->zero_grad();
          const Batch b = global_batch(Data::Gpt, t, kWorld * 2).slice(pg.rank() * 2, 2);
          const at::Tensor loss = loss_of(model->forward(b.x), b.y);
          if (t == 0) {
            for (size_t u = 1; u < units.size(); ++u) {
              for (const auto& f : units[u]->flats) {
                if (f->state() == fsdp::FlatParam::State::NodeSharded) run.node_copy_bytes += f->owned_bytes() - 
                    static_cast<int64_t>(f->shard().nbytes());
              }
            }
          }
          loss.backward();
          if (t == 0) {  // a forward without backward (say, an evaluation in grad mode), then the step
            loss_of(model->forward(b.x), b.y);
          }
          opt->step();
        }
        const comm::Traffic t1 = dtrain::testing::traffic_at_rest(pg);
        std::lock_guard<std::mutex> lock(mu);
        for (const auto& p : model->parameters()) run.shards.push_back(p.detach().clone());
        if (pg.rank() == 0) {
          auto sent = [](const comm::Traffic& t) {  // (the shard group is the world here: "world_within_node")
            int64_t n = 0;
            for (const auto& [label, g] : t.by_group) {
              if (label.size() > 12 && label.compare(label.size() - 12, 12, "_within_node") == 0) n += g.sent;
            }
            return n;
          };
          runs[0].within_sent = sent(t1) - sent(t0);
          runs[0].across = t1.across_nodes_sent - t0.across_nodes_sent;
        }
      },
      60000, nodes);
  return runs;
}

void expect_same_shards(const std::vector<RankRun>& a, const std::vector<RankRun>& b) {
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_EQ(a[r].shards.size(), b[r].shards.size());
    for (size_t i = 0; i < a[r].shards.size(); ++i) {
      EXPECT_TRUE(at::equal(a[r].shards[i], b[r].shards[i]))
          << "rank " << r << " shard " << i << ": max diff " << (a[r].shards[i] - b[r].shards[i]).abs().max().item<double>();
    }
  }
}

}  // namespace

TEST(FsdpSecondaryShard, TrainsBitIdenticallyWithTheBackwardsGathersInsideTheNode) {
  for (const bool quant : {false, true}) {
    SCOPED_TRACE(quant ? "int8 gathers" : "exact gathers");
    const std::vector<RankRun> plain = train_on_two_nodes(false, quant);
    const std::vector<RankRun> hpz = train_on_two_nodes(true, quant);
    expect_same_shards(hpz, plain);
    // The within-node group sends each nested unit's other half once a step (the forward without
    // backward of step 0 gathered over the whole shard group, from the master shards).
    EXPECT_EQ(plain[0].within_sent, 0);
    // (the counters are the process's: all 4 ranks' bytes)
    EXPECT_EQ(hpz[0].within_sent, kWorld * kSteps * hpz[0].expected_within);
    EXPECT_LT(hpz[0].across, plain[0].across);
    EXPECT_EQ(plain[0].node_copy_bytes, 0);
    // Between forward and backward every nested unit keeps half its gathered parameters.
    for (int r = 0; r < kWorld; ++r) EXPECT_EQ(hpz[r].node_copy_bytes, hpz[r].expected_within) << "rank " << r;
  }
}

// FSDP(checkpoint(block)): the recomputation in backward gathers from the node copies too.
TEST(FsdpSecondaryShard, RecomputedBlocksGatherInsideTheNode) {
  const std::vector<RankRun> plain = train_on_two_nodes(false, false, kTwoNodes, true);
  const std::vector<RankRun> hpz = train_on_two_nodes(true, false, kTwoNodes, true);
  expect_same_shards(hpz, plain);
  EXPECT_EQ(hpz[0].within_sent, kWorld * kSteps * hpz[0].expected_within);
  EXPECT_EQ(hpz[0].node_copy_bytes, hpz[0].expected_within);
}

TEST(FsdpSecondaryShard, OnOneNodeItChangesNothing) {
  const std::vector<RankRun> plain = train_on_two_nodes(false, false, {});
  const std::vector<RankRun> hpz = train_on_two_nodes(true, false, {});
  expect_same_shards(hpz, plain);
  EXPECT_EQ(hpz[0].within_sent, 0);
  EXPECT_EQ(hpz[0].node_copy_bytes, 0);
}
