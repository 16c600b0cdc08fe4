// PartnerSnapshots: Design note [partner snapshots] in dtrain/checkpoint/partner_snapshot.h.
#include "dtrain/checkpoint/partner_snapshot.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "dtrain/comm/all_to_all.h"
#include "dtrain/comm/types.h"
#include "dtrain/util/system.h"
#include "background_group.h"

namespace dtrain::checkpoint {

namespace {

using SnapshotJson = nlohmann::json;
constexpr int64_t kAlign = 8;  // each piece's bytes start at a multiple of this (any dtype's view)

int64_t aligned(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// A host byte tensor of `n` bytes: `buffer` itself when it has that size (kept from the snapshot
// before the last: no fresh pages to fault in), else a new one.
at::Tensor reuse(at::Tensor& buffer, int64_t n) {
  if (!buffer.defined() || buffer.numel() != n) buffer = at::empty({n}, at::kByte);
  return buffer;
}

// Where each of `pieces` lies in one host byte tensor: a header saying so, and each piece's offset.
struct PackPlan {
  std::string header;
  std::vector<int64_t> offsets;
  int64_t total = 0;
};
PackPlan plan_pack(int rank, int64_t step, const std::vector<Piece>& pieces,
                   const std::map<std::string, std::string>& metadata) {
  SnapshotJson h = {{"rank", rank}, {"step", step}, {"metadata", metadata}, {"pieces", SnapshotJson::array()}};
  PackPlan plan;
  for (const Piece& p : pieces) {
    TORCH_CHECK(p.data.defined(), "PartnerSnapshots: the piece of \"", p.key, "\" has no data");
    h["pieces"].push_back({{"key", p.key}, {"shape", p.shape}, {"begin", p.begin}, {"numel", p.data.numel()},
                           {"dtype", static_cast<int>(p.data.scalar_type())}, {"offset", plan.total}});
    plan.offsets.push_back(plan.total);
    plan.total += aligned(static_cast<int64_t>(p.data.nbytes()));
  }
  plan.header = h.dump();
  return plan;
}

// `p`'s data into `bytes` at `offset`.
void pack_piece(const Piece& p, const at::Tensor& bytes, int64_t offset) {
  const int64_t n = static_cast<int64_t>(p.data.nbytes());
  if (n > 0) bytes.narrow(0, offset, n).copy_(p.data.contiguous().view({-1}).view(at::kByte));
}

// The snapshot `header` describes, its pieces views into `bytes`.
HeldSnapshot unpack(const std::string& header, const at::Tensor& bytes) {
  const SnapshotJson h = SnapshotJson::parse(header);
  HeldSnapshot s;
  s.rank = h.at("rank").get<int>();
  s.step = h.at("step").get<int64_t>();
  s.metadata = h.at("metadata").get<std::map<std::string, std::string>>();
  for (const SnapshotJson& p : h.at("pieces")) {
    const auto dtype = static_cast<at::ScalarType>(p.at("dtype").get<int>());
    const int64_t numel = p.at("numel").get<int64_t>();
    const int64_t n = numel * static_cast<int64_t>(c10::elementSize(dtype));
    at::Tensor data = n == 0 ? at::empty({0}, at::TensorOptions(dtype))
                             : bytes.narrow(0, p.at("offset").get<int64_t>(), n).view(dtype);
    s.pieces.push_back({p.at("key").get<std::string>(), p.at("shape").get<std::vector<int64_t>>(),
                        p.at("begin").get<int64_t>(), data});
  }
  return s;
}

at::Tensor bytes_of(const std::string& text) {
  at::Tensor t = at::empty({static_cast<int64_t>(text.size())}, at::kByte);
  if (!text.empty()) std::memcpy(t.data_ptr(), text.data(), text.size());
  return t;
}

// Sends `out` to `to` while receiving `in` from `from`: one all_to_all over the group (every
// member exchanges with its partners at once), whose wait an elastic run can abort (Design note
// [aborting a group's waits], comm/abort.h): Gloo's send and receive works report their
// completion only to a blocking wait, so a peer lost during them would hold this one for the
// group's whole timeout.
void exchange(const comm::ProcessGroup& g, const at::Tensor& out, int to, at::Tensor& in, int from) {
  std::vector<int64_t> sent(g.size(), 0), received(g.size(), 0);
  sent[to] = out.numel();
  received[from] = in.numel();
  comm::all_to_all(g, in, out, comm::AllToAllOptions().input_split_sizes(sent).output_split_sizes(received));
}

}  // namespace

int64_t HeldSnapshot::bytes() const {
  int64_t n = 0;
  for (const Piece& p : pieces) n += static_cast<int64_t>(p.data.nbytes());
  return n;
}

PartnerSnapshots::PartnerSnapshots(const comm::ProcessGroup& pg, int stride) : stride_(stride) {
  TORCH_CHECK(pg.is_member(), "PartnerSnapshots: this rank is not a member of the process group");
  TORCH_CHECK(stride >= 1, "PartnerSnapshots: the partner stride must be at least 1, got ", stride);
  detail::BackgroundGroup made = detail::background_group(pg, "partner-snapshots");
  group_ = made.group;
  gloo_threads_ = made.threads;
}

void PartnerSnapshots::yield_cores() {
  detail::yield_cores(std::exchange(gloo_threads_, {}));
  yielding_ = true;
}

int PartnerSnapshots::partner() const { return keeper_of(group_.rank()); }
int PartnerSnapshots::keeper_of(int rank) const { return (rank + stride_) % group_.size(); }
int PartnerSnapshots::holding_for() const {
  const int w = group_.size();
  return ((group_.rank() - stride_) % w + w) % w;
}
const HeldSnapshot& PartnerSnapshots::mine() const {
  TORCH_CHECK(!in_flight(), "PartnerSnapshots::mine: an exchange is in flight: call wait() first");
  return mine_;
}
const HeldSnapshot& PartnerSnapshots::held() const {
  TORCH_CHECK(!in_flight(), "PartnerSnapshots::held: an exchange is in flight: call wait() first");
  return held_;
}

std::vector<int64_t> PartnerSnapshots::steps() const {
  TORCH_CHECK(!in_flight(), "PartnerSnapshots::steps: an exchange is in flight: call wait() first");
  std::vector<int64_t> out;
  if (mine_.step >= 0) out.push_back(mine_.step);
  if (previous_mine_.step >= 0) out.push_back(previous_mine_.step);
  return out;
}
const HeldSnapshot* PartnerSnapshots::mine_of(int64_t step) const {
  TORCH_CHECK(!in_flight(), "PartnerSnapshots::mine_of: an exchange is in flight: call wait() first");
  if (step < 0) return nullptr;
  return mine_.step == step ? &mine_ : previous_mine_.step == step ? &previous_mine_ : nullptr;
}
const HeldSnapshot* PartnerSnapshots::held_of(int64_t step) const {
  TORCH_CHECK(!in_flight(), "PartnerSnapshots::held_of: an exchange is in flight: call wait() first");
  if (step < 0) return nullptr;
  return held_.step == step ? &held_ : previous_held_.step == step ? &previous_held_ : nullptr;
}

PartnerSnapshots::~PartnerSnapshots() {
  if (worker_.joinable()) worker_.join();
}

double PartnerSnapshots::take(int64_t step, const std::vector<Piece>& pieces,
                              const std::map<std::string, std::string>& metadata, const std::vector<at::Tensor>& steady) {
  const auto t0 = std::chrono::steady_clock::now();
  wait();  // (the previous snapshot's exchange; its failure rethrown)
  // Into the slot the current pair does not use (Design note [partner snapshots]: double buffers).
  const int slot = 1 - current_;
  previous_mine_ = previous_held_ = HeldSnapshot{};  // (its buffers are about to be reused)
  PackPlan plan = plan_pack(group_.rank(), step, pieces, metadata);
  const at::Tensor bytes = reuse(packed_[slot], plan.total);
  const std::vector<bool> later = in_storage_of(pieces, steady);
  std::vector<size_t> deferred;  // (packed by the worker: Design note [a copy overlapped with the next step])
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (later[i]) {
      deferred.push_back(i);
    } else {
      pack_piece(pieces[i], bytes, plan.offsets[i]);
    }
  }
  if (steady.empty()) {
    exchange_pair(step, slot, plan.header);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    packing_ = !deferred.empty();
  }
  done_ = false;
  std::vector<Piece> to_pack;
  for (size_t i : deferred) to_pack.push_back(pieces[i]);
  auto body = [this, step, slot, plan = std::move(plan), bytes, deferred = std::move(deferred), to_pack = std::move(to_pack)] {
    at::NoGradGuard no_grad;  // (the copies of parameters record no autograd history)
    std::exception_ptr failure;
    try {
      for (size_t k = 0; k < deferred.size(); ++k) pack_piece(to_pack[k], bytes, plan.offsets[deferred[k]]);
    } catch (...) {
      failure = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      packing_ = false;
    }
    packed_cv_.notify_all();
    if (yielding_) util::lower_this_threads_priority();  // (the exchange yields the cores to the steps: yield_cores)
    try {
      if (!failure) exchange_pair(step, slot, plan.header);
    } catch (...) {
      failure = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      error_ = failure;
      failed_step_ = step;
    }
    done_ = true;
  };
  try {
    worker_ = std::thread(std::move(body));
  } catch (...) {  // (no thread: nothing in flight, nothing to pack)
    {
      std::lock_guard<std::mutex> lock(mu_);
      packing_ = false;
    }
    done_ = true;
    throw;
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void PartnerSnapshots::exchange_pair(int64_t step, int slot, const std::string& header) {
  const at::Tensor& bytes = packed_[slot];
  HeldSnapshot mine = unpack(header, bytes), held;
  if (partner() == group_.rank()) {
    held = mine;
  } else {
    at::Tensor in_sizes = at::empty({2}, at::kLong);
    exchange(group_, at::tensor({static_cast<int64_t>(header.size()), bytes.numel()}, at::kLong), partner(), in_sizes,
             holding_for());
    at::Tensor in_header = at::empty({in_sizes[0].item<int64_t>()}, at::kByte);
    exchange(group_, bytes_of(header), partner(), in_header, holding_for());
    at::Tensor in_bytes = reuse(received_[slot], in_sizes[1].item<int64_t>());
    exchange(group_, bytes, partner(), in_bytes, holding_for());
    held = unpack(std::string(static_cast<const char*>(in_header.data_ptr()), static_cast<size_t>(in_header.numel())),
                  in_bytes);
    TORCH_CHECK(held.rank == holding_for() && held.step == step, group_.describe(), " partner snapshot: expected rank ",
                holding_for(), "'s of step ", step, ", received rank ", held.rank, "'s of step ", held.step);
  }
  // (mine_ and held_ are replaced together once the exchange completed: a partner lost during it
  // leaves this rank the previous step's pair, whole)
  previous_mine_ = std::exchange(mine_, std::move(mine));
  previous_held_ = std::exchange(held_, std::move(held));
  current_ = slot;
}

double PartnerSnapshots::packed() {
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  if (!packing_) return 0.0;
  packed_cv_.wait(lock, [this] { return !packing_; });
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void PartnerSnapshots::wait() {
  if (worker_.joinable()) worker_.join();
  std::exception_ptr failure;
  {
    std::lock_guard<std::mutex> lock(mu_);
    failure = std::exchange(error_, nullptr);
  }
  if (!failure) return;
  const std::string what = group_.describe() + ": the partner snapshot of step " + std::to_string(failed_step_) +
                           " failed in the background (the previous snapshot is kept): ";
  try {
    std::rethrow_exception(failure);
  } catch (const comm::CommError& e) {
    throw comm::CommError(what + e.what());  // (a lost peer stays a communication failure: recoverable)
  } catch (const std::exception& e) {
    TORCH_CHECK(false, what, e.what());
  }
}

bool PartnerSnapshots::in_flight() const { return !done_.load(); }

std::string rebuild_checkpoint(const std::string& root, const comm::ProcessGroup& survivors,
                               const PartnerSnapshots& snapshots, const std::vector<int>& lost,
                               const SaveOptions& options) {
  const HeldSnapshot& mine = snapshots.mine();
  TORCH_CHECK(mine.step >= 0, "rebuild_checkpoint: this rank has taken no snapshot");
  auto is_lost = [&](int r) { return std::find(lost.begin(), lost.end(), r) != lost.end(); };
  TORCH_CHECK(!is_lost(mine.rank), "rebuild_checkpoint: rank ", mine.rank, " is alive but listed as lost");
  std::vector<Piece> pieces = mine.pieces;
  const HeldSnapshot& held = snapshots.held();
  if (held.rank != mine.rank && is_lost(held.rank)) {
    TORCH_CHECK(held.step == mine.step, "rebuild_checkpoint: rank ", mine.rank, " holds rank ", held.rank,
                "'s snapshot of step ", held.step, " but its own is of step ", mine.step);
    pieces.insert(pieces.end(), held.pieces.begin(), held.pieces.end());
  }
  // Every lost rank's state must be held by a survivor: its partner (the rank it sent to).
  for (int r : lost) {
    const int keeper = snapshots.keeper_of(r);
    TORCH_CHECK(!is_lost(keeper), "rebuild_checkpoint: rank ", r, "'s snapshot was held by rank ", keeper,
                ", which is lost too: rank ", r, "'s state of step ", mine.step,
                " is gone (resume from the last checkpoint on disk)");
  }
  return save(root, mine.step, survivors, pieces, mine.metadata, options);
}

}  // namespace dtrain::checkpoint
