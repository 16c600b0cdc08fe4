#pragma once
// Dropout for models built from tensor-parallel layers, with masks that do not depend on the
// tensor-parallel degree or on sequence parallelism, and that activation checkpointing replays.
//
// Design note [dropout streams]
// -----------------------------
// Megatron-LM keeps two random streams: outside the split regions the default one, the same on
// every rank of a group (the ranks drop the same elements of the same activation), inside them a
// per-rank one (each rank drops its own heads' elements). Its per-rank stream is seeded by the
// rank, so the masks change with the degree. Here:
// - outside a region (dropout_replicated: the embedding sum, the residual branches) the mask of the
//   whole activation is drawn from the default generator of x's device, which every rank of the
//   group holds in the same state; under sequence parallelism each rank keeps its part of the
//   sequence. Every degree draws the same numbers.
// - inside a region (dropout_heads: attention probabilities, split by heads) one seed is drawn from
//   the default CPU generator per call (every rank draws it, so the default stream stays in step at
//   any degree), and head h's mask comes from a generator seeded by (seed, h): each rank draws only
//   its own heads' masks (a per-rank stream), and head h's mask is the same at any degree.
// models::GPT (math attention) draws its masks with the same functions, so a plain GPT with dropout
// trains as a ParallelGPT at any degree does. Recomputation (recompute/checkpoint.cpp) restores the default generators before it replays a
// block, so both kinds draw the same masks again. Rank threads sharing one process share its
// default generator: these functions need one process per rank (as dtrun starts them).
#include <cstdint>

#include <ATen/core/Tensor.h>

#include "dtrain/comm/process_group.h"

namespace dtrain::tensor_parallel {

// The one-process case (models::GPT uses it, so that a GPT and a ParallelGPT at any degree draw the
// same masks): x's mask drawn whole from the default generator of x's device.
at::Tensor dropout(const at::Tensor& x, double p, bool training);

// x: the same activation on every rank of `tp`, or (sequence_dim >= 0) this rank's part of it
// along sequence_dim, parts in rank order. Identity unless training and p > 0.
at::Tensor dropout_replicated(const at::Tensor& x, double p, bool training, const comm::ProcessGroup& tp,
                              int64_t sequence_dim = -1);

// x: [B, h, ...], heads first_head .. first_head + h - 1 of the model's (this rank's heads).
at::Tensor dropout_heads(const at::Tensor& x, double p, bool training, int64_t first_head);

}  // namespace dtrain::tensor_parallel
