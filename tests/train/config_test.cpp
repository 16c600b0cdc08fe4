// The request (train/config.h): flags and configuration documents (TOML, JSON) read by one table of
// keys, the command line over the document, unknown keys and flags named with the nearest known
// one, --print-config's document read back as the same request.
#include <gtest/gtest.h>

#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "dtrain/train/config.h"
#include "testing/testing.h"

namespace train = dtrain::train;
using dtrain::testing::temp_dir;

namespace {

std::string write_file(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
  return path;
}

std::string error_of(const std::vector<std::string>& args, const train::ExtraFlags& extra = {}) {
  try {
    train::parse_config(args, extra);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Config, ADocumentIsTheSameRequestAsItsFlags) {
  const std::vector<std::string> flags = {"--strategy", "fsdp", "--batch-size", "3", "--lr", "0.002",
                                          "--activation-checkpointing", "--sharding", "hybrid", "--max-gathered-units", "3",
                                          "--precision", "bf16", "--memory-budget", "1GiB", "--plan"};
  const train::TrainConfig by_flags = train::parse_config(flags);
  const std::string dir = temp_dir();
  const std::string toml = write_file(dir + "/run.toml",
                                 "strategy = \"fsdp\"\nbatch_size = 3\nlr = 0.002\nactivation_checkpointing = true\n"
                                 "sharding = \"hybrid\"\nmax_gathered_units = 3\nprecision = \"bf16\"\nmemory-budget = \"1GiB\"\n"
                                 "plan = true\n");
  const std::string json = write_file(dir + "/run.json",
                                 "{\"strategy\": \"fsdp\", \"batch_size\": 3, \"lr\": 0.002, "
                                 "\"activation_checkpointing\": true, \"sharding\": \"hybrid\", \"max-gathered-units\": 3, "
                                 "\"precision\": \"bf16\", \"memory_budget\": \"1GiB\", \"plan\": true}");
  for (const std::string& doc : {toml, json}) {
    const train::TrainConfig by_doc = train::parse_config({"--config", doc});
    EXPECT_EQ(train::to_toml(by_doc), train::to_toml(by_flags)) << doc;
    EXPECT_TRUE(train::differences(by_doc, by_flags).empty()) << doc;
  }
  // The command line over the document; --print-config's document reads back as the same request.
  const train::TrainConfig over = train::parse_config({"--config", toml, "--lr", "0.005"});
  EXPECT_EQ(over.lr, 0.005);
  EXPECT_EQ(over.batch_size, 3);
  const std::string printed = write_file(dir + "/printed.toml", train::to_toml(over));
  EXPECT_EQ(train::to_toml(train::parse_config({"--config", printed})), train::to_toml(over));
  EXPECT_EQ(train::differences(by_flags, over), (std::vector<std::string>{"lr: 0.002 -> 0.005"}));
}

TEST(Config, UnknownKeysAndFlagsNameTheNearestKnownOne) {
  EXPECT_EQ(error_of({"--bach-size", "4"}), "unknown option '--bach-size' (did you mean --batch-size?)");
  EXPECT_EQ(error_of({"--zzzzzzzz"}), "unknown option '--zzzzzzzz'");
  const std::string doc = write_file(temp_dir() + "/bad.toml", "strategy = \"ddp\"\nlearning_rate = 0.1\n");
  EXPECT_NE(error_of({"--config", doc}).find("bad.toml: unknown key 'learning-rate'"), std::string::npos)
      << error_of({"--config", doc});
  const std::string typo = write_file(temp_dir() + "/typo.json", "{\"stratgy\": \"ddp\"}");
  EXPECT_NE(error_of({"--config", typo}).find("(did you mean strategy?)"), std::string::npos);
  // Values are checked by the flag's own rule, named as the flag.
  const std::string value = write_file(temp_dir() + "/value.toml", "strategy = \"zero9\"\n");
  EXPECT_NE(error_of({"--config", value}).find("--strategy must be single, dp, ddp"), std::string::npos);
  const std::string nested = write_file(temp_dir() + "/nested.toml", "[fsdp]\nsharding = \"full\"\n");
  EXPECT_NE(error_of({"--config", nested}).find("must be a string, a number or true/false"), std::string::npos);
  const std::string broken = write_file(temp_dir() + "/broken.toml", "strategy = \n");
  EXPECT_NE(error_of({"--config", broken}).find("broken.toml:1:"), std::string::npos) << error_of({"--config", broken});
  const std::string yaml = write_file(temp_dir() + "/run.yaml", "strategy: ddp\n");
  EXPECT_NE(error_of({"--config", yaml}).find("TOML (.toml) or JSON (.json)"), std::string::npos);
}

TEST(Config, TheProgramsOwnFlagsAreKeysToo) {
  int64_t layers = 0;
  bool verbose = false;
  train::ExtraFlags extra;
  extra.valued["--layers"] = [&](const std::string& v) { layers = train::int_flag("--layers", v, 1); };
  extra.switches["--verbose"] = [&] { verbose = true; };
  const std::string doc = write_file(temp_dir() + "/own.toml", "layers = 6\nverbose = true\nsteps = 7\n");
  const train::TrainConfig c = train::parse_config({"--config", doc}, extra);
  EXPECT_EQ(layers, 6);
  EXPECT_TRUE(verbose);
  EXPECT_EQ(c.steps, 7);
  EXPECT_NE(train::to_toml(c).find("layers = \"6\""), std::string::npos);
  EXPECT_EQ(error_of({"--layrs", "2"}, extra), "unknown option '--layrs' (did you mean --layers?)");
}

TEST(Config, FlagsThatDoNotApplyAreNamed) {
  EXPECT_NE(error_of({"--strategy", "ddp", "--wrap", "none"}).find("--wrap applies to --strategy fsdp or hsdp"),
            std::string::npos);
  EXPECT_NE(error_of({"--global-batch-size", "16", "--grad-accum", "2"}).find("leave --grad-accum out"),
            std::string::npos);
  EXPECT_NE(error_of({"--schedule", "gpipe"}).find("apply to pipeline parallelism"), std::string::npos);
  EXPECT_EQ(error_of({"--strategy", "zero2", "--tp", "2"}), "");  // (the plan decides what combines)
  for (const std::vector<std::string> every : {std::vector<std::string>{}, {"--snapshot-every", "2"}}) {
    std::vector<std::string> args{"--snapshot-sync"};
    args.insert(args.end(), every.begin(), every.end());
    EXPECT_NE(error_of(args).find("--snapshot-sync ends each step's partner snapshot within the step"), std::string::npos);
  }
  EXPECT_EQ(error_of({"--snapshot-sync", "--snapshot-every", "1"}), "");
}
