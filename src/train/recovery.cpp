// Between a failed step and the step it redoes (train/recovery.h, Design note [in-process recovery]).
#include "dtrain/train/recovery.h"

#include <chrono>
#include <stdexcept>

#include <torch/optim/optimizer.h>

#include "dtrain/comm/types.h"
#include "dtrain/train/plan.h"
#include "state/optimizer_part.h"

namespace dtrain::train::detail {

bool recoverable(const std::exception& e, const Session& session) {
  if (dynamic_cast<const LeftOut*>(&e)) return false;  // (the others went on without this rank)
  return dynamic_cast<const comm::CommError*>(&e) != nullptr || session.pg.abort_signal()->aborted();
}

void regroup_session(Session& session, const std::string& why, int64_t next_step) {
  if (!why.empty() && !session.pg.abort_signal()->aborted()) session.elastic->report_failure(why);
  session.pg = session.elastic->regroup(next_step);
  session.launch.rank = session.pg.rank();
  session.launch.world_size = session.pg.size();
}

void move_optimizer_state(Strategy& from, Strategy& to) {
  TORCH_CHECK(!from.optimizer_part().is_sharded() && !to.optimizer_part().is_sharded(),
              "--elastic: the optimizer state is sharded (ZeRO): a lost rank's part is not on the survivors");
  torch::optim::Optimizer& a = from.optimizer();
  torch::optim::Optimizer& b = to.optimizer();
  TORCH_CHECK(a.param_groups().size() == b.param_groups().size(), "--elastic: the rebuilt optimizer has ",
              b.param_groups().size(), " parameter groups, ", a.param_groups().size(), " before");
  for (size_t g = 0; g < a.param_groups().size(); ++g) {
    const auto& pa = a.param_groups()[g].params();
    const auto& pb = b.param_groups()[g].params();
    TORCH_CHECK(pa.size() == pb.size(), "--elastic: parameter group ", g, " has ", pb.size(), " parameters, ", pa.size(),
                " before");
    for (size_t i = 0; i < pa.size(); ++i) {
      TORCH_CHECK(pa[i].is_same(pb[i]), "--elastic: parameter ", i, " of group ", g,
                  " is another tensor after regrouping (the model's parameters must stay the same tensors)");
    }
  }
  std::swap(a.state(), b.state());
}

}  // namespace dtrain::train::detail
