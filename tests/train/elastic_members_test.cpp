// The next generation's members under whole units (Design note [whole units], train/elastic.h):
// survivors whose unit is whole keep their places, joiners come in whole units after them, and
// the ids' order is the layout's rank order (parallel/layout.h) with every survivor keeping its
// stage, shard rank and tensor rank.
#include <gtest/gtest.h>

#include <vector>

#include "dtrain/parallel/layout.h"
#include "dtrain/train/elastic.h"

namespace dtrain::train {
namespace {

Membership generation(std::vector<int> ids, int64_t joiners = 0) {
  Membership m;
  m.generation = 3;
  m.ids = std::move(ids);
  m.baseline = 7;
  m.joiners = joiners;
  return m;
}

TEST(ElasticMembers, UnitsOfOneRankKeepEverySurvivorAndTakeEveryJoiner) {
  const Membership m = choose_members(generation({0, 1, 2}, 1), {0, 2}, {{2, 5, false}, {3, 4, true}, {4, 6, false}}, {});
  EXPECT_EQ(m.generation, 4);
  EXPECT_EQ(m.baseline, 7);
  EXPECT_EQ(m.ids, (std::vector<int>{0, 2, 5, 6}));  // (survivors in their order, joiners in theirs)
  EXPECT_EQ(m.newcomers, (std::vector<int>{5, 6}));
  EXPECT_EQ(m.joiners, 4);  // (the dead one passed over)
}

TEST(ElasticMembers, AShardGroupThatLostAMemberLeavesWhole) {
  // hsdp: replicate 2 x shard 2 over ids 0-3; id 1 lost: unit {0, 1} leaves, {2, 3} goes on.
  const Units hsdp{1, 1, 2};
  const Membership shrunk = choose_members(generation({0, 1, 2, 3}), {0, 2, 3}, {}, hsdp);
  EXPECT_EQ(shrunk.ids, (std::vector<int>{2, 3}));
  EXPECT_TRUE(shrunk.newcomers.empty());
  // One replacement: not a whole unit, it waits (its slot not counted as seen).
  const Membership waiting = choose_members(shrunk, {2, 3}, {{1, 4, false}}, hsdp);
  EXPECT_EQ(waiting.ids, (std::vector<int>{2, 3}));
  EXPECT_EQ(waiting.joiners, 0);
  // Two: a unit, after the survivors' (shard ranks 0 and 1 in their order).
  const Membership grown = choose_members(shrunk, {2, 3}, {{1, 4, false}, {2, 5, false}}, hsdp);
  EXPECT_EQ(grown.ids, (std::vector<int>{2, 3, 4, 5}));
  EXPECT_EQ(grown.newcomers, (std::vector<int>{4, 5}));
  EXPECT_EQ(grown.joiners, 2);
  // A dead one first is passed over; the next alive one waits for its unit.
  const Membership passed = choose_members(shrunk, {2, 3}, {{1, 4, true}, {2, 5, false}}, hsdp);
  EXPECT_EQ(passed.ids, (std::vector<int>{2, 3}));
  EXPECT_EQ(passed.joiners, 1);
  // Every unit broken: no member left, even with a whole unit of joiners waiting (they would hold
  // none of the trained state: the survivors refuse and dtrun restarts from the checkpoint).
  EXPECT_TRUE(choose_members(generation({0, 1, 2, 3}), {0, 3}, {}, hsdp).ids.empty());
  EXPECT_TRUE(choose_members(generation({0, 1, 2, 3}), {0, 3}, {{1, 4, false}, {2, 5, false}}, hsdp).ids.empty());
}

TEST(ElasticMembers, PipelineReplicasKeepTheirStagesAndJoinersFillTheirPlaces) {
  // ddp x pp 2 over 4 ranks: stage 0 = ranks 0, 1, stage 1 = ranks 2, 3; replica r = ranks r, 2 + r.
  const Units pipeline{1, 2, 1};
  const Membership shrunk = choose_members(generation({0, 1, 2, 3}), {0, 1, 3}, {}, pipeline);
  ASSERT_EQ(shrunk.ids, (std::vector<int>{1, 3}));  // (replica 1: its stage 0, then its stage 1)
  const Membership grown = choose_members(shrunk, {1, 3}, {{1, 4, false}, {2, 5, false}}, pipeline);
  ASSERT_EQ(grown.ids, (std::vector<int>{1, 4, 3, 5}));
  // Every survivor's stage is the one it had, by the layout's formula.
  const parallel::Layout before{2, 1, 2, 1}, after_shrink{1, 1, 2, 1}, after_grow{2, 1, 2, 1};
  EXPECT_EQ(before.pipeline_rank(1), after_shrink.pipeline_rank(0));
  EXPECT_EQ(before.pipeline_rank(3), after_shrink.pipeline_rank(1));
  EXPECT_EQ(after_shrink.pipeline_rank(0), after_grow.pipeline_rank(0));  // id 1
  EXPECT_EQ(after_shrink.pipeline_rank(1), after_grow.pipeline_rank(2));  // id 3
  EXPECT_EQ(after_grow.pipeline_rank(1), 0);  // id 4: the joining replica's stage 0
  EXPECT_EQ(after_grow.pipeline_rank(3), 1);  // id 5: its stage 1
}

TEST(ElasticMembers, HybridShardsAroundStagesKeepStageAndShardRank) {
  // hsdp shard 2 x pp 2 over 8 ranks: stage s, data rank d at rank 4s + d; unit = d / 2.
  const Units units{1, 2, 2};
  const Membership shrunk = choose_members(generation({0, 1, 2, 3, 4, 5, 6, 7}), {0, 1, 2, 3, 4, 5, 7}, {}, units);
  // id 6 lost (stage 1, data rank 2: unit 1): unit 1 = ids 2, 3, 6, 7 leaves.
  EXPECT_EQ(shrunk.ids, (std::vector<int>{0, 1, 4, 5}));
}

}  // namespace
}  // namespace dtrain::train
