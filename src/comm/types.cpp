#include "dtrain/comm/types.h"

namespace dtrain::comm {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
  }
  return "?";
}

const char* to_string(BackendKind kind) {
  switch (kind) {
    case BackendKind::Gloo: return "gloo";
    case BackendKind::Nccl: return "nccl";
    case BackendKind::Mpi: return "mpi";
  }
  return "?";
}

}  // namespace dtrain::comm
