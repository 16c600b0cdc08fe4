// TensorHolding: a rank's parameters as tensors of the model (single, dp, ddp, zero1, zero2; and
// the same around pipeline stages), whole or tensor-parallel pieces (holding.h).
//
// Who counts and who writes: the data-parallel replicas of a tensor hold equal values (ZeRO's
// owners step them and broadcast), so in norms and sums each element is counted once over the
// world: by the tensor rank that holds its piece (a whole tensor: tensor rank 0) on the replica
// that steps it (a replicated optimizer: data rank 0; ZeRO: the owner). In checkpoints every
// tensor is written in full (pieces gathered over the tensor group), split among the D x T ranks
// that hold it; ZeRO's optimizer state by its owner's tensor group.
#include <unordered_map>
#include <unordered_set>

#include <ATen/ATen.h>

#include "dtrain/checkpoint/piece.h"
#include "dtrain/checkpoint/streaming_writer.h"
#include "dtrain/comm/all_reduce.h"
#include "dtrain/optim/clip_grad.h"
#include "holding.h"

namespace dtrain::train::detail {

NamedTensors unique_tensors(const NamedTensors& named) {
  NamedTensors out;
  std::unordered_set<const void*> seen;
  for (const auto& [name, t] : named) {
    if (seen.insert(t.unsafeGetTensorImpl()).second) out.emplace_back(name, t);
  }
  return out;
}

NamedTensors named_parameters(const torch::nn::Module& m) {
  NamedTensors out;
  for (const auto& p : m.named_parameters()) out.emplace_back(p.key(), p.value());
  return out;
}

NamedTensors named_buffers(const torch::nn::Module& m) {
  NamedTensors out;
  for (const auto& b : m.named_buffers()) out.emplace_back(b.key(), b.value());
  return out;
}

std::pair<double, double> sums_over(const comm::ProcessGroup& group, const std::vector<at::Tensor>& tensors) {
  double sums[2] = {0, 0};
  for (const auto& t : tensors) {
    auto d = t.detach().to(at::kDouble);
    sums[0] += d.sum().item<double>();
    sums[1] += d.pow(2).sum().item<double>();
  }
  auto t = at::tensor(std::vector<double>{sums[0], sums[1]}, at::kDouble).to(group.device());
  comm::all_reduce(group, t);
  t = t.to(at::kCPU);
  return {t[0].item<double>(), t[1].item<double>()};
}

checkpoint::Pieces pieces_of(const Cut& cut) {
  checkpoint::Pieces pieces;
  if (!cut) return pieces;
  const tensor_parallel::Plan plan = *cut;
  pieces.full_shape = [plan](const std::string& name, const at::Tensor& local) {
    return plan.full_shape(name, local.sizes().vec());
  };
  pieces.piece = [plan](const std::string& name, const at::Tensor& full) { return plan.piece(name, full); };
  return pieces;
}

at::Tensor full_of(const Cut& cut, const std::string& name, const at::Tensor& t) {
  return cut && cut->is_cut(name) ? cut->full(name, t) : t.detach();
}

namespace {

class TensorHolding : public Holding {
 public:
  TensorHolding(std::shared_ptr<torch::nn::Module> model, NamedTensors params, NamedTensors buffers,
                const parallel::Groups& groups, Cut cut, std::unique_ptr<WholeModel> whole)
      : model_(std::move(model)), params_(std::move(params)), stepped_(unique_tensors(params_)),
        buffers_(std::move(buffers)), groups_(groups), cut_(std::move(cut)), whole_(std::move(whole)) {}

  std::vector<at::Tensor> grads_held(OptimizerPart& opt) override { return opt.stepped_params(); }

  double clip_grad_norm(OptimizerPart& opt, double max_norm) override {
    std::vector<at::Tensor> counted, scaled;
    for (size_t i = 0; i < stepped_.size(); ++i) {
      const at::Tensor& g = stepped_[i].second.grad();
      if (g.defined() && counts(opt, i)) counted.push_back(g);
    }
    for (const auto& p : grads_held(opt)) {
      if (p.grad().defined()) scaled.push_back(p.grad());
    }
    return optim::clip_grads(groups_.world, counted, scaled, max_norm);
  }

  std::pair<double, double> param_sums(OptimizerPart& opt) override {
    std::vector<at::Tensor> mine;
    for (size_t i = 0; i < stepped_.size(); ++i) {
      if (counts(opt, i)) mine.push_back(stepped_[i].second);
    }
    return sums_over(groups_.world, mine);
  }

  checkpoint::Snapshot snapshot(OptimizerPart& opt, bool held) override;
  // (a pipeline rank: the other stages' parameters back in full shapes, so that the model can be
  // put under a plan again; their values come with the next load)
  void release_model() override {
    if (whole_) whole_->materialize();
  }
  void load(const checkpoint::Reader& reader, OptimizerPart& opt) override;
  std::string export_weights(const std::string& path) override;

 private:
  bool counts(OptimizerPart& opt, size_t i) const {
    return opt.counts(i) && (cut_ ? cut_->counts(stepped_[i].first) : groups_.tensor.rank() == 0);
  }
  // This rank's share of the tensors every rank of its stage holds: D x T writers.
  int writer() const { return groups_.data.rank() * groups_.tensor.size() + groups_.tensor.rank(); }
  int writers() const { return groups_.data.size() * groups_.tensor.size(); }

  std::shared_ptr<torch::nn::Module> model_;
  NamedTensors params_;   // under every name
  NamedTensors stepped_;  // each tensor once: the optimizer's params, in order
  NamedTensors buffers_;
  const parallel::Groups& groups_;
  Cut cut_;
  std::unique_ptr<WholeModel> whole_;  // pipeline stages: the rest of the model
};

checkpoint::Snapshot TensorHolding::snapshot(OptimizerPart& opt, bool held) {
  checkpoint::Snapshot s;
  const int w = held ? 0 : writer(), ws = held ? 1 : writers();  // (held: every tensor whole)
  auto add = [&](const std::string& name, const at::Tensor& full, int w, int ws) {
    if (auto piece = checkpoint::replicated_piece(checkpoint::model_key(name), full, w, ws)) {
      s.pieces.push_back(std::move(*piece));
    }
  };
  for (const auto& [name, p] : params_) add(name, full_of(cut_, name, p), w, ws);
  for (const auto& [name, b] : buffers_) add(name, b.detach(), w, ws);
  // The optimizer's state of what this rank steps, in full (pieces gathered over the tensor group:
  // ZeRO's owners of one parameter are the same data rank on every tensor rank).
  optim::OptimizerStateDict dict = opt.state_dict();
  std::vector<std::string> names;
  for (size_t k = 0; k < opt.stepped().size(); ++k) {
    const auto& [name, p] = stepped_[opt.stepped()[k]];
    names.push_back(name);
    if (!dict.params[k] || !cut_ || !cut_->is_cut(name)) continue;
    for (auto& [field, t] : dict.params[k]->tensors) {
      if (t.sizes() == p.sizes()) t = cut_->full(name, t);
    }
  }
  const bool replicated = !opt.is_sharded();
  return s.add(checkpoint::snapshot_optimizer(dict, names, replicated ? w : held ? 0 : groups_.tensor.rank(),
                                              replicated ? ws : held ? 1 : groups_.tensor.size()));
}

void TensorHolding::load(const checkpoint::Reader& reader, OptimizerPart& opt) {
  // The whole model, every key checked against it (a pipeline's other stages read and dropped).
  const checkpoint::Pieces pieces = pieces_of(cut_);
  if (whole_) whole_->materialize();
  checkpoint::load_model(reader, *model_, pieces);
  if (whole_) whole_->release();
  const NamedTensors all = unique_tensors(named_parameters(*model_));
  std::vector<std::string> all_names;
  std::vector<at::Tensor> all_params;
  std::unordered_map<const void*, size_t> index;
  for (const auto& [name, p] : all) {
    index.emplace(p.unsafeGetTensorImpl(), all_params.size());
    all_names.push_back(name);
    all_params.push_back(p);
  }
  std::vector<size_t> mine;  // in the optimizer's order
  for (const auto& p : opt.stepped_params()) {
    auto it = index.find(p.unsafeGetTensorImpl());
    TORCH_CHECK(it != index.end(), "a parameter the optimizer steps is not a parameter of the model");
    mine.push_back(it->second);
  }
  checkpoint::load_optimizer(reader, opt.optimizer(), all_names, all_params, mine, pieces);
}

std::string TensorHolding::export_weights(const std::string& path) {
  if (whole_) whole_->gather();
  NamedTensors tensors;
  for (const auto& [name, p] : unique_tensors(named_parameters(*model_))) tensors.emplace_back(name, full_of(cut_, name, p));
  for (const auto& [name, b] : named_buffers(*model_)) tensors.emplace_back(name, b.detach());
  const std::string out = groups_.world.rank() == 0 ? checkpoint::export_named_weights(tensors, path) : "";
  if (whole_) whole_->release();
  return out;
}

}  // namespace

std::unique_ptr<Holding> tensor_holding(std::shared_ptr<torch::nn::Module> model, NamedTensors params,
                                        NamedTensors buffers, const parallel::Groups& groups, Cut cut,
                                        std::unique_ptr<WholeModel> whole) {
  return std::make_unique<TensorHolding>(std::move(model), std::move(params), std::move(buffers), groups,
                                         std::move(cut), std::move(whole));
}

}  // namespace dtrain::train::detail
