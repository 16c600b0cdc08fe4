#include "dtrain/train/strategy.h"

#include <cstdio>
#include <stdexcept>

#include "dtrain/ddp/comm_hook.h"
#include "dtrain/pipeline/sharded_stages.h"
#include "state/holding.h"
#include "state/optimizer_part.h"

namespace dtrain::train {

Strategy::Strategy(std::shared_ptr<torch::nn::Module> model, parallel::Plan plan, parallel::Groups groups)
    : model_(std::move(model)), plan_(std::move(plan)), groups_(std::move(groups)) {}

Strategy::~Strategy() = default;

void Strategy::set_pipeline(std::unique_ptr<pipeline::Pipeline> p) { pipeline_ = std::move(p); }

void Strategy::set_sharded_stages(std::unique_ptr<pipeline::ShardedStages> s) { stages_ = std::move(s); }

void Strategy::set_parts(std::unique_ptr<detail::OptimizerPart> optimizer, std::unique_ptr<detail::Holding> holding) {
  optimizer_ = std::move(optimizer);
  holding_ = std::move(holding);
}

optim::ShardedOptimizer& Strategy::sharded_optimizer() {
  TORCH_CHECK(optimizer_ && optimizer_->zero(), "this plan's optimizer state is not sharded by owner (zero1, zero2)");
  return *optimizer_->zero();
}

void Strategy::zero_grad() {
  holding_->before_zero_grad();
  optimizer_->zero_grad();
}

double Strategy::clip_grad_norm(double max_norm) { return holding_->clip_grad_norm(*optimizer_, max_norm); }

void Strategy::step() {
  optimizer_->step();
  holding_->after_step();
}

std::vector<at::Tensor> Strategy::grads_held() { return holding_->grads_held(*optimizer_); }

int64_t Strategy::optimizer_state_bytes() { return optimizer_->state_bytes(); }

std::vector<at::Tensor> Strategy::steady_tensors() {
  std::vector<at::Tensor> out = optimizer_->params();
  for (const auto& param : optimizer_->state_dict().params) {
    if (!param) continue;
    for (const auto& [field, t] : param->tensors) out.push_back(t);
  }
  return out;
}

namespace {
// Where a rank's compression state lies in a checkpoint (Design note [gradient compression]).
std::string compression_prefix(int rank) { return "compression/rank" + std::to_string(rank) + "/"; }
}  // namespace

checkpoint::Snapshot Strategy::state_snapshot(Scope scope) {
  checkpoint::Snapshot snap = holding_->snapshot(*optimizer_, scope == Scope::Held);
  if (comm_hook_) {
    for (const auto& [name, t] : comm_hook_->state()) {
      snap.pieces.push_back(checkpoint::whole_piece(compression_prefix(groups_.world.rank()) + name, t));
    }
  }
  return snap;
}

bool Strategy::load_state(const checkpoint::Reader& reader) {
  holding_->load(reader, *optimizer_);
  if (!comm_hook_) return false;
  // Every rank's own state at the same world size (decided from the reader's index, alike on every
  // rank: a hook that started over beside one restored would run other collectives); at another
  // world size, or with a rank's state missing, the state starts over.
  const int world = groups_.world.size();
  bool whole = reader.saved_world_size() == world;
  for (int r = 0; whole && r < world; ++r) whole = !reader.keys_with_prefix(compression_prefix(r)).empty();
  if (!whole) {
    comm_hook_->reset_state();
    return false;
  }
  const std::string prefix = compression_prefix(groups_.world.rank());
  std::vector<std::pair<std::string, at::Tensor>> state;
  for (const auto& key : reader.keys_with_prefix(prefix)) {
    state.emplace_back(key.substr(prefix.size()), reader.read(key).view(reader.info(key).shape));
  }
  comm_hook_->load_state(state);
  return true;
}

void Strategy::continue_compression_at(int64_t step) {
  if (!comm_hook_) return;
  const bool stateful = !comm_hook_->state().empty();
  comm_hook_->load_state({{"step", at::scalar_tensor(step, at::kLong).reshape({1})}});  // (the rest starts over)
  if (stateful && groups_.world.rank() == 0) {
    std::printf("--grad-compression %s: the error feedback and factors start over at %d rank(s), the warm-up "
                "counted from step %lld\n", comm_hook_->name().c_str(), groups_.world.size(), static_cast<long long>(step));
  }
}

std::string Strategy::export_weights(const std::string& path) { return holding_->export_weights(path); }

std::pair<double, double> Strategy::param_sums() { return holding_->param_sums(*optimizer_); }

int64_t Strategy::peak_owned_bytes() { return holding_->peak_owned_bytes(); }

void Strategy::release_model() { holding_->release_model(); }

torch::optim::Optimizer& Strategy::optimizer() { return optimizer_->optimizer(); }

}  // namespace dtrain::train
