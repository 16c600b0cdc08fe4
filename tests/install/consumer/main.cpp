// Uses the installed headers and library: a one-process group, a collective, a DDP-wrapped module.
#include <cstdio>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

#include <dtrain/comm.h>
#include <dtrain/ddp/distributed_data_parallel.h>

int main() {
  auto pg = dtrain::comm::init_process_group(dtrain::comm::InitOptions().configure_threads(false));
  auto t = at::ones({3});
  dtrain::comm::all_reduce(pg, t);
  auto model = dtrain::ddp::DistributedDataParallel<torch::nn::Linear>(torch::nn::Linear(4, 2), pg);
  model->forward(at::ones({1, 4})).sum().backward();
  std::printf("consumer ok: world %d, sum %.0f\n", pg.size(), t.sum().item<float>());
  return 0;
}
