// dtrain-tokenize: trains a SentencePiece model on text and writes the text as token shards that
// dtrain-gpt (data::TokenDataset) trains on: Megatron's .bin/.idx pairs, one document per input
// file. The tokenizer is SentencePiece's (Debian's libsentencepiece-dev), not one of our own.
//
//   build/bin/dtrain-tokenize --input corpus/ --output tokens/ --vocab-size 2048
//   build/bin/dtrun --standalone --nproc-per-node 2 build/bin/dtrain-gpt --data tokens/train \
//       --val-data tokens/val --vocab-size 2048 --tokenizer tokens/tokenizer.model
//
// Writes OUTPUT/tokenizer.model (and .vocab; --model reuses a trained one instead), OUTPUT/train/
// shard-NNNNN.{bin,idx} (--shard-tokens per shard) and, with --val-fraction F, the last F of the
// documents' tokens as OUTPUT/val/shard-00000.{bin,idx}.
//
// With --model FILE alone it is the tokenizer of a trained model for other programs (dtrain-gpt
// --generate --tokenizer): --encode TEXT prints the ids, --decode "ID ..." the text, --vocab the
// vocabulary's size.
//
// Design note [sentencepiece in its own process]: libsentencepiece carries its own protobuf, and
// loaded into a process with libtorch (whose libprotobuf it interposes) the process crashes before
// main; so this tool links no libtorch (the token writer and the file helpers it uses are
// libtorch-free sources of the library, compiled in), and dtrain-gpt asks it for encodings.
#include <sys/stat.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include "dtrain/data/token_writer.h"
#include "dtrain/util/fs.h"
#include "dtrain/util/parse.h"

namespace fs = dtrain::util::fs;

namespace {

constexpr const char* kUsage = R"(usage: dtrain-tokenize --input PATH --output DIR [options]
       dtrain-tokenize --model FILE --encode TEXT | --decode "ID ..." | --vocab
  --input PATH           a text file or a directory of them (each file one document)
  --output DIR           where the tokenizer and the token shards go
  --vocab-size N         the tokenizer's vocabulary (2048)
  --model-type bpe|unigram  SentencePiece's model (bpe)
  --model FILE           encode with this trained SentencePiece model instead of training one
  --val-fraction F       the last F of the tokens as validation shards (0: none)
  --shard-tokens N       tokens per training shard (100000000)
  --encode TEXT, --decode "ID ...", --vocab   with --model: the ids of TEXT, the text of the ids,
                         the vocabulary's size
)";

struct Options {
  std::string input, output, model, model_type = "bpe";
  std::optional<std::string> encode, decode;
  bool vocab = false;
  int64_t vocab_size = 2048, shard_tokens = 100000000;
  double val_fraction = 0;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::cout << kUsage;
      std::exit(0);
    }
    if (flag == "--vocab") {
      o.vocab = true;
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
    const std::string v = argv[++i];
    auto integer = [&](int64_t lo) {
      const auto x = dtrain::util::parse_int(v);
      if (!x || *x < lo) throw std::invalid_argument(flag + " expects an integer >= " + std::to_string(lo) + ", got '" + v + "'");
      return *x;
    };
    if (flag == "--input") o.input = v;
    else if (flag == "--encode") o.encode = v;
    else if (flag == "--decode") o.decode = v;
    else if (flag == "--output") o.output = v;
    else if (flag == "--model") o.model = v;
    else if (flag == "--vocab-size") o.vocab_size = integer(8);
    else if (flag == "--shard-tokens") o.shard_tokens = integer(1);
    else if (flag == "--model-type") {
      if (v != "bpe" && v != "unigram") throw std::invalid_argument("--model-type must be bpe or unigram, got '" + v + "'");
      o.model_type = v;
    } else if (flag == "--val-fraction") {
      const auto x = dtrain::util::parse_double(v);
      if (!x || !(*x >= 0 && *x < 1)) throw std::invalid_argument("--val-fraction expects a number in [0, 1), got '" + v + "'");
      o.val_fraction = *x;
    } else {
      throw std::invalid_argument("unknown option '" + flag + "' (dtrain-tokenize --help lists them)");
    }
  }
  const bool tool = o.encode || o.decode || o.vocab;
  if (tool && o.model.empty()) throw std::invalid_argument("--encode, --decode and --vocab need --model FILE");
  if (!tool && (o.input.empty() || o.output.empty())) throw std::invalid_argument("--input and --output are needed (--help)");
  return o;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The input's documents: each regular file (a directory's sorted by name), read whole.
std::vector<std::pair<std::string, std::string>> documents(const std::string& input) {
  std::vector<std::string> files;
  if (fs::is_directory(input)) {
    for (const auto& n : fs::list_directory(input)) {
      if (fs::is_regular_file(fs::join(input, n))) files.push_back(fs::join(input, n));
    }
  } else {
    files.push_back(input);
  }
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& f : files) out.emplace_back(f, read_file(f));
  if (out.empty()) throw std::invalid_argument("--input " + input + " holds no files");
  return out;
}

std::unique_ptr<sentencepiece::SentencePieceProcessor> load(const std::string& model) {
  auto sp = std::make_unique<sentencepiece::SentencePieceProcessor>();
  if (const auto status = sp->Load(model); !status.ok()) {
    throw std::runtime_error("cannot load the SentencePiece model " + model + ": " + status.ToString());
  }
  return sp;
}

// --encode, --decode, --vocab: one line on stdout.
int serve(const Options& o) {
  auto sp = load(o.model);
  if (o.vocab) {
    std::printf("%d\n", sp->GetPieceSize());
  } else if (o.encode) {
    std::vector<int> ids;
    if (const auto status = sp->Encode(*o.encode, &ids); !status.ok()) throw std::runtime_error(status.ToString());
    for (size_t i = 0; i < ids.size(); ++i) std::printf(i ? " %d" : "%d", ids[i]);
    std::printf("\n");
  } else {
    std::vector<int> ids;
    std::istringstream in(*o.decode);
    for (int id; in >> id;) {
      if (id < 0 || id >= sp->GetPieceSize()) throw std::invalid_argument("--decode: id " + std::to_string(id) + " is outside the vocabulary");
      ids.push_back(id);
    }
    std::string text;
    if (const auto status = sp->Decode(ids, &text); !status.ok()) throw std::runtime_error(status.ToString());
    std::printf("%s\n", text.c_str());
  }
  return 0;
}

void make_dir(const std::string& d) {
  if (fs::create_directories(d) != 0) throw std::runtime_error("cannot create the directory " + d);
}

// Writes `docs` as shards of about `per_shard` tokens under `dir` (a document is never cut).
int write_shards(const std::string& dir, const std::vector<std::vector<int64_t>>& docs, int64_t per_shard) {
  make_dir(dir);
  int shards = 0;
  std::vector<std::vector<int64_t>> shard;
  int64_t tokens = 0;
  auto flush = [&] {
    char name[32];
    std::snprintf(name, sizeof name, "shard-%05d", shards++);
    dtrain::data::write_indexed_tokens(fs::join(dir, name), shard);
    shard.clear();
    tokens = 0;
  };
  for (const auto& d : docs) {
    shard.push_back(d);
    tokens += static_cast<int64_t>(d.size());
    if (tokens >= per_shard) flush();
  }
  if (!shard.empty()) flush();
  return shards;
}

int run(const Options& o) {
  if (o.encode || o.decode || o.vocab) return serve(o);
  const auto docs = documents(o.input);
  make_dir(o.output);
  std::string model = o.model;
  if (model.empty()) {
    model = fs::join(o.output, "tokenizer.model");
    std::string files;  // (SentencePiece reads a comma-separated list, one sentence per line)
    for (const auto& [f, text] : docs) files += (files.empty() ? "" : ",") + f;
    std::ostringstream spec;
    spec << "--input=" << files << " --model_prefix=" << fs::join(o.output, "tokenizer") << " --vocab_size=" << o.vocab_size
         << " --model_type=" << o.model_type << " --character_coverage=1.0 --byte_fallback=true --minloglevel=1";
    const auto status = sentencepiece::SentencePieceTrainer::Train(spec.str());
    if (!status.ok()) throw std::runtime_error("SentencePiece could not train on " + o.input + ": " + status.ToString());
  }
  auto sp = load(model);
  std::vector<std::vector<int64_t>> ids;
  int64_t total = 0;
  for (const auto& [file, text] : docs) {
    std::vector<int> piece_ids;
    if (const auto status = sp->Encode(text, &piece_ids); !status.ok()) {
      throw std::runtime_error("cannot encode " + file + ": " + status.ToString());
    }
    ids.emplace_back(piece_ids.begin(), piece_ids.end());
    total += static_cast<int64_t>(piece_ids.size());
  }
  // The last val_fraction of the tokens (cut inside a document where it falls) are validation's.
  std::vector<std::vector<int64_t>> val;
  int64_t held = static_cast<int64_t>(o.val_fraction * static_cast<double>(total));
  while (held > 0 && !ids.empty()) {
    auto& last = ids.back();
    const int64_t take = std::min<int64_t>(held, static_cast<int64_t>(last.size()));
    val.insert(val.begin(), std::vector<int64_t>(last.end() - take, last.end()));
    last.resize(last.size() - static_cast<size_t>(take));
    if (last.empty()) ids.pop_back();
    held -= take;
  }
  const int shards = write_shards(fs::join(o.output, "train"), ids, o.shard_tokens);
  std::printf("dtrain-tokenize: %s, vocabulary %d: %lld tokens of %zu document(s) in %d training shard(s) under %s/train",
              model.c_str(), sp->GetPieceSize(), static_cast<long long>(total), docs.size(), shards, o.output.c_str());
  if (!val.empty()) {
    write_shards(fs::join(o.output, "val"), val, o.shard_tokens);
    std::printf(", validation under %s/val", o.output.c_str());
  }
  std::printf("\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "dtrain-tokenize: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain-tokenize: error: %s\n", e.what());
    return 1;
  }
}
