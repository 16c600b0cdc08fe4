#pragma once
// Training state <-> checkpoint pieces and metadata (the storage is store.h/piece.h): the model,
// the optimizer (plain or ZeRO-sharded), the random state and the small values of a run, under
// one key scheme that every strategy shares, so a checkpoint saved by one strategy at one world
// size loads into another strategy at another world size.
//
// Key scheme (tensor keys):
//   model/<name>                  a parameter or buffer, <name> as the UNWRAPPED module's
//                                 named_parameters() / named_buffers() (e.g. model/blocks.0.qkv.weight;
//                                 never with a wrapper's "module." prefix)
//   optim/<param name>/<field>    one optimizer state tensor of that parameter; fields as in
//                                 dtrain/optim/state_dict.h (step, exp_avg, exp_avg_sq,
//                                 momentum_buffer, ...; "step" is a 0-dim int64 tensor). A parameter
//                                 without state (yet) has no keys.
//   rng/cpu/rank<r>               rank r's CPU generator state (uint8)
// Metadata (strings; numbers in round-trip text, "%.17g" for doubles):
//   optim/kind                    SGD | Adam | AdamW | RMSprop | Adagrad
//   optim/groups                  number of param groups
//   optim/group/<g>/<option>      group g's options (names as in state_dict.h; booleans 0/1)
//   amp/scale, amp/growth_tracker the loss scaler's state (put_grad_scaler_state)
// and whatever else the caller adds (the demo adds train/step, data/epoch, data/offset, run/...).
//
// Param groups are matched by index (group g's options go to the optimizer's group g, whose
// parameters are the ones it was built with); per-parameter state is matched by name.
//
// Who writes what: a replicated tensor (model, plain optimizer under DDP) is split among the ranks
// (each writes 1/W, replicated_piece), a ZeRO owner writes its parameters' state whole. Loading
// reads by key from whichever ranks wrote it, so any world size loads any checkpoint: every rank
// reads the whole model, a plain optimizer's full state, a ShardedOptimizer only the state of the
// parameters it owns under its own (current) partition.
//
// Random state on resume: at the same world size each rank restores its own; at another world
// size rank r restores rank r's if the checkpoint has it, else rank 0's.
//
// Errors name the key: a missing key, a shape or dtype that differs from the model's, a checkpoint
// for another optimizer type.
#include <cstdint>
#include <map>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "dtrain/amp/grad_scaler.h"
#include "dtrain/checkpoint/piece.h"
#include "dtrain/checkpoint/store.h"
#include "dtrain/optim/sharded_optimizer.h"
#include "dtrain/optim/state_dict.h"

namespace dtrain::checkpoint {

using Metadata = std::map<std::string, std::string>;

// One rank's contribution to a checkpoint: the arguments of save().
struct Snapshot {
  std::vector<Piece> pieces;
  Metadata metadata;
  // Appends `other`'s pieces and metadata; a metadata key both have must have the same value.
  Snapshot& add(Snapshot other);
};

std::string model_key(const std::string& name);                                  // "model/<name>"
std::string optim_key(const std::string& param_name, const std::string& field);  // "optim/<name>/<field>"
std::string rng_key(int rank);                                                    // "rng/cpu/rank<r>"

// The names of `params` in `module` (by identity, from named_parameters()), e.g. to name a
// ShardedOptimizer's params(). Throws if one is not a parameter of the module.
std::vector<std::string> param_names(const torch::nn::Module& module, const std::vector<at::Tensor>& params);

// ---- model -------------------------------------------------------------------------------------

// This rank's 1/W of every parameter and buffer (model/<name>); together the ranks write each once.
Snapshot snapshot_model(const torch::nn::Module& module, int rank, int world);
// Copies every parameter and buffer of `module` from model/<name> (the whole tensor, on every
// rank). Checked in full before anything changes: every name present, same shape and dtype, and no
// model/ key the module lacks (a checkpoint of a bigger model is an error, not a partial load).
void load_model(const Reader& reader, torch::nn::Module& module);

// A model whose parameters are pieces of the checkpoint's full tensors (tensor parallelism): for a
// parameter `name` holding `local`, the full shape it is a piece of, and this rank's piece of a full
// value. Loading checks the full shapes and keeps the pieces; unset functions mean "whole".
struct Pieces {
  std::function<std::vector<int64_t>(const std::string& name, const at::Tensor& local)> full_shape;
  std::function<at::Tensor(const std::string& name, const at::Tensor& full)> piece;
};
void load_model(const Reader& reader, torch::nn::Module& module, const Pieces& pieces);

// The model/ keys a sharded loader expects (e.g. FSDP's): key -> (whole shape, dtype).
using ModelKeys = std::map<std::string, std::pair<std::vector<int64_t>, at::ScalarType>>;
// Throws, naming the key, unless the checkpoint's model/ keys are exactly `expected`'s, with those
// shapes and dtypes (checked before anything is read).
void check_model_keys(const Reader& reader, const ModelKeys& expected);

// ---- optimizer -----------------------------------------------------------------------------------

// A plain optimizer whose state is the same on every rank (single, DDP): its state split among
// the ranks (1/W each) and its metadata. `params` lists every parameter of `opt` once (e.g. in
// param-group order), `names` their names.
Snapshot snapshot_optimizer(const torch::optim::Optimizer& opt, const std::vector<std::string>& names,
                            const std::vector<at::Tensor>& params, int rank, int world);
// ZeRO: each rank writes the state of the parameters it owns, whole. `names` as opt.params().
Snapshot snapshot_optimizer(optim::ShardedOptimizer& opt, const std::vector<std::string>& names);

// Replaces the optimizer's state and group options with the checkpoint's (all of it for a plain
// optimizer; only the owned parameters' state for a ShardedOptimizer, under its current partition,
// so any world size loads any checkpoint). A parameter without keys ends with no state. Throws,
// naming the key, for another optimizer type or group count, a field of the wrong shape or dtype,
// or an optim/ key that names no parameter of `names` or no field of the optimizer type.
void load_optimizer(const Reader& reader, torch::optim::Optimizer& opt, const std::vector<std::string>& names,
                    const std::vector<at::Tensor>& params);
void load_optimizer(const Reader& reader, optim::ShardedOptimizer& opt, const std::vector<std::string>& names);
// Tensor parallelism: `params` (named `names`) are pieces; their state in the checkpoint is full.
void load_optimizer(const Reader& reader, torch::optim::Optimizer& opt, const std::vector<std::string>& names,
                    const std::vector<at::Tensor>& params, const Pieces& pieces);
// The state in `dict` (full tensors, e.g. gathered from pieces) split among `world` ranks as
// replicated state, under `names` (one per dict.params entry), with the optimizer's metadata.
Snapshot snapshot_optimizer(const optim::OptimizerStateDict& dict, const std::vector<std::string>& names, int rank,
                            int world);
// Part of a model (a pipeline stage): `opt` steps the parameters `mine` (indices, in `opt`'s order)
// of the whole model's `all_params`, named `all_names`; the checkpoint's optim/ keys may name any of them.
// With `pieces` (tensor-parallel stages) the checkpoint's state is full and the parameters pieces.
void load_optimizer(const Reader& reader, torch::optim::Optimizer& opt, const std::vector<std::string>& all_names,
                    const std::vector<at::Tensor>& all_params, const std::vector<size_t>& mine,
                    const Pieces& pieces = {});

// The metadata half of optimizer state (for strategies that cut the tensors their own way, e.g.
// FSDP's flat shards): optim/kind, optim/groups and every group's options.
void put_optimizer_metadata(Metadata& meta, const optim::OptimizerStateDict& dict);
// Throws, naming the key, unless the checkpoint was saved by an optimizer of `opt`'s type with
// `opt`'s number of param groups.
void check_optimizer_metadata(const Metadata& meta, const torch::optim::Optimizer& opt);
// Sets `dict`'s group options (its current layout) from the checkpoint's.
void read_group_options(const Metadata& meta, optim::OptimizerStateDict& dict);

// ---- random state ----------------------------------------------------------------------------------

// This rank's CPU generator state (rng/cpu/rank<r>), written by this rank.
Snapshot snapshot_rng(int rank);
// Sets the CPU generator from rng/cpu/rank<rank>, or from rng/cpu/rank0 if the checkpoint (saved
// at a smaller world size) has no such key. Throws if neither exists.
void load_rng(const Reader& reader, int rank);

// ---- small values --------------------------------------------------------------------------------

void put(Metadata& meta, const std::string& key, int64_t value);
void put(Metadata& meta, const std::string& key, double value);  // round-trip text
void put(Metadata& meta, const std::string& key, const std::string& value);
// The value of `key`, parsed; throws naming the key when it is missing or not a number.
int64_t get_int(const Metadata& meta, const std::string& key);
double get_double(const Metadata& meta, const std::string& key);
const std::string& get_string(const Metadata& meta, const std::string& key);

// amp/scale and amp/growth_tracker.
void put_grad_scaler_state(Metadata& meta, const amp::GradScalerState& state);
// Throws, naming the key, when the checkpoint has no loss-scaler state or an invalid one.
amp::GradScalerState grad_scaler_state(const Metadata& meta);

}  // namespace dtrain::checkpoint
