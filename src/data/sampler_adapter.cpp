#include "dtrain/data/sampler_adapter.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

namespace dtrain::data {

DataLoaderSampler::DataLoaderSampler(int64_t dataset_size, DistributedSamplerOptions options)
    : state_(std::make_shared<State>(State{DistributedSampler(dataset_size, std::move(options)), {}, 0})) {
  state_->indices = state_->sampler.indices();
}

void DataLoaderSampler::set_epoch(int64_t epoch) { state_->sampler.set_epoch(epoch); }
int64_t DataLoaderSampler::epoch() const { return state_->sampler.epoch(); }

void DataLoaderSampler::reset(c10::optional<size_t> new_size) {
  if (new_size && static_cast<int64_t>(*new_size) != state_->sampler.dataset_size()) {
    const int64_t epoch = state_->sampler.epoch();
    state_->sampler = DistributedSampler(static_cast<int64_t>(*new_size), state_->sampler.options());
    state_->sampler.set_epoch(epoch);
  }
  state_->indices = state_->sampler.indices();
  state_->position = 0;
}

c10::optional<std::vector<size_t>> DataLoaderSampler::next(size_t batch_size) {
  auto& s = *state_;
  if (s.position >= s.indices.size()) return c10::nullopt;
  const size_t n = std::min(batch_size, s.indices.size() - s.position);
  std::vector<size_t> out(s.indices.begin() + static_cast<std::ptrdiff_t>(s.position),
                          s.indices.begin() + static_cast<std::ptrdiff_t>(s.position + n));
  s.position += n;
  return out;
}

void DataLoaderSampler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("epoch", at::tensor(state_->sampler.epoch(), at::kLong), /*is_buffer=*/true);
  archive.write("position", at::tensor(static_cast<int64_t>(state_->position), at::kLong), /*is_buffer=*/true);
}

void DataLoaderSampler::load(torch::serialize::InputArchive& archive) {
  at::Tensor epoch = at::empty({}, at::kLong), position = at::empty({}, at::kLong);
  archive.read("epoch", epoch, /*is_buffer=*/true);
  archive.read("position", position, /*is_buffer=*/true);
  state_->sampler.set_epoch(epoch.item<int64_t>());
  state_->indices = state_->sampler.indices();
  const int64_t p = position.item<int64_t>();
  TORCH_CHECK(p >= 0 && p <= static_cast<int64_t>(state_->indices.size()), "DataLoaderSampler::load: position ", p,
              " is outside this rank's ", state_->indices.size(), " indices");
  state_->position = static_cast<size_t>(p);
}

}  // namespace dtrain::data
