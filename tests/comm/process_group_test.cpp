// ProcessGroup::repoint (Design note [a group re-pointed], dtrain/comm/process_group.h): every copy
// of a handle made before goes on over the new group; a group of other places is refused.
#include <gtest/gtest.h>

#include <string>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "dtrain/comm.h"
#include "testing/testing.h"

using namespace dtrain::comm;
using dtrain::testing::error_of;
using dtrain::testing::run_ranks;

namespace {

// A new generation over the same ranks (a group of its own, not a subgroup: its abort signal is new).
ProcessGroup next_generation(const ProcessGroup& pg, const std::string& prefix) {
  return ProcessGroup::create(BackendKind::Gloo, c10::make_intrusive<c10d::PrefixStore>(prefix, pg.store()), pg.rank(),
                              pg.size());
}

}  // namespace

TEST(ProcessGroupRepoint, EveryCopyOfTheHandleGoesOnOverTheNewGroup) {
  run_ranks(4, [](ProcessGroup& pg) {
    ProcessGroup pair = pg.split({{0, 1}, {2, 3}}, "tensor");  // (what a model is built on)
    const ProcessGroup layer = pair;                            // (what one of its layers holds)
    pg.abort_signal()->abort("the job regrouped");             // (the old generation, its subgroups too)
    at::Tensor t = at::full({2}, static_cast<float>(pg.rank() + 1));
    EXPECT_NE(error_of([&] { all_reduce(layer, t); }).find("aborted"), std::string::npos);

    const ProcessGroup fresh = next_generation(pg, "gen1/");
    const ProcessGroup fresh_pair = fresh.split({{0, 1}, {2, 3}}, "tensor");
    const ProcessGroup was = pair.repoint(fresh_pair);
    EXPECT_TRUE(was.abort_signal()->aborted());      // (the state replaced, kept by the caller)
    EXPECT_FALSE(layer.abort_signal()->aborted());   // (the copy made before: the new group's)
    EXPECT_EQ(layer.abort_signal(), fresh.abort_signal());
    all_reduce(layer, t);
    const float sum = pg.rank() < 2 ? 1 + 2 : 3 + 4;
    EXPECT_TRUE(at::equal(t, at::full({2}, sum))) << t;
    EXPECT_EQ(layer.name(), fresh_pair.name());

    // Other places in the group: refused, naming them; the handle stays as it was.
    const ProcessGroup swapped = fresh.split({{1, 0}, {3, 2}}, "tensor");
    const std::string msg = error_of([&] { pair.repoint(swapped); });
    EXPECT_NE(msg.find("re-pointed only at one of the same ranks in the same order"), std::string::npos) << msg;
    EXPECT_NE(error_of([&] { pair.repoint(layer); }).find("already this one"), std::string::npos);
    t.fill_(1);
    all_reduce(layer, t);
    EXPECT_TRUE(at::equal(t, at::full({2}, 2.0f))) << t;
  });
}
