#pragma once
// Optimizer state in a neutral form: per parameter (by its index in a fixed parameter order), the
// named tensors of its state, plus each param group's options as named numbers. It is what a
// plain torch::optim optimizer holds, independent of which rank held it, so a ZeRO-1 run can
// consolidate its state on one rank (ShardedOptimizer::consolidate_state_dict) and load it back at
// any world size, or into a plain optimizer (load_state_dict_into), and the other way round.
//
// Supported: torch::optim SGD, Adam, AdamW, RMSprop, Adagrad (and subclasses of them). Fields,
// under the names PyTorch's Python state_dict uses ("step" is a 0-dim int64 tensor, every other
// tensor has its parameter's shape and dtype; a tensor the optimizer does not hold is left out):
//
//   SGD      momentum_buffer                                  (state only when momentum != 0)
//   Adam     step exp_avg exp_avg_sq [max_exp_avg_sq]         (max_exp_avg_sq when amsgrad)
//   AdamW    step exp_avg exp_avg_sq [max_exp_avg_sq]
//   RMSprop  step square_avg [momentum_buffer] [grad_avg]     (when momentum > 0 / centered)
//   Adagrad  step sum                                         (state for every parameter)
//
// Group options (all numbers; booleans as 0/1):
//   SGD      lr momentum dampening weight_decay nesterov
//   Adam(W)  lr beta1 beta2 eps weight_decay amsgrad
//   RMSprop  lr alpha eps weight_decay momentum centered
//   Adagrad  lr lr_decay weight_decay initial_accumulator_value eps
//
// Everything is named tensors and numbers, so it is easy to save (e.g. one archive entry per
// "params/<i>/<field>"). The tensors in a dict are its own (copies), never the optimizer's.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

namespace dtrain::optim {

// One parameter's optimizer state: field name -> tensor.
struct ParamStateDict {
  std::map<std::string, at::Tensor> tensors;
};

struct ParamGroupStateDict {
  std::vector<int64_t> params;            // indices (into the parameter order) of the group's parameters
  std::map<std::string, double> options;  // see the table above
};

struct OptimizerStateDict {
  std::string optimizer;                             // "SGD", "Adam", "AdamW", "RMSprop" or "Adagrad"
  std::vector<std::optional<ParamStateDict>> params;  // by parameter index; nullopt: no state (yet)
  std::vector<ParamGroupStateDict> groups;           // in the optimizer's group order
};

// "SGD", "Adam", "AdamW", "RMSprop" or "Adagrad"; throws for any other optimizer type.
std::string optimizer_kind(const torch::optim::Optimizer& opt);
// The state tensor fields of `kind` ("step" first where it has one), in a fixed order.
const std::vector<std::string>& state_fields(const std::string& kind);

// `opt`'s state (copied) and group options. `params_in_order` lists every parameter of `opt`
// exactly once (e.g. in param-group order, as ShardedOptimizer::params()); it fixes the indices.
OptimizerStateDict state_dict_of(const torch::optim::Optimizer& opt, const std::vector<at::Tensor>& params_in_order);
// The same with the state's tensors themselves, not copies (Design note [snapshots are views] in
// dtrain/checkpoint/piece.h): valid until the optimizer's next step; for a caller that writes or
// copies them before then (a checkpoint's snapshot).
OptimizerStateDict state_dict_view(const torch::optim::Optimizer& opt, const std::vector<at::Tensor>& params_in_order);

// Replaces `opt`'s state and group options with `dict`'s (copied onto each parameter's device):
// parameters without an entry end with no state, as after PyTorch's load_state_dict. Everything
// is checked before anything changes (check_state_dict, and the same group layout as `opt`).
void load_state_dict_into(torch::optim::Optimizer& opt, const std::vector<at::Tensor>& params_in_order,
                          const OptimizerStateDict& dict);

// Throws, naming the parameter index and field, unless `dict` fits an optimizer of `opt`'s type
// with `opt`'s number of groups over `params_in_order` (shapes, dtypes, required/unknown fields,
// option names, groups that cover every parameter once). Changes nothing.
void check_state_dict(const OptimizerStateDict& dict, const torch::optim::Optimizer& opt,
                      const std::vector<at::Tensor>& params_in_order);

// Bytes of all state tensors `opt` holds (under ZeRO-1, about 1/W of the plain optimizer's).
int64_t state_bytes(const torch::optim::Optimizer& opt);

}  // namespace dtrain::optim
