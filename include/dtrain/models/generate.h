#pragma once
// Sampling a continuation from a language model, one token at a time (nanoGPT's generate): the
// last `context` tokens go through the model, its last position's logits are divided by the
// temperature, cut to the top k, and a token is drawn from their softmax (temperature 0: the
// most likely token). Works on any model given as a function from tokens [1, T] to logits
// [1, T, vocab], on one process.
//
//   auto out = dtrain::models::generate([&](const at::Tensor& t) { return gpt->forward(t); }, 128, prompt,
//                                       dtrain::models::GenerateOptions().max_new_tokens(200).top_k(40));
#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

namespace dtrain::models {

struct GenerateOptions {
  TORCH_ARG(int64_t, max_new_tokens) = 200;
  TORCH_ARG(double, temperature) = 1.0;  // 0: greedy
  TORCH_ARG(int64_t, top_k) = 0;         // 0: every token
  TORCH_ARG(uint64_t, seed) = 0;         // the sampling's own generator (the default one is not touched)
};

using LogitsFn = std::function<at::Tensor(const at::Tensor& tokens)>;

// The prompt's tokens followed by max_new_tokens sampled ones. Throws std::invalid_argument for an
// empty prompt or a negative temperature or top_k, under no_grad, in the model's current mode.
std::vector<int64_t> generate(const LogitsFn& logits, int64_t context, std::vector<int64_t> prompt,
                              const GenerateOptions& options = {});

}  // namespace dtrain::models
