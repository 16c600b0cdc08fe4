#pragma once
// The GPT cut into pipeline stages by layer counts (dtrain/pipeline/stage.h).
#include <cstdint>
#include <vector>

#include "dtrain/models/gpt.h"
#include "dtrain/models/parallel_gpt.h"
#include "dtrain/pipeline/stage.h"

namespace dtrain::models {

// `n` stages of the GPT's blocks, `starts[k]` the first block of stage k (empty: as even as
// possible, the first layers % n stages one block more); the first stage also holds tok_emb and
// pos_emb, the last ln_f and lm_head. Each stage's module names its parameters as the GPT does
// ("blocks.5.qkv.weight"), holding the GPT's own modules (shared, not copied). The stages compute
// what GPT::forward does: stage 0 takes the tokens [B, T], the last returns the logits [B, T, V].
// Throws std::invalid_argument when n exceeds the layers.
std::vector<pipeline::Stage> gpt_stages(const GPT& model, int n, std::vector<int64_t> starts = {});

// The same for the GPT from tensor-parallel layers (--tp with --pp): each stage runs this rank's
// pieces; between stages travel [B, T, C] activations ([B, T / tp, C] with sequence parallelism),
// and the last stage returns this rank's logits [B, T, V / tp] (ParallelGPT::loss takes them).
std::vector<pipeline::Stage> gpt_stages(const ParallelGPT& model, int n, std::vector<int64_t> starts = {});

}  // namespace dtrain::models
