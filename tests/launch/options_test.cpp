// dtrun's command line: flags, torchrun spellings, validation.
#include <gtest/gtest.h>

#include "dtrain/launch/options.h"

namespace dtrain::launch {
namespace {

LaunchOptions parse(std::vector<std::string> args) { return parse_args(args); }

std::string usage_error(std::vector<std::string> args) {
  try {
    parse_args(args);
  } catch (const UsageError& e) {
    EXPECT_EQ(e.exit_code(), 2);
    return e.what();
  }
  ADD_FAILURE() << "no UsageError";
  return "";
}

TEST(LaunchOptions, Defaults) {
  auto o = parse({"prog"});
  EXPECT_EQ(o.nproc_per_node, 1);
  EXPECT_EQ(o.nnodes, 1);
  EXPECT_EQ(o.node_rank, 0);
  EXPECT_EQ(o.master_addr, "127.0.0.1");
  EXPECT_EQ(o.master_port, 0) << "one node: the store picks a free port";
  EXPECT_EQ(o.max_restarts, 0);
  EXPECT_DOUBLE_EQ(o.term_timeout_s, 5.0);
  EXPECT_EQ(o.run_id, "none");
  EXPECT_EQ(o.command, (std::vector<std::string>{"prog"}));
}

TEST(LaunchOptions, TorchrunSpellings) {
  for (auto flag : {"--nproc-per-node", "--nproc_per_node"}) {
    auto o = parse({flag, "4", "prog"});
    EXPECT_EQ(o.nproc_per_node, 4) << flag;
  }
  EXPECT_EQ(parse({"--nproc-per-node=3", "prog"}).nproc_per_node, 3);
  EXPECT_EQ(parse({"--nproc_per_node=3", "prog"}).nproc_per_node, 3);
  EXPECT_EQ(parse({"-n", "2", "prog"}).nproc_per_node, 2);
  EXPECT_EQ(parse({"-n2", "prog"}).nproc_per_node, 2);

  auto o = parse({"--nnodes", "2", "--node_rank=1", "--master_addr", "10.0.0.1", "--master-port", "1234",
                  "--max_restarts", "3", "--no-python", "--term-timeout", "0.5", "--rdzv-id", "job7", "prog"});
  EXPECT_EQ(o.nnodes, 2);
  EXPECT_EQ(o.node_rank, 1);
  EXPECT_EQ(o.master_addr, "10.0.0.1");
  EXPECT_EQ(o.master_port, 1234);
  EXPECT_EQ(o.max_restarts, 3);
  EXPECT_DOUBLE_EQ(o.term_timeout_s, 0.5);
  EXPECT_EQ(o.run_id, "job7");
  EXPECT_EQ(parse({"--nnodes", "2:2", "prog"}).nnodes, 2);
  // torchrun's logging flags are accepted and change nothing.
  EXPECT_EQ(parse({"--redirects", "3", "--tee", "3", "--rdzv-backend", "c10d", "prog"}).command[0], "prog");
  EXPECT_EQ(parse({"-r", "1", "-t", "1", "--no_python", "prog"}).command[0], "prog");
}

TEST(LaunchOptions, MultiNodeDefaultsToTorchrunPort) {
  auto o = parse({"--nnodes", "2", "--master-addr", "h0", "prog"});
  EXPECT_EQ(o.master_port, kDefaultMasterPort);
}

TEST(LaunchOptions, RdzvEndpoint) {
  auto o = parse({"--nnodes=2", "--rdzv-endpoint", "node0:4321", "prog"});
  EXPECT_EQ(o.master_addr, "node0");
  EXPECT_EQ(o.master_port, 4321);
  o = parse({"--nnodes=2", "--rdzv_endpoint=node0", "prog"});
  EXPECT_EQ(o.master_port, kDefaultRdzvPort);
  o = parse({"--rdzv-endpoint", "[::1]:777", "prog"});
  EXPECT_EQ(o.master_addr, "::1");
  EXPECT_EQ(o.master_port, 777);
}

TEST(LaunchOptions, Standalone) {
  auto o = parse({"--standalone", "--nproc-per-node", "2", "prog"});
  EXPECT_TRUE(o.standalone);
  EXPECT_EQ(o.master_addr, "127.0.0.1");
  EXPECT_EQ(o.master_port, 0);
  EXPECT_NE(o.run_id, "none") << "standalone gets a random run id";
}

TEST(LaunchOptions, ProgramArgumentsAreNotParsed) {
  auto o = parse({"-n", "2", "prog", "--nnodes", "5", "-x", "--", "y"});
  EXPECT_EQ(o.nnodes, 1);
  EXPECT_EQ(o.command, (std::vector<std::string>{"prog", "--nnodes", "5", "-x", "--", "y"}));
  o = parse({"-n", "2", "--", "--weird-name", "a"});
  EXPECT_EQ(o.command, (std::vector<std::string>{"--weird-name", "a"}));
}

TEST(LaunchOptions, Help) {
  EXPECT_TRUE(parse({"--help"}).help);
  EXPECT_TRUE(parse({"-h"}).help);
  EXPECT_NE(usage().find("--nproc-per-node"), std::string::npos);
}

TEST(LaunchOptions, BadCommandLines) {
  EXPECT_NE(usage_error({"--bogus", "prog"}).find("unknown flag --bogus"), std::string::npos);
  EXPECT_NE(usage_error({"-x", "prog"}).find("unknown flag -x"), std::string::npos);
  EXPECT_NE(usage_error({"--nproc-per-node"}).find("--nproc-per-node needs a value"), std::string::npos);
  EXPECT_NE(usage_error({"--nproc-per-node", "two", "prog"}).find("expected an integer, got 'two'"), std::string::npos);
  EXPECT_NE(usage_error({"--nproc-per-node", "-1", "prog"}).find("at least 1"), std::string::npos);
  // (0: a coordinator, only node 0 of an elastic job: Design note [a coordinator node])
  EXPECT_NE(usage_error({"--nproc-per-node", "0", "prog"}).find("only for node 0 of an elastic job"), std::string::npos);
  EXPECT_NE(usage_error({"-n", "0", "--nnodes", "2", "prog"}).find("only for node 0 of an elastic job"), std::string::npos);
  EXPECT_NE(usage_error({"-n", "0", "--nnodes", "1:2", "--node-rank", "1", "prog"}).find("only for node 0"), std::string::npos);
  EXPECT_NE(usage_error({"--nnodes", "2", "--node-rank", "2", "prog"}).find("out of range"), std::string::npos);
  EXPECT_NE(usage_error({"--nnodes", "3:2", "prog"}).find("1 <= MIN <= MAX"), std::string::npos);
  EXPECT_NE(usage_error({"--nnodes", "0:2", "prog"}).find("1 <= MIN <= MAX"), std::string::npos);
  EXPECT_NE(usage_error({"--nnodes", "1:2", "--node-rank", "3", "prog"}).find("1..2 under a coordinator node 0"),
            std::string::npos);
  EXPECT_NE(usage_error({"--rdzv-last-call", "-1", "prog"}).find("--rdzv-last-call"), std::string::npos);
  EXPECT_NE(usage_error({"--nnodes", "1:2", "--rdzv-timeout", "3", "--rdzv-last-call", "3", "prog"}).find("less than --rdzv-timeout"),
            std::string::npos);
  EXPECT_NE(usage_error({"-n", "2"}).find("no program"), std::string::npos);
  EXPECT_NE(usage_error({"--master-port", "70000", "prog"}).find("not a TCP port"), std::string::npos);
  EXPECT_NE(usage_error({"--standalone", "--nnodes", "2", "prog"}).find("single node"), std::string::npos);
  EXPECT_NE(usage_error({"--nnodes", "2", "--node-rank", "1", "--master-port", "0", "prog"}).find("node 0's real"),
            std::string::npos);
  EXPECT_NE(usage_error({"--max-restarts", "-1", "prog"}).find("--max-restarts"), std::string::npos);
  EXPECT_NE(usage_error({"--term-timeout", "soon", "prog"}).find("number of seconds"), std::string::npos);
  EXPECT_NE(usage_error({"--standalone=yes", "prog"}).find("takes no value"), std::string::npos);
  EXPECT_NE(usage_error({"-m", "prog"}).find("not Python modules"), std::string::npos);
  EXPECT_NE(usage_error({"--master-port", "1", "--rdzv-endpoint", "h:2", "prog"}).find("not both"), std::string::npos);
  EXPECT_NE(usage_error({"--rdzv-backend", "etcd", "prog"}).find("not supported"), std::string::npos);
}

TEST(LaunchOptions, ValidateIsTheOnePlace) {
  LaunchOptions o;
  o.command = {"prog"};
  o.nproc_per_node = 2;
  o.nnodes = 3;
  o.node_rank = 2;
  validate(o);
  EXPECT_EQ(o.master_port, kDefaultMasterPort);
  EXPECT_EQ(o.world_size(), 6);
  o.node_rank = 3;
  EXPECT_THROW(validate(o), UsageError);
  // An elastic job's training nodes are 1..MAX under a coordinator node 0 (-n 0 there).
  o.min_nodes = 1;
  validate(o);
  o.node_rank = 0;
  o.nproc_per_node = 0;
  validate(o);
  EXPECT_TRUE(o.coordinator());
  EXPECT_EQ(o.world_size(), 0);
}

}  // namespace
}  // namespace dtrain::launch
