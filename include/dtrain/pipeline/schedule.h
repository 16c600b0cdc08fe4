#pragma once
// Pipeline schedules as data: for each rank of a pipeline, the ordered list of what it does in one
// training step (PyTorch's torch.distributed.pipelining keeps schedules the same way: one table,
// one runtime, a new schedule is a new table).
//
// A model cut into S = p x v stages runs on p ranks; stage s lives on rank s % p (v = 1: stage s
// on rank s; interleaved, v > 1: rank r holds stages r, r + p, r + 2p, ...: the "loop" placement of
// Megatron-LM and PyTorch). A step's batch is cut into m micro-batches. Every (stage, micro-batch)
// gets one Forward and one Backward; the runtime (pipeline/pipeline.h) adds the transfers between
// ranks itself: before the Forward of a stage > 0 it receives its input, after the Forward of a
// stage < S - 1 it sends the output, before the Backward of a stage < S - 1 it receives the output's
// gradient, after the Backward of a stage > 0 it sends the input's gradient. Sends and receives are
// asynchronous and tagged by (kind, stage, micro-batch), so that two ranks sending to each other at
// the same time (pytorch#126419, #127332) cannot block each other; a receive is waited for only by
// the computation that needs it. A schedule therefore cannot hang as long as every rank's order
// of computations is one that some interleaving of all ranks can execute: simulate() checks exactly
// that (and the placement, and that each action appears once), before a step runs.
//
//   gpipe        all m forwards, then all m backwards (activations of m micro-batches alive).
//   1f1b         rank r does p - 1 - r forwards, then alternates one forward and one backward,
//                then the remaining backwards: at most p micro-batches alive on rank 0.
//   interleaved  1F1B over v stages per rank (Megatron-LM's interleaved schedule): smaller bubble,
//                m must be a multiple of p.
#include <string>
#include <vector>

namespace dtrain::pipeline {

enum class Kind {
  kForward,   // the stage's forward of one micro-batch (the last stage also computes the loss)
  kBackward,  // the stage's backward of one micro-batch
};

struct Action {
  Kind kind;
  int stage;       // 0 .. S-1
  int microbatch;  // 0 .. m-1
  bool operator==(const Action& o) const { return kind == o.kind && stage == o.stage && microbatch == o.microbatch; }
};

// What a schedule is for.
struct Shape {
  int ranks = 1;           // p: ranks of the pipeline
  int virtual_stages = 1;  // v: stages per rank
  int microbatches = 1;    // m
  int stages() const { return ranks * virtual_stages; }
  int rank_of(int stage) const { return stage % ranks; }
};

struct Schedule {
  std::string name;
  Shape shape;
  std::vector<std::vector<Action>> per_rank;  // per_rank[r]: rank r's actions in order
};

// The names make_schedule takes.
const std::vector<std::string>& schedule_names();
// Throws std::invalid_argument naming the problem (unknown name, v > 1 with a non-interleaved
// schedule, interleaved with v < 2 or m not a multiple of p, a degree < 1).
Schedule make_schedule(const std::string& name, const Shape& shape);
Schedule gpipe(const Shape& shape);
Schedule one_f_one_b(const Shape& shape);
Schedule interleaved_1f1b(const Shape& shape);

// What executing a schedule looks like, with a forward costing 1 time unit and a backward 2.
struct Simulation {
  std::vector<std::vector<std::pair<int, Action>>> timeline;  // per rank: (start time, action)
  int makespan = 0;                  // time units until the last rank finishes
  double idle_fraction = 0;          // idle time over ranks x makespan
  double ideal_idle_fraction = 0;    // (p - 1) / (v m + p - 1): the bubble of a perfect schedule
  std::vector<int> peak_alive;       // per rank: most micro-batch activations held at once
};
// Runs every rank's list against the dependencies (forward of stage s after forward of s - 1;
// backward of s after its forward and after backward of s + 1). Throws std::invalid_argument when
// an action is missing, repeated or on the wrong rank, or when the lists cannot all be executed
// (a deadlock: it names the actions each rank is stuck at).
Simulation simulate(const Schedule& schedule);

// The schedule as a table: one row per rank, one column per time unit ("F3" forward of micro-batch
// 3, "B3" backward; with v > 1 the stage too: "F3.s5"), then the simulation's figures.
std::string describe(const Schedule& schedule);

}  // namespace dtrain::pipeline
