// parallel::Plan: the one validation (each refusal with its reason of method), the names the
// planner and the metrics print, and train::make_plan's resolution of a request (layouts, defaults,
// the split of the global batch).
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "dtrain/parallel/plan.h"
#include "dtrain/train/plan.h"

using dtrain::parallel::DataParallel;
using dtrain::parallel::Plan;
namespace train = dtrain::train;

namespace {

std::string refusal(const Plan& p, int world) {
  try {
    p.validate(world);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

Plan plan(DataParallel d, dtrain::parallel::Layout l, int64_t micro = 4, int64_t accumulation = 1) {
  Plan p;
  p.data = d;
  p.layout = l;
  p.batch = {micro * accumulation * l.data_parallel(), micro, accumulation};
  return p;
}

train::TrainConfig request(const std::string& strategy, int tp = 1, int pp = 1) {
  train::TrainConfig c;
  c.strategy = strategy;
  c.tp = tp;
  c.pp = pp;
  c.batch_size = 4;
  return c;
}

}  // namespace

TEST(Plan, ValidatesDegreesAgainstTheWorld) {
  EXPECT_EQ(refusal(plan(DataParallel::Replicate, {4, 1}), 4), "");
  EXPECT_NE(refusal(plan(DataParallel::Replicate, {2, 1, 1, 3}), 4).find("--tp 3 must divide the world size (4 ranks)"),
            std::string::npos);
  EXPECT_NE(refusal(plan(DataParallel::Replicate, {1, 1, 3, 1}), 4).find("--pp 3 must divide"), std::string::npos);
  EXPECT_NE(refusal(plan(DataParallel::Replicate, {1, 1}), 2).find("does not fit 2 ranks"), std::string::npos);
  EXPECT_NE(refusal(plan(DataParallel::None, {2, 1, 1, 2}), 4).find("--strategy single --tp 2 trains one replica on 2"),
            std::string::npos);
  EXPECT_NE(refusal(plan(DataParallel::Local, {2, 1}), 2).find("--strategy dp is one process over all local GPUs"),
            std::string::npos);
}

TEST(Plan, RefusesWhatSavesNothingOrCannotWorkWithTheReason) {
  EXPECT_NE(refusal(plan(DataParallel::ShardGradients, {1, 2, 2, 1}), 4).find("saves nothing over zero1"),
            std::string::npos);
  EXPECT_EQ(refusal(plan(DataParallel::ShardOptimizer, {1, 2, 2, 2}), 8), "");  // (zero1 around TP stages)
  EXPECT_EQ(refusal(plan(DataParallel::ShardGradients, {1, 2, 1, 2}), 4), "");  // (zero2 around TP)
  Plan hsdp_stages = plan(DataParallel::FullShard, {2, 2, 2, 1});
  hsdp_stages.fsdp.sharding = dtrain::parallel::Sharding::Hybrid;
  EXPECT_EQ(refusal(hsdp_stages, 8), "");
  Plan grad_op = plan(DataParallel::FullShard, {1, 2, 2, 1});
  grad_op.fsdp.sharding = dtrain::parallel::Sharding::GradOp;
  EXPECT_NE(refusal(grad_op, 4).find("each stage is gathered for the whole step already"), std::string::npos);
  Plan offload = plan(DataParallel::FullShard, {1, 2, 2, 1});
  offload.fsdp.cpu_offload = true;
  EXPECT_NE(refusal(offload, 4).find("have no unit to act on"), std::string::npos);
  Plan sp = plan(DataParallel::Replicate, {2, 1});
  sp.sequence_parallel = true;
  EXPECT_NE(refusal(sp, 2).find("--sequence-parallel applies to tensor parallelism"), std::string::npos);
  Plan pipe = plan(DataParallel::Replicate, {1, 1, 2, 1});
  pipe.pipeline.microbatches = 3;
  EXPECT_NE(refusal(pipe, 2).find("--microbatches 3 must divide the micro-batch of 4"), std::string::npos);
  Plan batch = plan(DataParallel::Replicate, {2, 1});
  batch.batch.global = 12;
  EXPECT_NE(refusal(batch, 2).find("does not split into 2 data-parallel rank(s) x 4 per micro-batch x 1"),
            std::string::npos);
}

TEST(Plan, QuantizedCollectivesBelongToFsdp) {
  using dtrain::parallel::Quant;
  Plan fsdp = plan(DataParallel::FullShard, {1, 2});
  fsdp.fsdp.gather_quant = Quant::Int8;
  fsdp.fsdp.reduce_quant = Quant::Int8;
  EXPECT_EQ(refusal(fsdp, 2), "");
  EXPECT_NE(fsdp.describe().find("gathers int8; reductions int8"), std::string::npos) << fsdp.describe();
  EXPECT_NE(fsdp.table().find("gather_quant          int8"), std::string::npos) << fsdp.table();
  Plan ddp = plan(DataParallel::Replicate, {2, 1});
  ddp.fsdp.gather_quant = Quant::Int8;
  EXPECT_NE(refusal(ddp, 2).find("--gather-quant int8 quantizes the parameter gathers and gradient reduce-scatters "
                                 "of --strategy fsdp or hsdp; --strategy ddp has none"),
            std::string::npos) << refusal(ddp, 2);
  Plan zero2 = plan(DataParallel::ShardGradients, {1, 2});
  zero2.fsdp.reduce_quant = Quant::Int8;
  EXPECT_NE(refusal(zero2, 2).find("--reduce-quant int8 quantizes"), std::string::npos) << refusal(zero2, 2);
  Plan none = plan(DataParallel::FullShard, {2, 1});
  none.fsdp.sharding = dtrain::parallel::Sharding::None;
  none.fsdp.reduce_quant = Quant::Int8;
  EXPECT_EQ(refusal(none, 2), "");  // (its all-reduce quantized)
  none.fsdp.gather_quant = Quant::Int8;
  EXPECT_NE(refusal(none, 2).find("--gather-quant int8 with --sharding none: every rank holds every parameter"),
            std::string::npos) << refusal(none, 2);
  EXPECT_EQ(dtrain::parallel::parse_quant("--gather-quant", "int8"), Quant::Int8);
  EXPECT_EQ(dtrain::parallel::parse_quant("--gather-quant", "fp8"), Quant::Fp8);
  EXPECT_THROW(dtrain::parallel::parse_quant("--gather-quant", "int4"), std::invalid_argument);
  Plan fp8 = plan(DataParallel::FullShard, {1, 2});
  fp8.fsdp.gather_quant = Quant::Fp8;
  EXPECT_EQ(refusal(fp8, 2), "");
  EXPECT_NE(fp8.describe().find("gathers fp8"), std::string::npos) << fp8.describe();
  fp8.fsdp.reduce_quant = Quant::Fp8;
  EXPECT_NE(refusal(fp8, 2).find("--reduce-quant fp8: gradients are reduced as int8 blocks only"), std::string::npos)
      << refusal(fp8, 2);
  train::TrainConfig asked = request("hsdp");
  asked.reduce_quant = "int8";
  const Plan made = train::make_plan(asked, 4, 2);
  EXPECT_EQ(made.fsdp.gather_quant, Quant::None);
  EXPECT_EQ(made.fsdp.reduce_quant, Quant::Int8);
}

TEST(Plan, SecondaryShardsBelongToFsdpThatReshards) {
  Plan fsdp = plan(DataParallel::FullShard, {1, 4});
  fsdp.fsdp.secondary_shard = true;
  EXPECT_EQ(refusal(fsdp, 4), "");
  EXPECT_NE(fsdp.describe().find("secondary shard per node"), std::string::npos) << fsdp.describe();
  EXPECT_NE(fsdp.table().find("secondary_shard       node"), std::string::npos) << fsdp.table();
  Plan ddp = plan(DataParallel::Replicate, {4, 1});
  ddp.fsdp.secondary_shard = true;
  EXPECT_NE(refusal(ddp, 4).find("--secondary-shard node keeps a copy of FSDP's gathered parameters inside each node; "
                                 "--strategy ddp gathers none"),
            std::string::npos) << refusal(ddp, 4);
  Plan grad_op = fsdp;
  grad_op.fsdp.sharding = dtrain::parallel::Sharding::GradOp;
  EXPECT_NE(refusal(grad_op, 4).find("--secondary-shard node with --sharding grad_op: parameters stay gathered"),
            std::string::npos) << refusal(grad_op, 4);
  train::TrainConfig asked = request("fsdp");
  asked.secondary_shard = "node";
  EXPECT_TRUE(train::make_plan(asked, 4, 2).fsdp.secondary_shard);
}

TEST(Plan, HierarchicalAllReduceBelongsToDdpAndZeroOne) {
  for (const DataParallel d : {DataParallel::Replicate, DataParallel::ShardOptimizer}) {
    Plan p = plan(d, d == DataParallel::Replicate ? dtrain::parallel::Layout{4, 1} : dtrain::parallel::Layout{1, 4});
    p.hierarchical_all_reduce = true;
    EXPECT_EQ(refusal(p, 4), "") << p.name();
    EXPECT_NE(p.describe().find("all-reduce in two levels"), std::string::npos) << p.describe();
    EXPECT_NE(p.table().find("two_level_all_reduce  yes"), std::string::npos) << p.table();
    p.compression = dtrain::parallel::parse_compression("bf16");  // (the cast hooks run in two levels)
    EXPECT_EQ(refusal(p, 4), "") << p.name();
    p.compression = dtrain::parallel::parse_compression("powersgd:4");
    EXPECT_NE(refusal(p, 4).find("--hierarchical-all-reduce with --grad-compression powersgd:4"), std::string::npos)
        << refusal(p, 4);
  }
  Plan fsdp = plan(DataParallel::FullShard, {1, 4});
  fsdp.hierarchical_all_reduce = true;
  EXPECT_NE(refusal(fsdp, 4).find("--strategy fsdp reduce-scatters: its --reduce-quant int8 runs in two levels"),
            std::string::npos) << refusal(fsdp, 4);
  train::TrainConfig asked = request("ddp");
  asked.hierarchical_all_reduce = true;
  EXPECT_TRUE(train::make_plan(asked, 4, 2).hierarchical_all_reduce);
}

TEST(Plan, NamesAndDescribesItself) {
  EXPECT_EQ(plan(DataParallel::Replicate, {2, 1}).name(), "ddp");
  EXPECT_EQ(plan(DataParallel::None, {1, 1, 1, 2}).name(), "tp2");
  Plan p = plan(DataParallel::FullShard, {1, 2, 2, 2});
  p.sequence_parallel = true;
  p.recompute = true;
  EXPECT_EQ(p.name(), "tp2+sp+pp2+fsdp+recompute");
  p.fsdp.sharding = dtrain::parallel::Sharding::Hybrid;
  EXPECT_EQ(dtrain::parallel::kind_name(p), "hsdp");
  const std::string line = p.describe();
  EXPECT_NE(line.find("hsdp over 2 ranks x tensor 2 (sequence parallel) x pipeline 2 (1f1b, 1 micro-batches)"),
            std::string::npos) << line;
  EXPECT_NE(line.find("global batch 8 = 2 x 4 per micro-batch x 1 accumulation"), std::string::npos) << line;
  EXPECT_NE(p.table().find("sharding"), std::string::npos);
}

TEST(MakePlan, ResolvesLayoutsAndDefaults) {
  Plan p = train::make_plan(request("zero1", 2), 8, 8);
  EXPECT_EQ(p.layout.shard, 4);
  EXPECT_EQ(p.layout.tensor, 2);
  EXPECT_EQ(p.data, DataParallel::ShardOptimizer);
  p = train::make_plan(request("hsdp", 2), 8, 4);  // (a node of 4 ranks holds 2 tensor groups: shard 2)
  EXPECT_EQ(p.layout.replicate, 2);
  EXPECT_EQ(p.layout.shard, 2);
  p = train::make_plan(request("fsdp", 1, 2), 4, 4);
  EXPECT_EQ(p.pipeline.microbatches, 2);
  EXPECT_EQ(p.pipeline.schedule, dtrain::parallel::Schedule::OneFOneB);
  train::TrainConfig fp16 = request("ddp");
  fp16.precision = "fp16";
  EXPECT_TRUE(train::make_plan(fp16, 1, 1).loss_scaling);
  EXPECT_THROW(train::make_plan(request("auto"), 2, 2), std::invalid_argument);
}

// Design note [the global batch]: the request's ranks x batch, whatever the plan.
TEST(MakePlan, EveryPlanTrainsTheGlobalBatchOfTheRequest) {
  for (const auto& [strategy, tp, pp] : {std::tuple{"ddp", 1, 1}, {"zero2", 2, 1}, {"ddp", 2, 1}, {"fsdp", 1, 2},
                                          {"single", 2, 2}, {"zero1", 2, 2}}) {
    const Plan p = train::make_plan(request(strategy, tp, pp), 4, 4);
    EXPECT_EQ(p.batch.global, 16) << p.name();
    EXPECT_EQ(p.batch.micro, 4) << p.name();
    EXPECT_EQ(p.batch.accumulation * p.batch.micro * p.data_parallel(), 16) << p.name();
  }
  train::TrainConfig c = request("ddp");
  c.global_batch_size = 24;
  EXPECT_EQ(train::make_plan(c, 2, 2).batch.accumulation, 3);
  c.global_batch_size = 20;
  try {
    train::make_plan(c, 2, 2);
    FAIL() << "20 samples split into 2 ranks x 4";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("does not split into 2 data-parallel rank(s) x --batch-size 4: give a "
                                         "--batch-size that divides 10"),
              std::string::npos) << e.what();
  }
}
