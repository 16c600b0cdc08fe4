// docs/train.md's program, exactly (tests/install/check.sh builds it against an installed dtrain and runs it).
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <dtrain/train/fit.h>

// Your model, as you would write it anyway: nothing of dtrain in it.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    body = register_module("body", torch::nn::Sequential(torch::nn::Linear(16, 64), torch::nn::Tanh(),
                                                         torch::nn::Linear(64, 64), torch::nn::Tanh()));
    head = register_module("head", torch::nn::Linear(64, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return head(body->forward(x)); }
  torch::nn::Sequential body{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

int main(int argc, char** argv) {
  dtrain::train::TrainConfig cfg;                        // --strategy, --precision, --save, ... (1)
  cfg.program = "my_trainer";
  if (auto rc = dtrain::train::parse_command_line(argc, argv, cfg)) return *rc;
  return dtrain::train::run_reporting_errors(cfg.program, [&] {
    auto session = dtrain::train::start(cfg);            // process group + device (2)
    torch::manual_seed(cfg.seed);
    Net net;
    net->to(session.device);
    auto x = at::randn({4096, 16}), y = at::randn({4096, 4});
    dtrain::train::ModelHooks hooks;                     // what only you know about the model (3)
    auto layer = [](const std::string& path, torch::nn::Module& m) {
      return path.rfind("body.", 0) == 0 && dynamic_cast<torch::nn::LinearImpl*>(&m) != nullptr;
    };
    hooks.wrap.fn = [layer](const std::string& p, torch::nn::Module& m, int64_t) { return layer(p, m); };
    hooks.recompute = layer;
    dtrain::train::fit(session, net, dtrain::train::TensorDataset{x, y},
                       [](const at::Tensor& out, const at::Tensor& t) { return at::mse_loss(out, t); }, cfg, hooks);
    return 0;
  });
}
