#pragma once
// A pipeline stage: the part of a model one step of the pipeline runs, as an ordinary module whose
// parameters keep the whole model's names (so a stage's checkpoint part is the model's own, and a
// pipeline checkpoint loads without the pipeline), plus its forward.
//
// Stages come from a list the user gives (any modules, any forward), from a Sequential cut at
// child indices (split_sequential), or for the GPT by layer counts (models/gpt_stages.h).
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

namespace dtrain::pipeline {

struct Stage {
  // Holds the stage's layers; named_parameters() gives the whole model's names for them.
  std::shared_ptr<torch::nn::Module> module;
  // The model's input (first stage) or the previous stage's output -> this stage's output (the
  // last stage: what the loss function takes).
  std::function<at::Tensor(const at::Tensor&)> forward;
};

// A stage from modules the caller picks out of its model: each registered under its name in the
// model ("body", "head"), so the stage's parameters keep the model's names; `forward` computes the
// stage's output from its input (the user's own model: examples/mlp).
Stage make_stage(const std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>& modules,
                 std::function<at::Tensor(const at::Tensor&)> forward);

// Where n stages of `count` layers begin, as even as possible (the first count % n stages get one
// more): {0, ...}. Throws std::invalid_argument when n > count ("more stages than layers").
std::vector<int64_t> even_starts(int64_t count, int n, const std::string& what = "layers");

// A Sequential cut into stages at child indices: `starts` are the first child of each stage
// (starts[0] == 0, increasing, < size; empty: even_starts(size, n)). Each stage is a Sequential of
// the same child modules (shared, not copied) under their original indices: "3.weight" stays
// "3.weight". Throws std::invalid_argument for bad cuts.
std::vector<Stage> split_sequential(const torch::nn::Sequential& model, int n, std::vector<int64_t> starts = {});

}  // namespace dtrain::pipeline
