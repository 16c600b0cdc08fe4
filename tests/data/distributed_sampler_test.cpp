// DistributedSampler against PyTorch's torch.utils.data.DistributedSampler (golden file made by
// tests/data/make_sampler_golden.py), plus its argument checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "dtrain/data/distributed_sampler.h"

namespace {

using dtrain::data::DistributedSampler;
using dtrain::data::DistributedSamplerOptions;

// ---- a tiny JSON reader: objects, arrays, integers, booleans, strings, null ----
struct Json {
  enum Kind { Null, Bool, Int, String, Array, Object } kind = Null;
  bool b = false;
  int64_t i = 0;
  std::string s;
  std::vector<Json> items;
  std::map<std::string, Json> fields;

  const Json& operator[](const std::string& key) const {
    auto it = fields.find(key);
    if (it == fields.end()) throw std::runtime_error("golden: missing key " + key);
    return it->second;
  }
};

class JsonParser {
 public:
  explicit JsonParser(std::string text) : t_(std::move(text)) {}
  Json parse() {
    Json v = value();
    ws();
    if (p_ != t_.size()) fail("trailing characters");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) {
    throw std::runtime_error("golden JSON: " + what + " at offset " + std::to_string(p_));
  }
  void ws() {
    while (p_ < t_.size() && std::isspace(static_cast<unsigned char>(t_[p_]))) ++p_;
  }
  bool eat(char c) {
    ws();
    if (p_ < t_.size() && t_[p_] == c) {
      ++p_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail(std::string("expected '") + c + "'");
  }
  bool word(const char* w) {
    const std::string s(w);
    if (t_.compare(p_, s.size(), s) == 0) {
      p_ += s.size();
      return true;
    }
    return false;
  }
  std::string str() {
    expect('"');
    std::string out;
    while (p_ < t_.size() && t_[p_] != '"') {
      if (t_[p_] == '\\') ++p_;  // the golden file has no escapes beyond \" and \\ (if any)
      out += t_[p_++];
    }
    expect('"');
    return out;
  }
  Json value() {
    ws();
    if (p_ >= t_.size()) fail("unexpected end");
    Json v;
    const char c = t_[p_];
    if (c == '{') {
      ++p_;
      v.kind = Json::Object;
      if (eat('}')) return v;
      do {
        ws();
        std::string key = str();
        expect(':');
        v.fields[key] = value();
      } while (eat(','));
      expect('}');
    } else if (c == '[') {
      ++p_;
      v.kind = Json::Array;
      if (eat(']')) return v;
      do v.items.push_back(value());
      while (eat(','));
      expect(']');
    } else if (c == '"') {
      v.kind = Json::String;
      v.s = str();
    } else if (word("true")) {
      v.kind = Json::Bool;
      v.b = true;
    } else if (word("false")) {
      v.kind = Json::Bool;
    } else if (word("null")) {
    } else {
      size_t used = 0;
      v.kind = Json::Int;
      try {
        v.i = std::stoll(t_.substr(p_, 32), &used);
      } catch (const std::exception&) {
        fail("expected a value");
      }
      p_ += used;
    }
    return v;
  }

  std::string t_;
  size_t p_ = 0;
};

const Json& golden() {
  static const Json g = [] {
    const std::string path =
        std::string(DTRAIN_SOURCE_DIR) + "/tests/data/golden/distributed_sampler.json";
    std::ifstream in(path);
    if (!in) throw std::runtime_error("cannot open " + path);
    std::stringstream ss;
    ss << in.rdbuf();
    return JsonParser(ss.str()).parse();
  }();
  return g;
}

std::string describe(const Json& c) {
  std::ostringstream os;
  os << "n=" << c["n"].i << " num_replicas=" << c["num_replicas"].i << " rank=" << c["rank"].i
     << " shuffle=" << c["shuffle"].b << " seed=" << c["seed"].i << " epoch=" << c["epoch"].i
     << " drop_last=" << c["drop_last"].b;
  return os.str();
}

TEST(DistributedSampler, MatchesPyTorchGolden) {
  const Json& cases = golden()["cases"];
  ASSERT_GT(cases.items.size(), 900u);
  int checked = 0;
  for (const Json& c : cases.items) {
    SCOPED_TRACE(describe(c));
    DistributedSampler sampler(c["n"].i, DistributedSamplerOptions(c["num_replicas"].i, c["rank"].i)
                                             .shuffle(c["shuffle"].b)
                                             .seed(c["seed"].i)
                                             .drop_last(c["drop_last"].b));
    sampler.set_epoch(c["epoch"].i);
    EXPECT_EQ(sampler.num_samples(), c["num_samples"].i);
    EXPECT_EQ(sampler.total_size(), c["total_size"].i);
    std::vector<int64_t> expected;
    for (const Json& v : c["indices"].items) expected.push_back(v.i);
    ASSERT_EQ(sampler.indices(), expected);
    ++checked;
  }
  EXPECT_EQ(checked, static_cast<int>(cases.items.size()));
}

TEST(DistributedSampler, GoldenCoversEdgeCases) {
  // The golden file must include the interesting regimes, or the test above proves little.
  bool empty = false, pad_beyond_dataset = false, dropped = false, big_seed = false, neg_seed = false;
  for (const Json& c : golden()["cases"].items) {
    const int64_t n = c["n"].i, r = c["num_replicas"].i;
    empty |= n == 0;
    pad_beyond_dataset |= !c["drop_last"].b && c["total_size"].i - n > n && n > 0;
    dropped |= c["drop_last"].b && n % r != 0;
    big_seed |= c["seed"].i > (int64_t(1) << 32);
    neg_seed |= c["seed"].i < 0;
  }
  EXPECT_TRUE(empty && pad_beyond_dataset && dropped && big_seed && neg_seed);
}

TEST(DistributedSampler, PartitionsTheDatasetAcrossRanks) {
  for (bool shuffle : {false, true}) {
    for (int64_t n : {10, 11, 12}) {
      const int64_t world = 4;
      std::multiset<int64_t> all;
      for (int64_t r = 0; r < world; ++r) {
        DistributedSampler s(n, DistributedSamplerOptions(world, r).shuffle(shuffle).seed(7));
        s.set_epoch(3);
        auto idx = s.indices();
        EXPECT_EQ(static_cast<int64_t>(idx.size()), s.num_samples());
        all.insert(idx.begin(), idx.end());
      }
      // every sample appears, and only the padding repeats some
      for (int64_t i = 0; i < n; ++i) EXPECT_GE(all.count(i), 1u) << "n=" << n << " i=" << i;
      EXPECT_EQ(static_cast<int64_t>(all.size()), (n + world - 1) / world * world);
    }
  }
}

// PyTorch's padding rule, directly: without drop_last the list of n indices is padded to a multiple
// of the world by repeating it from its start (cyclically when the padding is longer than the
// list), and rank r takes elements r, r + W, ... Fails if the padding repeats the last index or
// restarts the order anywhere but at its first element.
TEST(DistributedSampler, PadsByWrappingAround) {
  auto global = [](int64_t n, int64_t world, bool shuffle) {
    std::vector<int64_t> out;
    std::vector<std::vector<int64_t>> per_rank;
    for (int64_t r = 0; r < world; ++r) {
      DistributedSampler s(n, DistributedSamplerOptions(world, r).shuffle(shuffle).seed(11));
      per_rank.push_back(s.indices());
    }
    for (size_t k = 0; k < per_rank[0].size(); ++k) {
      for (int64_t r = 0; r < world; ++r) out.push_back(per_rank[static_cast<size_t>(r)].at(k));
    }
    return out;
  };
  // Unshuffled: the order is 0..n-1, so the padded list is explicit.
  EXPECT_EQ(global(5, 4, false), (std::vector<int64_t>{0, 1, 2, 3, 4, 0, 1, 2}));
  EXPECT_EQ(global(2, 5, false), (std::vector<int64_t>{0, 1, 0, 1, 0}));  // cyclic: padding > n
  EXPECT_EQ(global(6, 3, false), (std::vector<int64_t>{0, 1, 2, 3, 4, 5}));  // no padding
  // Shuffled: the padding is the permutation's own head.
  for (int64_t n : {7, 9}) {
    const auto g = global(n, 4, true);
    ASSERT_EQ(static_cast<int64_t>(g.size()), (n + 3) / 4 * 4);
    for (size_t j = static_cast<size_t>(n); j < g.size(); ++j) EXPECT_EQ(g[j], g[j - static_cast<size_t>(n)]) << n << " " << j;
  }
}

TEST(DistributedSampler, EpochChangesOnlyShuffledOrder) {
  DistributedSampler s(50, DistributedSamplerOptions(2, 1).seed(3));
  const auto e0 = s.indices();
  s.set_epoch(1);
  EXPECT_EQ(s.epoch(), 1);
  EXPECT_NE(s.indices(), e0);
  s.set_epoch(0);
  EXPECT_EQ(s.indices(), e0);

  DistributedSampler plain(50, DistributedSamplerOptions(2, 1).shuffle(false));
  const auto p0 = plain.indices();
  plain.set_epoch(9);
  EXPECT_EQ(plain.indices(), p0);
  EXPECT_EQ(p0.front(), 1);
  EXPECT_EQ(p0.back(), 49);
}

TEST(DistributedSampler, DefaultOptions) {
  DistributedSamplerOptions o;
  EXPECT_EQ(o.num_replicas(), 1);
  EXPECT_EQ(o.rank(), 0);
  EXPECT_TRUE(o.shuffle());
  EXPECT_EQ(o.seed(), 0);
  EXPECT_FALSE(o.drop_last());
  DistributedSampler s(5);
  EXPECT_EQ(s.num_samples(), 5);
  EXPECT_EQ(s.dataset_size(), 5);
  auto idx = s.indices();
  std::sort(idx.begin(), idx.end());
  EXPECT_EQ(idx, (std::vector<int64_t>{0, 1, 2, 3, 4}));
}

void expect_error(const std::function<void()>& fn, const std::string& fragment) {
  try {
    fn();
    ADD_FAILURE() << "expected an error mentioning '" << fragment << "'";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(DistributedSampler, RejectsInvalidArguments) {
  expect_error([] { DistributedSampler(10, DistributedSamplerOptions(2, 2)); },
               "rank must be in the interval [0, 1]");
  expect_error([] { DistributedSampler(10, DistributedSamplerOptions(2, -1)); },
               "invalid rank -1");
  expect_error([] { DistributedSampler(10, DistributedSamplerOptions(0, 0)); },
               "num_replicas must be >= 1");
  expect_error([] { DistributedSampler(-1, DistributedSamplerOptions(1, 0)); },
               "dataset size must be >= 0");
}

}  // namespace
