// dtrain-mlp: a user's own model, written without any dtrain base class, trained by the library's
// loop with the same flags as dtrain-gpt (--strategy single|ddp|zero1|zero2|fsdp|hsdp, --precision,
// --activation-checkpointing, --clip-grad-norm, --save/--resume, --metrics, --pp, --tp ...). The
// recipe a user copies (README: "Train your own model"; docs/train.md). With --tp the same model is
// written from tensor-parallel layers (ParallelRegressor), under the same parameter names.
//
//   build/bin/dtrun --standalone --nproc-per-node 2 build/bin/dtrain-mlp --strategy fsdp --steps 200
#include <cmath>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "dtrain/tensor_parallel/linear.h"
#include "dtrain/train/fit.h"

namespace {

// The model: plain libtorch, nothing of dtrain in it. Its Linear layers sit in a Sequential, so
// FSDP can make each one a unit and recomputation can wrap each one with no change here
// (Design note [hooked modules]).
struct RegressorImpl : torch::nn::Module {
  RegressorImpl(int64_t in, int64_t hidden, int64_t depth, int64_t out) {
    body = register_module("body", torch::nn::Sequential());
    body->push_back(torch::nn::Linear(in, hidden));
    body->push_back(torch::nn::Tanh());
    for (int64_t i = 0; i < depth; ++i) {
      body->push_back(torch::nn::Linear(hidden, hidden));
      body->push_back(torch::nn::Tanh());
    }
    head = register_module("head", torch::nn::Linear(hidden, out));
  }
  at::Tensor forward(const at::Tensor& x) { return head(body->forward(x)); }
  torch::nn::Sequential body{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Regressor);

// The same model with its Linear layers split over a tensor-parallel group, as a user writes it:
// column-parallel and row-parallel layers alternate (each Tanh acts on this rank's features between
// a column and a row layer), the last one gathers its output if it is a column layer. Same names,
// and, drawn from the same seed, the same values as Regressor's (each layer draws the full init).
struct ParallelRegressorImpl : torch::nn::Module {
  ParallelRegressorImpl(int64_t in, int64_t hidden, int64_t depth, int64_t out, const dtrain::comm::ProcessGroup& tp) {
    namespace tpl = dtrain::tensor_parallel;
    bool column = true;  // the next layer's kind
    auto layer = [&](int64_t i, int64_t o, bool last) -> torch::nn::AnyModule {
      const bool c = column;
      column = !column;
      if (c) return torch::nn::AnyModule(tpl::ColumnParallelLinear(tpl::ParallelLinearOptions(i, o).gather_output(last), tp));
      return torch::nn::AnyModule(tpl::RowParallelLinear(tpl::ParallelLinearOptions(i, o), tp));
    };
    body = register_module("body", torch::nn::Sequential());
    body->push_back(layer(in, hidden, false));
    body->push_back(torch::nn::Tanh());
    for (int64_t i = 0; i < depth; ++i) {
      body->push_back(layer(hidden, hidden, false));
      body->push_back(torch::nn::Tanh());
    }
    torch::nn::AnyModule h = layer(hidden, out, true);
    head = register_module("head", h.ptr());
    head_forward = [h](const at::Tensor& x) mutable { return h.forward(x); };
  }
  at::Tensor forward(const at::Tensor& x) { return head_forward(body->forward(x)); }
  torch::nn::Sequential body{nullptr};
  std::shared_ptr<torch::nn::Module> head;
  std::function<at::Tensor(const at::Tensor&)> head_forward;
};
TORCH_MODULE(ParallelRegressor);

struct MlpFlags {
  int64_t hidden = 64, depth = 3, samples = 4096;
};

// A fixed regression task: y = sin(x A) B + 0.01 noise, x ~ N(0, 1), from its own seed (the same
// data for every --seed, world size and strategy).
dtrain::train::TensorDataset make_data(int64_t samples, int64_t in, int64_t out) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(20261125);
  auto x = at::randn({samples, in}, g);
  auto a = at::randn({in, 32}, g) / std::sqrt(static_cast<double>(in));
  auto b = at::randn({32, out}, g) / std::sqrt(32.0);
  auto y = at::sin(x.matmul(a)).matmul(b) + 0.01 * at::randn({samples, out}, g);
  return {x, y};
}

// The head as a module and its forward (the last pipeline stage holds it).
using Head = std::pair<std::shared_ptr<torch::nn::Module>, std::function<at::Tensor(const at::Tensor&)>>;
Head head_of(const Regressor& m) {
  auto h = m->head;
  return {h.ptr(), [h](const at::Tensor& x) mutable { return h(x); }};
}
Head head_of(const ParallelRegressor& m) { return {m->head, m->head_forward}; }

// Gives `model` (Regressor, or ParallelRegressor with --tp) with its hooks to `use` (train::fit's
// build function, Design note [planned layouts]).
template <class Model, class Use>
void hand_over(const dtrain::train::Session& session, const MlpFlags& m, dtrain::train::ModelHooks hooks, Model model, Use&& use) {
  model->to(session.device);
  // The layers: the linear modules of `body` (`head` is called directly, so it stays with the root).
  auto layer = [](const std::string& path, torch::nn::Module& mod) {
    return path.rfind("body.", 0) == 0 && (dynamic_cast<torch::nn::LinearImpl*>(&mod) != nullptr ||
                                           dynamic_cast<dtrain::tensor_parallel::ColumnParallelLinearImpl*>(&mod) != nullptr ||
                                           dynamic_cast<dtrain::tensor_parallel::RowParallelLinearImpl*>(&mod) != nullptr);
  };
  hooks.wrap.fn = [layer](const std::string& path, torch::nn::Module& mod, int64_t) { return layer(path, mod); };  // --wrap layer
  hooks.recompute = layer;                                                                                       // --activation-checkpointing
  // --pp: the stages are pieces of `body` (cut at its children), the last one with `head`, under
  // the model's own names ("body.2.weight", "head.weight").
  hooks.stages = [model](int n) {
    auto parts = dtrain::pipeline::split_sequential(model->body, n);
    std::vector<dtrain::pipeline::Stage> stages;
    for (int k = 0; k + 1 < n; ++k) stages.push_back(dtrain::pipeline::make_stage({{"body", parts[k].module}}, parts[k].forward));
    auto last = parts.back();
    auto [head, head_forward] = head_of(model);
    stages.push_back(dtrain::pipeline::make_stage({{"body", last.module}, {"head", head}},
                                                  [last, f = head_forward](const at::Tensor& x) mutable { return f(last.forward(x)); }));
    return stages;
  };
  auto mse = [](const at::Tensor& out, const at::Tensor& y) { return at::mse_loss(out, y); };
  dtrain::train::FitOptions fo;
  fo.model_description = "MLP 16 -> " + std::to_string(m.depth + 1) + " x " + std::to_string(m.hidden) + " -> 4";
  use(model, mse, hooks, fo);
}

}  // namespace

int main(int argc, char** argv) {
  dtrain::train::TrainConfig cfg;
  cfg.program = "dtrain-mlp";
  cfg.batch_size = 32;
  MlpFlags m;
  dtrain::train::ExtraFlags flags;
  flags.valued = {
      {"--hidden", [&](const std::string& v) { m.hidden = dtrain::train::int_flag("--hidden", v, 1); }},
      {"--depth", [&](const std::string& v) { m.depth = dtrain::train::int_flag("--depth", v, 0); }},
      {"--samples", [&](const std::string& v) { m.samples = dtrain::train::int_flag("--samples", v, 1); }},
  };
  flags.usage = "MLP and data:\n  --hidden N --depth N      hidden width and hidden layers (64, 3)\n"
                "  --samples N               size of the generated regression data set (4096)\n";
  if (auto rc = dtrain::train::parse_command_line(argc, argv, cfg, flags, "Trains an MLP regressor on generated data.")) {
    return *rc;
  }
  return dtrain::train::run_reporting_errors(cfg.program, [&] {
    dtrain::train::Session session = dtrain::train::start(cfg);
    // The model the configuration names (--strategy auto builds one per layout it weighs).
    auto build = [&](const dtrain::parallel::Plan& p, auto&& use) {
      dtrain::train::ModelHooks hooks;
      if (p.layout.tensor > 1) {  // --tp: the model is built on the tensor-parallel group of the layout
        if (p.sequence_parallel) throw std::invalid_argument("--sequence-parallel: the MLP has no sequence");
        hooks.groups = dtrain::train::make_groups(p, session.pg);
        torch::manual_seed(cfg.seed);
        hand_over(session, m, hooks, ParallelRegressor(16, m.hidden, m.depth, 4, hooks.groups->tensor), use);
        return;
      }
      torch::manual_seed(cfg.seed);
      hand_over(session, m, hooks, Regressor(16, m.hidden, m.depth, 4), use);
    };
    dtrain::train::fit(session, make_data(m.samples, 16, 4), cfg, build);
    return 0;
  });
}
