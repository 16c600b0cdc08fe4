#include "dtrain/pipeline/sharded_stages.h"

#include <stdexcept>
#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace dtrain::pipeline {

ShardedStages::ShardedStages(const std::vector<Stage>& stages, const parallel::Groups& groups) : groups_(groups) {
  for (size_t s = 0; s < stages.size(); ++s) {
    std::vector<at::Tensor> params, values;
    std::vector<std::string> names;
    std::unordered_set<const void*> seen;
    for (const auto& item : stages[s].module->named_parameters()) {
      const at::Tensor& p = item.value();
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;  // (tied within the stage: once)
      if (!p.requires_grad() || (!params.empty() && p.scalar_type() != params[0].scalar_type())) {
        throw std::invalid_argument("--strategy fsdp around pipeline stages shards trainable parameters of one dtype "
                                    "per stage, but " + item.key() + " is " +
                                    (p.requires_grad() ? std::string("of another dtype") : std::string("frozen")) +
                                    ": use --strategy ddp or zero1 around the stages");
      }
      params.push_back(p);
      values.push_back(p.detach().clone());
      names.push_back(item.key());
    }
    if (params.empty()) continue;  // (a stage without parameters, e.g. an activation)
    const std::string name = "pipeline stage part " + std::to_string(s) + " (" + names.front() + " ...)";
    const at::ScalarType dtype = params[0].scalar_type();
    auto flat = std::make_unique<fsdp::FlatParam>(std::move(params), names, groups_, dtype, dtype, name);
    for (size_t i = 0; i < values.size(); ++i) flat->load(i, values[i]);
    flats_.push_back(std::move(flat));
  }
}

void ShardedStages::gather() {
  if (state_ != State::Sharded) return;
  for (auto& f : flats_) f->gather_async();
  for (auto& f : flats_) f->wait_gather();
  state_ = State::Gathered;
}

void ShardedStages::reduce_gradients() {
  TORCH_CHECK(state_ == State::Gathered, "pipeline (fsdp around stages): reduce_gradients() needs the gathered stages "
              "of a step (state ", state_ == State::Sharded ? "Sharded" : "Reduced", ")");
  for (auto& f : flats_) f->reduce_grads_async();
  for (auto& f : flats_) f->finish_reduce();
  state_ = State::Reduced;
}

void ShardedStages::reshard() {
  if (state_ == State::Sharded) return;
  at::NoGradGuard no_grad;
  for (auto& f : flats_) {
    for (const auto& e : f->entries()) const_cast<at::Tensor&>(e.param).mutable_grad() = at::Tensor();
    f->reshard();
  }
  state_ = State::Sharded;
}

void ShardedStages::release() {
  for (auto& f : flats_) f->release();
  state_ = State::Sharded;
}

std::vector<at::Tensor> ShardedStages::trainable_shards() const {
  std::vector<at::Tensor> out;
  for (const auto& f : flats_) out.push_back(f->shard());
  return out;
}

fsdp::ShardView ShardedStages::view() const {
  std::vector<const fsdp::FlatParam*> flats;
  for (const auto& f : flats_) flats.push_back(f.get());
  return fsdp::shard_view(flats, groups_.replicate.rank() == 0);
}

void ShardedStages::store_gathered_values() {
  TORCH_CHECK(state_ != State::Sharded, "pipeline (fsdp around stages): store_gathered_values() needs gathered stages");
  for (auto& f : flats_) {
    for (size_t i = 0; i < f->entries().size(); ++i) f->load(i, f->entries()[i].param.detach());
  }
}

}  // namespace dtrain::pipeline
