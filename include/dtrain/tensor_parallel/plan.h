#pragma once
// How a model built from tensor-parallel layers is cut, read off its modules: for every parameter,
// whether it is whole on each rank of the group or cut (and how), so the library can clip by the
// global norm, checkpoint under the plain model's names and full shapes, and export weights for any
// user model made of these layers (no per-model code).
//
//   auto plan = tensor_parallel::Plan::of(*model, tp);
//   at::Tensor full = plan.full("blocks.0.fc.weight", piece);   // collective over tp
//   at::Tensor mine = plan.piece("blocks.0.fc.weight", full);
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "dtrain/comm/process_group.h"

namespace dtrain::tensor_parallel {

class Plan {
 public:
  enum class Cut {
    Whole,   // every rank holds all of it (LayerNorms, a row-parallel bias, position embeddings)
    Rows,    // dim 0 in `stride` blocks, each cut evenly (column-parallel weight and bias, vocabulary rows)
    Columns, // dim 1, cut evenly (row-parallel weight)
  };
  struct Spec {
    Cut cut = Cut::Whole;
    int64_t stride = 1;
  };
  // The cuts of every parameter of `model` (names as model.named_parameters()); parameters of
  // modules other than ColumnParallelLinear, RowParallelLinear and VocabParallelEmbedding are Whole.
  static Plan of(const torch::nn::Module& model, comm::ProcessGroup tp);

  const Spec& spec(const std::string& name) const;
  bool is_cut(const std::string& name) const { return spec(name).cut != Cut::Whole; }
  // Whether this rank counts `name`'s elements in a norm or sum over the group (each element once):
  // its piece of a cut parameter; a whole one on rank 0 only.
  bool counts(const std::string& name) const { return is_cut(name) || tp_.rank() == 0; }
  // The full tensor from every rank's piece (collective over the group; rank order).
  at::Tensor full(const std::string& name, const at::Tensor& piece) const;
  // This rank's piece of a full tensor.
  at::Tensor piece(const std::string& name, const at::Tensor& full) const;
  // The full shape of a parameter whose piece has `piece_shape`.
  std::vector<int64_t> full_shape(const std::string& name, std::vector<int64_t> piece_shape) const;
  // Where elements of this rank's piece lie in the full tensor, both flattened row-major: the
  // contiguous runs covering the piece's range [begin, begin + count), in order (a Rows cut gives
  // one run per stride block, a Columns cut one per row). No communication: e.g. FSDP's flat shard
  // of a piece, saved and loaded as ranges of the full tensor (tensor_parallel/sharded.h).
  struct Segment {
    int64_t full_begin;   // first element in the full tensor
    int64_t piece_begin;  // first element in the piece
    int64_t count;
  };
  std::vector<Segment> segments(const std::string& name, const std::vector<int64_t>& piece_shape, int64_t begin,
                                int64_t count) const;
  const comm::ProcessGroup& group() const { return tp_; }

 private:
  std::map<std::string, Spec> specs_;
  comm::ProcessGroup tp_;
};

// Whether `model` has a layer built with sequence parallelism (ColumnParallelLinear or
// RowParallelLinear with options.sequence_parallel): a plan that asks for it and a model without
// one would do nothing of it.
bool has_sequence_parallel(const torch::nn::Module& model);

// Sets every parameter of `model` (cut by `plan`) to its piece of the same-named parameter of
// `full`, a plain model with the same names and full shapes (e.g. models::GPT for ParallelGPT).
void load_pieces(torch::nn::Module& model, const torch::nn::Module& full, const Plan& plan);

}  // namespace dtrain::tensor_parallel
