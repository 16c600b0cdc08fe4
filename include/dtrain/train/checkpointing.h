#pragma once
// Training checkpoints of the library loop: --save DIR --save-every N --resume DIR.
//
// A checkpoint (dtrain/checkpoint/store.h) holds the model and optimizer state (the strategy's
// state_snapshot, keys as dtrain/checkpoint/train_state.h), every rank's CPU random state, the
// loss scaler's state with --loss-scale dynamic (loss_scaling.h), and as
// metadata the step count and the data position: the data order is a function of (seed, epoch,
// step) (see fit.h), so a run resumed after step t recomputes it and continues with
// exactly the samples of step t + 1. The data position is stored too (data/epoch, data/offset:
// the next global sample in the epoch's permutation) and checked on resume, with the seed, the
// global batch and the dataset size, so a run that would see other data fails instead.
//
// Test hook: DTRAIN_TEST_FAIL_AT_STEP=N makes one rank (DTRAIN_TEST_FAIL_RANK, default the last)
// kill itself (SIGKILL) at the start of step N, on the first attempt only
// (TORCHELASTIC_RESTART_COUNT unset or 0): what a crash under `dtrun --max-restarts` looks like.
// Ranks are the process's first (RANK), whatever an elastic regroup made of them since.
// DTRAIN_TEST_FAIL_AFTER_MS=M kills it M ms into that step instead (a random moment of a step);
// DTRAIN_TEST_FAILS="N@R,M@Q" kills rank R at step N and rank Q at step M (a process that joined an
// elastic run: R its id, N its own steps). DTRAIN_TEST_FAIL_WHERE=vote: at the step's vote instead
// (--elastic: after its part of the step's collectives, before voting; Design note [in-process
// recovery]); =save: as the step's save begins (after the step was committed); =eval: as its
// evaluation (--eval-every) begins, likewise; =regroup: inside an
// elastic recovery, once the state is rebuilt on the new group (N: the step it will redo); =snapshot:
// as the step's partner snapshot begins (--snapshot-every; after its optimizer step).
// DTRAIN_TEST_FAIL_KILLS=node: the rank's dtrun is SIGKILLed with it (the whole node goes, at the
// start of the step or M ms into it); =stall:S: the rank stops making progress for S seconds instead.
#include <cstdint>
#include <optional>
#include <string>

#include <torch/nn/module.h>

#include "dtrain/checkpoint/async_saver.h"
#include "dtrain/checkpoint/partner_snapshot.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/train/loss_scaling.h"
#include "dtrain/train/config.h"
#include "dtrain/train/strategy.h"

namespace dtrain::train {

// How the run walks through the data (main.cpp): every step takes `global_batch` samples of an
// epoch's permutation of `samples`, `steps_per_epoch` steps per epoch.
struct DataPlan {
  int64_t samples = 0;
  int64_t global_batch = 0;
  int64_t steps_per_epoch = 0;
};

// With --resume: loads the newest valid checkpoint under o.resume (Design note [which checkpoint to
// resume], checkpointing.cpp; or o.resume itself when it is a checkpoint directory) into the
// strategy, the loss scaler and this rank's random state, checks that it continues this run's data,
// applies this run's --lr over the checkpoint's (with a line when they differ), and returns its
// step. Returns 0 without --resume or when there is no checkpoint there yet (so the same command
// line starts and resumes a run, e.g. under dtrun --max-restarts). Collective.
int64_t resume_checkpoint(const TrainConfig& o, const dtrain::comm::ProcessGroup& pg, Strategy& strategy,
                          LossScaling& scaling, const DataPlan& plan);

// Whether to save after `steps_done` steps: every --save-every steps and after the last one.
bool save_due(const TrainConfig& o, int64_t steps_done);

// Everything a checkpoint of step `steps_done` holds (views of the live state: Design note
// [snapshots are views], dtrain/checkpoint/piece.h). Collective over the tensor group with tensor
// parallelism.
checkpoint::Snapshot state_of(const TrainConfig& o, const dtrain::comm::ProcessGroup& pg, Strategy& strategy,
                              const LossScaling& scaling, const DataPlan& plan, int64_t steps_done);
// Collective: saves the state after `steps_done` steps under o.save; returns the checkpoint's directory.
std::string save_checkpoint(const TrainConfig& o, const dtrain::comm::ProcessGroup& pg, Strategy& strategy,
                            const LossScaling& scaling, const DataPlan& plan, int64_t steps_done);
// --save-async: the same state handed to `saver` (Design note [asynchronous saves]), the parameters
// and optimizer state copied in the background: call saver.copied() before the next optimizer step
// (Design note [a copy overlapped with the next step]); returns what the step waited. Collective
// over the saver's group.
checkpoint::AsyncSaveStats save_checkpoint_async(const TrainConfig& o, const dtrain::comm::ProcessGroup& pg,
                                                 Strategy& strategy, const LossScaling& scaling, const DataPlan& plan,
                                                 int64_t steps_done, checkpoint::AsyncSaver& saver);
// --snapshot-every: the same state into `snapshots` (Design note [partner snapshots]), packed and
// exchanged in the background: call snapshots.packed() before the next optimizer step; returns the
// seconds it held the caller. Collective.
double take_partner_snapshot(const TrainConfig& o, const dtrain::comm::ProcessGroup& pg, Strategy& strategy,
                             const LossScaling& scaling, const DataPlan& plan, int64_t steps_done,
                             checkpoint::PartnerSnapshots& snapshots);


// --export-weights: Strategy::export_weights to o.export_weights (collective); rank 0 reports it.
void export_weights(const TrainConfig& o, const dtrain::comm::ProcessGroup& pg, Strategy& strategy);

// The DTRAIN_TEST_FAIL_AT_STEP test hook (see above); call at the start of step `step` (1-based).
// `at`: where the call is ("step": its start; "vote"; "save": before the step's save).
void maybe_fail_for_test(const std::string& program, int64_t step, int rank, int world, const char* at = "step");

}  // namespace dtrain::train
