#pragma once
// DistributedSampler as a torch::data sampler, so that libtorch's own data loader hands each rank
// its part of every epoch with PyTorch's exact order:
//
//   dtrain::data::DataLoaderSampler sampler(dataset.size().value(),
//       dtrain::data::DistributedSamplerOptions(pg.size(), pg.rank()).shuffle(true).seed(0));
//   auto loader = torch::data::make_data_loader(dataset.map(torch::data::transforms::Stack<>()),
//                                               sampler, torch::data::DataLoaderOptions(32));
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);            // as PyTorch's sampler.set_epoch, before iterating
//     for (auto& batch : *loader) ...
//   }
//
// make_data_loader takes the sampler by value: keep a handle to the copy it holds through
// set_epoch(), which is shared between copies (the epoch lives in a shared state).
#include <cstddef>
#include <memory>
#include <vector>

#include <c10/util/Optional.h>
#include <torch/data/samplers/base.h>

#include "dtrain/data/distributed_sampler.h"

namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

namespace dtrain::data {

class DataLoaderSampler : public torch::data::samplers::Sampler<std::vector<size_t>> {
 public:
  DataLoaderSampler(int64_t dataset_size, DistributedSamplerOptions options);

  // Selects the shuffle of `epoch` for every copy of this sampler; takes effect at the loader's
  // next epoch (its next begin()).
  void set_epoch(int64_t epoch);
  int64_t epoch() const;

  // torch::data::samplers::Sampler: reset() starts the epoch over (a new size re-plans the
  // sampler for a dataset of that size); next(n) hands out up to n of this rank's indices.
  void reset(c10::optional<size_t> new_size = c10::nullopt) override;
  c10::optional<std::vector<size_t>> next(size_t batch_size) override;
  // The epoch and the position in it (resume mid-epoch).
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  struct State {
    DistributedSampler sampler;
    std::vector<int64_t> indices;
    size_t position = 0;
  };
  std::shared_ptr<State> state_;
};

}  // namespace dtrain::data
