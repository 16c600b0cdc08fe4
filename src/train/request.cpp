// The request from the command line and a configuration document (config.h): the common keys
// (config.cpp), the program's own flags (ExtraFlags), the document under the command line.
#include <algorithm>
#include <iostream>
#include <stdexcept>

#include "dtrain/train/config.h"
#include "keys.h"

namespace dtrain::train {

bool TrainConfig::loss_scaling() const { return loss_scale == "dynamic" || (loss_scale.empty() && precision == "fp16"); }

optim::LrSchedule TrainConfig::lr_schedule_of() const {
  optim::LrSchedule s;
  s.kind = optim::parse_lr_schedule(lr_schedule);
  s.warmup_steps = warmup_steps;
  s.total_steps = steps;
  s.decay_steps = decay_steps;
  s.min_factor = lr > 0 ? min_lr / lr : 0.0;
  return s;
}

void TrainConfig::validate() const {
  auto refuse = [](const std::string& why) { throw std::invalid_argument(why); };
  const bool sharded = strategy == "fsdp" || strategy == "hsdp";
  if (strategy == "auto" && (tp > 1 || pp > 1)) {
    refuse("--strategy auto picks the layout itself (data parallel, and tensor and pipeline parallel where the program "
           "builds its model per layout): give --strategy with --tp or --pp, or leave them out");
  }
  if (!sharded && (!sharding.empty() || init_on_ranks || shard_size > 0)) {
    refuse("--sharding, --shard-size and --init-on-ranks apply to --strategy fsdp or hsdp");
  }
  if (strategy == "hsdp" && !sharding.empty() && sharding != "hybrid") {
    refuse("--strategy hsdp is hybrid sharding; use --strategy fsdp --sharding " + sharding);
  }
  if (!sharded && (!backward_prefetch.empty() || !overlap_reduction.empty() || max_gathered_units > 0)) {
    refuse("--backward-prefetch, --overlap-reduction and --max-gathered-units apply to --strategy fsdp or hsdp");
  }
  const bool hybrid = sharding == "hybrid" || (sharding.empty() && strategy == "hsdp");
  if (shard_size > 0 && !hybrid) refuse("--shard-size applies to hybrid sharding");
  if (cpu_offload && !sharded) {
    refuse("--cpu-offload applies to --strategy fsdp or hsdp (ddp and zero keep every tensor on --device)");
  }
  if (given.count("wrap") && !sharded) refuse("--wrap applies to --strategy fsdp or hsdp");
  if (given.count("wrap") && pp > 1) refuse("--wrap picks FSDP's units; with --pp each pipeline stage is one unit");
  if (precision == "fp16" && device != "cuda") {
    refuse("--precision fp16 needs --device cuda (fp16 autocast is CUDA-only in libtorch); on the CPU use --precision bf16");
  }
  if (backend == "nccl" && device != "cuda") refuse("--backend nccl moves CUDA tensors only: use --device cuda, or --backend gloo");
  if (given.count("max-skipped-steps") && !loss_scaling()) {
    refuse("--max-skipped-steps applies to --loss-scale dynamic (without it a non-finite loss or gradient norm stops "
           "the run at once)");
  }
  if (given.count("loss-scale-growth-interval") && !loss_scaling()) {
    refuse("--loss-scale-growth-interval applies to --loss-scale dynamic");
  }
  if (pp == 1 && (microbatches > 0 || !schedule.empty() || virtual_stages > 1)) {
    refuse("--microbatches, --schedule and --virtual-stages apply to pipeline parallelism (--pp N)");
  }
  if (global_batch_size > 0 && given.count("grad-accum")) {
    refuse("--global-batch-size sets the samples per step and the plan accumulates what its ranks do not take at "
           "once: leave --grad-accum out");
  }
  if (memory_budget > 0 && strategy != "auto" && !plan && !elastic) {
    refuse("--memory-budget applies to --strategy auto (or --plan, to mark what fits; or --elastic, to check every "
           "membership's plan against it)");
  }
  if (plan && (tp > 1 || pp > 1)) {
    refuse("--plan lists the layouts itself (data parallel, and tensor and pipeline parallel where the program builds "
           "its model per layout); leave out --tp and --pp");
  }
  if (min_lr > lr) refuse("--min-lr " + std::to_string(min_lr) + " is above --lr " + std::to_string(lr) + ": the schedule decays from --lr down to --min-lr");
  if (given.count("min-lr") && lr_schedule == "constant") refuse("--min-lr applies to --lr-schedule cosine, linear or wsd");
  lr_schedule_of().validate();
  if (optimizer == "sgd" && (given.count("beta1") || given.count("beta2") || given.count("eps"))) {
    refuse("--beta1, --beta2 and --eps are AdamW's: with --optimizer sgd leave them out");
  }
  if (eval_only && resume.empty()) refuse("--eval-only evaluates a checkpoint: give --resume DIR");
  if (evaluates() && val_fraction == 0 && val_data.empty()) {
    refuse(std::string(eval_only ? "--eval-only" : "--eval-every") + " needs held-out samples: --val-fraction F (the last F "
           "of --data) or --val-data PATH");
  }
  if (val_fraction > 0 && !val_data.empty()) refuse("--val-fraction and --val-data both name the held-out samples: give one");
  if (eval_batches > 0 && !evaluates()) refuse("--eval-batches applies to --eval-every N or --eval-only");
  if (eval_only && eval_every > 0) refuse("--eval-only evaluates once and trains nothing: leave --eval-every out");
  if (save_every > 0 && save.empty()) refuse("--save-every needs --save DIR (where to write the checkpoints)");
  if (save_async && save.empty()) refuse("--save-async needs --save DIR (where to write the checkpoints)");
  if (snapshot_sync && snapshot_every != 1) {
    refuse("--snapshot-sync ends each step's partner snapshot within the step, so that a failure redoes only the step in "
           "flight: it needs --snapshot-every 1");
  }
  validate_elastic();
}

// --elastic (Design note [in-process recovery], train/elastic.h): ddp and hsdp (around pipeline
// stages and tensor-parallel layers too): Design note [whole units]; zero1, zero2 and fsdp
// (partner snapshots; zero1 and fsdp around pipeline stages, all three around tensor-parallel
// layers, in whole units too), on Gloo; with --grad-compression too (Design note [gradient
// compression]: a hook's state starts over at a membership change).
void TrainConfig::validate_elastic() const {
  auto refuse = [](const std::string& why) { throw std::invalid_argument(why); };
  if (given.count("elastic-join-timeout") && !elastic) refuse("--elastic-join-timeout applies to --elastic");
  if (!elastic) return;
  const bool hybrid = sharding == "hybrid" || (sharding.empty() && strategy == "hsdp");
  const bool sharded = strategy == "zero1" || strategy == "zero2" || (strategy == "fsdp" && !hybrid);
  if (strategy != "ddp" && !hybrid && !sharded) {
    refuse("--elastic recovers in process --strategy ddp, hsdp, zero1, zero2 and fsdp (with --pp and --tp where the "
           "plan allows them); for --strategy " + strategy + " leave --elastic out and let dtrun --max-restarts "
           "resume it from --save's checkpoints");
  }
  if (snapshot_every > 0 && (hybrid || ((pp > 1 || tp > 1) && !sharded))) {
    refuse("--snapshot-every: with --strategy " + strategy + (pp > 1 ? " --pp" : "") + (tp > 1 ? " --tp" : "") +
           " every part of the state is in another replica's memory (Design note [whole units]): partner snapshots "
           "would never be read; leave it out");
  }
  if (sharded && snapshot_every == 0) {
    refuse("--elastic with --strategy " + strategy + " needs --snapshot-every N: each rank's part of the state is on no "
           "other rank, so the survivors roll back to the partner snapshots (N = 1: to the last committed step, or the one before it where the failure cut its exchange)");
  }
  if (global_batch_size == 0) {
    refuse("--elastic needs --global-batch-size N: the samples of every step, which each world size the job takes "
           "keeps (at least the largest world size; where a size does not divide it, the ranks' shares are uneven and "
           "weighted by their samples)");
  }
  if (memory_budget > 0 && init_on_ranks) {
    refuse("--memory-budget with --elastic measures one micro-batch through the model, which --init-on-ranks builds "
           "without values: leave one of them out");
  }
  if (memory_budget > 0 && (tp > 1 || pp > 1 || hybrid)) {
    refuse("--memory-budget with --elastic checks the plans the memory planner counts (ddp, zero1, zero2, fsdp without "
           "--tp or --pp; Design note [memory plan]): leave it out with --tp, --pp and hsdp");
  }
  if (device == "cuda" && backend != "gloo") refuse("--elastic needs Gloo (libtorch 1.13 cannot abort an NCCL group): add --backend gloo");
}

namespace {

// Every flag name, common and the program's, without "--".
std::vector<std::string> known_names(const ExtraFlags& extra) {
  std::vector<std::string> names{"config", "print-config", "help"};
  for (const auto& k : detail::keys()) names.push_back(k.name);
  for (const auto& [flag, set] : extra.valued) names.push_back(flag.substr(2));
  for (const auto& [flag, set] : extra.switches) names.push_back(flag.substr(2));
  return names;
}

[[noreturn]] void unknown(const std::string& what, const std::string& name, const ExtraFlags& extra, bool flag) {
  const std::string near = detail::nearest(name, known_names(extra));
  const std::string dash = flag ? "--" : "";
  throw std::invalid_argument(what + (near.empty() ? "" : " (did you mean " + dash + near + "?)"));
}

bool is_switch(const std::string& name, const ExtraFlags& extra) {
  if (name == "print-config") return true;
  if (const detail::Key* k = detail::find_key(name)) return k->is_switch;
  return extra.switches.count("--" + name) > 0;
}

// Sets `name` to `value` (a switch: "true"/"false") from the command line or a document.
void apply(TrainConfig& o, const ExtraFlags& extra, const std::string& name, const std::string& value) {
  if (const detail::Key* k = detail::find_key(name)) {
    const std::string before = k->get(o);
    k->set(o, value);
    if (k->get(o) != before) o.given.insert(name);  // (a default written out, e.g. by --print-config, changes nothing)
    return;
  }
  if (auto it = extra.valued.find("--" + name); it != extra.valued.end()) {
    it->second(value);
  } else if (auto s = extra.switches.find("--" + name); s != extra.switches.end()) {
    if (value != "true" && value != "false") throw std::invalid_argument("--" + name + " expects true or false, got '" + value + "'");
    if (value == "true") s->second();
  } else {
    throw std::logic_error("apply: unknown key " + name);
  }
  for (auto& [given, v] : o.program_flags) {  // (given again: the later value)
    if (given == name) {
      v = value;
      return;
    }
  }
  o.program_flags.emplace_back(name, value);
}

// The command line as (name, value) pairs, names checked.
std::vector<std::pair<std::string, std::string>> split(const std::vector<std::string>& args, const ExtraFlags& extra) {
  const std::vector<std::string> names = known_names(extra);
  std::vector<std::pair<std::string, std::string>> out;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string flag = args[i], value;
    const auto eq = flag.find('=');
    const bool inline_value = flag.rfind("--", 0) == 0 && eq != std::string::npos;
    if (inline_value) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
    }
    const std::string name = flag.rfind("--", 0) == 0 ? flag.substr(2) : flag;
    if (flag.rfind("--", 0) != 0 || std::find(names.begin(), names.end(), name) == names.end()) {
      unknown("unknown option '" + args[i] + "'", name, extra, true);
    }
    if (!inline_value && is_switch(name, extra)) {
      value = "true";
    } else if (!inline_value) {
      if (i + 1 >= args.size()) throw std::invalid_argument(flag + " needs a value");
      value = args[++i];
    }
    out.emplace_back(name, value);
  }
  return out;
}

}  // namespace

TrainConfig parse_config(const std::vector<std::string>& args, const ExtraFlags& extra, TrainConfig defaults) {
  TrainConfig o = std::move(defaults);
  const auto flags = split(args, extra);
  for (const auto& [name, value] : flags) {
    if (name == "config") o.config = value;
  }
  if (!o.config.empty()) {  // the document first: the command line overrides it
    const std::vector<std::string> names = known_names(extra);
    for (const auto& [name, value] : detail::read_document(o.config)) {
      if (name == "config" || name == "print-config" || name == "help" ||
          std::find(names.begin(), names.end(), name) == names.end()) {
        unknown(o.config + ": unknown key '" + name + "'", name, extra, false);
      }
      apply(o, extra, name, value);
    }
  }
  for (const auto& [name, value] : flags) {
    if (name != "config" && name != "print-config" && name != "help") apply(o, extra, name, value);
  }
  o.validate();
  if (extra.check) extra.check();
  return o;
}

TrainConfig request_from_toml(const std::string& text, const std::string& program) {
  TrainConfig o;
  o.program = program;
  for (const auto& [name, value] : detail::read_toml_text(text, program + " configuration")) {
    if (const detail::Key* k = detail::find_key(name)) k->set(o, value);
  }
  return o;
}

std::optional<int> parse_command_line(int argc, char** argv, TrainConfig& cfg, const ExtraFlags& extra,
                                      const std::string& summary) {
  std::vector<std::string> args(argv + 1, argv + argc);
  bool print = false;
  for (const auto& a : args) {
    if (a == "--help" || a == "-h") {
      std::cout << usage(cfg.program, summary, extra);
      return 0;
    }
    print = print || a == "--print-config";
  }
  try {
    cfg = parse_config(args, extra, cfg);
  } catch (const std::exception& e) {
    std::cerr << cfg.program << ": " << e.what() << " (" << cfg.program << " --help lists every flag)\n";
    return 2;
  }
  if (print) {
    std::cout << to_toml(cfg);
    return 0;
  }
  return std::nullopt;
}

}  // namespace dtrain::train
