#include "strategy.h"

#include <stdexcept>

#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "dtrain/ddp/distributed_data_parallel.h"
#include "dtrain/ddp/sharded_data_parallel.h"
#include "dtrain/comm/all_reduce.h"
#include "dtrain/fsdp/fully_sharded_data_parallel.h"
#include "dtrain/fsdp/train_state.h"
#include "dtrain/optim/clip_grad.h"
#include "dtrain/optim/sharded_optimizer.h"
#include "dtrain/optim/state_dict.h"
#include "checkpointing.h"
#include "device.h"

namespace gpt_demo {

using namespace dtrain;

namespace {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const Options& o,
                                                        std::vector<torch::optim::OptimizerParamGroup> groups) {
  if (o.optimizer == "sgd") {
    return std::make_unique<torch::optim::SGD>(std::move(groups), torch::optim::SGDOptions(o.lr).momentum(0.9));
  }
  return std::make_unique<torch::optim::AdamW>(std::move(groups), torch::optim::AdamWOptions(o.lr).weight_decay(0.01));
}

std::vector<torch::optim::OptimizerParamGroup> one_group(const models::GPT& m) {
  return {torch::optim::OptimizerParamGroup(m->parameters())};
}

// single and ddp: a plain optimizer over full gradients (identical on every rank under DDP).
class Replicated : public Strategy {
 public:
  Replicated(const Options& o, const comm::ProcessGroup& pg, models::GPT m)
      : Strategy(m), optimizer_(make_optimizer(o, one_group(m))), rank_(pg.rank()), world_(pg.size()) {
    if (o.strategy == "ddp") {
      ddp_ = std::make_unique<ddp::DistributedDataParallel<models::GPT>>(
          m, pg, ddp::DistributedDataParallelOptions().bucket_cap_mb(o.bucket_cap_mb));
    }
  }
  at::Tensor loss(const at::Tensor& x, const at::Tensor& y) override {
    return ddp_ ? models::gpt_loss((*ddp_)->forward(x), y) : model_->loss(x, y);
  }
  std::shared_ptr<void> no_sync() override {
    if (!ddp_) return nullptr;
    return std::make_shared<ddp::DataParallelState::NoSyncGuard>((*ddp_)->no_sync());
  }
  void zero_grad() override { optimizer_->zero_grad(); }
  double clip_grad_norm(double max_norm) override {
    return torch::nn::utils::clip_grad_norm_(model_->parameters(), max_norm);
  }
  void step() override { optimizer_->step(); }
  std::vector<at::Tensor> grads_held() override { return model_->parameters(); }
  int64_t optimizer_state_bytes() override { return optim::state_bytes(*optimizer_); }
  // Replicated state: each rank writes 1/W of the model and of the optimizer state.
  checkpoint::Snapshot state_snapshot() override {
    const auto params = model_->parameters();
    return checkpoint::snapshot_model(*model_, rank_, world_)
        .add(checkpoint::snapshot_optimizer(*optimizer_, checkpoint::param_names(*model_, params), params, rank_, world_));
  }
  void load_state(const checkpoint::Reader& reader) override {
    const auto params = model_->parameters();
    checkpoint::load_model(reader, *model_);
    checkpoint::load_optimizer(reader, *optimizer_, checkpoint::param_names(*model_, params), params);
  }

 private:
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::unique_ptr<ddp::DistributedDataParallel<models::GPT>> ddp_;
  int rank_, world_;
};

// zero1: DDP (full gradients everywhere) + optimizer state sharded by parameter.
// zero2: gradients reduce-scattered to their owners (ShardedDataParallel) + the same sharded optimizer.
class Sharded : public Strategy {
 public:
  Sharded(const Options& o, const comm::ProcessGroup& pg, models::GPT m)
      : Strategy(m),
        optimizer_(one_group(m), pg, [o](std::vector<torch::optim::OptimizerParamGroup> g) {
          return make_optimizer(o, std::move(g));
        }) {
    if (o.strategy == "zero1") {
      ddp_ = std::make_unique<ddp::DistributedDataParallel<models::GPT>>(
          m, pg, ddp::DistributedDataParallelOptions().bucket_cap_mb(o.bucket_cap_mb));
    } else {
      sdp_ = std::make_unique<ddp::ShardedDataParallel<models::GPT>>(
          m, pg, optimizer_, ddp::ShardedDataParallelOptions().bucket_cap_mb(o.bucket_cap_mb));
    }
  }
  at::Tensor loss(const at::Tensor& x, const at::Tensor& y) override {
    return models::gpt_loss(ddp_ ? (*ddp_)->forward(x) : (*sdp_)->forward(x), y);
  }
  std::shared_ptr<void> no_sync() override {
    if (ddp_) return std::make_shared<ddp::DataParallelState::NoSyncGuard>((*ddp_)->no_sync());
    using Guard = decltype((*sdp_)->no_sync());
    return std::make_shared<Guard>((*sdp_)->no_sync());
  }
  void zero_grad() override { optimizer_.zero_grad(); }
  double clip_grad_norm(double max_norm) override { return optim::clip_grad_norm(optimizer_, max_norm); }
  void step() override { optimizer_.step(); }
  // zero1 holds every gradient (DDP) but steps only its own; zero2 holds only its own.
  std::vector<at::Tensor> grads_held() override {
    const auto& pg = optimizer_.process_group();
    std::vector<at::Tensor> owned;
    for (size_t i : optimizer_.partition().by_rank[pg.rank()]) owned.push_back(optimizer_.params()[i]);
    return owned;
  }
  int64_t optimizer_state_bytes() override { return optim::state_bytes(optimizer_.local()); }
  // The model split among the ranks; each owner writes its parameters' optimizer state whole.
  // Loading reads the state of the parameters this rank owns now (any saved world size).
  checkpoint::Snapshot state_snapshot() override {
    const auto& pg = optimizer_.process_group();
    return checkpoint::snapshot_model(*model_, pg.rank(), pg.size())
        .add(checkpoint::snapshot_optimizer(optimizer_, checkpoint::param_names(*model_, optimizer_.params())));
  }
  void load_state(const checkpoint::Reader& reader) override {
    checkpoint::load_model(reader, *model_);
    checkpoint::load_optimizer(reader, optimizer_, checkpoint::param_names(*model_, optimizer_.params()));
  }

 private:
  optim::ShardedOptimizer optimizer_;
  std::unique_ptr<ddp::DistributedDataParallel<models::GPT>> ddp_;
  std::unique_ptr<ddp::ShardedDataParallel<models::GPT>> sdp_;
};

// fsdp / hsdp: FullyShardedDataParallel, one unit per transformer block (--wrap block) plus the
// root (embeddings, final norm, head); the optimizer steps this rank's flat fp32 shards. bf16/fp16:
// parameters gathered and computed in that dtype, gradients reduced in fp32, logits returned in
// fp32. --cpu-offload keeps the shards and the optimizer on the CPU (for a model on a GPU).
class FullySharded : public Strategy {
 public:
  FullySharded(const Options& o, const comm::ProcessGroup& pg, models::GPT m)
      : Strategy(m), model_fsdp_(m, pg, fsdp_options(o, m)) {
    optimizer_ = make_optimizer(o, {torch::optim::OptimizerParamGroup(model_fsdp_->parameters())});
  }
  at::Tensor loss(const at::Tensor& x, const at::Tensor& y) override {
    return models::gpt_loss(model_fsdp_->forward(x), y);
  }
  std::shared_ptr<void> no_sync() override {
    return std::make_shared<fsdp::FullyShardedState::NoSyncGuard>(model_fsdp_->no_sync());
  }
  void zero_grad() override { optimizer_->zero_grad(); }
  double clip_grad_norm(double max_norm) override { return model_fsdp_->clip_grad_norm(max_norm); }
  void step() override { optimizer_->step(); }
  std::vector<at::Tensor> grads_held() override { return model_fsdp_->parameters(); }
  int64_t optimizer_state_bytes() override { return optim::state_bytes(*optimizer_); }
  int64_t peak_owned_bytes() override { return model_fsdp_->state().peak_owned_bytes(); }
  std::pair<double, double> param_sums() override {
    // Padding in the shards is zero; every element is held once per shard group.
    double sums[2] = {0, 0};
    for (const auto& s : model_fsdp_->state().shards()) {
      auto d = s.detach().to(at::kDouble);
      sums[0] += d.sum().item<double>();
      sums[1] += d.pow(2).sum().item<double>();
    }
    const auto& shard_group = model_fsdp_->state().groups().shard;
    auto t = at::tensor(std::vector<double>{sums[0], sums[1]}, at::kDouble).to(shard_group.device());
    comm::all_reduce(shard_group, t);
    t = t.to(at::kCPU);
    return {t[0].item<double>(), t[1].item<double>()};
  }
  checkpoint::Snapshot state_snapshot() override {
    return fsdp::snapshot_model(model_fsdp_->state()).add(fsdp::snapshot_optimizer(model_fsdp_->state(), *optimizer_));
  }
  void load_state(const checkpoint::Reader& reader) override {
    fsdp::load_model(reader, model_fsdp_->state());
    fsdp::load_optimizer(reader, model_fsdp_->state(), *optimizer_);
  }
  // Streamed one FlatParam at a time as it is gathered: rank 0 holds at most one unit beyond its shards.
  std::string export_weights(const std::string& path, const comm::ProcessGroup&) override {
    return model_fsdp_->state().export_full_weights(path, /*rank=*/0);
  }

 private:
  static fsdp::FullyShardedOptions fsdp_options(const Options& o, const models::GPT& m) {
    auto opts = fsdp::FullyShardedOptions().sharding(fsdp::parse_sharding(o.sharding));
    if (o.wrap == "block") opts.wrap_policy(fsdp::WrapPolicy::by_type<models::GPTBlockImpl>());
    if (o.shard_size > 0) opts.hybrid_layout(fsdp::MeshLayout{0, o.shard_size});
    if (!o.backward_prefetch.empty()) opts.backward_prefetch(fsdp::parse_backward_prefetch(o.backward_prefetch));
    if (!o.overlap_reduction.empty()) opts.overlap_reduction(o.overlap_reduction == "on");
    if (o.max_gathered_units > 0) opts.max_gathered_units(o.max_gathered_units);
    if (o.precision != "fp32") {
      // bf16 or fp16: gathered parameters (so forward and backward) in that dtype, gradients reduced
      // in fp32 (Design note [fp32 reduction] in device.h), logits returned in fp32.
      opts.mixed_precision(fsdp::MixedPrecision().param_dtype(compute_dtype(o)).reduce_dtype(at::kFloat)
                               .output_dtype(at::kFloat));
    }
    // Master shards, gradients and optimizer state on the CPU; a no-op for a model on the CPU.
    opts.cpu_offload(o.cpu_offload);
    if (o.init_on_ranks) opts.param_init_fn(m->initializer(o.seed));
    return opts;
  }
  fsdp::FullyShardedDataParallel<models::GPT> model_fsdp_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
};

}  // namespace

std::pair<double, double> Strategy::param_sums() {
  double checksum = 0, sq = 0;
  for (const auto& p : model_->parameters()) {
    auto d = p.detach().to(at::kDouble);
    checksum += d.sum().item<double>();
    sq += d.pow(2).sum().item<double>();
  }
  return {checksum, sq};
}

std::string Strategy::export_weights(const std::string& path, const comm::ProcessGroup& pg) {
  return pg.rank() == 0 ? export_module_weights(*model_, path) : "";
}

std::unique_ptr<Strategy> make_strategy(const Options& o, const comm::ProcessGroup& pg, models::GPT model) {
  if (o.strategy == "single") {
    if (pg.size() != 1) {
      throw std::invalid_argument("--strategy single trains in one process, but WORLD_SIZE is " +
                                  std::to_string(pg.size()) + ": use --strategy ddp, or run without a launcher");
    }
    return std::make_unique<Replicated>(o, pg, std::move(model));
  }
  if (o.strategy == "ddp") return std::make_unique<Replicated>(o, pg, std::move(model));
  if (o.strategy == "zero1" || o.strategy == "zero2") return std::make_unique<Sharded>(o, pg, std::move(model));
  if (o.strategy == "fsdp" || o.strategy == "hsdp") return std::make_unique<FullySharded>(o, pg, std::move(model));
  throw std::invalid_argument("unknown strategy '" + o.strategy + "'");
}

}  // namespace gpt_demo
