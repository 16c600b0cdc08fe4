// ShardHolding: a rank's parameters as flat shards, FSDP's (fsdp, hsdp) or its pipeline stages'
// (pipeline::ShardedStages), whole or tensor-parallel pieces (holding.h). The optimizer steps the
// trainable shards. Each rank writes the ranges its shards hold (fsdp/train_state.h; in full-tensor
// coordinates with tensor parallelism, Design note [TP inside FSDP]); norms and sums count what the
// writing view holds, so each element once over the world (hybrid replicas and whole parameters
// on tensor ranks other than 0 are left out).
#include <set>

#include <ATen/ATen.h>

#include "dtrain/checkpoint/piece.h"
#include "dtrain/checkpoint/streaming_writer.h"
#include "dtrain/fsdp/fully_sharded_data_parallel.h"
#include "dtrain/fsdp/train_state.h"
#include "dtrain/optim/clip_grad.h"
#include "dtrain/pipeline/sharded_stages.h"
#include "dtrain/tensor_parallel/sharded.h"
#include "holding.h"

namespace dtrain::train::detail {
namespace {

// The shared part: the view, the ranges counted, the optimizer's state.
class ShardHolding : public Holding {
 public:
  ShardHolding(const parallel::Groups& groups, Cut cut) : groups_(groups), cut_(std::move(cut)) {}

  std::vector<at::Tensor> grads_held(OptimizerPart& opt) override { return opt.params(); }

  double clip_grad_norm(OptimizerPart& opt, double max_norm) override {
    std::vector<at::Tensor> counted, scaled;
    const fsdp::ShardView v = local_view();
    for (const auto& [flat, range] : ranges_counted(v)) {
      const at::Tensor& g = v.shards[flat].grad();
      if (g.defined()) counted.push_back(g.narrow(0, range.first, range.second));
    }
    for (const auto& t : opt.params()) {
      if (t.grad().defined()) scaled.push_back(t.grad());
    }
    return optim::clip_grads(groups_.world, counted, scaled, max_norm);
  }

  std::pair<double, double> param_sums(OptimizerPart&) override {
    std::vector<at::Tensor> mine;
    const fsdp::ShardView v = local_view();
    for (const auto& [flat, range] : ranges_counted(v)) mine.push_back(v.shards[flat].narrow(0, range.first, range.second));
    return sums_over(groups_.world, mine);
  }

  checkpoint::Snapshot snapshot(OptimizerPart& opt, bool held) override {
    fsdp::ShardView v = view(true);
    v.writes = v.writes || held;  // (held: the other replicas' shards too)
    checkpoint::Snapshot s;
    s.pieces = fsdp::snapshot_params(v);
    if (groups_.tensor.rank() == 0 || held) {  // buffers are whole: tensor rank 0's data-parallel ranks write 1/D each
      for (const auto& [name, b] : buffers()) {
        if (auto p = checkpoint::replicated_piece(checkpoint::model_key(name), b.detach(), held ? 0 : groups_.data.rank(),
                                                  held ? 1 : groups_.data.size())) {
          s.pieces.push_back(std::move(*p));
        }
      }
    }
    return s.add(fsdp::snapshot_optimizer(v, opt.optimizer()));
  }

 protected:
  virtual fsdp::ShardView local_view() const = 0;
  virtual NamedTensors buffers() const = 0;
  // In full-tensor coordinates (writing: each element on one rank).
  fsdp::ShardView view(bool writing) const {
    return cut_ ? tensor_parallel::full_view(local_view(), *cut_, writing) : local_view();
  }
  // (shard index, (offset, count)) of the ranges this rank counts: what it writes, in the shards'
  // own coordinates; a tied parameter's range (listed under each of its names) once.
  std::vector<std::pair<size_t, std::pair<int64_t, int64_t>>> ranges_counted(const fsdp::ShardView& v) const {
    std::vector<std::pair<size_t, std::pair<int64_t, int64_t>>> out;
    if (!v.writes) return out;
    std::set<std::pair<size_t, int64_t>> seen;
    for (const auto& sl : v.slices) {
      if (cut_ && !cut_->counts(sl.name)) continue;
      if (!seen.insert({sl.flat, sl.shard_offset}).second) continue;
      out.push_back({sl.flat, {sl.shard_offset, sl.count}});
    }
    return out;
  }

  const parallel::Groups& groups_;
  Cut cut_;
};

// FSDP's wrapper over the whole model.
class FsdpHolding : public ShardHolding {
 public:
  FsdpHolding(std::shared_ptr<torch::nn::Module> model, fsdp::FullyShardedState& state, const parallel::Groups& groups,
              Cut cut)
      : ShardHolding(groups, std::move(cut)), model_(std::move(model)), state_(state) {}

  double clip_grad_norm(OptimizerPart& opt, double max_norm) override {
    if (!cut_) return state_.clip_grad_norm(max_norm, 2.0);  // (FSDP's own: offloaded shards too)
    return ShardHolding::clip_grad_norm(opt, max_norm);
  }
  int64_t peak_owned_bytes() override { return state_.peak_owned_bytes(); }
  void release_model() override { state_.release_module(); }

  void load(const checkpoint::Reader& reader, OptimizerPart& opt) override {
    if (cut_) {
      tensor_parallel::load_model(reader, state_, *cut_);
    } else {
      fsdp::load_model(reader, state_);
    }
    fsdp::load_optimizer(reader, view(false), opt.optimizer());
  }

  std::string export_weights(const std::string& path) override {
    if (!cut_) return state_.export_full_weights(path, 0);
    // Data-parallel rank 0 of every tensor rank gets its pieces whole (one unit at a time), then
    // the full tensors over its tensor group (those ranks make one).
    const auto dict = state_.full_state_dict(0);
    if (dict.is_empty()) return "";
    NamedTensors tensors;
    for (const auto& [name, p] : unique_tensors(named_parameters(*model_))) tensors.emplace_back(name, cut_->full(name, dict[name]));
    for (const auto& [name, b] : state_.buffers()) tensors.emplace_back(name, dict[name]);
    return groups_.world.rank() == 0 ? checkpoint::export_named_weights(tensors, path) : "";
  }

 protected:
  fsdp::ShardView local_view() const override { return fsdp::shard_view(state_); }
  NamedTensors buffers() const override { return state_.buffers(); }

 private:
  std::shared_ptr<torch::nn::Module> model_;
  fsdp::FullyShardedState& state_;
};

// The pipeline stages of this rank, each one flat parameter gathered for the whole step (Design
// note [sharded stages], pipeline/sharded_stages.h).
class StagesHolding : public ShardHolding {
 public:
  StagesHolding(pipeline::ShardedStages& stages, NamedTensors buffers, const parallel::Groups& groups, Cut cut,
                std::unique_ptr<WholeModel> whole)
      : ShardHolding(groups, std::move(cut)), stages_(stages), buffers_(std::move(buffers)), whole_(std::move(whole)) {}

  void before_zero_grad() override { stages_.reshard(); }  // (after a skipped step the stages are still gathered)
  void after_step() override { stages_.reshard(); }
  // (every stage's parameters back in full shapes, this rank's (empty placeholders while sharded)
  // and the others', so that the model can be put under a plan again; the values come with the
  // next load)
  void release_model() override {
    stages_.release();
    whole_->materialize();
  }

  void load(const checkpoint::Reader& reader, OptimizerPart& opt) override {
    // The whole model, every key checked against it (the other stages' values read and dropped).
    stages_.gather();
    whole_->materialize();
    checkpoint::load_model(reader, whole_->module(), pieces_of(cut_));
    whole_->release();
    stages_.store_gathered_values();
    stages_.reshard();
    fsdp::load_optimizer(reader, view(false), opt.optimizer());
  }

  std::string export_weights(const std::string& path) override {
    const bool gathered_here = stages_.state() == pipeline::ShardedStages::State::Sharded;
    stages_.gather();
    whole_->gather();
    NamedTensors tensors;
    for (const auto& [name, p] : unique_tensors(named_parameters(whole_->module()))) tensors.emplace_back(name, full_of(cut_, name, p));
    for (const auto& [name, b] : named_buffers(whole_->module())) tensors.emplace_back(name, b.detach());
    const std::string out = groups_.world.rank() == 0 ? checkpoint::export_named_weights(tensors, path) : "";
    whole_->release();
    if (gathered_here) stages_.reshard();
    return out;
  }

 protected:
  fsdp::ShardView local_view() const override { return stages_.view(); }
  NamedTensors buffers() const override { return buffers_; }

 private:
  pipeline::ShardedStages& stages_;
  NamedTensors buffers_;
  std::unique_ptr<WholeModel> whole_;
};

}  // namespace

std::unique_ptr<Holding> fsdp_holding(std::shared_ptr<torch::nn::Module> model, fsdp::FullyShardedState& state,
                                      const parallel::Groups& groups, Cut cut) {
  return std::make_unique<FsdpHolding>(std::move(model), state, groups, std::move(cut));
}

std::unique_ptr<Holding> stages_holding(pipeline::ShardedStages& stages, NamedTensors buffers,
                                        const parallel::Groups& groups, Cut cut, std::unique_ptr<WholeModel> whole) {
  return std::make_unique<StagesHolding>(stages, std::move(buffers), groups, std::move(cut), std::move(whole));
}

}  // namespace dtrain::train::detail
