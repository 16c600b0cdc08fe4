// dtrain-gpt: trains a byte-level GPT on real text with the strategy picked by --strategy.
//
//   build/bin/dtrun --standalone --nproc-per-node 2 build/bin/dtrain-gpt --strategy ddp --steps 200
//
// Data order: a DistributedSampler (shuffle, seed, drop_last) per rank; each step takes
// batch-size x grad-accum consecutive samples of the rank's list. Because the sampler deals
// samples round-robin, step t of any world size W covers global positions
// [t*G, (t+1)*G) of the epoch's permutation (G = W x batch-size x grad-accum), and an epoch has
// floor(N / G) steps for every W: equal global batches give the same samples at every step.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>

#include "dtrain/amp/autocast.h"
#include "dtrain/comm/all_gather.h"
#include "dtrain/comm/init.h"
#include "dtrain/data/distributed_sampler.h"
#include "dtrain/data/text_dataset.h"
#include "dtrain/models/gpt.h"
#include "dtrain/train/metrics.h"
#include "dtrain/train/progress.h"
#include "dtrain/util/system.h"
#include "checkpointing.h"
#include "device.h"
#include "loss_scaling.h"
#include "options.h"
#include "strategy.h"

using namespace dtrain;

namespace {

std::string human_count(int64_t n) {
  char buf[32];
  if (n >= 1000000) {
    std::snprintf(buf, sizeof(buf), "%.2fM", n / 1e6);
  } else {
    std::snprintf(buf, sizeof(buf), "%.1fk", n / 1e3);
  }
  return buf;
}

int run(const gpt_demo::Options& o) {
  // The one device of this rank (device.h): the model, every batch and the autocast region.
  const comm::LaunchInfo launch = comm::resolve_launch_info();
  const c10::Device device = gpt_demo::resolve_device(o.device, launch.rank, launch.local_rank,
                                                      static_cast<int64_t>(torch::cuda::device_count()));
  auto pg = comm::init_process_group(
      comm::InitOptions().backend(gpt_demo::backend_for(o)).configure_threads(o.threads == 0));
  if (o.threads > 0) util::set_threads(o.threads);
  const int rank = pg.rank();
  const int world = pg.size();

  const std::string path = o.data.empty() ? data::kDefaultTextCorpus : o.data;
  auto dataset = data::TextDataset::from_path(path, o.seq_len);
  data::DistributedSampler sampler(dataset.size(), data::DistributedSamplerOptions(world, rank)
                                                       .shuffle(true).seed(static_cast<int64_t>(o.seed)).drop_last(true));
  const int64_t per_step = o.batch_size * o.grad_accum;  // samples per rank per step
  const int64_t steps_per_epoch = sampler.num_samples() / per_step;
  TORCH_CHECK(steps_per_epoch >= 1, "the data (", dataset.size(), " samples of ", o.seq_len,
              " bytes) is too small for a global batch of ", per_step * world,
              " sequences: lower --batch-size/--grad-accum/--seq-len or give more --data");

  models::GPT gpt(models::GPTOptions().seq_len(o.seq_len).layers(o.layers).d_model(o.d_model).heads(o.heads)
                      .seed(o.seed).activation_checkpointing(o.activation_checkpointing).defer_init(o.init_on_ranks)
                      .fused_attention(o.attention == "fused"));
  const int64_t num_parameters = gpt->num_parameters();  // (FSDP then shards them)
  // Model FLOPs utilisation: training FLOPs per token x tokens/s over the devices' peak.
  const double flops_per_token = gpt->flops_per_token(o.seq_len);
  const double peak_tflops = o.peak_tflops > 0 ? o.peak_tflops : util::known_peak_tflops(util::device_name(device));
  auto mfu = [&](double tokens_per_s) { return tokens_per_s * flops_per_token / (peak_tflops * 1e12 * world); };
  gpt_demo::place_model(*gpt, device, o.init_on_ranks);
  auto strategy = gpt_demo::make_strategy(o, pg, gpt);
  gpt_demo::LossScaling scaling(o, pg);

  if (rank == 0) {
    std::printf("dtrain-gpt: strategy %s, %d rank(s); GPT %lld layers, d_model %lld, %lld heads (%s parameters)\n",
                o.strategy.c_str(), world, static_cast<long long>(o.layers), static_cast<long long>(o.d_model),
                static_cast<long long>(o.heads), human_count(num_parameters).c_str());
    std::printf("dtrain-gpt: batch %lld x %lld bytes per rank x %lld accumulation = %lld sequences per step; "
                "%lld steps per epoch of %s (%lld samples)\n",
                static_cast<long long>(o.batch_size), static_cast<long long>(o.seq_len),
                static_cast<long long>(o.grad_accum), static_cast<long long>(per_step * world),
                static_cast<long long>(steps_per_epoch), path.c_str(), static_cast<long long>(dataset.size()));
    std::printf("dtrain-gpt: BLAS %s (%d thread(s)), %d intra-op thread(s) per rank, backend %s\n",
                util::blas_name().c_str(), util::blas_threads(), at::get_num_threads(),
                comm::to_string(pg.backend_kind()));
    std::printf("dtrain-gpt: device %s (rank 0), precision %s, loss scaling %s%s\n", device.str().c_str(),
                o.precision.c_str(), o.loss_scale.c_str(), o.cpu_offload ? ", FSDP shards offloaded to the CPU" : "");
    std::fflush(stdout);
  }

  // --resume: the model, optimizer and random state of the checkpoint, and the step to go on from.
  const gpt_demo::DataPlan plan{dataset.size(), per_step * world, steps_per_epoch};
  const int64_t start = gpt_demo::resume_checkpoint(o, pg, *strategy, scaling, plan);

  train::MetricsWriter metrics = rank == 0 && !o.metrics.empty() ? train::MetricsWriter(o.metrics) : train::MetricsWriter();
  train::Progress progress(o.steps, train::Progress::stdout_is_interactive());
  std::vector<int64_t> order;
  int64_t epoch = -1;
  double total_time = 0;
  const double tokens_per_step = static_cast<double>(per_step * world * o.seq_len);

  for (int64_t step = start; step < o.steps; ++step) {
    gpt_demo::maybe_fail_for_test(step + 1, rank, world);
    const auto t0 = std::chrono::steady_clock::now();
    if (step / steps_per_epoch != epoch) {
      epoch = step / steps_per_epoch;
      sampler.set_epoch(epoch);
      order = sampler.indices();
    }
    const int64_t first = (step % steps_per_epoch) * per_step;
    strategy->zero_grad();
    double local_loss = 0;
    double fwd_s = 0, bwd_s = 0;
    for (int64_t m = 0; m < o.grad_accum; ++m) {
      std::vector<int64_t> idx(order.begin() + first + m * o.batch_size, order.begin() + first + (m + 1) * o.batch_size);
      auto [x_cpu, y_cpu] = dataset.batch(idx);
      const at::Tensor x = x_cpu.to(device), y = y_cpu.to(device);
      const bool last = m + 1 == o.grad_accum;
      auto guard = last ? nullptr : strategy->no_sync();
      const auto f0 = std::chrono::steady_clock::now();
      at::Tensor loss;
      {
        std::optional<amp::AutocastGuard> autocast;  // bf16 or fp16 on the device's type
        if (o.precision != "fp32") autocast.emplace(device.type(), gpt_demo::compute_dtype(o));
        loss = strategy->loss(x, y) / static_cast<double>(o.grad_accum);
      }
      const auto f1 = std::chrono::steady_clock::now();
      scaling.scale(loss).backward();  // with ddp: ends after the last bucket's all-reduce is written back
      fwd_s += std::chrono::duration<double>(f1 - f0).count();
      bwd_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - f1).count();
      local_loss += loss.item<double>();
    }
    const auto o0 = std::chrono::steady_clock::now();
    // Design note [loss scaling in the demo] (loss_scaling.h): unscale, clip the true gradients, step
    // unless some rank's are inf/NaN.
    const double loss_scale = scaling.current_scale();
    const bool finite = scaling.unscale(*strategy, step + 1);
    const double grad_norm = o.clip_grad_norm > 0 && finite ? strategy->clip_grad_norm(o.clip_grad_norm) : -1.0;
    const bool stepped = scaling.step(*strategy, step + 1);
    const double opt_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - o0).count();
    // One small collective for the step's report: every rank's loss and peak RSS.
    const auto on_group = at::TensorOptions().dtype(at::kDouble).device(pg.device());
    auto mine = at::tensor(std::vector<double>{local_loss, util::peak_rss_mib()}, at::kDouble).to(pg.device());
    auto all = at::empty({2 * world}, on_group);
    comm::all_gather(pg, all, mine);
    all = all.to(at::kCPU);
    const auto t1 = std::chrono::steady_clock::now();
    const double dt = std::chrono::duration<double>(t1 - t0).count();
    total_time += dt;
    auto per_rank = all.view({world, 2});
    const double loss = per_rank.select(1, 0).mean().item<double>();
    const double rss = per_rank.select(1, 1).max().item<double>();
    if (rank == 0) {
      progress.update(step + 1, loss, tokens_per_step / dt);
      train::JsonLine line;
      if (grad_norm >= 0) line.add("grad_norm", grad_norm);  // before clipping, over all ranks
      if (scaling.enabled()) line.add("loss_scale", loss_scale).add("skipped", static_cast<int64_t>(stepped ? 0 : 1));
      if (peak_tflops > 0) line.add("mfu", mfu(tokens_per_step / dt));
      metrics.write(line.add("step", step + 1).add("loss", loss).add("tokens_per_s", tokens_per_step / dt)
                        .add("step_time_s", dt).add("forward_s", fwd_s).add("backward_s", bwd_s)
                        .add("optimizer_s", opt_s).add("peak_rss_mib", rss));
    }
    if (gpt_demo::save_due(o, step + 1)) gpt_demo::save_checkpoint(o, pg, *strategy, scaling, plan, step + 1);
  }
  if (rank == 0) progress.finish();
  if (!o.export_weights.empty()) gpt_demo::export_weights(o, pg, *strategy);

  // Final summary: checksums of the full parameters (identical on every rank) and memory.
  const auto [checksum, sq] = strategy->param_sums();
  auto mem = at::tensor(std::vector<double>{util::peak_rss_mib(), strategy->optimizer_state_bytes() / 1048576.0,
                                            strategy->peak_owned_bytes() / 1048576.0,
                                            util::peak_device_memory_mib(device)},
                        at::kDouble).to(pg.device());
  auto all_mem = at::empty({4 * world}, mem.options());
  comm::all_gather(pg, all_mem, mem);
  all_mem = all_mem.to(at::kCPU);
  if (rank == 0) {
    std::vector<double> per_rank, state_mib, owned_mib, gpu_mib;
    for (int r = 0; r < world; ++r) {
      per_rank.push_back(all_mem[4 * r].item<double>());
      state_mib.push_back(all_mem[4 * r + 1].item<double>());
      owned_mib.push_back(all_mem[4 * r + 2].item<double>());
      gpu_mib.push_back(all_mem[4 * r + 3].item<double>());
    }
    const int64_t trained = o.steps - start;  // steps of this run (after a resumed checkpoint's)
    const double tokens_per_s = trained > 0 ? tokens_per_step * trained / total_time : 0.0;
    train::JsonLine summary;
    if (scaling.enabled()) summary.add("skipped_steps", scaling.skipped_steps()).add("loss_scale", scaling.current_scale());
    if (device.is_cuda()) {
      summary.add("peak_gpu_mib", *std::max_element(gpu_mib.begin(), gpu_mib.end())).add("peak_gpu_mib_per_rank", gpu_mib)
          .add("gpu", util::device_name(device));
    }
    if (peak_tflops > 0) {
      summary.add("mfu", mfu(tokens_per_s)).add("peak_tflops", peak_tflops).add("flops_per_token", flops_per_token);
    }
    metrics.write(summary.add("final", true).add("steps", o.steps).add("world_size", world)
                      .add("strategy", o.strategy).add("param_checksum", checksum).add("param_sq", sq)
                      .add("tokens_per_s", tokens_per_s).add("mean_step_time_s", trained > 0 ? total_time / trained : 0.0)
                      .add("start_step", start)
                      .add("peak_rss_mib_per_rank", per_rank).add("optimizer_state_mib_per_rank", state_mib)
                      .add("peak_owned_mib_per_rank", owned_mib).add("parameters", num_parameters).add("threads_per_rank", at::get_num_threads())
                      .add("blas", util::blas_name()));
    std::printf("dtrain-gpt: done: %lld steps, %.1f tokens/s, param checksum %.10g, peak RSS %.0f MiB (rank 0)",
                static_cast<long long>(o.steps), tokens_per_s, checksum, per_rank[0]);
    if (scaling.enabled()) {
      std::printf(", %lld step(s) skipped, loss scale %g", static_cast<long long>(scaling.skipped_steps()),
                  scaling.current_scale());
    }
    std::printf("\n");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  for (const auto& a : args) {
    if (a == "--help" || a == "-h") {
      std::cout << gpt_demo::usage();
      return 0;
    }
  }
  gpt_demo::Options options;
  try {
    options = gpt_demo::parse_options(args);
  } catch (const std::exception& e) {
    std::cerr << "dtrain-gpt: " << e.what() << "\n\n" << gpt_demo::usage();
    return 2;
  }
  const char* rank = std::getenv("RANK");
  const std::string who = std::string("dtrain-gpt [rank ") + (rank ? rank : "0") + "]";
  try {
    return run(options);
  } catch (const c10::Error& e) {
    std::cerr << who << ": error: " << e.what_without_backtrace() << "\n";
  } catch (const std::exception& e) {
    std::cerr << who << ": error: " << e.what() << "\n";
  }
  return 1;
}
