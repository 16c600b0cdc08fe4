// Run::share_state (train/run.h): what a process joining an elastic run (Design note [in-process
// recovery], train/elastic.h) takes from the live ranks instead of a checkpoint: the step, the
// learning rate's base, the loss scaler and the optimizer state. The parameters come with the
// data-parallel wrapper's broadcast when the model is put under the plan on the new group.
#include <cstring>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "dtrain/comm/broadcast.h"
#include "dtrain/optim/state_dict.h"
#include "dtrain/train/run.h"

namespace dtrain::train::detail {

namespace {
// rank 0's text to every rank of `pg` (its length first).
std::string broadcast_text(const comm::ProcessGroup& pg, const std::string& text) {
  at::Tensor n = at::tensor(std::vector<int64_t>{static_cast<int64_t>(text.size())}, at::kLong).to(pg.device());
  comm::broadcast(pg, n);
  const int64_t size = n.to(at::kCPU).item<int64_t>();
  at::Tensor bytes = at::empty({size}, at::kByte);
  if (pg.rank() == 0) std::memcpy(bytes.data_ptr(), text.data(), static_cast<size_t>(size));
  bytes = bytes.to(pg.device());
  comm::broadcast(pg, bytes);
  bytes = bytes.to(at::kCPU);
  return std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(size));
}

std::string encode(const checkpoint::Metadata& meta) {
  std::string out;
  for (const auto& [k, v] : meta) out += k + '\n' + v + '\n';
  return out;
}
checkpoint::Metadata decode(const std::string& text) {
  checkpoint::Metadata meta;
  size_t at = 0;
  while (at < text.size()) {
    const size_t k_end = text.find('\n', at), v_end = text.find('\n', k_end + 1);
    meta[text.substr(at, k_end - at)] = text.substr(k_end + 1, v_end - k_end - 1);
    at = v_end + 1;
  }
  return meta;
}
}  // namespace

void Run::share_state() {
  const comm::ProcessGroup& pg = session_.pg;
  const bool root = pg.rank() == 0;
  torch::optim::Optimizer& opt = strategy_->optimizer();
  std::vector<at::Tensor> params;
  for (const auto& g : opt.param_groups()) params.insert(params.end(), g.params().begin(), g.params().end());
  optim::OptimizerStateDict dict = root ? optim::state_dict_view(opt, params) : optim::state_dict_of(opt, params);
  const std::vector<std::string>& fields = optim::state_fields(dict.optimizer);
  // The step, each group's base learning rate, and per parameter which state fields rank 0 holds.
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
  checkpoint::Metadata meta;
  scaling_.save(meta);
  const checkpoint::Metadata scaler = decode(broadcast_text(pg, encode(meta)));
  const size_t groups = lr_.base().size();
  for (size_t i = 0; i < params.size(); ++i) {
    const auto present = static_cast<int64_t>(got[1 + groups + i]);
    if (!root) dict.params[i] = present ? std::optional<optim::ParamStateDict>(optim::ParamStateDict{}) : std::nullopt;
    for (size_t f = 0; f < fields.size(); ++f) {
      if (!(present & (int64_t{1} << f))) continue;
      at::Tensor t = root ? dict.params[i]->tensors.at(fields[f]).contiguous()
                          : (fields[f] == "step" ? at::zeros({}, at::kLong) : at::empty_like(params[i], at::MemoryFormat::Contiguous));
      at::Tensor wire = t.to(pg.device());
      comm::broadcast(pg, wire);
      if (!root) dict.params[i]->tensors[fields[f]] = wire.to(t.device());
    }
  }
  if (root) return;
  optim::load_state_dict_into(opt, params, dict);
  committed_ = start_ = static_cast<int64_t>(got[0]);
  lr_.set_base(std::vector<double>(got + 1, got + 1 + groups));
  scaling_.load(scaler);
}

}  // namespace dtrain::train::detail
