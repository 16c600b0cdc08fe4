#pragma once
// A pipeline rank's view of the whole model (Design note [a rank keeps its stages]).
//
// Design note [a rank keeps its stages]
// A rank holds the parameters of its own stages only: the others' (built with the whole model, as
// a libtorch module cannot be built without values) are released once the pipeline is made and
// come back, as zeros then filled, only for whole-model work: loading a checkpoint (every key
// checked against the whole model), the final sums and the weights export.
#include <memory>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "dtrain/parallel/layout.h"

namespace dtrain::train::detail {

class WholeModel {
 public:
  // `local`: this rank's stage parameters; the model's others are released now.
  WholeModel(std::shared_ptr<torch::nn::Module> model, const std::vector<at::Tensor>& local, const parallel::Groups& groups);
  torch::nn::Module& module() { return *model_; }
  // The other stages' parameters back as zeros (full shapes) / released again.
  void materialize();
  void release();
  // Every stage's current values into the whole model on every rank (collective over the world:
  // one replica of each stage contributes; with tensor parallelism each tensor rank's pieces).
  // Leaves the others materialized: release() when done.
  void gather();

 private:
  std::shared_ptr<torch::nn::Module> model_;
  const parallel::Groups& groups_;
  std::vector<const void*> local_;  // this rank's stage parameters (their TensorImpls)
  std::vector<std::pair<at::Tensor, std::vector<int64_t>>> others_;  // the other stages' parameters, full shapes
};

}  // namespace dtrain::train::detail
