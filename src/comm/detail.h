#pragma once
// Internal helpers shared by the collective implementations (not installed).
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "dtrain/comm/flight_recorder.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/comm/work.h"

namespace dtrain::comm::detail {

// "[dtrain rank 1/3] all_reduce(sum, 1024 x Float)"
std::string context(const ProcessGroup& pg, const std::string& op, const at::Tensor& t,
                    const std::string& extra = "");

// Validates what every collective needs (member, contiguous, dense) with a message naming `ctx`.
void check_tensor(const std::string& ctx, const at::Tensor& t, const char* what = "tensor");

// What a timed-out operation of `pg` adds to its error (Design note [flight recorder]): the
// members that never reached operation `seq` (each member that times out in it says so in the
// group's store; those silent a few seconds later are named) and this rank's recent operations.
std::string diagnose_timeout(const ProcessGroup& pg, uint64_t seq);

// Starts a backend call, turning a synchronous failure into a CommError; wraps it in a Work that
// runs `then` after completion; waits unless `async_op`. Records the operation in the flight
// recorder (its sequence number in `pg`, its state, times).
// `interrupt`: the wait blocks even while the group's abort signal is armed and the raise ends it
// through the backend work's abort() (Gloo's send and receive works, which polling never sees
// complete: Design note [aborting a group's waits]).
template <class Start>
Work launch(const ProcessGroup& pg, const std::string& ctx, Start&& start, std::function<void()> then, bool async_op,
            bool interrupt = false) {
  if (auto why = pg.abort_signal()->reason()) throw CommError(ctx + " not started: the group was aborted: " + *why);
  const uint64_t seq = pg.next_sequence();
  const auto op = ctx.find("] ");
  const uint64_t recorded = flight::start(pg.name(), seq, op == std::string::npos ? ctx : ctx.substr(op + 2));
  compat::WorkPtr w;
  try {
    w = start();
  } catch (const std::exception&) {
    flight::end(recorded, false);
    rethrow_comm_error(ctx);
  }
  Work work(std::move(w), std::move(then), ctx, recorded, [pg, seq] { return diagnose_timeout(pg, seq); },
            pg.abort_signal(), interrupt);
  if (!async_op) work.wait();
  return work;
}

// With DTRAIN_DEBUG: all ranks agree on (operation, dtype, sizes) before the real collective.
void verify_same_call(const ProcessGroup& pg, const std::string& ctx, int op_code,
                      const std::vector<int64_t>& signature);

// check_tensor on both, and the same dtype and device (what every input/output collective needs).
void check_input_output(const std::string& ctx, const at::Tensor& input, const at::Tensor& output);

c10d::ReduceOp to_c10d(ReduceOp op);

// Gloo (libtorch 1.13) moves and reduces only float, double, half, int8, uint8, int32 and int64.
bool gloo_supports(at::ScalarType t);

// The first `needed` elements of a caller's workspace (AllGatherOptions / ReduceScatterOptions),
// checked: contiguous, of the input's dtype and device, large enough; `ctx` names the call.
at::Tensor workspace_view(const std::string& ctx, const at::Tensor& workspace, const at::Tensor& input,
                          int64_t needed);
// For pure data movement (broadcast, gathers, all-to-all, send/recv) any dtype travels as its
// bytes: a flat uint8 view of a contiguous tensor (bit-exact, same bytes on the wire).
at::Tensor as_wire(const ProcessGroup& pg, const at::Tensor& t);
// Bytes per element on the wire (element_size when as_wire made a byte view, else 1).
int64_t wire_scale(const ProcessGroup& pg, const at::Tensor& t);

}  // namespace dtrain::comm::detail
