#include "dtrain/launch/options.h"
#include "dtrain/launch/cores.h"
#include "dtrain/util/parse.h"

#include <sys/resource.h>
#include <sys/stat.h>

#include <algorithm>
#include <charconv>
#include <cctype>
#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include <torch/cuda.h>

namespace dtrain::launch {
namespace {

int parse_int(const std::string& flag, const std::string& value) {
  auto v = util::parse_int(value);
  if (!v || *v < INT32_MIN || *v > INT32_MAX) throw UsageError(flag + ": expected an integer, got '" + value + "'");
  return static_cast<int>(*v);
}

// The job secret from a file: its first line, at least 16 characters of [A-Za-z0-9_-]; the file
// must not be readable by others (as ssh insists for keys). Its content is never printed.
std::string read_secret_file(const std::string& flag, const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw UsageError(flag + ": cannot read " + path);
  if (st.st_mode & (S_IRWXG | S_IRWXO)) {
    throw UsageError(flag + ": " + path + " is readable or writable by others; chmod 600 it");
  }
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  const bool ok = s.size() >= 16 && s.size() <= 256 && std::all_of(s.begin(), s.end(), [](char c) {
                    return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_';
                  });
  if (!ok) throw UsageError(flag + ": " + path + " must hold one line of 16 to 256 letters, digits, '-' or '_'");
  return s;
}

double parse_seconds(const std::string& flag, const std::string& value) {
  auto v = util::parse_double(value);
  if (!v) throw UsageError(flag + ": expected a number of seconds, got '" + value + "'");
  return *v;
}

// The cores dtrun may run on (its affinity: taskset, cpusets), at least 1.
int usable_cores() { return std::max(1, static_cast<int>(allowed_cores().size())); }

// --nproc-per-node: a count, or torchrun's "auto" (GPUs if any, else CPU cores), "cpu", "gpu".
int parse_nproc(const std::string& flag, const std::string& value) {
  if (value == "cpu") return usable_cores();
  if (value == "gpu") {
    int gpus = static_cast<int>(torch::cuda::device_count());
    if (gpus == 0) throw UsageError(flag + " gpu: no CUDA device is visible");
    return gpus;
  }
  if (value == "auto") {
    int gpus = static_cast<int>(torch::cuda::device_count());
    return gpus > 0 ? gpus : usable_cores();
  }
  return parse_int(flag, value);
}

// --nnodes N or MIN:MAX (torchrun's elastic range: Design note [elastic membership], agent.h).
void parse_nnodes(const std::string& flag, const std::string& value, LaunchOptions& o) {
  auto colon = value.find(':');
  if (colon == std::string::npos) {
    o.nnodes = parse_int(flag, value);
    o.min_nodes = 0;
    return;
  }
  const int lo = parse_int(flag, value.substr(0, colon));
  const int hi = parse_int(flag, value.substr(colon + 1));
  if (lo < 1 || lo > hi)
    throw UsageError(flag + " " + value + ": MIN:MAX needs 1 <= MIN <= MAX (the job runs while at least MIN nodes are alive)");
  o.min_nodes = lo;
  o.nnodes = hi;
}

// HOST[:PORT], [IPV6]:PORT.
void parse_endpoint(const std::string& flag, const std::string& value, LaunchOptions& o) {
  std::string host = value;
  std::string port;
  if (!value.empty() && value.front() == '[') {
    auto close = value.find(']');
    if (close == std::string::npos) throw UsageError(flag + ": unterminated '[' in '" + value + "'");
    host = value.substr(1, close - 1);
    std::string rest = value.substr(close + 1);
    if (!rest.empty()) {
      if (rest.front() != ':') throw UsageError(flag + ": expected HOST:PORT, got '" + value + "'");
      port = rest.substr(1);
    }
  } else {
    auto colon = value.rfind(':');
    if (colon != std::string::npos) {
      host = value.substr(0, colon);
      port = value.substr(colon + 1);
    }
  }
  if (host.empty()) throw UsageError(flag + ": missing host in '" + value + "'");
  o.master_addr = host;
  o.master_port = port.empty() ? kDefaultRdzvPort : parse_int(flag, port);
}

// 128 random bits as hex, from the kernel's generator.
std::string random_secret() {
  unsigned char b[16] = {};
  std::ifstream in("/dev/urandom", std::ios::binary);
  in.read(reinterpret_cast<char*>(b), sizeof(b));
  if (!in) throw UsageError("cannot read /dev/urandom for the job secret");
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (unsigned char c : b) {
    s += hex[c >> 4];
    s += hex[c & 15];
  }
  return s;
}

std::string random_run_id() {
  std::random_device rd;
  std::ostringstream s;
  s << std::hex << rd() << rd();
  return s.str();
}

}  // namespace

LaunchOptions parse_args(const std::vector<std::string>& args) {
  LaunchOptions o;
  bool port_from_endpoint = false;
  bool port_from_flag = false;

  using Setter = std::function<void(const std::string& flag, const std::string& value)>;
  struct Flag {
    bool takes_value;
    Setter set;
  };
  auto ignored = [](const std::string&, const std::string&) {};
  auto not_supported = [](const std::string& why) {
    return [why](const std::string& flag, const std::string&) { throw UsageError(flag + ": " + why); };
  };
  const std::string python_only = "dtrun runs executables, not Python modules or scripts";
  const std::map<std::string, Flag> flags = {
      {"help", {false, [&](auto&, auto&) { o.help = true; }}},
      {"nproc-per-node", {true, [&](auto& f, auto& v) { o.nproc_per_node = parse_nproc(f, v); }}},
      {"nnodes", {true, [&](auto& f, auto& v) { parse_nnodes(f, v, o); }}},
      {"rdzv-last-call", {true, [&](auto& f, auto& v) { o.rdzv_last_call_s = parse_seconds(f, v); }}},
      {"node-rank", {true, [&](auto& f, auto& v) { o.node_rank = parse_int(f, v); }}},
      {"master-addr", {true, [&](auto& f, auto& v) {
         if (v.empty()) throw UsageError(f + ": empty host");
         o.master_addr = v;
       }}},
      {"master-port", {true, [&](auto& f, auto& v) {
         o.master_port = parse_int(f, v);
         port_from_flag = true;
       }}},
      {"rdzv-endpoint", {true, [&](auto& f, auto& v) {
         parse_endpoint(f, v, o);
         port_from_endpoint = true;
       }}},
      {"rdzv-backend", {true, [&](auto& f, auto& v) {
         if (v != "static" && v != "c10d")
           throw UsageError(f + " " + v + ": dtrun's agents always meet in node 0's agent store "
                            "(like 'static' and 'c10d'); other backends are not supported");
       }}},
      {"rdzv-id", {true, [&](auto&, auto& v) { o.run_id = v; }}},
      {"rdzv-conf", {true, ignored}},
      {"rdzv-timeout", {true, [&](auto& f, auto& v) { o.rdzv_timeout_s = parse_seconds(f, v); }}},
      {"heartbeat-timeout", {true, [&](auto& f, auto& v) { o.heartbeat_timeout_s = parse_seconds(f, v); }}},
      {"stall-timeout", {true, [&](auto& f, auto& v) { o.stall_timeout_s = parse_seconds(f, v); }}},
      {"job-secret-file", {true, [&](auto& f, auto& v) { o.job_secret = read_secret_file(f, v); }}},
      {"standalone", {false, [&](auto&, auto&) { o.standalone = true; }}},
      {"keep-survivors", {false, [&](auto&, auto&) { o.keep_survivors = true; }}},
      {"allocator", {true, [&](auto& f, auto& v) {
         if (v != "auto" && v != "system" && v != "tcmalloc" && v != "jemalloc")
           throw UsageError(f + " must be auto, system, tcmalloc or jemalloc, not '" + v + "'");
         o.allocator = v;
       }}},
      {"bind-cores", {true, [&](auto& f, auto& v) {
         if (v != "auto" && v != "on" && v != "off") throw UsageError(f + " must be on, off or auto, not '" + v + "'");
         o.bind_cores = v;
       }}},
      {"max-restarts", {true, [&](auto& f, auto& v) { o.max_restarts = parse_int(f, v); }}},
      {"monitor-interval", {true, [&](auto& f, auto& v) { o.monitor_interval_s = parse_seconds(f, v); }}},
      {"term-timeout", {true, [&](auto& f, auto& v) { o.term_timeout_s = parse_seconds(f, v); }}},
      {"role", {true, [&](auto& f, auto& v) {
         if (v.empty()) throw UsageError(f + ": empty role name");
         o.role = v;
       }}},
      // torchrun compatibility: accepted, no effect (dtrun always runs the program directly and
      // always forwards output with a rank prefix).
      {"no-python", {false, ignored}},
      {"tee", {true, ignored}},
      {"redirects", {true, ignored}},
      {"start-method", {true, ignored}},
      {"local-addr", {true, ignored}},
      {"log-dir", {true, not_supported("dtrun writes no log files; worker output goes to dtrun's "
                                       "stdout/stderr with a rank prefix")}},
      {"module", {false, not_supported(python_only)}},
      {"run-path", {false, not_supported(python_only)}},
  };
  const std::map<std::string, std::string> short_flags = {
      {"-h", "help"}, {"-n", "nproc-per-node"}, {"-m", "module"}, {"-r", "redirects"}, {"-t", "tee"}};

  size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') break;  // the program
    std::string name;
    std::optional<std::string> inline_value;
    std::string shown;  // the flag as the user should see it in errors
    if (arg[1] == '-') {
      auto eq = arg.find('=');
      name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
      if (eq != std::string::npos) inline_value = arg.substr(eq + 1);
      shown = "--" + name;
      std::replace(name.begin(), name.end(), '_', '-');
    } else {
      std::string key = arg.substr(0, 2);
      auto it = short_flags.find(key);
      if (it == short_flags.end()) throw UsageError("unknown flag " + arg);
      name = it->second;
      if (arg.size() > 2) inline_value = arg.substr(2);  // -n2
      shown = key;
    }
    auto it = flags.find(name);
    if (it == flags.end()) throw UsageError("unknown flag " + shown);
    const Flag& flag = it->second;
    std::string value;
    if (flag.takes_value) {
      if (inline_value) {
        value = *inline_value;
      } else {
        if (i + 1 >= args.size()) throw UsageError(shown + " needs a value");
        value = args[++i];
      }
    } else if (inline_value) {
      throw UsageError(shown + " takes no value");
    }
    flag.set(shown, value);
  }
  o.command.assign(args.begin() + static_cast<std::ptrdiff_t>(i), args.end());

  if (o.help) return o;
  if (port_from_flag && port_from_endpoint)
    throw UsageError("give either --master-port or --rdzv-endpoint HOST:PORT, not both");
  if (o.standalone && o.run_id == "none") o.run_id = random_run_id();
  if (o.standalone) {
    o.job_secret = random_secret();
  } else if (o.job_secret.empty()) {
    const char* s = std::getenv("DTRAIN_JOB_SECRET");
    if (s) o.job_secret = s;
  }
  validate(o);
  return o;
}

void validate(LaunchOptions& o) {
  if (o.command.empty()) throw UsageError("no program to run (dtrun [flags] PROGRAM [ARGS...])");
  if (o.nproc_per_node < 0) throw UsageError("--nproc-per-node must be at least 1 (or 0 for a coordinator node 0)");
  // What this machine can run: at most 8 workers per core (more only oversubscribes; a typo such as
  // 1000000 would fork until the system refuses), and within the user's process limit.
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  if (o.nproc_per_node > 8 * cores) {
    throw UsageError("--nproc-per-node " + std::to_string(o.nproc_per_node) + " is more than this machine can run (" +
                     std::to_string(cores) + " cores; at most " + std::to_string(8 * cores) + " workers per node)");
  }
  struct rlimit nproc {};
  if (::getrlimit(RLIMIT_NPROC, &nproc) == 0 && nproc.rlim_cur != RLIM_INFINITY &&
      static_cast<rlim_t>(o.nproc_per_node) >= nproc.rlim_cur) {
    throw UsageError("--nproc-per-node " + std::to_string(o.nproc_per_node) + " reaches the process limit (ulimit -u " +
                     std::to_string(nproc.rlim_cur) + ")");
  }
  if (o.nnodes < 1) throw UsageError("--nnodes must be at least 1");
  if (o.min_nodes == 0) o.min_nodes = o.nnodes;
  if (o.rdzv_last_call_s < 0 || (o.elastic() && o.rdzv_last_call_s >= o.rdzv_timeout_s))
    throw UsageError("--rdzv-last-call must be at least 0 and less than --rdzv-timeout");
  if (o.coordinator() && (!o.elastic() || o.node_rank != 0))
    throw UsageError("--nproc-per-node 0 (a coordinator that trains nothing) is only for node 0 of an elastic job "
                     "(--nnodes MIN:MAX --node-rank 0); every other node needs at least 1 worker");
  // (under a coordinator node 0 the training nodes are 1..MAX: node 0's settings tell which, at
  // the rendezvous: AgentStore::settings_mismatch)
  const int last_rank = o.elastic() ? o.nnodes : o.nnodes - 1;
  if (o.node_rank < 0 || o.node_rank > last_rank)
    throw UsageError("--node-rank " + std::to_string(o.node_rank) + " is out of range for --nnodes " +
                     (o.elastic() ? std::to_string(o.min_nodes) + ":" : std::string()) + std::to_string(o.nnodes) +
                     " (0.." + std::to_string(o.nnodes - 1) +
                     (o.elastic() ? "; 1.." + std::to_string(o.nnodes) + " under a coordinator node 0" : std::string()) + ")");
  if (o.standalone) {
    if (o.nnodes != 1) throw UsageError("--standalone runs a single node; drop --nnodes " + std::to_string(o.nnodes));
    o.master_addr = "127.0.0.1";
  }
  if (o.master_port == -1) o.master_port = o.nnodes == 1 ? 0 : kDefaultMasterPort;
  if (o.master_port < 0 || o.master_port > 65535)
    throw UsageError("--master-port " + std::to_string(o.master_port) + " is not a TCP port (0..65535)");
  if (o.master_port == 0 && o.node_rank != 0)
    throw UsageError("node rank " + std::to_string(o.node_rank) +
                     " needs node 0's real --master-port (port 0, 'pick a free one', only works on node 0)");
  if (o.max_restarts < 0) throw UsageError("--max-restarts must be at least 0");
  if (o.term_timeout_s < 0) throw UsageError("--term-timeout must not be negative");
  if (o.rdzv_timeout_s <= 0) throw UsageError("--rdzv-timeout must be positive");
  if (o.stall_timeout_s < 0) throw UsageError("--stall-timeout must be 0 (off) or a number of seconds");
  if (o.heartbeat_timeout_s <= 0) throw UsageError("--heartbeat-timeout must be positive");
  if (o.monitor_interval_s <= 0) throw UsageError("--monitor-interval must be positive");
  if (o.world_size() > 1000000) throw UsageError("world size " + std::to_string(o.world_size()) + " is too large");
}

std::string usage() {
  return R"(usage: dtrun [flags] [--] PROGRAM [ARGS...]

Starts --nproc-per-node copies of PROGRAM on this node with torchrun's environment (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...), hosts the agent store on node 0, prefixes
every output line with the worker's rank ("[3]: ..."), stops all workers when one fails and exits
with the failed worker's exit code.

flags (--a-b and --a_b are the same flag; values as --flag V or --flag=V):
  -n, --nproc-per-node P   workers on this node: a number, or auto|cpu|gpu (default 1); 0 on
                           node 0 of a MIN:MAX job: a coordinator that hosts the store and
                           decides the rounds but trains nothing, so any training node can be lost
      --nnodes N|MIN:MAX   number of nodes (default 1); MIN:MAX: elastic, the job runs while
                           at least MIN nodes are alive: a lost node is dropped and a node that
                           starts later joins, each at a restart of every worker at the new size
      --node-rank K        this node's rank, 0..N-1 (MIN:MAX: 0..MAX-1, or 1..MAX under a
                           coordinator node 0; node 0 hosts the store) (default 0)
      --rdzv-last-call S   MIN:MAX: once MIN nodes joined, wait S seconds for more (default 5)
      --master-addr HOST   node 0's address, where the agent store listens (default 127.0.0.1)
      --master-port PORT   the agent store's port; 0 = let node 0 pick a free one
                           (default: free port for one node, 29500 for several)
      --rdzv-endpoint HOST[:PORT]  same as --master-addr HOST --master-port PORT (default 29400)
      --standalone         single node on 127.0.0.1 with a free port and a random run id
      --max-restarts R     restart the whole group (every node) up to R times after failures
                           (a node joining an elastic job restarts it without counting) (default 0)
      --keep-survivors     a worker that fails leaves the others running and is reported to
                           them through the store, for programs that recover in process
                           (dtrain-gpt --elastic); with --max-restarts R a replacement
                           joins in its place; a node gone silent is declared dead too;
                           exit 0 when this node's last survivors end 0; with MIN:MAX fewer
                           than MIN nodes left ends the job; workers that cannot go on in
                           process fail the round for --max-restarts (default off)
      --allocator A        the workers' memory allocator: auto (tcmalloc, else jemalloc, else the
                           system's), system, tcmalloc or jemalloc (preloaded; a missing one
                           names its package) (default auto)
      --bind-cores B       on: each local worker pinned to its own run of cores (within a NUMA
                           node) with OMP_NUM_THREADS its cores; off: left to the OS; auto: on
                           when every worker gets a core (default auto)
      --term-timeout S     seconds between SIGTERM and SIGKILL when stopping workers (default 5)
      --rdzv-timeout S     seconds the agents wait for each other (default 300)
      --job-secret-file F  the job's secret (first line of F, mode 600; or DTRAIN_JOB_SECRET):
                           the same on every node; the agent store's keys are named after it so
                           that no process without it can read, write or stop the job.
                           --standalone makes one. Without one, a multi-node store is open to
                           anyone who reaches it (dtrun warns)
      --stall-timeout S    end the round when no rank made progress (no collective started or
                           ended, no CPU used) for S seconds, printing what each rank was doing
                           and which is stuck (default 300; 0: off). SIGUSR1 to dtrun prints the
                           same report at any time
      --heartbeat-timeout S  a node's dtrun silent this long counts as gone (default 30)
      --monitor-interval S seconds between polls of the agent store (default 0.1)
      --rdzv-id ID         TORCHELASTIC_RUN_ID (default "none")
      --role NAME          ROLE_NAME (default "default")
      --no-python, -t/--tee, -r/--redirects, --start-method, --rdzv-backend static|c10d,
      --rdzv-conf, --local-addr   accepted for torchrun compatibility; no effect
  -h, --help               this text

exit status: 0 when every worker on every node exited 0; the failed worker's exit code
(128+N for signal N) otherwise; 2 for a bad command line; 127 when PROGRAM is not found.
See docs/launch.md.
)";
}

}  // namespace dtrain::launch
