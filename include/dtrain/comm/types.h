#pragma once
// Plain value types shared by every collective (Gloo style: small structs, no hidden state).
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace dtrain::comm {

enum class ReduceOp {
  Sum,  // element-wise sum over ranks
  Avg,  // sum divided by the group size (done as Sum + divide where the backend has no AVG)
  Max,  // element-wise maximum
  Min,  // element-wise minimum
};

const char* to_string(ReduceOp op);

enum class BackendKind {
  Gloo,  // CPU tensors, TCP transport (default)
  Nccl,  // CUDA tensors; only when libtorch was built with CUDA/NCCL
  Mpi,   // optional; only when libtorch was built with MPI
};

const char* to_string(BackendKind kind);

// Thrown by every communication call that fails. what() names the rank, the operation and the
// cause ("[dtrain rank 1/3] all_reduce(sum, 1024 x float) failed: peer rank closed the connection...").
class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A failure after which this process must end rather than recover in process: it left a
// collective or transfer its peers still wait in, and only its closed sockets end their waits
// (Design note [pipeline transfers], pipeline/pipeline.h).
class FatalError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// PyTorch's default process-group timeout.
inline constexpr std::chrono::milliseconds kDefaultTimeout = std::chrono::minutes(30);

}  // namespace dtrain::comm
