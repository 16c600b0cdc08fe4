#include "optimizer_part.h"

#include "dtrain/compat.h"

namespace dtrain::train::detail {

std::unique_ptr<OptimizerPart> OptimizerPart::replicated(std::vector<at::Tensor> params, const OptimizerFactory& make,
                                                         int replica) {
  std::unique_ptr<OptimizerPart> o(new OptimizerPart());
  o->plain_ = make({torch::optim::OptimizerParamGroup(params)});
  for (size_t i = 0; i < params.size(); ++i) o->stepped_.push_back(i);
  o->counted_.assign(params.size(), replica == 0);
  o->params_ = std::move(params);
  return o;
}

std::unique_ptr<OptimizerPart> OptimizerPart::sharded(std::vector<at::Tensor> params, const comm::ProcessGroup& group,
                                                      const OptimizerFactory& make) {
  std::unique_ptr<OptimizerPart> o(new OptimizerPart());
  o->sharded_ = std::make_unique<optim::ShardedOptimizer>(
      std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(params)}, group, make);
  o->stepped_ = o->sharded_->partition().by_rank[group.rank()];
  o->counted_.assign(params.size(), false);
  for (size_t i : o->stepped_) o->counted_[i] = true;
  o->params_ = std::move(params);
  return o;
}

void OptimizerPart::zero_grad() {
  if (sharded_) {
    sharded_->zero_grad();
  } else {
    compat::zero_grad_in_place(*plain_);
  }
}

void OptimizerPart::step() {
  if (sharded_) {
    sharded_->step();  // each owner steps its parameters and broadcasts them over the group
  } else {
    plain_->step();
  }
}

std::vector<at::Tensor> OptimizerPart::stepped_params() const {
  std::vector<at::Tensor> out;
  for (size_t i : stepped_) out.push_back(params_[i]);
  return out;
}

optim::OptimizerStateDict OptimizerPart::state_dict() { return optim::state_dict_view(optimizer(), stepped_params()); }

int64_t OptimizerPart::state_bytes() { return optim::state_bytes(optimizer()); }

}  // namespace dtrain::train::detail
