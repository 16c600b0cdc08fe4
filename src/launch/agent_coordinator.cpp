// A coordinator node 0 (dtrun --nnodes MIN:MAX --nproc-per-node 0, Design note [a coordinator
// node], dtrain/launch/agent.h): node 0's duties in a round, without workers of its own.
#include <algorithm>
#include <string>
#include <vector>

#include "agent_internal.h"
#include "dtrain/launch/agent.h"

namespace dtrain::launch {

int Agent::workers_per_node() const {
  return options_.coordinator() && store_ ? store_->workers_per_node() : options_.nproc_per_node;
}

// The round's nodes run; the coordinator watches them as node 0 does while its workers run (a
// round's failure, nodes gone silent, nodes waiting to join) and, as waiting_peers(), for the
// round's end. What ends the round goes where a member's would: after_failure() (a restart or the
// end) or the exit barrier.
void Agent::coordinating() {
  next_poll_ = Clock::now();
  for (;;) {
    wait_events(options_.monitor_interval_s);
    int sig = 0;
    if (take_stop_signal(&sig)) {
      output_.log("received " + signal_name(sig) + "; stopping every node's workers");
      publish(signal_failure(sig));
      return after_failure();
    }
    try {
      collect_reports();
      auto poll = take_poll();
      if (!poll) continue;
      if (auto f = poll->failure) {
        failure_ = *f;
        output_.log(describe(*f));
        return after_failure();
      }
      if (poll->all_done) {
        exit_code_ = *poll->all_done;
        output_.log("round " + std::to_string(round_) + " ended: every training node's workers " +
                    (exit_code_ == 0 ? std::string("finished") : "failed (exit code " + std::to_string(exit_code_) + ")") +
                    (failed_.empty() ? "" : " (lost on the way: rank(s) " + failed_ + ")"));
        state_ = AgentState::kExitBarrier;
        return;
      }
      if (auto f = news_of_nodes(*poll)) {
        output_.log(f->what + "; stopping every node's workers");
        publish(*f);
        return after_failure();
      }
    } catch (const std::exception& e) {  // (the store is this process's own: hardly ever)
      lost_store(e);
      return after_failure();
    }
  }
}

}  // namespace dtrain::launch
