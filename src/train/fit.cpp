#include "dtrain/train/fit.h"

#include <algorithm>

#include "dtrain/comm/all_gather.h"
#include "dtrain/comm/barrier.h"
#include "dtrain/util/memory.h"
#include "dtrain/util/system.h"

#include <cmath>
#include <cstdlib>
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

void print_start(const TrainConfig& cfg, const Session& s, const parallel::Plan& plan, const FitOptions& fo,
                 int64_t parameters, int64_t steps_per_epoch, int64_t samples) {
  const char* p = cfg.program.c_str();
  std::printf("%s: plan %s, %d rank(s): %s\n", p, plan.name().c_str(), s.pg.size(), plan.describe().c_str());
  std::printf("%s: %s (%s parameters)\n", p, fo.model_description.empty() ? "model" : fo.model_description.c_str(),
              human_count(parameters).c_str());
  if (plan.data == parallel::DataParallel::Local && !s.device.is_cuda()) {
    std::printf("%s: --strategy dp spreads each batch over the GPUs of this process, and --device is cpu: training as "
                "--strategy single\n", p);
  }
  std::printf("%s: global batch %lld %s %d data-parallel rank(s) x %s%lld per micro-batch x %lld accumulation; %lld steps "
              "per epoch of %lld samples\n",
              p, static_cast<long long>(plan.batch.global), plan.batch.uneven ? "over" : "=", plan.data_parallel(),
              plan.batch.uneven ? "up to " : "", static_cast<long long>(plan.batch.micro),
              static_cast<long long>(plan.batch.accumulation), static_cast<long long>(steps_per_epoch),
              static_cast<long long>(samples));
  if (cfg.lr_schedule != "constant" || cfg.warmup_steps > 0) {
    std::printf("%s: learning rate %g, %s\n", p, cfg.lr, cfg.lr_schedule_of().describe().c_str());
  }
  const std::string allocator = util::allocator_in_use();
  std::printf("%s: BLAS %s (%d thread(s)), %d intra-op thread(s) per rank, backend %s, allocator %s%s\n", p,
              util::blas_name().c_str(), util::blas_threads(), at::get_num_threads(),
              comm::to_string(s.pg.backend_kind()), allocator.c_str(),
              allocator != "glibc"              ? ""
              : std::getenv("DTRUN") != nullptr ? " (dtrun: --allocator system, or tcmalloc and jemalloc not installed)"
                                                : " (tcmalloc or jemalloc keep less memory: run under dtrun, whose --allocator "
                                                  "auto preloads one, or set LD_PRELOAD)");
  std::printf("%s: device %s (rank 0)%s\n", p, s.device.str().c_str(),
              plan.fsdp.cpu_offload && plan.data == parallel::DataParallel::FullShard ? ", FSDP shards offloaded to the CPU" : "");
  std::fflush(stdout);
}

namespace {
// Every rank's figures of one kind, from the all-gathered table (rank-major, `k` per rank).
std::vector<double> column(const at::Tensor& all, int world, int k, int i) {
  std::vector<double> out;
  for (int r = 0; r < world; ++r) out.push_back(all[k * r + i].item<double>());
  return out;
}
double most(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }
}  // namespace

FitResult Run::finish() {
  const comm::ProcessGroup& pg = session_.pg;
  const int world = pg.size();
  if (pg.rank() == 0) progress_.finish();
  if (saver_) {  // a run ends with its last checkpoint complete
    saver_->wait();
    if (const auto written = saver_->finished(); written && pg.rank() == 0) {
      std::printf("%s: the checkpoint of step %lld is written (%.2f s in the background)\n", cfg_.program.c_str(),
                  static_cast<long long>(written->step), written->write_s);
      std::fflush(stdout);
    }
  }
  if (snapshots_) snapshots_->wait();  // (the last exchange; its failure ends the run as the others do)
  if (!cfg_.export_weights.empty()) export_weights(cfg_, pg, *strategy_);
  const int64_t tensor_peak = util::peak_bytes(session_.device);
  // Checksums of the full parameters (identical on every rank) and memory.
  const auto [checksum, sq] = strategy_->param_sums();
  auto mem = at::tensor(std::vector<double>{util::peak_rss_mib(), strategy_->optimizer_state_bytes() / 1048576.0,
                                            strategy_->peak_owned_bytes() / 1048576.0,
                                            util::peak_device_memory_mib(session_.device), tensor_peak / 1048576.0},
                        at::kDouble).to(pg.device());
  auto all = at::empty({5 * world}, mem.options());
  comm::all_gather(pg, all, mem);
  all = all.to(at::kCPU);
  FitResult result;
  result.start_step = start_;
  const int64_t trained = cfg_.eval_only ? 0 : cfg_.steps - start_;  // steps of this run (after a resumed checkpoint's)
  result.tokens_per_s = trained > 0 ? tokens_per_step_ * trained / total_time_ : 0.0;
  result.param_checksum = checksum;
  result.param_sq = sq;
  result.val_loss = last_val_loss_;
  if (pg.rank() != 0) return result;
  const std::vector<double> rss = column(all, world, 5, 0), state = column(all, world, 5, 1),
                            owned = column(all, world, 5, 2), gpu = column(all, world, 5, 3), tensors = column(all, world, 5, 4);
  JsonLine summary;
  if (scaling_.enabled()) summary.add("skipped_steps", scaling_.skipped_steps()).add("loss_scale", scaling_.current_scale());
  if (session_.device.is_cuda()) {
    summary.add("peak_gpu_mib", most(gpu)).add("peak_gpu_mib_per_rank", gpu).add("gpu", util::device_name(session_.device));
  }
  if (const double u = mfu(result.tokens_per_s, fo_.flops_per_token, peak_tflops_, world)) {
    summary.add("mfu", u).add("peak_tflops", peak_tflops_).add("flops_per_token", fo_.flops_per_token);
  }
  if (owned[0] >= 0) summary.add("peak_owned_mib_per_rank", owned);  // (tracked by FSDP only)
  // The steps' most live tensor memory (CPU: counted allocations, util/memory.h; CUDA: allocated),
  // and what the memory plan predicted for it.
  if (util::counting_cpu_allocations() || session_.device.is_cuda()) {
    summary.add("peak_tensor_mib", most(tensors)).add("peak_tensor_mib_per_rank", tensors);
  }
  if (predicted_ >= 0) summary.add("predicted_peak_mib", predicted_ / 1048576.0);
  if (last_val_loss_) summary.add("val_loss", *last_val_loss_).add("eval_samples", eval_samples());
  metrics_.write(summary.add("final", true).add("steps", cfg_.steps).add("world_size", world)
                     .add("strategy", parallel::kind_name(plan_)).add("plan", plan_.name())
                     .add("tp", static_cast<int64_t>(plan_.layout.tensor)).add("pp", static_cast<int64_t>(plan_.layout.pipeline))
                     .add("sequence_parallel", plan_.sequence_parallel).add("activation_checkpointing", plan_.recompute)
                     .add("global_batch", plan_.batch.global).add("accumulation", plan_.batch.accumulation)
                     .add("param_checksum", checksum).add("param_sq", sq)
                     .add("tokens_per_s", result.tokens_per_s).add("mean_step_time_s", trained > 0 ? total_time_ / trained : 0.0)
                     .add("start_step", start_).add("peak_rss_mib_per_rank", rss).add("optimizer_state_mib_per_rank", state)
                     .add("parameters", parameters_)
                     .add("threads_per_rank", at::get_num_threads()).add("blas", util::blas_name()));
  std::printf("%s: done: %lld steps, %.1f tokens/s, param checksum %.10g, peak RSS %.0f MiB (rank 0)", cfg_.program.c_str(),
              static_cast<long long>(cfg_.steps), result.tokens_per_s, checksum, rss[0]);
  if (scaling_.enabled()) {
    std::printf(", %lld step(s) skipped, loss scale %g", static_cast<long long>(scaling_.skipped_steps()),
                scaling_.current_scale());
  }
  std::printf("\n");
  std::fflush(stdout);
  return result;
}

void check_val_data(const TrainConfig& cfg, bool given) {
  if (!cfg.val_data.empty() && !given) {
    throw std::invalid_argument("--val-data: " + cfg.program + " reads no held-out samples from a path; hold out the "
                                "last samples of its data with --val-fraction F");
  }
}

bool report_plan(const Session& session, const TrainConfig& cfg, const MemoryPlan& plan) {
  if (session.pg.rank() == 0) {
    std::printf("%s", format_plan(plan, cfg.program).c_str());
    std::fflush(stdout);
    if (cfg.plan) write_plan(cfg, plan);
  }
  if (!cfg.plan) return true;
  if (cfg.picks_plan() && plan.budget > 0) chosen(plan);  // (nothing fits: the error)
  // --plan ends here: every rank leaves together, so that a rank still building a layout's groups
  // never finds the store gone (rank 0 serves it where no launcher agent does: srun, torch env://).
  comm::barrier(session.pg);
  return false;
}

void write_plan(const TrainConfig& cfg, const MemoryPlan& plan) {
  if (cfg.metrics.empty()) return;
  MetricsWriter metrics(cfg.metrics);
  auto mib = [](int64_t b) { return static_cast<double>(b) / 1048576.0; };
  for (size_t i = 0; i < plan.candidates.size(); ++i) {
    const Candidate& c = plan.candidates[i];
    JsonLine line;
    line.add("plan", c.name).add("strategy", parallel::kind_name(c.plan)).add("recompute", c.plan.recompute)
        .add("tp", static_cast<int64_t>(c.plan.layout.tensor)).add("pp", static_cast<int64_t>(c.plan.layout.pipeline))
        .add("sequence_parallel", c.plan.sequence_parallel).add("accumulation", c.plan.batch.accumulation)
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
