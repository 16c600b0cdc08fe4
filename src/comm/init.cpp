#include "dtrain/comm/init.h"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <thread>

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "dtrain/compat.h"
#include "dtrain/util/parse.h"
#include "dtrain/util/system.h"

namespace dtrain::comm {

namespace {

int parse_int(const std::string& name, const std::string& value, int lo, int hi) {
  auto v = util::parse_int(value);
  if (!v || *v < lo || *v > hi) {
    throw std::invalid_argument(name + "='" + value + "' is not an integer in [" + std::to_string(lo) +
                                ", " + std::to_string(hi) + "]");
  }
  return static_cast<int>(*v);
}

std::optional<int> get_int(const EnvLookup& env, const std::string& name, int lo, int hi) {
  auto v = env(name);
  if (!v) return std::nullopt;
  return parse_int(name, *v, lo, hi);
}

// SLURM_TASKS_PER_NODE looks like "2(x3),1": expand it and pick node `node`'s count.
std::optional<int> slurm_tasks_on_node(const std::string& spec, int node) {
  int index = 0;
  size_t pos = 0;
  while (pos < spec.size()) {
    size_t end = spec.find(',', pos);
    if (end == std::string::npos) end = spec.size();
    std::string item = spec.substr(pos, end - pos);
    int repeat = 1;
    size_t paren = item.find("(x");
    int count = std::stoi(item.substr(0, paren));
    if (paren != std::string::npos) repeat = std::stoi(item.substr(paren + 2));
    if (node < index + repeat) return count;
    index += repeat;
    pos = end + 1;
  }
  return std::nullopt;
}

bool truthy(const std::optional<std::string>& v) {
  if (!v) return false;
  std::string s = *v;
  std::transform(s.begin(), s.end(), s.begin(), ::tolower);
  return s == "1" || s == "true" || s == "yes" || s == "on";
}

}  // namespace

std::string slurm_first_host(const std::string& nodelist) {
  // "node[03-05,9],gpu1" -> "node03"; "a1,a2" -> "a1"; "host" -> "host".
  size_t bracket = nodelist.find('[');
  size_t comma = nodelist.find(',');
  if (bracket == std::string::npos || (comma != std::string::npos && comma < bracket)) {
    return nodelist.substr(0, comma);
  }
  std::string prefix = nodelist.substr(0, bracket);
  size_t close = nodelist.find(']', bracket);
  if (close == std::string::npos) throw std::invalid_argument("malformed SLURM node list '" + nodelist + "'");
  std::string inner = nodelist.substr(bracket + 1, close - bracket - 1);
  std::string first = inner.substr(0, std::min(inner.find(','), inner.find('-')));
  return prefix + first;
}

LaunchInfo resolve_launch_info(const EnvLookup& env) {
  LaunchInfo info;
  constexpr int kMax = 1 << 24;
  if (env("RANK") || env("WORLD_SIZE")) {
    // torchrun / dtrun / hand-written env:// contract.
    info.source = "env";
    if (!env("RANK") || !env("WORLD_SIZE")) {
      throw std::invalid_argument("RANK and WORLD_SIZE must be set together (got only " +
                                  std::string(env("RANK") ? "RANK" : "WORLD_SIZE") + ")");
    }
    info.world_size = *get_int(env, "WORLD_SIZE", 1, kMax);
    info.rank = *get_int(env, "RANK", 0, info.world_size - 1);
    info.local_world_size = get_int(env, "LOCAL_WORLD_SIZE", 1, kMax).value_or(info.world_size);
    info.local_rank = get_int(env, "LOCAL_RANK", 0, info.local_world_size - 1).value_or(info.rank % info.local_world_size);
  } else if (env("SLURM_PROCID")) {
    info.source = "slurm";
    info.world_size = get_int(env, "SLURM_NTASKS", 1, kMax).value_or(1);
    info.rank = *get_int(env, "SLURM_PROCID", 0, info.world_size - 1);
    info.local_rank = get_int(env, "SLURM_LOCALID", 0, kMax).value_or(0);
    std::optional<int> local_n;
    if (auto spec = env("SLURM_TASKS_PER_NODE")) {
      try {
        local_n = slurm_tasks_on_node(*spec, get_int(env, "SLURM_NODEID", 0, kMax).value_or(0));
      } catch (const std::exception&) {
        throw std::invalid_argument("SLURM_TASKS_PER_NODE='" + *spec + "' is malformed");
      }
    }
    info.local_world_size = local_n.value_or(get_int(env, "SLURM_NTASKS_PER_NODE", 1, kMax).value_or(1));
    if (info.local_rank >= info.local_world_size) {
      throw std::invalid_argument("SLURM_LOCALID=" + std::to_string(info.local_rank) +
                                  " is not below the tasks on this node (" + std::to_string(info.local_world_size) + ")");
    }
    if (auto addr = env("MASTER_ADDR")) {
      info.master_addr = *addr;
    } else if (auto list = env("SLURM_STEP_NODELIST") ? env("SLURM_STEP_NODELIST") : env("SLURM_JOB_NODELIST")) {
      info.master_addr = slurm_first_host(*list);
    }
    if (!env("MASTER_PORT")) {
      // A port derived from the job id, so concurrent jobs on shared nodes differ; override with
      // MASTER_PORT.
      if (auto job = get_int(env, "SLURM_JOB_ID", 0, 2147483647)) info.master_port = 20000 + *job % 20000;
    }
  } else {
    info.source = "default";
  }
  if (auto addr = env("MASTER_ADDR")) info.master_addr = *addr;
  if (auto port = get_int(env, "MASTER_PORT", 0, 65535)) info.master_port = *port;
  info.use_agent_store = truthy(env("TORCHELASTIC_USE_AGENT_STORE"));
  info.restart_count = get_int(env, "TORCHELASTIC_RESTART_COUNT", 0, kMax).value_or(0);
  return info;
}

LaunchInfo resolve_launch_info() {
  return resolve_launch_info([](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (!v) return std::nullopt;
    return std::string(v);
  });
}

int default_threads_per_rank(int local_world_size) {
  if (const char* v = std::getenv("DTRAIN_NUM_THREADS"); v && *v) {
    return parse_int("DTRAIN_NUM_THREADS", v, 1, 4096);
  }
  if (const char* v = std::getenv("OMP_NUM_THREADS"); v && *v) {
    return parse_int("OMP_NUM_THREADS", v, 1, 4096);
  }
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / std::max(1, local_world_size));
}

namespace {

BackendKind pick_backend(const std::string& name) {
  if (name == "gloo") return BackendKind::Gloo;
  if (name == "nccl") return BackendKind::Nccl;
  if (name == "mpi") return BackendKind::Mpi;
  if (name == "auto") {
#ifdef DTRAIN_WITH_NCCL
    if (at::globalContext().hasCUDA()) return BackendKind::Nccl;
#endif
    return BackendKind::Gloo;
  }
  throw std::invalid_argument("unknown backend '" + name + "': use gloo, nccl, mpi or auto");
}

std::pair<std::string, int> parse_host_port(const std::string& hp, const std::string& what) {
  size_t colon = hp.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    throw std::invalid_argument(what + " '" + hp + "' is not host:port");
  }
  std::string host = hp.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return {host, parse_int(what + " port", hp.substr(colon + 1), 1, 65535)};
}

c10::intrusive_ptr<c10d::Store> tcp_store(const std::string& host, int port, int world, bool server,
                                          std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(port);
  opts.isServer = server;
  opts.numWorkers = world;
  opts.waitWorkers = false;
  opts.timeout = timeout;
  opts.multiTenant = true;
  return compat::make_tcp_store(host, opts);
}

// The launcher hosts the store; like torchrun, each restart attempt gets its own keys.
c10::intrusive_ptr<c10d::Store> agent_store(const LaunchInfo& info, int world, std::chrono::milliseconds timeout) {
  auto base = tcp_store(info.master_addr, info.master_port, world, false, timeout);
  // Under dtrun's job secret (Design note [control plane], launch/agent_store.h) the job's
  // keys are named after it: a process that does not hold it cannot name them.
  const char* secret = std::getenv("DTRAIN_JOB_SECRET");
  const std::string job = secret && *secret ? "job-" + std::string(secret) : "";
  return c10::make_intrusive<c10d::PrefixStore>(job + "/worker/attempt_" + std::to_string(info.restart_count), base);
}

}  // namespace

c10::intrusive_ptr<c10d::Store> job_store(const InitOptions& options) {
  const LaunchInfo info = resolve_launch_info();
  if (options.init_method() != "env://" || !info.use_agent_store || info.master_port < 0) {
    throw CommError("joining a running job needs its launcher's store (start the process with dtrun, which sets "
                    "TORCHELASTIC_USE_AGENT_STORE, MASTER_ADDR and MASTER_PORT)");
  }
  try {
    return c10::make_intrusive<c10d::PrefixStore>("dtrain", agent_store(info, info.world_size, options.timeout()));
  } catch (const std::exception& e) {
    throw CommError(std::string("joining a running job: cannot reach its store: ") + e.what());
  }
}

ProcessGroup init_process_group(const InitOptions& options) {
  LaunchInfo info;
  try {
    info = resolve_launch_info();
  } catch (const std::exception& e) {
    throw CommError(std::string("init_process_group: bad launcher environment: ") + e.what());
  }
  const int world = options.world_size() >= 0 ? options.world_size() : info.world_size;
  const int rank = options.rank() >= 0 ? options.rank() : info.rank;
  const std::string where = "[dtrain rank " + std::to_string(rank) + "] init_process_group(" +
                            options.init_method() + "): ";
  if (world < 1 || rank < 0 || rank >= world) {
    throw CommError(where + "rank " + std::to_string(rank) + " is not in [0, world size " +
                    std::to_string(world) + ")");
  }
  BackendKind kind;
  try {
    kind = pick_backend(options.backend());
  } catch (const std::exception& e) {
    throw CommError(where + e.what());
  }
  if (options.configure_threads()) util::set_threads(default_threads_per_rank(info.local_world_size));

  c10::intrusive_ptr<c10d::Store> store;
  const std::string& method = options.init_method();
  try {
    if (method == "env://") {
      if (world == 1 && info.master_port < 0) {
        store = c10::make_intrusive<c10d::HashStore>();  // a single process needs no rendezvous
      } else if (info.master_port < 0) {
        throw std::invalid_argument(
            "MASTER_PORT is not set: start the program with dtrun (or torchrun --no-python, or "
            "srun), or set MASTER_ADDR and MASTER_PORT yourself");
      } else if (info.use_agent_store) {
        store = agent_store(info, world, options.timeout());
      } else {
        store = tcp_store(info.master_addr, info.master_port, world, rank == 0, options.timeout());
      }
    } else if (method.rfind("tcp://", 0) == 0) {
      auto [host, port] = parse_host_port(method.substr(6), "init_method");
      store = tcp_store(host, port, world, rank == 0, options.timeout());
    } else if (method.rfind("file://", 0) == 0) {
      const std::string path = method.substr(7);
      if (path.empty()) throw std::invalid_argument("file:// needs a path, e.g. file:///tmp/rendezvous");
      store = c10::make_intrusive<c10d::FileStore>(path, world);
    } else {
      throw std::invalid_argument("unknown init_method '" + method + "': use env://, tcp://host:port or file:///path");
    }
  } catch (const CommError&) {
    throw;
  } catch (const std::exception& e) {
    throw CommError(where + e.what());
  }
  c10::Device device = kind == BackendKind::Nccl ? c10::Device(c10::kCUDA, info.local_rank)
                                                 : c10::Device(c10::kCPU);
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("dtrain", store);
  return ProcessGroup::create(kind, prefixed, rank, world, options.timeout(), {}, device);
}

}  // namespace dtrain::comm
