#include "dtrain/train/fit.h"

#include "dtrain/util/memory.h"

#include <cmath>
#include <sstream>
#include <stdexcept>
#include <unordered_set>

#include "dtrain/comm/process_group.h"

namespace dtrain::train::detail {

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
}  // namespace

int64_t count_parameters(const torch::nn::Module& m) {
  int64_t n = 0;
  std::unordered_set<const void*> seen;
  for (const auto& p : m.parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) n += p.numel();
  }
  return n;
}

void check_finite(const TrainConfig& cfg, int64_t step, double loss, double grad_norm, bool loss_scaling) {
  const bool bad_loss = !std::isfinite(loss);
  const bool bad_norm = grad_norm != -1.0 && !std::isfinite(grad_norm);  // (-1: not computed this step)
  if (!bad_loss && !bad_norm) return;
  std::ostringstream what;
  what << "step " << step << ": the " << (bad_loss ? "loss" : "gradient norm") << " is "
       << (bad_loss ? loss : grad_norm) << ": training diverged; stopping (lower --lr, clip with --clip-grad-norm"
       << (cfg.precision == "fp16" || loss_scaling ? "" : ", or use --loss-scale dynamic to skip such steps") << ")";
  throw std::runtime_error(what.str());
}

void print_start(const TrainConfig& cfg, const Session& s, const FitOptions& fo, int64_t parameters,
                 int64_t global_batch, int64_t steps_per_epoch, int64_t samples) {
  const char* p = cfg.program.c_str();
  std::printf("%s: strategy %s, %d rank(s); %s (%s parameters)\n", p, cfg.strategy.c_str(), s.pg.size(),
              fo.model_description.empty() ? "model" : fo.model_description.c_str(), human_count(parameters).c_str());
  if (cfg.pp > 1) {
    std::printf("%s: pipeline of %d stages (%d rank(s) x %d virtual), schedule %s, %d micro-batches; %d data-parallel "
                "pipeline(s)\n",
                p, cfg.pp * cfg.virtual_stages, cfg.pp, cfg.virtual_stages, cfg.schedule.c_str(), cfg.microbatches,
                s.pg.size() / (cfg.pp * cfg.tp));
  }
  if (cfg.tp > 1) {
    std::printf("%s: tensor parallel over %d rank(s)%s; %d data-parallel rank(s) (%s)\n", p, cfg.tp,
                cfg.sequence_parallel ? " with sequence parallelism" : "", s.pg.size() / (cfg.tp * cfg.pp),
                cfg.fsdp() ? "each tensor rank's pieces sharded over them" : "replicas");
  }
  std::printf("%s: batch %lld per data-parallel rank x %lld accumulation = %lld samples per step; %lld steps per epoch of %lld "
              "samples\n",
              p, static_cast<long long>(cfg.batch_size), static_cast<long long>(cfg.grad_accum),
              static_cast<long long>(global_batch), static_cast<long long>(steps_per_epoch),
              static_cast<long long>(samples));
  std::printf("%s: BLAS %s (%d thread(s)), %d intra-op thread(s) per rank, backend %s\n", p,
              util::blas_name().c_str(), util::blas_threads(), at::get_num_threads(),
              comm::to_string(s.pg.backend_kind()));
  std::printf("%s: device %s (rank 0), precision %s, loss scaling %s%s\n", p, s.device.str().c_str(),
              cfg.precision.c_str(), cfg.loss_scale.c_str(), cfg.cpu_offload ? ", FSDP shards offloaded to the CPU" : "");
  std::fflush(stdout);
}

FitResult finish(const TrainConfig& cfg, const Session& s, Strategy& strategy, const LossScaling& scaling,
                 MetricsWriter& metrics, int64_t start, double total_time, double tokens_per_step,
                 double peak_tflops, const FitOptions& fo, int64_t parameters, int64_t tensor_peak, int64_t predicted) {
  const comm::ProcessGroup& pg = s.pg;
  const int world = pg.size();
  // Checksums of the full parameters (identical on every rank) and memory.
  const auto [checksum, sq] = strategy.param_sums();
  auto mem = at::tensor(std::vector<double>{util::peak_rss_mib(), strategy.optimizer_state_bytes() / 1048576.0,
                                            strategy.peak_owned_bytes() / 1048576.0,
                                            util::peak_device_memory_mib(s.device), tensor_peak / 1048576.0},
                        at::kDouble).to(pg.device());
  auto all_mem = at::empty({5 * world}, mem.options());
  comm::all_gather(pg, all_mem, mem);
  all_mem = all_mem.to(at::kCPU);
  FitResult result;
  result.start_step = start;
  const int64_t trained = cfg.steps - start;  // steps of this run (after a resumed checkpoint's)
  result.tokens_per_s = trained > 0 ? tokens_per_step * trained / total_time : 0.0;
  result.param_checksum = checksum;
  result.param_sq = sq;
  if (pg.rank() != 0) return result;
  std::vector<double> per_rank, state_mib, owned_mib, gpu_mib, tensor_mib;
  for (int r = 0; r < world; ++r) {
    per_rank.push_back(all_mem[5 * r].item<double>());
    state_mib.push_back(all_mem[5 * r + 1].item<double>());
    const double owned = all_mem[5 * r + 2].item<double>();
    if (owned >= 0) owned_mib.push_back(owned);  // (not tracked by replicated strategies: the field is left out)
    gpu_mib.push_back(all_mem[5 * r + 3].item<double>());
    tensor_mib.push_back(all_mem[5 * r + 4].item<double>());
  }
  JsonLine summary;
  if (scaling.enabled()) summary.add("skipped_steps", scaling.skipped_steps()).add("loss_scale", scaling.current_scale());
  if (s.device.is_cuda()) {
    summary.add("peak_gpu_mib", *std::max_element(gpu_mib.begin(), gpu_mib.end())).add("peak_gpu_mib_per_rank", gpu_mib)
        .add("gpu", util::device_name(s.device));
  }
  if (const double u = mfu(result.tokens_per_s, fo.flops_per_token, peak_tflops, world)) {
    summary.add("mfu", u).add("peak_tflops", peak_tflops).add("flops_per_token", fo.flops_per_token);
  }
  if (static_cast<int>(owned_mib.size()) == world) summary.add("peak_owned_mib_per_rank", owned_mib);
  // The steps' most live tensor memory (CPU: counted allocations, util/memory.h; CUDA: allocated),
  // and what the memory plan predicted for it.
  if (util::counting_cpu_allocations() || s.device.is_cuda()) {
    summary.add("peak_tensor_mib", *std::max_element(tensor_mib.begin(), tensor_mib.end()))
        .add("peak_tensor_mib_per_rank", tensor_mib);
  }
  if (predicted >= 0) summary.add("predicted_peak_mib", predicted / 1048576.0);
  metrics.write(summary.add("final", true).add("steps", cfg.steps).add("world_size", world)
                    .add("strategy", cfg.strategy).add("tp", static_cast<int64_t>(cfg.tp)).add("pp", static_cast<int64_t>(cfg.pp))
                    .add("sequence_parallel", cfg.sequence_parallel).add("activation_checkpointing", cfg.activation_checkpointing)
                    .add("param_checksum", checksum).add("param_sq", sq)
                    .add("tokens_per_s", result.tokens_per_s).add("mean_step_time_s", trained > 0 ? total_time / trained : 0.0)
                    .add("start_step", start)
                    .add("peak_rss_mib_per_rank", per_rank).add("optimizer_state_mib_per_rank", state_mib)
                    .add("parameters", parameters)
                    .add("threads_per_rank", at::get_num_threads()).add("blas", util::blas_name()));
  std::printf("%s: done: %lld steps, %.1f tokens/s, param checksum %.10g, peak RSS %.0f MiB (rank 0)",
              cfg.program.c_str(), static_cast<long long>(cfg.steps), result.tokens_per_s, checksum, per_rank[0]);
  if (scaling.enabled()) {
    std::printf(", %lld step(s) skipped, loss scale %g", static_cast<long long>(scaling.skipped_steps()),
                scaling.current_scale());
  }
  std::printf("\n");
  std::fflush(stdout);
  return result;
}

bool report_plan(const Session& session, const TrainConfig& cfg, const MemoryPlan& plan) {
  if (session.pg.rank() == 0) {
    std::printf("%s", format_plan(plan, cfg.program).c_str());
    std::fflush(stdout);
    if (cfg.plan) write_plan(cfg, plan);
  }
  if (!cfg.plan) return true;
  if (cfg.strategy == "auto" && plan.budget > 0) chosen(plan);  // (nothing fits: the error)
  return false;
}

void write_plan(const TrainConfig& cfg, const MemoryPlan& plan) {
  if (cfg.metrics.empty()) return;
  MetricsWriter metrics(cfg.metrics);
  auto mib = [](int64_t b) { return static_cast<double>(b) / 1048576.0; };
  for (size_t i = 0; i < plan.candidates.size(); ++i) {
    const Candidate& c = plan.candidates[i];
    JsonLine line;
    line.add("plan", c.name).add("strategy", c.strategy).add("recompute", c.recompute)
        .add("tp", static_cast<int64_t>(c.tp)).add("pp", static_cast<int64_t>(c.pp)).add("sequence_parallel", c.sequence_parallel)
        .add("world_size", static_cast<int64_t>(plan.world)).add("params_mib", mib(c.params)).add("grads_mib", mib(c.grads))
        .add("optimizer_mib", mib(c.optimizer)).add("buffers_mib", mib(c.buffers)).add("step_mib", mib(c.step_extra))
        .add("other_mib", mib(c.other)).add("predicted_peak_mib", mib(c.total()))
        .add("predicted_rss_mib", c.rss_besides >= 0 ? mib(c.rss_besides + c.total()) : -1.0)
        .add("chosen", static_cast<int>(i) == plan.chosen);
    if (plan.budget > 0) line.add("budget_mib", mib(plan.budget));
    metrics.write(line);
  }
}

}  // namespace dtrain::train::detail
