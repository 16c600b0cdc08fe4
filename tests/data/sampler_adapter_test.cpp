// DataLoaderSampler: libtorch's data loader hands each rank exactly DistributedSampler's indices,
// epoch by epoch, in batches; every rank together covers the dataset; save/load resumes mid-epoch.
#include "dtrain/data/sampler_adapter.h"

#include <gtest/gtest.h>

#include <set>
#include <sstream>

#include <torch/data.h>
#include <torch/serialize/archive.h>

using dtrain::data::DataLoaderSampler;
using dtrain::data::DistributedSampler;
using dtrain::data::DistributedSamplerOptions;

namespace {

// Sample i of this dataset is the scalar i, so a batch shows which indices the loader took.
std::vector<int64_t> epoch_through_loader(int64_t n, int world, int rank, int64_t epoch, size_t batch,
                                          std::vector<size_t>* batch_sizes = nullptr) {
  auto ds = torch::data::datasets::TensorDataset(at::arange(n, at::kLong)).map(torch::data::transforms::Stack<torch::data::TensorExample>());
  DataLoaderSampler sampler(n, DistributedSamplerOptions(world, rank).shuffle(true).seed(7));
  DataLoaderSampler handle = sampler;  // shares the epoch with the copy the loader holds
  auto loader = torch::data::make_data_loader(std::move(ds), std::move(sampler), torch::data::DataLoaderOptions(batch));
  handle.set_epoch(epoch);
  std::vector<int64_t> seen;
  for (auto& b : *loader) {
    if (batch_sizes) batch_sizes->push_back(static_cast<size_t>(b.data.size(0)));
    for (int64_t i = 0; i < b.data.size(0); ++i) seen.push_back(b.data[i].item<int64_t>());
  }
  return seen;
}

}  // namespace

TEST(DataLoaderSampler, LoaderSeesTheSamplersIndicesPerRankAndEpoch) {
  const int64_t n = 23;
  for (int world : {1, 2, 3}) {
    std::set<int64_t> all;
    for (int rank = 0; rank < world; ++rank) {
      for (int64_t epoch : {0, 1}) {
        DistributedSampler ref(n, DistributedSamplerOptions(world, rank).shuffle(true).seed(7));
        ref.set_epoch(epoch);
        std::vector<size_t> sizes;
        const auto seen = epoch_through_loader(n, world, rank, epoch, 4, &sizes);
        EXPECT_EQ(seen, ref.indices()) << "world " << world << " rank " << rank << " epoch " << epoch;
        EXPECT_EQ(sizes.front(), 4u);
        if (epoch == 0) all.insert(seen.begin(), seen.end());
      }
    }
    EXPECT_EQ(all.size(), static_cast<size_t>(n)) << "the ranks together cover the dataset (world " << world << ")";
  }
  // Another epoch, another order.
  EXPECT_NE(epoch_through_loader(n, 2, 0, 0, 4), epoch_through_loader(n, 2, 0, 1, 4));
}

TEST(DataLoaderSampler, SaveAndLoadResumeMidEpoch) {
  DataLoaderSampler a(40, DistributedSamplerOptions(2, 1).shuffle(true).seed(3));
  a.set_epoch(5);
  a.reset(c10::nullopt);
  const auto first = a.next(6).value();
  torch::serialize::OutputArchive out;
  a.save(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  const auto rest = a.next(100).value();
  EXPECT_FALSE(a.next(1).has_value()) << "exhausted for this epoch";

  DataLoaderSampler b(40, DistributedSamplerOptions(2, 1).shuffle(true).seed(3));
  torch::serialize::InputArchive in;
  std::istringstream is(bytes.str());
  in.load_from(is);
  b.load(in);
  EXPECT_EQ(b.epoch(), 5);
  EXPECT_EQ(b.next(100).value(), rest);
  EXPECT_EQ(first.size(), 6u);
}
