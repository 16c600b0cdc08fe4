// The vocabulary split over the tensor-parallel group: the embedding and the cross-entropy equal
// their one-process forms (torch::nn::Embedding, at::cross_entropy over the whole logits) in value
// and gradient, at TP 1-4; targets on every rank's part of the vocabulary.
#include <gtest/gtest.h>

#include <mutex>

#include <ATen/ATen.h>
#include <torch/nn/modules/embedding.h>

#include "dtrain/comm.h"
#include "dtrain/tensor_parallel/regions.h"
#include "dtrain/tensor_parallel/vocab.h"
#include "testing/models.h"
#include "testing/testing.h"

using namespace dtrain;
using dtrain::testing::run_ranks;
namespace tp = dtrain::tensor_parallel;

namespace {

constexpr int64_t kVocab = 24, kDim = 6;

class VocabParallel : public ::testing::TestWithParam<int> {};

TEST_P(VocabParallel, EmbeddingAndCrossEntropyEqualOneProcess) {
  const int n = GetParam();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const at::Tensor tokens = at::randint(kVocab, {2, 7}, gen);
  const at::Tensor targets = at::randint(kVocab, {2, 7}, gen);
  const at::Tensor probe = at::randn({2, 7, kDim}, gen);  // d(loss)/d(embedding output) = probe
  // One process: the embedding, and the cross-entropy of logits = embedding @ W^T.
  at::Tensor ref_out, ref_emb_grad, ref_logits, ref_loss, ref_logits_grad;
  {
    std::lock_guard<std::mutex> lock(dtrain::testing::init_mutex());
    torch::manual_seed(5);
    torch::nn::Embedding emb(kVocab, kDim);
    ref_out = emb(tokens);
    (ref_out * probe).sum().backward();
    ref_emb_grad = emb->weight.grad();
    ref_logits = at::randn({2, 7, kVocab}, gen).requires_grad_(true);
    ref_loss = at::cross_entropy_loss(ref_logits.view({-1, kVocab}), targets.view({-1}), {}, at::Reduction::None)
                   .view({2, 7});
    ref_loss.mean().backward();
    ref_logits_grad = ref_logits.grad();
  }
  std::mutex mu;
  run_ranks(n, [&](comm::ProcessGroup& pg) {
    tp::VocabParallelEmbedding emb(nullptr);
    {
      std::lock_guard<std::mutex> lock(dtrain::testing::init_mutex());
      torch::manual_seed(5);
      emb = tp::VocabParallelEmbedding(kVocab, kDim, pg);
    }
    at::Tensor out = emb(tokens);
    (out * probe).sum().backward();
    at::Tensor logits = tp::slice_along(ref_logits.detach(), pg, -1).requires_grad_(true);
    at::Tensor loss = tp::vocab_parallel_cross_entropy(logits, targets, pg);
    loss.mean().backward();
    std::lock_guard<std::mutex> lock(mu);
    const std::string r = "rank " + std::to_string(pg.rank()) + " of " + std::to_string(n);
    EXPECT_LT((out - ref_out).abs().max().item<double>(), 1e-6) << r << ": embedding output";
    EXPECT_LT((emb->weight.grad() - tp::slice_along(ref_emb_grad, pg, 0)).abs().max().item<double>(), 1e-6)
        << r << ": embedding gradient (its rows)";
    EXPECT_LT((loss - ref_loss).abs().max().item<double>(), 1e-5) << r << ": loss per position";
    EXPECT_LT((logits.grad() - tp::slice_along(ref_logits_grad, pg, -1)).abs().max().item<double>(), 1e-6)
        << r << ": logits gradient (its columns)";
  });
}

INSTANTIATE_TEST_SUITE_P(Degrees, VocabParallel, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& i) { return "tp" + std::to_string(i.param); });

TEST(VocabParallelErrors, AVocabularyThatDoesNotDivideIsAClearError) {
  run_ranks(4, [&](comm::ProcessGroup& pg) {
    try {
      tp::VocabParallelEmbedding(10, 4, pg);
      ADD_FAILURE() << "a vocabulary of 10 over 4 ranks was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("vocabulary (10) does not divide by the tensor-parallel degree 4"),
                std::string::npos) << e.what();
    }
  });
}

}  // namespace
