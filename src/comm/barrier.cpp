#include "dtrain/comm/barrier.h"

#include "detail.h"

namespace dtrain::comm {

Work barrier(const ProcessGroup& pg, bool async_op) {
  const auto ctx = pg.describe() + " barrier()";
  if (pg.size() == 1) return Work();
  c10d::BarrierOptions opts;
  opts.timeout = pg.timeout();
  return detail::launch(pg, ctx, [&] { return pg.backend().barrier(opts); }, nullptr, async_op);
}

}  // namespace dtrain::comm
