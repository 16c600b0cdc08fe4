#pragma once
// The communication at the edges of a tensor-parallel region, as autograd functions (Megatron-LM's
// mappings; PyTorch DTensor's redistributions between Replicate, Shard and Partial):
//
//   forward                        backward                      used by
//   copy_to_region:    identity    all-reduce of the gradient    a column-parallel layer's input
//   reduce_from_region: all-reduce identity                      a row-parallel layer's output
//   gather_from_region: all-gather along `dim`   this rank's slice   a column-parallel output, gathered
//   scatter_to_region:  this rank's slice        all-gather          a row-parallel input, not yet split
//   gather_sequence:    all-gather along `dim`   reduce-scatter      entering a TP region (sequence parallel)
//   reduce_scatter_sequence: reduce-scatter      all-gather          leaving a TP region (sequence parallel)
//
// Slices along `dim` are even: the size along `dim` must divide by the group's size (a clear error
// otherwise, naming the sizes). All are collectives over `tp`: every rank of the group calls them in
// the same order, forward and backward. Sums are plain sums (no averaging), as in Megatron.
#include <ATen/core/Tensor.h>

#include "dtrain/comm/process_group.h"

namespace dtrain::tensor_parallel {

at::Tensor copy_to_region(const at::Tensor& x, const comm::ProcessGroup& tp);
at::Tensor reduce_from_region(const at::Tensor& x, const comm::ProcessGroup& tp);
at::Tensor gather_from_region(const at::Tensor& x, const comm::ProcessGroup& tp, int64_t dim = -1);
at::Tensor scatter_to_region(const at::Tensor& x, const comm::ProcessGroup& tp, int64_t dim = -1);
at::Tensor gather_sequence(const at::Tensor& x, const comm::ProcessGroup& tp, int64_t dim);
at::Tensor reduce_scatter_sequence(const at::Tensor& x, const comm::ProcessGroup& tp, int64_t dim);

// Without autograd: all of `x` along `dim` from every rank (rank order), and this rank's even slice.
at::Tensor all_gather_along(const at::Tensor& x, const comm::ProcessGroup& tp, int64_t dim);
at::Tensor slice_along(const at::Tensor& x, const comm::ProcessGroup& tp, int64_t dim);
// Dim 0 cut in `stride` blocks, each sliced evenly (a fused q | k | v weight: stride 3): this
// rank's rows of every block, blocks in order; and the full tensor back from every rank's piece.
at::Tensor rows_piece(const at::Tensor& full, const comm::ProcessGroup& tp, int64_t stride = 1);
at::Tensor rows_full(const at::Tensor& piece, const comm::ProcessGroup& tp, int64_t stride = 1);

}  // namespace dtrain::tensor_parallel
