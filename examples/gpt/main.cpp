// dtrain-gpt: trains a byte-level GPT on real text with the strategy picked by --strategy, through
// the library's training loop (dtrain/train/fit.h): this file holds only what is the GPT's, the
// data, the model and its flags.
//
//   build/bin/dtrun --standalone --nproc-per-node 2 build/bin/dtrain-gpt --strategy ddp --steps 200
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/data/text_dataset.h"
#include "dtrain/data/token_dataset.h"
#include "dtrain/checkpoint/store.h"
#include "dtrain/checkpoint/train_state.h"
#include "dtrain/models/generate.h"
#include "dtrain/models/gpt.h"
#include "dtrain/models/gpt_stages.h"
#include "dtrain/models/parallel_gpt.h"
#include "dtrain/train/fit.h"
#include "dtrain/util/fs.h"
#include "dtrain/util/parse.h"
#include "tokenizer.h"

using namespace dtrain;

namespace {

struct GptFlags {
  int64_t layers = 4, d_model = 128, heads = 4, seq_len = 128;
  int64_t vocab_size = 0;           // 0: bytes (256); token files need theirs
  std::optional<std::string> generate;  // --generate PROMPT: sample a continuation from --resume's model
  int64_t max_new_tokens = 200, top_k = 0;
  double temperature = 1.0;
  std::string tokenizer;            // a SentencePiece model (dtrain-tokenize's tokenizer.model); empty: bytes
  double dropout = 0.0;
  std::string attention = "fused";  // fused (scaled_dot_product_attention where libtorch has it) | math
  std::string data;                 // empty: /usr/share/common-licenses
};

// Token files (a .bin, or a directory holding .bin shards), else text.
bool is_token_data(const std::string& path) {
  auto bin = [](const std::string& p) { return p.size() > 4 && p.compare(p.size() - 4, 4, ".bin") == 0; };
  if (bin(path)) return true;
  if (path.empty() || !util::fs::is_directory(path)) return false;
  for (const auto& name : util::fs::list_directory(path)) {
    if (bin(name)) return true;
  }
  return false;
}

train::ExtraFlags gpt_flags(GptFlags& g) {
  train::ExtraFlags f;
  f.valued = {
      {"--layers", [&g](const std::string& v) { g.layers = train::int_flag("--layers", v, 1); }},
      {"--d-model", [&g](const std::string& v) { g.d_model = train::int_flag("--d-model", v, 1); }},
      {"--heads", [&g](const std::string& v) { g.heads = train::int_flag("--heads", v, 1); }},
      {"--seq-len", [&g](const std::string& v) { g.seq_len = train::int_flag("--seq-len", v, 1); }},
      {"--attention", [&g](const std::string& v) { g.attention = train::choice_flag("--attention", v, {"fused", "math"}); }},
      {"--data", [&g](const std::string& v) { g.data = v; }},
      {"--vocab-size", [&g](const std::string& v) { g.vocab_size = train::int_flag("--vocab-size", v, 2); }},
      {"--generate", [&g](const std::string& v) { g.generate = v; }},
      {"--max-new-tokens", [&g](const std::string& v) { g.max_new_tokens = train::int_flag("--max-new-tokens", v, 1); }},
      {"--top-k", [&g](const std::string& v) { g.top_k = train::int_flag("--top-k", v, 0); }},
      {"--temperature", [&g](const std::string& v) {
         const auto t = util::parse_double(v);
         if (!t || !(*t >= 0)) throw std::invalid_argument("--temperature expects a number >= 0, got '" + v + "'");
         g.temperature = *t;
       }},
      {"--tokenizer", [&g](const std::string& v) { g.tokenizer = v; }},
      {"--dropout", [&g](const std::string& v) {
         const auto p = util::parse_double(v);
         if (!p || !(*p >= 0.0 && *p < 1.0)) throw std::invalid_argument("--dropout expects a number in [0, 1), got '" + v + "'");
         g.dropout = *p;
       }},
  };
  f.usage = R"(GPT and data:
  --layers N --d-model N --heads N --seq-len N     model shape (4, 128, 4, 128); --wrap layer makes
                            each transformer block an FSDP unit, --activation-checkpointing
                            recomputes each block
  --attention fused|math    fused: scaled_dot_product_attention where libtorch has it (2.x; flash
                            kernels on CUDA), math: softmax(q k^T) v by hand (1.13 always) (fused)
  --data PATH               text file or directory (default /usr/share/common-licenses), or token
                            files: nanoGPT's uint16 .bin, Megatron's .bin/.idx, or a directory of
                            .bin shards (dtrain-tokenize writes them; needs --vocab-size)
  --vocab-size N            the tokenizer's vocabulary (token files); bytes: 256
Generation (one process, no training):
  --generate PROMPT         with --resume DIR: the checkpoint's model (any plan) continues PROMPT
  --max-new-tokens N --temperature T --top-k K   (200, 1.0: 0 is greedy, 0: every token)
  --tokenizer FILE          a SentencePiece model (dtrain-tokenize) for the prompt and the output;
                            without it prompt and output are bytes
  --dropout P               dropout on the embeddings, attention and residual branches (0); with
                            --tp the masks do not depend on the degree
)";
  f.check = [&g] {
    if (g.vocab_size > 0 && !is_token_data(g.data) && !g.generate) {
      throw std::invalid_argument("--vocab-size applies to token files (--data tokens.bin); text is bytes (256)");
    }
    if (is_token_data(g.data) && g.vocab_size == 0) {
      throw std::invalid_argument("--data " + g.data + " holds token files: give their tokenizer's --vocab-size");
    }
    if (g.d_model % g.heads != 0) {
      throw std::invalid_argument("--d-model (" + std::to_string(g.d_model) + ") must be divisible by --heads (" +
                                  std::to_string(g.heads) + ")");
    }
  };
  return f;
}

// --generate: the plain GPT from the checkpoint (saved under any plan: full tensors under the plain
// model's names), sampling on one process.
int generate_text(const train::TrainConfig& cfg, const GptFlags& g) {
  if (cfg.resume.empty()) throw std::invalid_argument("--generate needs the model to continue from: --resume DIR");
  if (util::env_int("WORLD_SIZE").value_or(1) > 1) throw std::invalid_argument("--generate runs on one process, not under dtrun");
  Tokenizer tok(g.tokenizer);
  const int64_t vocab = g.vocab_size > 0 ? g.vocab_size : tok.vocab_size();
  models::GPT gpt(models::GPTOptions().seq_len(g.seq_len).layers(g.layers).d_model(g.d_model).heads(g.heads)
                      .vocab_size(vocab).fused_attention(g.attention == "fused"));
  const auto reader = checkpoint::Reader::open(cfg.resume);
  checkpoint::load_model(reader, *gpt);
  gpt->eval();
  const auto out = models::generate([&](const at::Tensor& t) { return gpt->forward(t); }, g.seq_len, tok.encode(*g.generate),
                                    models::GenerateOptions().max_new_tokens(g.max_new_tokens).temperature(g.temperature)
                                        .top_k(g.top_k).seed(cfg.seed));
  std::printf("%s\n", tok.decode(out).c_str());
  return 0;
}

template <class Dataset>
void train_on(const train::TrainConfig& cfg, const GptFlags& g, train::Session& session, const Dataset& dataset,
              const std::string& path, const std::function<Dataset(const std::string&)>& open) {
  // The model the configuration names, given to `use` (train::fit with a build function, Design
  // note [planned layouts]: --strategy auto builds one per layout it weighs).
  auto build = [&](const parallel::Plan& p, auto&& use) {
    const bool init_on_ranks = p.shards_parameters() && p.fsdp.init_on_ranks;
    const int tp = p.layout.tensor;
    const auto options = models::GPTOptions().seq_len(g.seq_len).layers(g.layers).d_model(g.d_model).heads(g.heads)
                             .vocab_size(g.vocab_size > 0 ? g.vocab_size : 256)
                             .seed(cfg.seed).defer_init(init_on_ranks).fused_attention(g.attention == "fused").dropout(g.dropout);
    models::GPT gpt(options);
    train::FitOptions fo;
    fo.tokens_per_sample = g.seq_len;
    fo.flops_per_token = gpt->flops_per_token(g.seq_len);
    fo.model_description = "GPT " + std::to_string(g.layers) + " layers, d_model " + std::to_string(g.d_model) + ", " +
                           std::to_string(g.heads) + " heads, data " + path;
    train::ModelHooks hooks;
    if (tp > 1) {  // --tp: the GPT from tensor-parallel layers, each rank keeping its pieces of the seeded GPT
      if (p.sequence_parallel && g.seq_len % tp != 0) {
        throw std::invalid_argument("--sequence-parallel cuts the sequence over --tp " + std::to_string(tp) +
                                    " ranks: --seq-len " + std::to_string(g.seq_len) + " must be divisible by it");
      }
      hooks.groups = train::make_groups(p, session.pg);
      hooks.wrap = fsdp::WrapPolicy::by_type<tensor_parallel::ParallelBlockImpl>();  // --strategy fsdp|hsdp
      hooks.recompute = recompute::of_type<tensor_parallel::ParallelBlockImpl>();    // --activation-checkpointing
      models::ParallelGPT tp_gpt(models::GPTOptions(options).fused_attention(false), hooks.groups->tensor, p.sequence_parallel);
      tp_gpt->load_from(*gpt);
      gpt = nullptr;  // (its values are in the pieces now)
      hooks.stages = [tp_gpt](int n) { return models::gpt_stages(tp_gpt, n); };     // --pp: TP stages
      train::place_model(*tp_gpt, session.device, false);
      use(tp_gpt, [tp_gpt](const at::Tensor& logits, const at::Tensor& y) { return tp_gpt->loss(logits, y); }, hooks, fo);
      return;
    }
    train::place_model(*gpt, session.device, init_on_ranks);
    hooks.wrap = fsdp::WrapPolicy::by_type<models::GPTBlockImpl>();      // one FSDP unit per block
    hooks.recompute = recompute::of_type<models::GPTBlockImpl>();        // --activation-checkpointing
    hooks.stages = [gpt](int n) { return models::gpt_stages(gpt, n); };  // --pp: cut by layer counts
    if (init_on_ranks) hooks.param_init = gpt->initializer(cfg.seed);
    use(gpt, models::gpt_loss, hooks, fo);
  };
  if (!cfg.val_data.empty()) {  // held-out samples of its own (else --val-fraction holds out the last windows)
    train::fit(session, dataset, open(cfg.val_data), cfg, build);
  } else {
    train::fit(session, dataset, cfg, build);
  }
}

int run(const train::TrainConfig& cfg, const GptFlags& g) {
  if (g.generate) return generate_text(cfg, g);
  train::Session session = train::start(cfg);
  const std::string path = g.data.empty() ? data::kDefaultTextCorpus : g.data;
  if (is_token_data(path)) {
    const std::function<data::TokenDataset(const std::string&)> open = [&](const std::string& p) {
      return data::TokenDataset::open(p, g.seq_len, g.vocab_size);
    };
    train_on(cfg, g, session, open(path), path, open);
  } else {
    const std::function<data::TextDataset(const std::string&)> open = [&](const std::string& p) {
      return data::TextDataset::from_path(p, g.seq_len);
    };
    train_on(cfg, g, session, open(path), path, open);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  train::TrainConfig cfg;
  cfg.program = "dtrain-gpt";
  GptFlags g;
  const train::ExtraFlags flags = gpt_flags(g);
  if (auto rc = train::parse_command_line(argc, argv, cfg, flags,
                                          "Trains a byte-level GPT on real text, in one process, data-parallel "
                                          "(DDP, ZeRO, FSDP) or pipelined (--pp).")) {
    return *rc;
  }
  return train::run_reporting_errors(cfg.program, [&] { return run(cfg, g); });
}
