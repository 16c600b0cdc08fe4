// The launcher contract: env:// (torchrun/dtrun), SLURM, tcp:// and file://.
#include <gtest/gtest.h>

#include <map>
#include <thread>

#include <ATen/ATen.h>

#include "dtrain/comm.h"
#include "testing/testing.h"

using namespace dtrain::comm;

namespace {
EnvLookup env_of(std::map<std::string, std::string> m) {
  return [m](const std::string& k) -> std::optional<std::string> {
    auto it = m.find(k);
    if (it == m.end()) return std::nullopt;
    return it->second;
  };
}
}  // namespace

TEST(LaunchInfo, TorchrunContract) {
  auto info = resolve_launch_info(env_of({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"},
                                          {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "10.1.2.3"},
                                          {"MASTER_PORT", "29400"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                          {"TORCHELASTIC_RESTART_COUNT", "2"}}));
  EXPECT_EQ(info.source, "env");
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.world_size, 4);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 2);
  EXPECT_EQ(info.master_addr, "10.1.2.3");
  EXPECT_EQ(info.master_port, 29400);
  EXPECT_TRUE(info.use_agent_store);
  EXPECT_EQ(info.restart_count, 2);
}

TEST(LaunchInfo, NoLauncherIsASingleProcess) {
  auto info = resolve_launch_info(env_of({}));
  EXPECT_EQ(info.source, "default");
  EXPECT_EQ(info.world_size, 1);
  EXPECT_EQ(info.rank, 0);
  EXPECT_EQ(info.master_port, -1);
}

TEST(LaunchInfo, BadValuesNameTheVariable) {
  auto msg = [](std::map<std::string, std::string> m) {
    try {
      resolve_launch_info(env_of(std::move(m)));
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(msg({{"RANK", "4"}, {"WORLD_SIZE", "4"}}).find("RANK='4'"), std::string::npos);
  EXPECT_NE(msg({{"RANK", "x"}, {"WORLD_SIZE", "4"}}).find("RANK='x'"), std::string::npos);
  EXPECT_NE(msg({{"RANK", "0"}}).find("RANK and WORLD_SIZE must be set together"), std::string::npos);
  EXPECT_NE(msg({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}).find("MASTER_PORT"),
            std::string::npos);
}

TEST(LaunchInfo, Slurm) {
  auto info = resolve_launch_info(env_of({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "6"}, {"SLURM_LOCALID", "1"},
                                          {"SLURM_NODEID", "2"}, {"SLURM_TASKS_PER_NODE", "2(x2),2"},
                                          {"SLURM_JOB_NODELIST", "gpu[07-09]"}, {"SLURM_JOB_ID", "12345"}}));
  EXPECT_EQ(info.source, "slurm");
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.world_size, 6);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 2);
  EXPECT_EQ(info.master_addr, "gpu07");
  EXPECT_EQ(info.master_port, 20000 + 12345 % 20000);
  // MASTER_ADDR / MASTER_PORT win over the derived values.
  info = resolve_launch_info(env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"MASTER_ADDR", "head"},
                                     {"MASTER_PORT", "1234"}, {"SLURM_JOB_ID", "1"}}));
  EXPECT_EQ(info.master_addr, "head");
  EXPECT_EQ(info.master_port, 1234);
}

TEST(LaunchInfo, SlurmHostlist) {
  EXPECT_EQ(slurm_first_host("node[03-05,9],gpu1"), "node03");
  EXPECT_EQ(slurm_first_host("a1,a2"), "a1");
  EXPECT_EQ(slurm_first_host("host"), "host");
  EXPECT_EQ(slurm_first_host("n[7,9]"), "n7");
}

TEST(Init, FileInitMethodWithThreads) {
  const std::string dir = dtrain::testing::temp_dir();
  for (const std::string method : {std::string("file://") + dir + "/rdzv"}) {
    std::vector<std::thread> ts;
    std::vector<float> got(3, -1);
    for (int r = 0; r < 3; ++r) {
      ts.emplace_back([&, r] {
        auto pg = init_process_group(InitOptions().init_method(method).rank(r).world_size(3).backend("gloo")
                                         .timeout(std::chrono::seconds(20)).configure_threads(false));
        auto t = at::ones({1});
        all_reduce(pg, t);
        got[r] = t.item<float>();
      });
    }
    for (auto& t : ts) t.join();
    EXPECT_EQ(got, std::vector<float>(3, 3.0f)) << method;
  }
}

// tcp://host:port through real processes (rank 0 serves the store at that address): every rank
// joins and the all-reduce sums every rank's value. Fails if the address is parsed wrongly (the job
// would time out) or a rank other than 0 tries to serve the store.
TEST(Init, TcpInitMethodAtTwoAndThreeRanks) {
  const std::string w = dtrain::testing::bin("comm_test_worker");
  for (int world : {2, 3}) {
    const std::string method = "tcp://127.0.0.1:" + std::to_string(dtrain::testing::free_port());
    std::string cmd;
    for (int r = world - 1; r >= 1; --r) cmd += w + " all-reduce " + std::to_string(r) + " " + std::to_string(world) + " " + method + " & ";
    cmd += w + " all-reduce 0 " + std::to_string(world) + " " + method + "; s=$?; wait; exit $s";
    const auto res = dtrain::testing::run_command(cmd, 60);
    EXPECT_EQ(res.exit_code, 0) << method << "\n" << res.output;
    const float sum = static_cast<float>(world * (world + 1) / 2);
    for (int r = 0; r < world; ++r) {
      const std::string line = "rank " + std::to_string(r) + ": sum " + c10::str(sum);
      EXPECT_NE(res.output.find(line), std::string::npos) << "W = " << world << ": no \"" << line << "\" in\n" << res.output;
    }
  }
}

TEST(Init, BadInitMethodAndBackend) {
  auto msg = [](InitOptions o) {
    try {
      init_process_group(o.configure_threads(false));
    } catch (const CommError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(msg(InitOptions().init_method("udp://x")).find("unknown init_method"), std::string::npos);
  EXPECT_NE(msg(InitOptions().backend("foo")).find("unknown backend 'foo'"), std::string::npos);
  EXPECT_NE(msg(InitOptions().rank(2).world_size(2)).find("rank 2 is not in"), std::string::npos);
  EXPECT_NE(msg(InitOptions().rank(0).world_size(2)).find("MASTER_PORT is not set"), std::string::npos);
#ifdef DTRAIN_WITH_NCCL
  // A CUDA build accepts nccl; without a GPU to run on, its error says so.
  if (!at::hasCUDA()) EXPECT_NE(msg(InitOptions().backend("nccl")).find("CUDA"), std::string::npos);
#else
  EXPECT_NE(msg(InitOptions().backend("nccl")).find("NCCL"), std::string::npos);
#endif
}

TEST(Init, SingleProcessNeedsNoLauncher) {
  auto pg = init_process_group(InitOptions().configure_threads(false));
  EXPECT_EQ(pg.size(), 1);
  auto t = at::ones({2});
  all_reduce(pg, t);
  EXPECT_TRUE(at::equal(t, at::ones({2})));
}

TEST(Init, ThreadsPerRank) {
  const int cores = std::max(1u, std::thread::hardware_concurrency());
  EXPECT_EQ(default_threads_per_rank(1), cores);
  EXPECT_EQ(default_threads_per_rank(1000), 1);
}
