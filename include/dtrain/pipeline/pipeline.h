#pragma once
// The pipeline runtime: runs one rank's list of a schedule (pipeline/schedule.h) over the stages
// this rank holds, moving activations and their gradients between ranks by c10d send/recv.
//
//   auto stages = pipeline::split_sequential(model, 4);          // or your own list, or GPT's
//   pipeline::Pipeline pipe(stages, pp_group, loss_fn,
//                           pipeline::PipelineOptions().schedule("1f1b").microbatches(8));
//   torch::optim::AdamW opt(pipe.parameters(), ...);             // this rank's stages only
//   for (...) { opt.zero_grad(); double loss = pipe.step(x, y); opt.step(); }
//
// Design note [pipeline transfers]
// --------------------------------
// - What moves: the output of stage s to stage s + 1 after its forward; the gradient of that
//   output back after the backward of s + 1. Stages on the same rank (one pipeline rank) hand
//   tensors over directly.
// - When: every send is asynchronous and waited for at the end of the step (the tensor stays alive
//   until then); every receive is posted one action ahead of the computation that needs it and
//   waited for by that computation. Messages are tagged by (kind, stage, micro-batch), so their
//   order on the wire never matters, and two ranks that send to each other at once cannot block.
//   A step thus finishes whenever the schedule's lists can be executed together, which
//   pipeline::simulate checks when the Pipeline is made (pytorch#126419/#127332 hung where a
//   send and a receive crossed; torchtitan#775 with fewer micro-batches than stages: both work).
// - Shapes: at the first step each boundary's sender sends the shape and dtype of its output
//   first; the receiver allocates from it. Every later output must have that shape: a different
//   one is an error on the sender naming both ranks and stages. Every micro-batch has the same
//   shape (the batch must divide into --microbatches).
// - A step that fails on this rank under --elastic (a collective aborted inside a stage, a
//   tensor-parallel layer's, or a peer lost: a CommError) throws at once; its peers' waits for it
//   end when the job's abort signal is raised (the failure is reported before the recovery, and
//   every rank's watcher raises it: Design note [in-process recovery], train/elastic.h), since
//   Gloo's send and receive waits are interrupted by it like any collective (Design note
//   [aborting a group's waits], comm/abort.h). The step's sends and posted receives are kept
//   (never destroyed while Gloo may still touch their memory), and the step is dropped
//   everywhere by the vote that follows. Until that interruption existed, a stage's peer waited
//   out the collective timeout in a receive whenever the abort reached one stage of a pipeline
//   mid-step: a failed stage finished its transfers with zeros, the pipeline group had an abort
//   signal of its own, and still a stage that left through a collective outside the pipeline's
//   run (FSDP's reduce-scatter) left its peer in a receive under load. Any other error inside a
//   step (not a CommError) is rethrown as comm::FatalError, which ends the process
//   (train/recovery.h): its closed sockets end its peers' waits.
// - Loss: the last stage's loss of each micro-batch is divided by m (and multiplied by the loss
//   scale) before its backward, so gradients add up to those of the mean loss over the batch,
//   as one process computes them. step() returns the mean loss on every rank of the pipeline.
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include "dtrain/comm/process_group.h"
#include "dtrain/comm/work.h"
#include "dtrain/pipeline/schedule.h"
#include "dtrain/pipeline/stage.h"

namespace dtrain::pipeline {

struct PipelineOptions {
  TORCH_ARG(std::string, schedule) = "1f1b";
  // Micro-batches per step (0: as many as pipeline ranks).
  TORCH_ARG(int, microbatches) = 0;
  // Stages per rank (> 1: the interleaved schedule).
  TORCH_ARG(int, virtual_stages) = 1;
};

// The mean loss of a micro-batch: the last stage's output and the targets of those samples.
using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& targets)>;

class Pipeline {
 public:
  // all_stages: the whole model's stages in order, p x v of them (p = pp.size(), v =
  // options.virtual_stages); this rank keeps stages pp.rank(), pp.rank() + p, ... and drops the
  // rest. Throws std::invalid_argument for a bad count or schedule (naming both).
  Pipeline(std::vector<Stage> all_stages, comm::ProcessGroup pp, LossFn loss, PipelineOptions options = {});
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  // One step's forwards and backwards over the micro-batches of the batch (inputs and targets:
  // every sample of the step, dim 0; only the first stage reads inputs and the last targets, so
  // other ranks may pass undefined tensors as long as the first and last get them). Gradients
  // accumulate into this rank's stage parameters. Returns the mean loss over the micro-batches on
  // every rank of the pipeline (a collective over it). `loss_multiplier` scales each micro-batch's
  // loss before its backward (a loss scale); the returned loss is not scaled.
  double step(const at::Tensor& inputs, const at::Tensor& targets, double loss_multiplier = 1.0);
  // The schedule's forwards alone, under no_grad (evaluation): the mean loss over the micro-batches
  // on every rank of the pipeline, nothing kept for a backward. The batch has the training
  // step's shape (every transfer keeps the shape agreed at the first step).
  double evaluate(const at::Tensor& inputs, const at::Tensor& targets);

  // This rank's stages (in schedule order) and their indices in the whole model.
  const std::vector<Stage>& stages() const { return local_; }
  const std::vector<int>& stage_indices() const { return local_index_; }
  // Their parameters under the whole model's names (each tensor once).
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  std::vector<at::Tensor> parameters() const;
  const Schedule& schedule() const { return schedule_; }
  // The last step's time in this rank's forwards and backwards, and from its start to its last
  // send's end (before the loss is shared): 1 - sum(compute) / (ranks x max(wall)) is the
  // pipeline's measured idle fraction, to set against simulate()'s bubble.
  struct StepTimes {
    double compute_s = 0, wall_s = 0;
  };
  const StepTimes& last_step_times() const { return times_; }
  // The computations this rank ran in the last step (or evaluation), in the order it ran them.
  const std::vector<Action>& last_step_actions() const { return executed_; }
  const comm::ProcessGroup& group() const { return pp_; }
  void train(bool on = true);

 private:
  struct Transfers;  // the step's posted sends and receives (src/pipeline/pipeline.cpp)
  double run(const at::Tensor& inputs, const at::Tensor& targets, double loss_multiplier, bool forward_only);
  void forward(const Action& a, Transfers& t, const std::vector<at::Tensor>& inputs,
               const std::vector<at::Tensor>& targets, double scale);
  void backward(const Action& a, Transfers& t);
  // The message action `a` receives from another rank (peer -1: none).
  struct Link {
    int kind = 0, boundary = 0, peer = -1;
  };
  Link incoming(const Action& a) const;
  // After a failed step (Design note [pipeline transfers]): its sends and posted receives kept,
  // with their tensors, for the process's life (comm::Work::abandon).
  void abandon(Transfers& t);
  const Stage& local(int stage) const;
  // A message's tag: (kind, stage, micro-batch) -> a distinct positive number.
  int tag(int kind, int stage, int microbatch) const {
    return (kind * stages_ + stage) * schedule_.shape.microbatches + microbatch + 1;
  }

  comm::ProcessGroup pp_;
  LossFn loss_;
  PipelineOptions options_;
  Schedule schedule_;
  int stages_ = 0;  // S, the whole model's
  std::vector<Stage> local_;
  std::vector<int> local_index_;
  // Per (stage, micro-batch) of the running step: the stage's input (a leaf that requires grad
  // for stages > 0) and its output (the loss, scaled, for the last stage).
  std::map<std::pair<int, int>, std::pair<at::Tensor, at::Tensor>> alive_;
  double loss_sum_ = 0;
  std::vector<Action> executed_;
  StepTimes times_;
  // Shapes and dtypes agreed at the first step, per boundary (the output of stage s).
  std::map<int, std::pair<std::vector<int64_t>, at::ScalarType>> agreed_;
};

// Averages `params`' gradients over `group` (data parallelism around a pipeline stage: each stage's
// replicas hold the same stage): one flat all-reduce per dtype. A parameter without a gradient
// counts as zeros.
void average_gradients(const std::vector<at::Tensor>& params, const comm::ProcessGroup& group);

}  // namespace dtrain::pipeline
