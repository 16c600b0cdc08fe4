#pragma once
// Learning-rate schedules: warm-up, then constant, cosine or linear decay, or warm-up-stable-decay
// (WSD, MiniCPM / Megatron's --lr-decay-style WSD), as nanoGPT's get_lr and torchtitan's
// lr_scheduler compute them.
//
//   dtrain::optim::LrSchedule schedule;                  // or from_flags via train::TrainConfig
//   schedule.kind = dtrain::optim::LrSchedule::Kind::Cosine;
//   schedule.warmup_steps = 100; schedule.total_steps = 5000; schedule.min_factor = 0.1;
//   dtrain::optim::LrScheduler sched(optimizer, schedule);   // records each group's lr as its base
//   for (int64_t step = 1; step <= 5000; ++step) {
//     sched.apply(step);                                  // before the step's optimizer.step()
//     ...
//   }
//
// Design note [a schedule is a function of the step]: the learning rate of step s is
// base_lr x factor(s), computed from the schedule's parameters and s alone, never accumulated step
// by step (PyTorch's LambdaLR). So a resumed run's curve is the uninterrupted one bit for bit from
// the step it resumes at, with nothing but the parameters in the checkpoint (the run's
// configuration, train/config.h), and a changed parameter at resume is a reported difference, not
// a silently different state. Each parameter group keeps its own base (the lr it was built with,
// PyTorch's initial_lr); the checkpoint saves the base, not the step's scheduled value.
//
// factor(s), s = 1, 2, ... the step about to be taken, W = warmup_steps, N = total_steps, m = min_factor:
//   s <= W:   s / (W + 1)                              (linear warm-up, never 0: nanoGPT's (it+1)/(W+1))
//   constant: 1
//   cosine:   m + (1 - m) (1 + cos(pi p)) / 2,  p = (s - W - 1) / (N - W - 1) clamped to [0, 1]
//   linear:   1 - (1 - m) p
//   wsd:      1 until step N - D, then linearly from 1 to m over the last D = decay_steps steps
#include <cstdint>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace dtrain::optim {

struct LrSchedule {
  enum class Kind { Constant, Cosine, Linear, Wsd };
  Kind kind = Kind::Constant;
  int64_t warmup_steps = 0;
  int64_t total_steps = 0;   // the run's last step (decay ends there)
  int64_t decay_steps = 0;   // wsd: the steps of the final decay
  double min_factor = 0.0;   // the end of the decay, as a fraction of the base learning rate

  // Throws std::invalid_argument naming the parameter when the schedule cannot be followed.
  void validate() const;
  // The factor of step `step` (1-based), in (0, 1].
  double factor(int64_t step) const;
  // "cosine, warm-up 100, min 0.1 x lr over 5000 steps", for the run's first lines.
  std::string describe() const;
};

// "constant" | "cosine" | "linear" | "wsd" (throws naming the choices) and back.
LrSchedule::Kind parse_lr_schedule(const std::string& name);
const char* lr_schedule_name(LrSchedule::Kind kind);

// Sets each parameter group's lr to its base x the schedule's factor. The bases are the groups'
// learning rates when the scheduler is made (set_base changes them, e.g. after a resume).
class LrScheduler {
 public:
  LrScheduler(torch::optim::Optimizer& optimizer, LrSchedule schedule);
  void apply(int64_t step);                     // before step `step`'s optimizer step (1-based)
  void restore_base();                          // each group's lr back to its base (before a save)
  void set_base(const std::vector<double>& lrs);
  const std::vector<double>& base() const { return base_; }
  const LrSchedule& schedule() const { return schedule_; }

 private:
  torch::optim::Optimizer* optimizer_;
  LrSchedule schedule_;
  std::vector<double> base_;
};

}  // namespace dtrain::optim
