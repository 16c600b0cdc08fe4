#include "dtrain/train/session.h"

#include "dtrain/util/memory.h"

#include <cstdlib>
#include <iostream>
#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <torch/cuda.h>

#include "dtrain/util/system.h"

namespace dtrain::train {

// Design note [ranks sharing a GPU]: NCCL refuses two ranks on one device, so with NCCL each local
// rank needs its own GPU. Gloo moves CUDA tensors through host memory (comm/send_recv.cpp stages
// the point-to-point ones, which its send/recv cannot), so over --backend gloo any number of ranks
// may share the GPUs, rank r of a node on cuda:(r mod GPUs). That is slow (every collective through
// the host) and meant for checking a multi-rank layout on a machine with fewer GPUs than ranks:
// the CUDA tests run every plan at W = 2 and 3 on one GPU that way (GptCuda.RanksSharingOneGpu...).
c10::Device resolve_device(const std::string& device, const std::string& backend, int rank, int local_rank,
                           int64_t cuda_devices) {
  if (device == "cpu") return c10::Device(c10::kCPU);
  if (device != "cuda") throw std::invalid_argument("--device must be cpu or cuda, got '" + device + "'");
  const std::string who = "rank " + std::to_string(rank) + ": --device cuda but ";
  if (cuda_devices <= 0) {
    throw std::invalid_argument(who + "this process sees no CUDA device (this libtorch is built without CUDA, or no "
                                      "GPU is visible: check the driver and CUDA_VISIBLE_DEVICES); use --device cpu");
  }
  if (local_rank < 0) throw std::invalid_argument(who + "its LOCAL_RANK is " + std::to_string(local_rank));
  if (local_rank >= cuda_devices) {
    if (backend == "gloo") return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank % cuda_devices));
    throw std::invalid_argument(who + "its LOCAL_RANK " + std::to_string(local_rank) + " has no GPU: this machine has " +
                                std::to_string(cuda_devices) + " CUDA device(s), one per local rank under " + backend +
                                "; start at most " + std::to_string(cuda_devices) +
                                " rank(s) per node (dtrun --nproc-per-node), or let ranks share the GPUs with "
                                "--backend gloo (slow: for checking a layout, not for speed)");
  }
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
}

std::string backend_for(const TrainConfig& cfg) {
  if (cfg.backend != "auto") return cfg.backend;
  return cfg.device == "cuda" ? "nccl" : "gloo";
}

void place_model(torch::nn::Module& model, const c10::Device& device, bool deferred) {
  if (!deferred) {
    model.to(device);
    return;
  }
  at::NoGradGuard no_grad;
  for (auto& p : model.parameters()) p.set_data(at::zeros({}, p.options().device(device)).expand(p.sizes()));
  for (auto& b : model.buffers()) b.set_data(b.to(device));
}

int run_reporting_errors(const std::string& program, const std::function<int()>& body) {
  const char* rank = std::getenv("RANK");
  const std::string who = program + " [rank " + (rank ? rank : "0") + "]";
  try {
    return body();
  } catch (const RunEnded& e) {  // (a process that came to join an elastic run after its end)
    std::cout << who << ": " << e.what() << "\n";
    return 0;
  } catch (const c10::Error& e) {
    std::cerr << who << ": error: " << e.what_without_backtrace() << "\n";
  } catch (const std::exception& e) {
    std::cerr << who << ": error: " << e.what() << "\n";
  }
  return 1;
}

Session start(const TrainConfig& cfg) {
  util::count_cpu_allocations();  // (peak_tensor_mib and the memory planner, util/memory.h)
  Session s;
  s.launch = comm::resolve_launch_info();
  const int64_t gpus = cfg.device == "cuda" ? static_cast<int64_t>(torch::cuda::device_count()) : 0;
  s.device = resolve_device(cfg.device, backend_for(cfg), s.launch.rank, s.launch.local_rank, gpus);
  if (s.device.is_cuda() && s.launch.local_rank == 0 && s.launch.local_world_size > gpus && gpus > 0) {
    std::cerr << "dtrain: " << s.launch.local_world_size << " local ranks share " << gpus
              << " GPU(s) over gloo (rank r on cuda:r mod " << gpus << "; slow, for checking a layout)\n";
  }
  const auto init = comm::InitOptions()
                        .backend(backend_for(cfg))
                        .configure_threads(cfg.threads == 0)
                        .timeout(std::chrono::milliseconds(static_cast<int64_t>(cfg.collective_timeout_s * 1000)));
  const auto elastic = ElasticOptions().join_timeout(std::chrono::seconds(cfg.elastic_join_timeout_s));
  const char* join = std::getenv("DTRAIN_ELASTIC_JOIN");
  if (cfg.elastic && join && *join) {  // (Design note [in-process recovery], train/elastic.h)
    if (cfg.threads == 0) util::set_threads(comm::default_threads_per_rank(s.launch.local_world_size));
    s.elastic = Elastic::join(comm::job_store(init), std::stoi(join), comm::BackendKind::Gloo, init.timeout(),
                              c10::Device(c10::kCPU), elastic);
    s.pg = s.elastic->group();
    s.launch.rank = s.pg.rank();
    s.launch.world_size = s.pg.size();
  } else {
    s.pg = comm::init_process_group(init);
    if (cfg.elastic) s.elastic = std::make_shared<Elastic>(s.pg, elastic);
  }
  if (cfg.threads > 0) util::set_threads(cfg.threads);
  // libtorch seeds its default generators at random per process: here every rank's start from
  // --seed, one random stream that the ranks of a tensor-parallel group draw alike (dropout outside
  // the split regions, Design note [dropout streams], tensor_parallel/dropout.h). The model's init
  // and the data order have their own seeded generators.
  at::manual_seed(cfg.seed);
  return s;
}

}  // namespace dtrain::train
