#include "dtrain/optim/state_dict.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <type_traits>
#include <typeinfo>
#include <unordered_map>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "dtrain/compat.h"

namespace dtrain::optim {

namespace to = torch::optim;

namespace {

using StateMap = std::decay_t<decltype(std::declval<to::Optimizer&>().state())>;

auto state_key(const at::Tensor& p) { return compat::optimizer_state_key<StateMap>(p); }

struct KindInfo {
  std::vector<std::string> fields;   // state tensor fields, "step" first where there is one
  std::vector<std::string> options;  // group options
  std::vector<std::string> flags;    // the options that are booleans
};

const KindInfo& info(const std::string& kind) {
  static const std::map<std::string, KindInfo> kinds = {
      {"SGD", {{"momentum_buffer"}, {"lr", "momentum", "dampening", "weight_decay", "nesterov"}, {"nesterov"}}},
      {"Adam",
       {{"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
        {"lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad"},
        {"amsgrad"}}},
      {"AdamW",
       {{"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
        {"lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad"},
        {"amsgrad"}}},
      {"RMSprop",
       {{"step", "square_avg", "momentum_buffer", "grad_avg"},
        {"lr", "alpha", "eps", "weight_decay", "momentum", "centered"},
        {"centered"}}},
      {"Adagrad",
       {{"step", "sum"}, {"lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"}, {}}},
  };
  auto it = kinds.find(kind);
  TORCH_CHECK(it != kinds.end(), "dtrain::optim: unknown optimizer kind \"", kind,
              "\" in the state dict; expected SGD, Adam, AdamW, RMSprop or Adagrad");
  return it->second;
}

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ", ") + s;
  return out;
}

// ---- per-parameter state: libtorch objects <-> named tensors --------------------------------

at::Tensor step_tensor(int64_t step) { return at::scalar_tensor(step, at::kLong); }

// `copy`: clone the tensors (a state dict), or reference them (to count bytes).
void put(ParamStateDict& d, const char* name, const at::Tensor& t, bool copy) {
  if (t.defined()) d.tensors[name] = copy ? t.detach().clone() : t;
}

// `index`: the parameter's index, or -1 where it is not known.
template <class S>
const S& as(const to::OptimizerParamState& s, const std::string& kind, int64_t index) {
  const auto* p = dynamic_cast<const S*>(&s);
  TORCH_CHECK(p, "dtrain::optim: ", index >= 0 ? "parameter " + std::to_string(index) : std::string("a parameter"),
              " has a ", c10::demangle(typeid(s).name()), ", not a ", kind,
              " state; was the optimizer's state replaced by hand?");
  return *p;
}

template <class S>
ParamStateDict read_adam_like(const S& s, bool copy) {
  ParamStateDict d;
  d.tensors["step"] = step_tensor(s.step());
  put(d, "exp_avg", s.exp_avg(), copy);
  put(d, "exp_avg_sq", s.exp_avg_sq(), copy);
  put(d, "max_exp_avg_sq", s.max_exp_avg_sq(), copy);
  return d;
}

ParamStateDict read_state(const std::string& kind, const to::OptimizerParamState& s, int64_t index, bool copy) {
  if (kind == "SGD") {
    ParamStateDict d;
    put(d, "momentum_buffer", as<to::SGDParamState>(s, kind, index).momentum_buffer(), copy);
    return d;
  }
  if (kind == "Adam") return read_adam_like(as<to::AdamParamState>(s, kind, index), copy);
  if (kind == "AdamW") return read_adam_like(as<to::AdamWParamState>(s, kind, index), copy);
  if (kind == "RMSprop") {
    const auto& r = as<to::RMSpropParamState>(s, kind, index);
    ParamStateDict d;
    d.tensors["step"] = step_tensor(r.step());
    put(d, "square_avg", r.square_avg(), copy);
    put(d, "momentum_buffer", r.momentum_buffer(), copy);
    put(d, "grad_avg", r.grad_avg(), copy);
    return d;
  }
  const auto& a = as<to::AdagradParamState>(s, kind, index);
  ParamStateDict d;
  d.tensors["step"] = step_tensor(a.step());
  put(d, "sum", a.sum(), copy);
  return d;
}

// A copy of field `name` on `p`'s device; undefined when absent.
at::Tensor field(const ParamStateDict& d, const char* name, const at::Tensor& p) {
  auto it = d.tensors.find(name);
  if (it == d.tensors.end()) return {};
  return it->second.detach().to(p.device(), it->second.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
}

int64_t step_of(const ParamStateDict& d) {
  auto it = d.tensors.find("step");
  return it == d.tensors.end() ? 0 : static_cast<int64_t>(it->second.item<double>());
}

template <class S>
std::unique_ptr<to::OptimizerParamState> make_adam_like(const ParamStateDict& d, const at::Tensor& p) {
  auto s = std::make_unique<S>();
  s->step(step_of(d));
  s->exp_avg(field(d, "exp_avg", p));
  s->exp_avg_sq(field(d, "exp_avg_sq", p));
  s->max_exp_avg_sq(field(d, "max_exp_avg_sq", p));
  return s;
}

std::unique_ptr<to::OptimizerParamState> make_state(const std::string& kind, const ParamStateDict& d,
                                                    const at::Tensor& p) {
  if (kind == "SGD") {
    auto s = std::make_unique<to::SGDParamState>();
    s->momentum_buffer(field(d, "momentum_buffer", p));
    return s;
  }
  if (kind == "Adam") return make_adam_like<to::AdamParamState>(d, p);
  if (kind == "AdamW") return make_adam_like<to::AdamWParamState>(d, p);
  if (kind == "RMSprop") {
    auto s = std::make_unique<to::RMSpropParamState>();
    s->step(step_of(d));
    s->square_avg(field(d, "square_avg", p));
    s->momentum_buffer(field(d, "momentum_buffer", p));
    s->grad_avg(field(d, "grad_avg", p));
    return s;
  }
  auto s = std::make_unique<to::AdagradParamState>();
  s->step(step_of(d));
  s->sum(field(d, "sum", p));
  return s;
}

// ---- group options <-> named numbers ---------------------------------------------------------

template <class O>
O& opts(to::OptimizerOptions& o) {
  auto* p = dynamic_cast<O*>(&o);
  TORCH_CHECK(p, "dtrain::optim: a param group has ", c10::demangle(typeid(o).name()), " options, not ",
              c10::demangle(typeid(O).name()));
  return *p;
}
template <class O>
const O& opts(const to::OptimizerOptions& o) {
  return opts<O>(const_cast<to::OptimizerOptions&>(o));
}

template <class O>
std::map<std::string, double> read_adam_options(const O& o) {
  return {{"lr", o.lr()},
          {"beta1", std::get<0>(o.betas())},
          {"beta2", std::get<1>(o.betas())},
          {"eps", o.eps()},
          {"weight_decay", o.weight_decay()},
          {"amsgrad", o.amsgrad() ? 1.0 : 0.0}};
}

std::map<std::string, double> read_options(const std::string& kind, const to::OptimizerOptions& o) {
  if (kind == "SGD") {
    const auto& s = opts<to::SGDOptions>(o);
    return {{"lr", s.lr()},
            {"momentum", s.momentum()},
            {"dampening", s.dampening()},
            {"weight_decay", s.weight_decay()},
            {"nesterov", s.nesterov() ? 1.0 : 0.0}};
  }
  if (kind == "Adam") return read_adam_options(opts<to::AdamOptions>(o));
  if (kind == "AdamW") return read_adam_options(opts<to::AdamWOptions>(o));
  if (kind == "RMSprop") {
    const auto& r = opts<to::RMSpropOptions>(o);
    return {{"lr", r.lr()},
            {"alpha", r.alpha()},
            {"eps", r.eps()},
            {"weight_decay", r.weight_decay()},
            {"momentum", r.momentum()},
            {"centered", r.centered() ? 1.0 : 0.0}};
  }
  const auto& a = opts<to::AdagradOptions>(o);
  return {{"lr", a.lr()},
          {"lr_decay", a.lr_decay()},
          {"weight_decay", a.weight_decay()},
          {"initial_accumulator_value", a.initial_accumulator_value()},
          {"eps", a.eps()}};
}

// Sets the options present in `m` (absent ones keep their value).
template <class O>
void write_adam_options(O& o, const std::map<std::string, double>& m) {
  auto betas = o.betas();
  for (const auto& [k, v] : m) {
    if (k == "lr") o.lr(v);
    else if (k == "beta1") std::get<0>(betas) = v;
    else if (k == "beta2") std::get<1>(betas) = v;
    else if (k == "eps") o.eps(v);
    else if (k == "weight_decay") o.weight_decay(v);
    else if (k == "amsgrad") o.amsgrad(v != 0);
  }
  o.betas(betas);
}

void write_options(const std::string& kind, to::OptimizerOptions& o, const std::map<std::string, double>& m) {
  if (kind == "SGD") {
    auto& s = opts<to::SGDOptions>(o);
    for (const auto& [k, v] : m) {
      if (k == "lr") s.lr(v);
      else if (k == "momentum") s.momentum(v);
      else if (k == "dampening") s.dampening(v);
      else if (k == "weight_decay") s.weight_decay(v);
      else if (k == "nesterov") s.nesterov(v != 0);
    }
  } else if (kind == "Adam") {
    write_adam_options(opts<to::AdamOptions>(o), m);
  } else if (kind == "AdamW") {
    write_adam_options(opts<to::AdamWOptions>(o), m);
  } else if (kind == "RMSprop") {
    auto& r = opts<to::RMSpropOptions>(o);
    for (const auto& [k, v] : m) {
      if (k == "lr") r.lr(v);
      else if (k == "alpha") r.alpha(v);
      else if (k == "eps") r.eps(v);
      else if (k == "weight_decay") r.weight_decay(v);
      else if (k == "momentum") r.momentum(v);
      else if (k == "centered") r.centered(v != 0);
    }
  } else {
    auto& a = opts<to::AdagradOptions>(o);
    for (const auto& [k, v] : m) {
      if (k == "lr") a.lr(v);
      else if (k == "lr_decay") a.lr_decay(v);
      else if (k == "weight_decay") a.weight_decay(v);
      else if (k == "initial_accumulator_value") a.initial_accumulator_value(v);
      else if (k == "eps") a.eps(v);
    }
  }
}

// Index of every parameter of `params` by its TensorImpl (duplicates rejected).
std::unordered_map<const c10::TensorImpl*, int64_t> index_of(const std::vector<at::Tensor>& params, const char* who) {
  std::unordered_map<const c10::TensorImpl*, int64_t> idx;
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(params[i].defined(), who, ": parameter ", i, " of params_in_order is undefined");
    auto [it, fresh] = idx.emplace(params[i].unsafeGetTensorImpl(), static_cast<int64_t>(i));
    TORCH_CHECK(fresh, who, ": parameters ", it->second, " and ", i,
                " of params_in_order are the same tensor; list each parameter once");
  }
  return idx;
}

// Per group of `opt`: the indices of its parameters in `params` (each of `params` exactly once).
std::vector<std::vector<int64_t>> group_indices(const to::Optimizer& opt, const std::vector<at::Tensor>& params,
                                                const char* who) {
  const auto idx = index_of(params, who);
  std::vector<std::vector<int64_t>> out;
  std::vector<bool> seen(params.size(), false);
  for (size_t g = 0; g < opt.param_groups().size(); ++g) {
    out.emplace_back();
    for (const auto& p : opt.param_groups()[g].params()) {
      auto it = idx.find(p.unsafeGetTensorImpl());
      TORCH_CHECK(it != idx.end(), who, ": param group ", g, " of the optimizer holds a parameter (shape ",
                  p.sizes(), ") that is not in params_in_order; pass every parameter of the optimizer");
      seen[it->second] = true;
      out.back().push_back(it->second);
    }
  }
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(seen[i], who, ": parameter ", i, " of params_in_order (shape ", params[i].sizes(),
                ") is in no param group of the optimizer; pass only the optimizer's parameters");
  }
  return out;
}

std::string list(const std::vector<int64_t>& v) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}

void check_impl(const OptimizerStateDict& dict, const to::Optimizer& opt, const std::vector<at::Tensor>& params,
                const char* who) {
  const std::string kind = optimizer_kind(opt);
  TORCH_CHECK(dict.optimizer == kind, who, ": the state dict is for ", dict.optimizer.empty() ? "(none)" : dict.optimizer,
              " but the optimizer is ", kind, "; load it into the optimizer type that made it");
  const KindInfo& k = info(kind);
  const size_t P = params.size();
  TORCH_CHECK(dict.params.size() == P, who, ": the state dict has ", dict.params.size(),
              " parameter entries but ", P, " parameters were given; pass the same parameters, in the same order, ",
              "as when it was made");
  TORCH_CHECK(dict.groups.size() == opt.param_groups().size(), who, ": the state dict has ", dict.groups.size(),
              " param group(s) but the optimizer has ", opt.param_groups().size(),
              "; build the optimizer with the same param groups");

  // Groups: every parameter in exactly one; options known; per parameter the options that decide
  // which fields it must have.
  std::vector<int64_t> group_of(P, -1);
  std::vector<std::map<std::string, double>> effective(dict.groups.size());
  for (size_t g = 0; g < dict.groups.size(); ++g) {
    for (int64_t i : dict.groups[g].params) {
      TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(P), who, ": param group ", g, " of the state dict lists parameter ",
                  i, ", outside [0, ", P, ")");
      TORCH_CHECK(group_of[i] < 0, who, ": parameter ", i, " is in param groups ", group_of[i], " and ", g,
                  " of the state dict; each parameter belongs to one group");
      group_of[i] = static_cast<int64_t>(g);
    }
    effective[g] = read_options(kind, opt.param_groups()[g].options());
    for (const auto& [name, v] : dict.groups[g].options) {
      TORCH_CHECK(contains(k.options, name), who, ": param group ", g, " has unknown option \"", name, "\" for ", kind,
                  "; known: ", join(k.options));
      TORCH_CHECK(std::isfinite(v), who, ": param group ", g, " option \"", name, "\" is ", v);
      TORCH_CHECK(!contains(k.flags, name) || v == 0 || v == 1, who, ": param group ", g, " option \"", name,
                  "\" is a boolean: 0 or 1, got ", v);
      effective[g][name] = v;
    }
  }
  for (size_t i = 0; i < P; ++i) {
    TORCH_CHECK(group_of[i] >= 0, who, ": parameter ", i, " is in no param group of the state dict");
  }

  for (size_t i = 0; i < P; ++i) {
    const auto& entry = dict.params[i];
    if (!entry) {
      TORCH_CHECK(kind != "Adagrad", who, ": parameter ", i,
                  " has no state, but Adagrad holds state (step, sum) for every parameter");
      continue;
    }
    const auto& o = effective[group_of[i]];
    std::vector<std::string> required;
    if (kind == "SGD") {
      required = {"momentum_buffer"};
    } else if (kind == "Adam" || kind == "AdamW") {
      required = {"step", "exp_avg", "exp_avg_sq"};
      if (o.at("amsgrad") != 0) required.push_back("max_exp_avg_sq");
    } else if (kind == "RMSprop") {
      required = {"step", "square_avg"};
      if (o.at("momentum") > 0) required.push_back("momentum_buffer");
      if (o.at("centered") != 0) required.push_back("grad_avg");
    } else {
      required = {"step", "sum"};
    }
    for (const auto& name : required) {
      TORCH_CHECK(entry->tensors.count(name), who, ": parameter ", i, " has no field \"", name, "\", which ", kind,
                  " needs with these options; the state dict is incomplete");
    }
    const auto& p = params[i];
    for (const auto& [name, t] : entry->tensors) {
      TORCH_CHECK(contains(k.fields, name), who, ": parameter ", i, " has unknown field \"", name, "\" for ", kind,
                  "; known: ", join(k.fields));
      TORCH_CHECK(t.defined(), who, ": parameter ", i, " field \"", name,
                  "\" is an undefined tensor; leave a field out instead");
      if (name == "step") {
        TORCH_CHECK(t.numel() == 1, who, ": parameter ", i, " field \"step\" must hold one number, has shape ",
                    t.sizes());
        const double s = t.item<double>();
        TORCH_CHECK(s >= 0 && s == std::floor(s), who, ": parameter ", i,
                    " field \"step\" must be a whole number >= 0, got ", s);
        continue;
      }
      TORCH_CHECK(t.sizes() == p.sizes(), who, ": parameter ", i, " field \"", name, "\" has shape ", t.sizes(),
                  " but the parameter has shape ", p.sizes(), "; the state dict is for another model or order");
      TORCH_CHECK(t.scalar_type() == p.scalar_type(), who, ": parameter ", i, " field \"", name, "\" is ",
                  t.scalar_type(), " but the parameter is ", p.scalar_type(), "; convert it with .to(",
                  p.scalar_type(), ") first");
    }
  }
}

}  // namespace

std::string optimizer_kind(const to::Optimizer& opt) {
  if (dynamic_cast<const to::SGD*>(&opt)) return "SGD";
  if (dynamic_cast<const to::AdamW*>(&opt)) return "AdamW";
  if (dynamic_cast<const to::Adam*>(&opt)) return "Adam";
  if (dynamic_cast<const to::RMSprop*>(&opt)) return "RMSprop";
  if (dynamic_cast<const to::Adagrad*>(&opt)) return "Adagrad";
  TORCH_CHECK(false, "dtrain::optim: unsupported optimizer type ", c10::demangle(typeid(opt).name()),
              "; state dicts support torch::optim SGD, Adam, AdamW, RMSprop and Adagrad");
}

const std::vector<std::string>& state_fields(const std::string& kind) { return info(kind).fields; }

namespace {
OptimizerStateDict state_dict_impl(const to::Optimizer& opt, const std::vector<at::Tensor>& params_in_order,
                                   bool copy, const char* who) {
  OptimizerStateDict d;
  d.optimizer = optimizer_kind(opt);
  const auto groups = group_indices(opt, params_in_order, who);
  d.params.resize(params_in_order.size());
  for (size_t i = 0; i < params_in_order.size(); ++i) {
    auto it = opt.state().find(state_key(params_in_order[i]));
    if (it != opt.state().end() && it->second) {
      d.params[i] = read_state(d.optimizer, *it->second, static_cast<int64_t>(i), copy);
    }
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    d.groups.push_back({groups[g], read_options(d.optimizer, opt.param_groups()[g].options())});
  }
  return d;
}
}  // namespace

OptimizerStateDict state_dict_of(const to::Optimizer& opt, const std::vector<at::Tensor>& params_in_order) {
  return state_dict_impl(opt, params_in_order, /*copy=*/true, "state_dict_of");
}

OptimizerStateDict state_dict_view(const to::Optimizer& opt, const std::vector<at::Tensor>& params_in_order) {
  return state_dict_impl(opt, params_in_order, /*copy=*/false, "state_dict_view");
}

void check_state_dict(const OptimizerStateDict& dict, const to::Optimizer& opt,
                      const std::vector<at::Tensor>& params_in_order) {
  check_impl(dict, opt, params_in_order, "check_state_dict");
}

void load_state_dict_into(to::Optimizer& opt, const std::vector<at::Tensor>& params_in_order,
                          const OptimizerStateDict& dict) {
  constexpr const char* who = "load_state_dict_into";
  check_impl(dict, opt, params_in_order, who);
  const auto groups = group_indices(opt, params_in_order, who);
  for (size_t g = 0; g < groups.size(); ++g) {
    TORCH_CHECK(groups[g] == dict.groups[g].params, who, ": param group ", g, " holds parameters ", list(groups[g]),
                " here but ", list(dict.groups[g].params),
                " in the state dict; build the optimizer with the same param groups");
  }
  // Checked: now change things.
  for (size_t g = 0; g < groups.size(); ++g) {
    write_options(dict.optimizer, opt.param_groups()[g].options(), dict.groups[g].options);
  }
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_in_order.size(); ++i) {
    const auto key = state_key(params_in_order[i]);
    opt.state().erase(key);
    if (dict.params[i]) opt.state()[key] = make_state(dict.optimizer, *dict.params[i], params_in_order[i]);
  }
}

int64_t state_bytes(const to::Optimizer& opt) {
  const std::string kind = optimizer_kind(opt);
  int64_t bytes = 0;
  for (const auto& kv : opt.state()) {
    if (!kv.second) continue;
    for (const auto& [name, t] : read_state(kind, *kv.second, /*index=*/-1, /*copy=*/false).tensors) {
      if (name != "step") bytes += static_cast<int64_t>(t.nbytes());
    }
  }
  return bytes;
}

}  // namespace dtrain::optim
