#include "dtrain/pipeline/pipeline.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <sstream>
#include <stdexcept>
#include <unordered_set>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "dtrain/comm/all_reduce.h"
#include "dtrain/comm/send_recv.h"
#include "dtrain/comm/types.h"

namespace dtrain::pipeline {

namespace {

enum Message : int { kActivation = 0, kGradient = 1, kShape = 2 };
constexpr int kMaxDims = 8;

// Adds the time from its construction to its end to `total` (a forward's or backward's compute;
// the receive waits inside are taken off where they happen).
struct ComputeTimer {
  double& total;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  ~ComputeTimer() { total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
};

std::string shape_text(const std::vector<int64_t>& s, at::ScalarType t) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << "] " << t;
  return o.str();
}

}  // namespace

// The step's transfers (Design note [pipeline transfers]).
struct Pipeline::Transfers {
  std::vector<comm::Work> sends;
  std::vector<at::Tensor> sent;                                            // alive until the sends end
  std::map<std::tuple<int, int, int>, std::pair<comm::Work, at::Tensor>> recvs;  // (message, stage, mb)
  std::map<std::tuple<int, int, int>, at::Tensor> handed;                  // between stages of this rank
};

Pipeline::Link Pipeline::incoming(const Action& a) const {
  const Shape& sh = schedule_.shape;
  const int me = pp_.rank();
  if (a.kind == Kind::kForward && a.stage > 0 && sh.rank_of(a.stage - 1) != me) {
    return {kActivation, a.stage - 1, sh.rank_of(a.stage - 1)};
  }
  if (a.kind == Kind::kBackward && a.stage < stages_ - 1 && sh.rank_of(a.stage + 1) != me) {
    return {kGradient, a.stage, sh.rank_of(a.stage + 1)};
  }
  return {};
}

void Pipeline::abandon(Transfers& t) {
  for (auto& send : t.sends) send.abandon();  // (an interrupted one was kept by its wait already)
  for (auto& [key, posted] : t.recvs) posted.first.abandon();
  t = Transfers{};
  alive_.clear();
}

Pipeline::Pipeline(std::vector<Stage> all_stages, comm::ProcessGroup pp, LossFn loss, PipelineOptions options)
    : pp_(std::move(pp)), loss_(std::move(loss)), options_(std::move(options)) {
  const int p = pp_.size(), v = options_.virtual_stages();
  const int m = options_.microbatches() > 0 ? options_.microbatches() : p;
  if (static_cast<int>(all_stages.size()) != p * v) {
    throw std::invalid_argument("pipeline: the model was cut into " + std::to_string(all_stages.size()) +
                                " stages, but " + std::to_string(p) + " pipeline rank(s) x " + std::to_string(v) +
                                " virtual stage(s) need " + std::to_string(p * v));
  }
  schedule_ = make_schedule(options_.schedule(), Shape{p, v, m});
  simulate(schedule_);  // throws if the lists cannot be executed together
  stages_ = p * v;
  for (int s = pp_.rank(); s < stages_; s += p) {
    local_.push_back(std::move(all_stages[s]));
    local_index_.push_back(s);
  }
  all_stages.clear();  // the other ranks' stages: freed here unless the caller keeps the model
}

const Stage& Pipeline::local(int stage) const {
  return local_.at(static_cast<size_t>(stage / pp_.size()));
}

std::vector<std::pair<std::string, at::Tensor>> Pipeline::named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::unordered_set<const void*> seen;
  for (const auto& st : local_) {
    for (const auto& item : st.module->named_parameters()) {
      if (seen.insert(item.value().unsafeGetTensorImpl()).second) out.emplace_back(item.key(), item.value());
    }
  }
  return out;
}

std::vector<at::Tensor> Pipeline::parameters() const {
  std::vector<at::Tensor> out;
  for (auto& [name, t] : named_parameters()) out.push_back(t);
  return out;
}

void Pipeline::train(bool on) {
  for (auto& st : local_) st.module->train(on);
}

double Pipeline::step(const at::Tensor& inputs, const at::Tensor& targets, double loss_multiplier) {
  return run(inputs, targets, loss_multiplier, false);
}

double Pipeline::evaluate(const at::Tensor& inputs, const at::Tensor& targets) {
  at::NoGradGuard no_grad;
  return run(inputs, targets, 1.0, true);
}

double Pipeline::run(const at::Tensor& inputs, const at::Tensor& targets, double loss_multiplier, bool forward_only) {
  const Shape& sh = schedule_.shape;
  const int m = sh.microbatches, me = pp_.rank();
  const bool first = local_index_.front() == 0, last = local_index_.back() == stages_ - 1;
  auto cut = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.defined(), "pipeline rank ", me, " holds stage ", first ? 0 : stages_ - 1, " and needs the ", what,
                " of the step");
    TORCH_CHECK(t.size(0) % m == 0, "pipeline: --microbatches ", m, " must divide the batch of ", t.size(0),
                " samples (", what, ")");
    return t.chunk(m, 0);
  };
  const std::vector<at::Tensor> in = first ? cut(inputs, "inputs") : std::vector<at::Tensor>{};
  const std::vector<at::Tensor> tg = last ? cut(targets, "targets") : std::vector<at::Tensor>{};
  loss_sum_ = 0;
  alive_.clear();
  Transfers t;
  using Clock = std::chrono::steady_clock;
  const auto started = Clock::now();
  times_ = StepTimes{};

  const int ps = pp_.size();
  // Received activations and gradients land where the stages compute: the group's device, except
  // over Gloo with CUDA stages (Design note [ranks sharing a GPU], train/session.cpp).
  const auto params = parameters();
  const c10::Device device = params.empty() ? pp_.device() : params.front().device();
  // Posts the receive `a` needs (if it needs one from another rank and its shape is known).
  auto post = [&](const Action& a, bool ahead) {
    const Link in = incoming(a);
    if (in.peer < 0) return;
    const int kind = in.kind, boundary = in.boundary, from = in.peer;
    const auto key = std::make_tuple(kind, a.stage, a.microbatch);
    if (t.recvs.count(key)) return;
    auto shape = agreed_.find(boundary);
    if (shape == agreed_.end()) {
      if (kind == kGradient || ahead) return;  // (a gradient's: never, this rank agreed it when it sent)
      // The first transfer over this boundary: its shape and dtype come first.
      auto meta = at::zeros({2 + kMaxDims}, at::kLong);
      comm::recv(pp_, meta, from, comm::SendRecvOptions().tag(tag(kShape, boundary, 0))).wait();
      std::vector<int64_t> dims(meta.data_ptr<int64_t>() + 2, meta.data_ptr<int64_t>() + 2 + meta[0].item<int64_t>());
      shape = agreed_.emplace(boundary, std::make_pair(dims, static_cast<at::ScalarType>(meta[1].item<int64_t>()))).first;
    }
    auto buffer = at::empty(shape->second.first, at::TensorOptions().dtype(shape->second.second).device(device));
    auto work = comm::recv(pp_, buffer, from,
                           comm::SendRecvOptions().tag(tag(kind, boundary, a.microbatch)).async_op(true));
    t.recvs.emplace(key, std::make_pair(std::move(work), buffer));
  };
  // (forward_only: the forwards in the schedule's order, each needing only the stage before it)
  std::vector<Action> actions;
  for (const Action& a : schedule_.per_rank[static_cast<size_t>(me)]) {
    if (!forward_only || a.kind == Kind::kForward) actions.push_back(a);
  }
  executed_.clear();
  try {
    for (size_t i = 0; i < actions.size(); ++i) {
      post(actions[i], false);
      executed_.push_back(actions[i]);
      if (i + 1 < actions.size()) post(actions[i + 1], true);  // one ahead
      // (a computation's time includes waiting for its receive: subtracted below)
      if (actions[i].kind == Kind::kForward) {
        forward(actions[i], t, in, tg, loss_multiplier / m);
      } else {
        backward(actions[i], t);
      }
    }
    for (auto& w : t.sends) w.wait();
  } catch (const std::exception& e) {
    // (under --elastic, Design note [pipeline transfers]: a communication's failure leaves the
    // step, its transfers kept; any other error must end the process, whose closed sockets end
    // its peers' waits)
    if (!pp_.abort_signal()->armed()) throw;
    if (!dynamic_cast<const comm::CommError*>(&e)) throw comm::FatalError(pp_.describe() + " pipeline: " + e.what());
    abandon(t);
    throw;
  }
  times_.wall_s = std::chrono::duration<double>(Clock::now() - started).count();
  if (forward_only) alive_.clear();
  TORCH_CHECK(alive_.empty(), "pipeline rank ", me, ": ", alive_.size(), " micro-batch(es) without a backward");
  // The mean loss, known to the last stage's rank, on every rank of the pipeline.
  auto total = at::tensor(std::vector<double>{last ? loss_sum_ : 0.0}, at::kDouble).to(pp_.device());
  if (ps > 1) comm::all_reduce(pp_, total);
  const auto sums = total.to(at::kCPU);
  return sums[0].item<double>() / m;
}

void Pipeline::forward(const Action& a, Transfers& t, const std::vector<at::Tensor>& inputs,
                       const std::vector<at::Tensor>& targets, double scale) {
  ComputeTimer timed{times_.compute_s};
  const Shape& sh = schedule_.shape;
  const int me = pp_.rank();
  at::Tensor x;
  if (a.stage == 0) {
    x = inputs.at(static_cast<size_t>(a.microbatch));
  } else {
    const auto key = std::make_tuple(static_cast<int>(kActivation), a.stage, a.microbatch);
    if (sh.rank_of(a.stage - 1) == me) {
      x = t.handed.at(key);
      t.handed.erase(key);
    } else {
      auto it = t.recvs.find(key);
      TORCH_INTERNAL_ASSERT(it != t.recvs.end(), "pipeline: no receive posted for stage ", a.stage);
      const auto w0 = std::chrono::steady_clock::now();
      it->second.first.wait();
      times_.compute_s -= std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
      x = it->second.second;
      t.recvs.erase(it);
    }
    x = x.detach();
    if (at::isFloatingType(x.scalar_type())) x.requires_grad_(true);
  }
  at::Tensor y = local(a.stage).forward(x);
  if (a.stage == stages_ - 1) {
    at::Tensor loss = loss_(y, targets.at(static_cast<size_t>(a.microbatch)));
    loss_sum_ += loss.detach().to(at::kCPU).item<double>();
    alive_[{a.stage, a.microbatch}] = {x, loss * scale};
    return;
  }
  alive_[{a.stage, a.microbatch}] = {x, y};
  const int to = sh.rank_of(a.stage + 1);
  if (to == me) {
    t.handed[{static_cast<int>(kActivation), a.stage + 1, a.microbatch}] = y;
    return;
  }
  std::vector<int64_t> dims(y.sizes().begin(), y.sizes().end());
  auto agreed = agreed_.find(a.stage);
  if (agreed == agreed_.end()) {
    TORCH_CHECK(static_cast<int>(dims.size()) <= kMaxDims, "pipeline: stage ", a.stage, " returns a ", dims.size(),
                "-dimensional tensor; at most ", kMaxDims, " dimensions can be sent between stages");
    auto meta = at::zeros({2 + kMaxDims}, at::kLong);
    meta[0] = static_cast<int64_t>(dims.size());
    meta[1] = static_cast<int64_t>(y.scalar_type());
    for (size_t i = 0; i < dims.size(); ++i) meta[2 + static_cast<int64_t>(i)] = dims[i];
    t.sends.push_back(comm::send(pp_, meta, to, comm::SendRecvOptions().tag(tag(kShape, a.stage, 0)).async_op(true)));
    t.sent.push_back(meta);
    agreed = agreed_.emplace(a.stage, std::make_pair(dims, y.scalar_type())).first;
  } else if (agreed->second.first != dims || agreed->second.second != y.scalar_type()) {
    std::ostringstream o;
    o << "pipeline: stage " << a.stage << " on rank " << me << " produced " << shape_text(dims, y.scalar_type())
      << " for micro-batch " << a.microbatch << ", but stage " << a.stage + 1 << " on rank " << to
      << " receives " << shape_text(agreed->second.first, agreed->second.second)
      << " (agreed at the first step): every micro-batch must have the same shape";
    throw std::runtime_error(o.str());
  }
  auto out = y.detach().contiguous();
  t.sends.push_back(
      comm::send(pp_, out, to, comm::SendRecvOptions().tag(tag(kActivation, a.stage, a.microbatch)).async_op(true)));
  t.sent.push_back(out);
}

void Pipeline::backward(const Action& a, Transfers& t) {
  ComputeTimer timed{times_.compute_s};
  const Shape& sh = schedule_.shape;
  const int me = pp_.rank();
  auto it = alive_.find({a.stage, a.microbatch});
  TORCH_INTERNAL_ASSERT(it != alive_.end(), "pipeline: backward before forward of stage ", a.stage);
  auto [x, y] = it->second;
  alive_.erase(it);
  if (a.stage == stages_ - 1) {
    y.backward();
  } else {
    const auto key = std::make_tuple(static_cast<int>(kGradient), a.stage, a.microbatch);
    at::Tensor grad;
    if (sh.rank_of(a.stage + 1) == me) {
      grad = t.handed.at(key);
      t.handed.erase(key);
    } else {
      auto r = t.recvs.find(key);
      TORCH_INTERNAL_ASSERT(r != t.recvs.end(), "pipeline: no gradient receive posted for stage ", a.stage);
      const auto w0 = std::chrono::steady_clock::now();
      r->second.first.wait();
      times_.compute_s -= std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
      grad = r->second.second;
      t.recvs.erase(r);
    }
    if (y.requires_grad()) torch::autograd::backward({y}, {grad});
  }
  if (a.stage == 0) return;
  at::Tensor g = x.grad().defined() ? x.grad() : at::zeros_like(x);
  const int to = sh.rank_of(a.stage - 1);
  if (to == me) {
    t.handed[{static_cast<int>(kGradient), a.stage - 1, a.microbatch}] = g;
    return;
  }
  g = g.contiguous();
  t.sends.push_back(
      comm::send(pp_, g, to, comm::SendRecvOptions().tag(tag(kGradient, a.stage - 1, a.microbatch)).async_op(true)));
  t.sent.push_back(g);
}

void average_gradients(const std::vector<at::Tensor>& params, const comm::ProcessGroup& group) {
  if (group.size() == 1 || params.empty()) return;
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const auto& p : params) {
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    by_dtype[p.grad().scalar_type()].push_back(p.grad());
  }
  for (auto& [dtype, grads] : by_dtype) {
    std::vector<at::Tensor> flat_parts;
    for (auto& g : grads) flat_parts.push_back(g.reshape({-1}));
    at::Tensor flat = at::cat(flat_parts);
    comm::all_reduce(group, flat, comm::AllReduceOptions().op(comm::ReduceOp::Avg));
    int64_t at = 0;
    for (auto& g : grads) {
      g.copy_(flat.narrow(0, at, g.numel()).view(g.sizes()));
      at += g.numel();
    }
  }
}

}  // namespace dtrain::pipeline
