// Run::share_state (train/run.h): what a process joining an elastic run (Design note [in-process
// recovery], train/elastic.h) takes from the live ranks instead of a checkpoint: the step, the
// learning rate's base and the optimizer state. The parameters come with the
// data-parallel wrapper's broadcast when the model is put under the plan on the new group.
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "dtrain/checkpoint/train_state.h"
#include "dtrain/comm/all_gather.h"
#include "dtrain/comm/broadcast.h"
#include "dtrain/optim/state_dict.h"
#include "dtrain/train/recovery.h"
#include "dtrain/train/run.h"

namespace dtrain::train::detail {

namespace {
// Sharded state (zero1/2, fsdp) came with load_from_peers (Design note [sharded state in
// process], recovery.h): only the step and the learning rate's base remain.
std::pair<int64_t, std::vector<double>> share_header(const comm::ProcessGroup& pg, int64_t step, const std::vector<double>& base) {
  std::vector<double> header{static_cast<double>(step)};
  header.insert(header.end(), base.begin(), base.end());
  at::Tensor h = at::tensor(header, at::kDouble).to(pg.device());
  comm::broadcast(pg, h);
  h = h.to(at::kCPU);
  const auto* got = h.data_ptr<double>();
  return {static_cast<int64_t>(got[0]), std::vector<double>(got + 1, got + h.numel())};
}
}  // namespace

void Run::share_scaling() {
  if (!scaling_.enabled()) return;  // (the plan's: alike on every rank)
  checkpoint::Metadata meta;
  scaling_.save(meta);
  const std::vector<std::string> rows = comm::all_gather_text(session_.pg, nlohmann::json(meta).dump());
  if (session_.elastic->newcomer()) scaling_.load(nlohmann::json::parse(rows.at(0)).get<checkpoint::Metadata>());
}

void Run::share_state() {
  const comm::ProcessGroup& pg = session_.pg;
  const bool newcomer = session_.elastic->newcomer();
  share_scaling();
  if (state_sharded(plan_)) {
    auto [step, base] = share_header(pg, committed_, lr_.base());
    if (!newcomer) return;
    committed_ = start_ = step;
    lr_.set_base(base);
    return;
  }
  torch::optim::Optimizer& opt = strategy_->optimizer();
  std::vector<at::Tensor> params;
  for (const auto& g : opt.param_groups()) params.insert(params.end(), g.params().begin(), g.params().end());
  optim::OptimizerStateDict dict = optim::state_dict_view(opt, params);
  const std::vector<std::string>& fields = optim::state_fields(dict.optimizer);
  // Rank 0's step, each group's base learning rate, and per parameter which state fields it holds.
  std::vector<double> header{static_cast<double>(committed_)};
  for (double lr : lr_.base()) header.push_back(lr);
  for (const auto& p : dict.params) {
    int64_t present = 0;
    for (size_t f = 0; f < fields.size(); ++f) present |= (p && p->tensors.count(fields[f]) ? int64_t{1} << f : 0);
    header.push_back(static_cast<double>(present));
  }
  at::Tensor h = at::tensor(header, at::kDouble).to(pg.device());
  comm::broadcast(pg, h);
  h = h.to(at::kCPU);
  const auto* got = h.data_ptr<double>();
  const size_t groups = lr_.base().size();
  // The state in one coalesced broadcast: the members hold it already (replicated, equal to rank
  // 0's), so theirs are the live tensors, written in place with the same values; a joiner's are new.
  std::vector<at::Tensor> tensors;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto present = static_cast<int64_t>(got[1 + groups + i]);
    if (newcomer) dict.params[i] = present ? std::optional<optim::ParamStateDict>(optim::ParamStateDict{}) : std::nullopt;
    for (size_t f = 0; f < fields.size(); ++f) {
      if (!(present & (int64_t{1} << f))) continue;
      at::Tensor& t = dict.params[i]->tensors[fields[f]];
      if (newcomer) t = fields[f] == "step" ? at::zeros({}, at::kLong) : at::empty_like(params[i], at::MemoryFormat::Contiguous);
      tensors.push_back(t);
    }
  }
  comm::broadcast_coalesced(pg, tensors);
  if (!newcomer) return;
  optim::load_state_dict_into(opt, params, dict);
  committed_ = start_ = static_cast<int64_t>(got[0]);
  lr_.set_base(std::vector<double>(got + 1, got + 1 + groups));  // (the loss scaler: share_scaling, above)
}

}  // namespace dtrain::train::detail
