// The request's keys (config.h): one table of every common flag, its setter and its value as
// TOML, read by the command line, by configuration documents (document.cpp) and by --print-config.
#include "dtrain/train/config.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <stdexcept>

#include "dtrain/parallel/plan.h"
#include "dtrain/util/parse.h"
#include "keys.h"

namespace dtrain::train {

int64_t int_flag(const std::string& flag, const std::string& v, int64_t lo) {
  auto x = util::parse_int(v);
  if (!x || *x < lo) {
    throw std::invalid_argument(flag + " expects an integer >= " + std::to_string(lo) + ", got '" + v + "'");
  }
  return *x;
}

double positive_flag(const std::string& flag, const std::string& v) {
  auto x = util::parse_double(v);
  if (!x || !(*x > 0)) throw std::invalid_argument(flag + " expects a positive number, got '" + v + "'");
  return *x;
}

double nonnegative_flag(const std::string& flag, const std::string& v) {
  auto x = util::parse_double(v);
  if (!x || !(*x >= 0) || !std::isfinite(*x)) throw std::invalid_argument(flag + " expects a number >= 0, got '" + v + "'");
  return *x;
}

std::string choice_flag(const std::string& flag, const std::string& v, const std::vector<std::string>& choices) {
  std::string list;
  for (size_t i = 0; i < choices.size(); ++i) {
    if (choices[i] == v) return v;
    list += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + choices[i];
  }
  throw std::invalid_argument(flag + " must be " + list + ", got '" + v + "'");
}

int64_t parse_memory_size(const std::string& flag, const std::string& text) {
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  const auto number = util::parse_double(text.substr(0, i));
  const std::string unit = text.substr(i);
  static const std::vector<std::pair<std::string, double>> units = {
      {"", 1},           {"B", 1},           {"KiB", 1024.0},   {"MiB", 1048576.0}, {"GiB", 1073741824.0},
      {"TiB", 1099511627776.0}, {"KB", 1e3}, {"MB", 1e6},        {"GB", 1e9},        {"TB", 1e12}};
  for (const auto& [name, scale] : units) {
    if (unit == name && number && *number > 0) return static_cast<int64_t>(std::llround(*number * scale));
  }
  throw std::invalid_argument(flag + " expects a size such as 512MiB, 4GiB or 1.5GB (KiB/MiB/GiB/TiB, KB/MB/GB/TB or "
                              "bytes), got '" + text + "'");
}

namespace detail {

std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

namespace {

std::string number_text(double x) {
  char buf[40];
  const auto end = std::to_chars(buf, buf + sizeof buf, x).ptr;  // (the shortest text that reads back as x)
  std::string s(buf, end);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";  // (a TOML float)
  return s;
}

bool switch_value(const std::string& key, const std::string& v) {
  if (v == "true" || v == "1") return true;
  if (v == "false" || v == "0") return false;
  throw std::invalid_argument(key + " expects true or false, got '" + v + "'");
}

template <class T>
Key integer(const char* name, T TrainConfig::*field, int64_t at_least) {
  return {name, false, [=](TrainConfig& c, const std::string& v) { c.*field = static_cast<T>(int_flag(std::string("--") + name, v, at_least)); },
          [=](const TrainConfig& c) { return std::to_string(c.*field); }};
}
Key number(const char* name, double TrainConfig::*field) {
  return {name, false, [=](TrainConfig& c, const std::string& v) { c.*field = positive_flag(std::string("--") + name, v); },
          [=](const TrainConfig& c) { return number_text(c.*field); }};
}
Key fraction(const char* name, double TrainConfig::*field, bool below_one) {
  return {name, false,
          [=](TrainConfig& c, const std::string& v) {
            const double x = nonnegative_flag(std::string("--") + name, v);
            if (below_one && !(x < 1)) throw std::invalid_argument(std::string("--") + name + " expects a number in [0, 1), got '" + v + "'");
            c.*field = x;
          },
          [=](const TrainConfig& c) { return number_text(c.*field); }};
}
Key text(const char* name, std::string TrainConfig::*field, bool nonempty = false, const char* what = "") {
  return {name, false,
          [=](TrainConfig& c, const std::string& v) {
            if (nonempty && v.empty()) throw std::invalid_argument(std::string("--") + name + " needs " + what);
            c.*field = v;
          },
          [=](const TrainConfig& c) { return quoted(c.*field); }};
}
Key choice(const char* name, std::string TrainConfig::*field, std::vector<std::string> choices) {
  return {name, false, [=](TrainConfig& c, const std::string& v) { c.*field = choice_flag(std::string("--") + name, v, choices); },
          [=](const TrainConfig& c) { return quoted(c.*field); }};
}
Key boolean(const char* name, bool TrainConfig::*field) {
  return {name, true, [=](TrainConfig& c, const std::string& v) { c.*field = switch_value(std::string("--") + name, v); },
          [=](const TrainConfig& c) { return std::string(c.*field ? "true" : "false"); }};
}

std::vector<Key> make_keys() {
  using C = TrainConfig;
  std::vector<Key> k = {
      choice("strategy", &C::strategy, {"single", "dp", "ddp", "zero1", "zero2", "fsdp", "hsdp", "auto"}),
      integer("batch-size", &C::batch_size, 1), integer("grad-accum", &C::grad_accum, 1),
      integer("global-batch-size", &C::global_batch_size, 1), integer("steps", &C::steps, 1), number("lr", &C::lr),
      integer("seed", &C::seed, 0), choice("optimizer", &C::optimizer, {"adamw", "sgd"}),
      choice("lr-schedule", &C::lr_schedule, {"constant", "cosine", "linear", "wsd"}),
      integer("warmup-steps", &C::warmup_steps, 0), fraction("min-lr", &C::min_lr, false),
      integer("decay-steps", &C::decay_steps, 1), fraction("weight-decay", &C::weight_decay, false),
      fraction("beta1", &C::beta1, true), fraction("beta2", &C::beta2, true), number("eps", &C::eps),
      integer("threads", &C::threads, 1), text("metrics", &C::metrics),
      text("tensorboard", &C::tensorboard, true, "a directory"), number("peak-tflops", &C::peak_tflops),
      number("bucket-cap-mb", &C::bucket_cap_mb), number("clip-grad-norm", &C::clip_grad_norm),
      boolean("activation-checkpointing", &C::activation_checkpointing),
      choice("precision", &C::precision, {"fp32", "bf16", "fp16"}), choice("device", &C::device, {"cpu", "cuda"}),
      choice("backend", &C::backend, {"auto", "gloo", "nccl"}), choice("loss-scale", &C::loss_scale, {"none", "dynamic"}),
      integer("loss-scale-growth-interval", &C::loss_scale_growth_interval, 1),
      integer("max-skipped-steps", &C::max_skipped_steps, 0), boolean("cpu-offload", &C::cpu_offload),
      boolean("hierarchical-all-reduce", &C::hierarchical_all_reduce),
      choice("gather-quant", &C::gather_quant, {"none", "int8", "fp8"}), choice("reduce-quant", &C::reduce_quant, {"none", "int8", "fp8"}),
      choice("secondary-shard", &C::secondary_shard, {"none", "node"}),
      choice("sharding", &C::sharding, {"full", "grad_op", "none", "hybrid"}), integer("shard-size", &C::shard_size, 1),
      boolean("init-on-ranks", &C::init_on_ranks), choice("backward-prefetch", &C::backward_prefetch, {"before", "after", "none"}),
      choice("overlap-reduction", &C::overlap_reduction, {"on", "off"}),
      integer("max-gathered-units", &C::max_gathered_units, 1), integer("eval-every", &C::eval_every, 1),
      integer("eval-batches", &C::eval_batches, 1), fraction("val-fraction", &C::val_fraction, true),
      text("val-data", &C::val_data, true, "a file or directory"), boolean("eval-only", &C::eval_only),
      text("save", &C::save),
      integer("save-every", &C::save_every, 1), boolean("save-async", &C::save_async),
      integer("snapshot-every", &C::snapshot_every, 0), boolean("snapshot-sync", &C::snapshot_sync), text("resume", &C::resume),
      boolean("elastic", &C::elastic), integer("elastic-join-timeout", &C::elastic_join_timeout_s, 1),
      text("export-weights", &C::export_weights, true, "a file name"), integer("pp", &C::pp, 1),
      integer("microbatches", &C::microbatches, 1), choice("schedule", &C::schedule, {"gpipe", "1f1b", "interleaved"}),
      integer("virtual-stages", &C::virtual_stages, 1), integer("tp", &C::tp, 1),
      boolean("sequence-parallel", &C::sequence_parallel), boolean("plan", &C::plan),
  };
  k.push_back({"wrap", false,
               [](C& c, const std::string& v) {
                 c.wrap = choice_flag("--wrap", v, {"layer", "block", "none"});
                 if (c.wrap == "block") c.wrap = "layer";
               },
               [](const C& c) { return quoted(c.wrap); }});
  k.push_back({"collective-timeout", false,
               [](C& c, const std::string& v) { c.collective_timeout_s = static_cast<double>(int_flag("--collective-timeout", v, 1)); },
               [](const C& c) { return std::to_string(static_cast<int64_t>(c.collective_timeout_s)); }});
  k.push_back({"grad-compression", false,
               [](C& c, const std::string& v) {
                 c.grad_compression = parallel::to_string(parallel::parse_compression(v));  // (checked, one spelling)
               },
               [](const C& c) { return quoted(c.grad_compression); }});
  k.push_back({"memory-budget", false, [](C& c, const std::string& v) { c.memory_budget = parse_memory_size("--memory-budget", v); },
               [](const C& c) { return std::to_string(c.memory_budget); }});
  return k;
}

}  // namespace

const std::vector<Key>& keys() {
  static const std::vector<Key> k = make_keys();
  return k;
}

const Key* find_key(const std::string& name) {
  for (const auto& k : keys()) {
    if (k.name == name) return &k;
  }
  return nullptr;
}

std::string nearest(const std::string& name, const std::vector<std::string>& known) {
  auto distance = [](const std::string& a, const std::string& b) {
    std::vector<size_t> row(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (size_t i = 1; i <= a.size(); ++i) {
      size_t diagonal = row[0];
      row[0] = i;
      for (size_t j = 1; j <= b.size(); ++j) {
        const size_t up = row[j];
        row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
        diagonal = up;
      }
    }
    return row[b.size()];
  };
  std::string best;
  size_t best_distance = 4;  // (at most 3 edits away, or none)
  for (const auto& k : known) {
    const size_t d = distance(name, k);
    if (d < best_distance) {
      best_distance = d;
      best = k;
    }
  }
  return best;
}

}  // namespace detail

std::string to_toml(const TrainConfig& cfg) {
  std::string s = "# " + cfg.program + " configuration (flags: --<key>, '-' for '_')\n";
  for (const auto& k : detail::keys()) {
    std::string name = k.name;
    for (char& ch : name) ch = ch == '-' ? '_' : ch;
    const std::string value = k.get(cfg);
    // A key left unset (no --tensorboard, no clipping, ...) has a value its flag would refuse: it is
    // written commented out, so the document reads back as the same request.
    bool settable = true;
    try {
      TrainConfig scratch;
      k.set(scratch, value.size() >= 2 && value.front() == '"' ? value.substr(1, value.size() - 2) : value);
    } catch (const std::invalid_argument&) {
      settable = false;
    }
    s += (settable ? "" : "# ") + name + " = " + value + (settable ? "" : "  (unset)") + "\n";
  }
  for (const auto& [name, value] : cfg.program_flags) s += name + " = " + detail::quoted(value) + "\n";
  return s;
}

std::vector<std::string> differences(const TrainConfig& before, const TrainConfig& now) {
  std::vector<std::string> out;
  for (const auto& k : detail::keys()) {
    const std::string a = k.get(before), b = k.get(now);
    if (a != b) out.push_back(k.name + ": " + a + " -> " + b);
  }
  return out;
}

}  // namespace dtrain::train
