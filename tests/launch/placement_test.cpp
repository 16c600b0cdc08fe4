// Where dtrun's workers run (issue 32): the allocator preloaded (Design note [the workers'
// allocator], launch/allocator.h) and the cores each is bound to (Design note [ranks bound to
// cores], launch/cores.h): the choices as pure functions, then what real workers find in their
// own /proc entries, on one node and on two.
#include <gtest/gtest.h>

#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "dtrain/launch/allocator.h"
#include "dtrain/launch/cores.h"
#include "dtrain/launch/options.h"
#include "dtrain/util/fs.h"
#include "testing/testing.h"

namespace dtrain::launch {
namespace {

using dtrain::testing::bin;
using dtrain::testing::read_file;
using dtrain::testing::run_command;
using dtrain::testing::temp_dir;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(Cores, ListsParseAndPrint) {
  EXPECT_EQ(parse_cpu_list("0-3,8,10-11\n"), (std::vector<int>{0, 1, 2, 3, 8, 10, 11}));
  EXPECT_EQ(parse_cpu_list(""), std::vector<int>{});
  EXPECT_THROW(parse_cpu_list("3-1"), std::invalid_argument);
  EXPECT_THROW(parse_cpu_list("a"), std::invalid_argument);
  EXPECT_EQ(cpu_list({0, 1, 2, 3, 8, 10, 11}), "0-3,8,10-11");
}

TEST(Cores, SplitIntoEqualRunsWithinNumaNodes) {
  const std::vector<int> eight{0, 1, 2, 3, 4, 5, 6, 7};
  // One node: contiguous runs, the remainder to none.
  EXPECT_EQ(split_cores(eight, 3, {eight}), (std::vector<std::vector<int>>{{0, 1}, {2, 3}, {4, 5}}));
  EXPECT_EQ(split_cores({0, 1}, 2, {}), (std::vector<std::vector<int>>{{0}, {1}}));
  // Two NUMA nodes whose cores interleave: each node's ranks on its own cores.
  const std::vector<std::vector<int>> nodes{{0, 2, 4, 6}, {1, 3, 5, 7}};
  EXPECT_EQ(split_cores(eight, 4, nodes), (std::vector<std::vector<int>>{{0, 2}, {4, 6}, {1, 3}, {5, 7}}));
  // Ranks that do not divide among the nodes: runs over the allowed cores in order.
  EXPECT_EQ(split_cores(eight, 3, nodes), (std::vector<std::vector<int>>{{0, 1}, {2, 3}, {4, 5}}));
  // Only what this process may use (its affinity) is split.
  EXPECT_EQ(split_cores({4, 5, 6, 7}, 2, nodes), (std::vector<std::vector<int>>{{4, 6}, {5, 7}}));
  // Nodes with unequal shares of the allowed cores: equal runs over the cores in order instead.
  EXPECT_EQ(split_cores({0, 1, 2, 3, 4, 5}, 2, {{0, 1, 2, 3}, {4, 5, 6, 7}}), (std::vector<std::vector<int>>{{0, 1, 2}, {3, 4, 5}}));
  // More ranks than cores: no binding.
  EXPECT_TRUE(split_cores({0, 1}, 3, {}).empty());
}

TEST(Cores, HardwareThreadsOfOneCoreStayTogether) {
  // Two cores with two threads each, numbered as x86 machines do: CPUs 0, 1 on cores 0, 1; CPUs
  // 2, 3 their second threads.
  const auto core_of = [](int cpu) { return std::make_pair(0, cpu % 2); };
  const std::vector<int> ordered = by_physical_core({0, 1, 2, 3}, core_of);
  EXPECT_EQ(ordered, (std::vector<int>{0, 2, 1, 3}));
  EXPECT_EQ(split_cores(ordered, 2, {}), (std::vector<std::vector<int>>{{0, 2}, {1, 3}}));  // (not {0, 1} and {2, 3})
  // Packages first, then cores.
  EXPECT_EQ(by_physical_core({0, 1, 2, 3}, [](int cpu) { return std::make_pair(cpu % 2, cpu / 2); }),
            (std::vector<int>{0, 2, 1, 3}));
}

TEST(Allocator, AutoTakesTheFirstInstalledAndANamedMissingOneNamesItsPackage) {
  const std::set<std::string> both{"/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"};
  auto in = [](const std::set<std::string>& files) { return [files](const std::string& p) { return files.count(p) > 0; }; };
  AllocatorChoice a = choose_allocator("auto", in(both));
  EXPECT_EQ(a.kind, Allocator::Tcmalloc);
  EXPECT_EQ(a.library, "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4");
  EXPECT_TRUE(a.automatic);
  EXPECT_EQ(choose_allocator("auto", in({"/usr/lib64/libjemalloc.so.2"})).library, "/usr/lib64/libjemalloc.so.2");
  EXPECT_EQ(choose_allocator("auto", in({})).kind, Allocator::System);
  EXPECT_EQ(choose_allocator("jemalloc", in(both)).kind, Allocator::Jemalloc);
  EXPECT_EQ(choose_allocator("system", in(both)).kind, Allocator::System);
  try {
    choose_allocator("tcmalloc", in({"/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}));
    ADD_FAILURE() << "a missing allocator was accepted";
  } catch (const UsageError& e) {
    EXPECT_TRUE(contains(e.what(), "libtcmalloc_minimal.so.4 is not installed")) << e.what();
    EXPECT_TRUE(contains(e.what(), "apt-get install libtcmalloc-minimal4")) << e.what();
  }
  // Preloaded first, before what the user preloads; nothing for the system's.
  EXPECT_EQ(allocator_env(a, "/opt/x.so").at("LD_PRELOAD"), a.library + ":/opt/x.so");
  EXPECT_EQ(allocator_env(a, "").at("LD_PRELOAD"), a.library);
  EXPECT_TRUE(allocator_env(choose_allocator("system", in(both)), "/opt/x.so").empty());
  EXPECT_THROW(parse_args({"--allocator", "mimalloc", "true"}), UsageError);
  EXPECT_THROW(parse_args({"--bind-cores", "yes", "true"}), UsageError);
  EXPECT_EQ(parse_args({"true"}).allocator, "auto");
}

// "[rank]:key value" lines a worker printed, by rank.
std::map<int, std::string> per_rank(const std::string& output, const std::string& key) {
  std::map<int, std::string> out;
  const std::regex line("\\[(\\d+)\\]:" + key + " ([^\\n]*)");
  for (std::sregex_iterator it(output.begin(), output.end(), line), end; it != end; ++it) out[std::stoi((*it)[1])] = (*it)[2];
  return out;
}

// What each worker of `dtrun -n 2 FLAGS` finds: the allocators mapped into a process it starts
// (its environment's LD_PRELOAD), its allowed cores, its OMP_NUM_THREADS.
const char* kReport =
    " sh -c 'echo \"maps $(grep -o -E \"lib(tc|je)malloc[a-z_]*\" /proc/self/maps | sort -u | tr \"\\n\" \" \")\"; "
    "echo \"cores $(sed -n \"s/^Cpus_allowed_list:[[:space:]]*//p\" /proc/self/status)\"; echo \"threads $OMP_NUM_THREADS\"'";

TEST(DtrunPlacement, WorkersRunOnTheAllocatorDtrunChose) {
  const auto tcmalloc = find_allocator(Allocator::Tcmalloc, util::fs::exists);
  const auto jemalloc = find_allocator(Allocator::Jemalloc, util::fs::exists);
  if (!tcmalloc || !jemalloc) GTEST_SKIP() << "needs libtcmalloc-minimal4 and libjemalloc2 (scripts/install-deps.sh installs them)";
  for (const std::string allocator : {"auto", "tcmalloc", "jemalloc", "system"}) {
    SCOPED_TRACE(allocator);
    const auto r = run_command("env -u LD_PRELOAD " + bin("dtrun") + " -n 2 --allocator " + allocator + kReport, 30);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::string want = allocator == "system" ? "" : allocator == "jemalloc" ? "libjemalloc" : "libtcmalloc";
    const auto maps = per_rank(r.output, "maps");
    ASSERT_EQ(maps.size(), 2u) << r.output;
    for (const auto& [rank, found] : maps) {
      if (want.empty()) {
        EXPECT_EQ(found, "") << "rank " << rank << "\n" << r.output;
      } else {
        EXPECT_TRUE(contains(found, want)) << "rank " << rank << ": " << found << "\n" << r.output;
      }
    }
    EXPECT_TRUE(contains(r.output, "dtrun: workers run on " + std::string(allocator == "system" ? "the system's" : ""))) << r.output;
  }
  // auto leaves a preload the user set alone (a sanitizer's runtime, an allocator of their own).
  const auto own = run_command("LD_PRELOAD=" + *jemalloc + " " + bin("dtrun") + " -n 1 --allocator auto" + kReport, 30);
  ASSERT_EQ(own.exit_code, 0) << own.output;
  EXPECT_EQ(per_rank(own.output, "maps").at(0), "libjemalloc ") << own.output;
  EXPECT_TRUE(contains(own.output, "LD_PRELOAD already set")) << own.output;
}

TEST(DtrunPlacement, EachWorkerIsBoundToItsOwnCores) {
  const std::vector<int> cores = allowed_cores();
  // Cores: each of the two ranks on its own half of dtrun's cores (auto binds where each gets
  // one), OMP_NUM_THREADS its count; off leaves every worker dtrun's cores and no OMP_NUM_THREADS.
  const auto bound = run_command("env -u OMP_NUM_THREADS " + bin("dtrun") + " -n 2" + kReport, 30);
  const auto off = run_command("env -u OMP_NUM_THREADS " + bin("dtrun") + " -n 2 --bind-cores off" + kReport, 30);
  ASSERT_EQ(bound.exit_code, 0) << bound.output;
  ASSERT_EQ(off.exit_code, 0) << off.output;
  for (int rank : {0, 1}) {
    EXPECT_EQ(per_rank(off.output, "cores").at(rank), cpu_list(cores)) << off.output;
    EXPECT_EQ(per_rank(off.output, "threads").at(rank), "") << off.output;
  }
  if (cores.size() < 2) GTEST_SKIP() << "one core: nothing to split";
  const auto runs = split_cores(by_physical_core(cores, physical_core_of), 2, numa_nodes());
  std::set<int> seen;
  for (int rank : {0, 1}) {
    const std::vector<int> mine = parse_cpu_list(per_rank(bound.output, "cores").at(rank));
    EXPECT_EQ(mine, runs[rank]) << bound.output;
    for (int c : mine) EXPECT_TRUE(seen.insert(c).second) << "core " << c << " given twice\n" << bound.output;
    EXPECT_EQ(per_rank(bound.output, "threads").at(rank), std::to_string(mine.size())) << bound.output;
  }
  EXPECT_TRUE(contains(bound.output, "each bound to its cores")) << bound.output;
  // Too many ranks to bind on: refused with on, unbound with auto.
  const int many = static_cast<int>(cores.size()) + 1;
  const auto refused = run_command(bin("dtrun") + " -n " + std::to_string(many) + " --bind-cores on true", 30);
  EXPECT_EQ(refused.exit_code, 2) << refused.output;
  EXPECT_TRUE(contains(refused.output, "cannot have a core each")) << refused.output;
  // --nproc-per-node cpu counts the cores dtrun may use (its affinity), not the machine's.
  const auto one = run_command("taskset -c " + std::to_string(cores.front()) + " " + bin("dtrun") +
                                   " -n cpu sh -c 'echo \"workers $LOCAL_WORLD_SIZE\"'", 30);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  EXPECT_EQ(per_rank(one.output, "workers").at(0), "1") << one.output;
}

TEST(DtrunPlacement, EachNodeChoosesForItsOwnWorkers) {
  if (!find_allocator(Allocator::Jemalloc, util::fs::exists)) GTEST_SKIP() << "needs libjemalloc2";
  const std::string dir = temp_dir();
  const std::string common = " --nnodes 2 --nproc-per-node 1 --master-addr 127.0.0.1 --rdzv-timeout 15 --allocator jemalloc ";
  const auto r = run_command(
      bin("dtrun") + common + "--node-rank 0 --master-port 0" + kReport + " > " + dir + "/n0.log 2>&1 & p0=$!; " +
          "port=; for i in $(seq 300); do port=$(sed -n 's/.*agent store listening on 127.0.0.1:\\([0-9]*\\).*/\\1/p' " + dir +
          "/n0.log); [ -n \"$port\" ] && break; sleep 0.05; done; " + bin("dtrun") + common + "--node-rank 1 --master-port \"$port\"" +
          kReport + " > " + dir + "/n1.log 2>&1; echo node1_exit=$?; wait $p0; echo node0_exit=$?",
      40);
  const std::string logs = read_file(dir + "/n0.log") + read_file(dir + "/n1.log");
  ASSERT_TRUE(contains(r.output, "node0_exit=0") && contains(r.output, "node1_exit=0")) << r.output << logs;
  const auto maps = per_rank(logs, "maps");
  ASSERT_EQ(maps.size(), 2u) << logs;
  for (const auto& [rank, found] : maps) EXPECT_TRUE(contains(found, "libjemalloc")) << "rank " << rank << "\n" << logs;
}

}  // namespace
}  // namespace dtrain::launch
