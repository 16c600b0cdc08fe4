#include "detail.h"

#include <chrono>
#include <sstream>
#include <thread>

#include <c10/util/Exception.h>

#include "dtrain/compat.h"

namespace dtrain::comm::detail {

std::string context(const ProcessGroup& pg, const std::string& op, const at::Tensor& t,
                    const std::string& extra) {
  std::ostringstream os;
  os << pg.describe() << " " << op << "(";
  if (!extra.empty()) os << extra << ", ";
  if (t.defined()) {
    os << t.numel() << " x " << t.scalar_type();
  } else {
    os << "no tensor";
  }
  os << ")";
  return os.str();
}

void check_tensor(const std::string& ctx, const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.defined(), ctx, ": the ", what, " is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, ctx, ": the ", what, " must be dense (strided)");
  TORCH_CHECK(t.is_contiguous(), ctx, ": the ", what,
              " must be contiguous; call .contiguous() first (collectives write in place)");
}

void check_input_output(const std::string& ctx, const at::Tensor& input, const at::Tensor& output) {
  check_tensor(ctx, input, "input");
  check_tensor(ctx, output, "output");
  TORCH_CHECK(input.scalar_type() == output.scalar_type() && input.device() == output.device(), ctx,
              ": input and output differ in dtype or device (", input.scalar_type(), " on ", input.device(),
              " vs ", output.scalar_type(), " on ", output.device(), ")");
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:  // Sum, then divide: Gloo has no AVG
      return c10d::ReduceOp::SUM;
    case ReduceOp::Max: return c10d::ReduceOp::MAX;
    case ReduceOp::Min: return c10d::ReduceOp::MIN;
  }
  return c10d::ReduceOp::SUM;
}

bool gloo_supports(at::ScalarType t) {
  switch (t) {
    case at::kFloat: case at::kDouble: case at::kChar: case at::kByte: case at::kInt: case at::kLong:
      return true;
    case at::kHalf:  // 1.13 only; 2.x's Gloo may lack it (compat.h)
      return compat::kGlooHandlesHalf;
    default:
      return false;
  }
}

at::Tensor workspace_view(const std::string& ctx, const at::Tensor& w, const at::Tensor& input, int64_t needed) {
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == input.scalar_type() && w.device() == input.device() &&
                  w.numel() >= needed,
              ctx, ": the workspace must be contiguous, of the input's dtype and device and hold at least ", needed,
              " elements (", w.numel(), " ", w.scalar_type(), " on ", w.device(), ")");
  return w.view({-1}).narrow(0, 0, needed);
}

at::Tensor as_wire(const ProcessGroup& pg, const at::Tensor& t) {
  if (pg.backend_kind() != BackendKind::Gloo || gloo_supports(t.scalar_type())) return t.view({-1});
  return t.view({-1}).view(at::kByte);
}

int64_t wire_scale(const ProcessGroup& pg, const at::Tensor& t) {
  if (pg.backend_kind() != BackendKind::Gloo || gloo_supports(t.scalar_type())) return 1;
  return static_cast<int64_t>(t.element_size());
}

void verify_same_call(const ProcessGroup& pg, const std::string& ctx, int op_code,
                      const std::vector<int64_t>& signature) {
  if (!pg.checks_collectives() || pg.size() == 1) return;
  constexpr int64_t kSlots = 8;
  TORCH_CHECK(static_cast<int64_t>(signature.size()) + 1 <= kSlots, "signature too long");
  auto mine = at::full({kSlots}, -1, at::kLong);
  mine[0] = op_code;
  for (size_t i = 0; i < signature.size(); ++i) mine[i + 1] = signature[i];
  // On the group's device (NCCL takes CUDA tensors only), compared on the CPU.
  std::vector<at::Tensor> in{mine.to(pg.device())};
  std::vector<std::vector<at::Tensor>> out(1);
  auto all = at::empty({pg.size(), kSlots}, at::TensorOptions(at::kLong).device(pg.device()));
  for (int r = 0; r < pg.size(); ++r) out[0].push_back(all[r]);
  try {
    pg.backend().allgather(out, in)->wait();
  } catch (const std::exception&) {
    rethrow_comm_error(ctx + " [DTRAIN_DEBUG check]");
  }
  all = all.cpu();
  auto fmt = [](const at::Tensor& row) {
    std::ostringstream os;
    os << "[";
    for (int64_t i = 0; i < row.numel(); ++i) {
      if (row[i].item<int64_t>() < 0) break;
      os << (i ? ", " : "") << row[i].item<int64_t>();
    }
    return os.str() + "]";
  };
  for (int r = 0; r < pg.size(); ++r) {
    if (!at::equal(all[r], mine)) {
      std::ostringstream os;
      os << ctx << ": rank " << pg.global_ranks()[r] << " called a different collective or sizes "
         << "(its signature " << fmt(all[r]) << " vs this rank's " << fmt(mine)
         << "; fields: op, dtype, element counts)";
      throw CommError(os.str());
    }
  }
}

}  // namespace dtrain::comm::detail

namespace dtrain::comm::detail {

std::string diagnose_timeout(const ProcessGroup& pg, uint64_t seq) {
  std::ostringstream os;
  os << ". Group " << pg.name() << " operation #" << seq;
  try {
    // Every member that times out here says so; those still silent after a grace period never
    // reached this operation (stopped, stuck before it, or in another one). The grace ends early
    // when the group is aborted (Design note [aborting a group's waits], comm/abort.h): the job knows
    // of a failure already, and an elastic survivor must not come late to the regroup while it
    // diagnoses (a rank stuck in compute that comes back would otherwise decide the next
    // generation alone, leaving the others out).
    const auto& store = pg.store();
    const std::string base = "dtrain/timed_out/" + pg.name() + "/" + std::to_string(seq) + "/";
    store->set(base + std::to_string(pg.rank()), std::vector<uint8_t>{1});
    std::vector<int> missing;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    const auto& abort = pg.abort_signal();
    for (;;) {
      missing.clear();
      for (int r = 0; r < pg.size(); ++r) {
        if (!store->check({base + std::to_string(r)})) missing.push_back(pg.global_ranks()[r]);
      }
      if (missing.empty() || std::chrono::steady_clock::now() > deadline || (abort && abort->aborted())) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    if (!missing.empty() && abort && abort->aborted()) {
      os << ": the job aborted the group before every member said whether it timed out in it";
    } else if (missing.empty()) {
      os << ": every member timed out in it (all waiting for each other: a mismatched call or a network failure)";
    } else {
      os << ": rank(s) ";
      for (size_t i = 0; i < missing.size(); ++i) os << (i ? ", " : "") << missing[i];
      os << " never reached it (stopped, stuck before it, or in another operation)";
    }
  } catch (const std::exception&) {
    os << " (the store could not be asked which ranks reached it)";
  }
  os << ". This rank's last operations (flight recorder):\n" << flight::describe(flight::snapshot(), 6);
  return os.str();
}

}  // namespace dtrain::comm::detail
