// load_from_peers: Design note [state re-split from memory] in dtrain/checkpoint/peer_load.h.
#include "dtrain/checkpoint/peer_load.h"

#include <algorithm>
#include <cstring>
#include <tuple>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "dtrain/comm/all_gather.h"
#include "dtrain/comm/all_to_all.h"

namespace dtrain::checkpoint {

namespace {

using Json = nlohmann::json;

// A range of a key one holder's piece supplies: elements [lo, hi), from its piece `piece` (whose
// first element is `begin`).
struct Segment {
  int64_t lo = 0, hi = 0;
  int rank = -1;
  size_t piece = 0;
  int64_t begin = 0;
};

// Every key the members hold: its shape, dtype, and who supplies which elements (disjoint,
// ascending; gaps are elements no member holds).
struct Key {
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  std::vector<Segment> segments;
};

struct Index {
  int holder = -1;  // the lowest rank that holds pieces (-1: none)
  int64_t step = -1;
  int world_size = 0;
  std::map<std::string, std::string> metadata;
  std::map<std::string, Key> keys;
};

std::string index_text(const HeldState& held) {
  Json pieces = Json::array();
  for (const Piece& p : held.pieces) {
    pieces.push_back({p.key, static_cast<int>(p.data.scalar_type()), p.shape, p.begin, p.data.numel()});
  }
  return Json{{"step", held.step}, {"world", held.world_size}, {"metadata", held.metadata}, {"pieces", pieces}}.dump();
}

// The holders' pieces of one key as disjoint segments, the lowest rank's where several overlap.
struct Source {
  int rank;
  size_t piece;
  int64_t begin, end;
};
std::vector<Segment> cover(std::vector<Source> sources) {
  std::vector<int64_t> cuts;
  for (const Source& s : sources) {
    cuts.push_back(s.begin);
    cuts.push_back(s.end);
  }
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  std::sort(sources.begin(), sources.end(), [](const Source& a, const Source& b) { return a.rank < b.rank; });
  std::vector<Segment> out;
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    for (const Source& s : sources) {
      if (s.begin > cuts[i] || s.end < cuts[i + 1]) continue;
      if (!out.empty() && out.back().hi == cuts[i] && out.back().rank == s.rank && out.back().piece == s.piece) {
        out.back().hi = cuts[i + 1];
      } else {
        out.push_back({cuts[i], cuts[i + 1], s.rank, s.piece, s.begin});
      }
      break;
    }
  }
  return out;
}

Index merge(const comm::ProcessGroup& pg, const std::vector<std::string>& texts) {
  Index index;
  std::map<std::string, std::vector<Source>> sources;
  for (int r = 0; r < static_cast<int>(texts.size()); ++r) {
    const Json j = Json::parse(texts[r]);
    const Json& pieces = j.at("pieces");
    if (pieces.empty()) continue;
    const int64_t step = j.at("step").get<int64_t>();
    if (index.holder < 0) {
      index = Index{r, step, j.at("world").get<int>(), j.at("metadata").get<std::map<std::string, std::string>>(), {}};
    }
    TORCH_CHECK(step == index.step, pg.describe(), " load_from_peers: rank ", r, " holds state of step ", step,
                ", rank ", index.holder, " of step ", index.step, " (the pieces must be of one step)");
    for (size_t i = 0; i < pieces.size(); ++i) {
      const Json& p = pieces[i];
      const std::string key = p.at(0).get<std::string>();
      const auto dtype = static_cast<at::ScalarType>(p.at(1).get<int>());
      const auto shape = p.at(2).get<std::vector<int64_t>>();
      auto [it, fresh] = index.keys.try_emplace(key, Key{shape, dtype, {}});
      TORCH_CHECK(fresh || (it->second.shape == shape && it->second.dtype == dtype), pg.describe(),
                  " load_from_peers: rank ", r, "'s piece of \"", key, "\" disagrees with another rank's on the shape or dtype");
      const int64_t begin = p.at(3).get<int64_t>();
      sources[key].push_back({r, i, begin, begin + p.at(4).get<int64_t>()});
    }
  }
  for (auto& [key, s] : sources) index.keys.at(key).segments = cover(std::move(s));
  return index;
}

struct Request {
  std::string key;
  int64_t begin, end;
};

// Calls f(segment, lo, hi) for the parts of [r.begin, r.end) each segment supplies, in order;
// a gap is an error.
template <class F>
void for_each_part(const comm::ProcessGroup& pg, const Index& index, const Request& r, F&& f) {
  const Key& k = index.keys.at(r.key);
  int64_t at = r.begin;
  for (const Segment& s : k.segments) {
    if (s.hi <= at || s.lo >= r.end) continue;
    TORCH_CHECK(s.lo <= at, pg.describe(), " load_from_peers: elements [", at, ", ", s.lo, ") of \"", r.key,
                "\" are held by no rank (lost with a rank whose copy is gone?)");
    const int64_t hi = std::min(s.hi, r.end);
    f(s, at, hi);
    at = hi;
  }
  TORCH_CHECK(at >= r.end, pg.describe(), " load_from_peers: elements [", at, ", ", r.end, ") of \"", r.key,
              "\" are held by no rank (lost with a rank whose copy is gone?)");
}

Reader reader_over(const Index& index, Reader::Fill fill) {
  std::map<std::string, TensorInfo> tensors;
  for (const auto& [key, k] : index.keys) tensors[key] = TensorInfo{k.shape, k.dtype};
  return Reader::in_memory(index.step, index.world_size, index.metadata, tensors, std::move(fill));
}

// The first run: the ranges `load` asks for (it reads zeros), or its error.
std::string record_requests(const Index& index, const std::function<void(const Reader&)>& load,
                            std::vector<Request>& requests) {
  try {
    const Reader recorder = reader_over(index, [&](const std::string& key, int64_t begin, int64_t end, char* dst) {
      requests.push_back({key, begin, end});
      const int64_t item = static_cast<int64_t>(c10::elementSize(index.keys.at(key).dtype));
      std::memset(dst, 0, static_cast<size_t>((end - begin) * item));
    });
    load(recorder);
  } catch (const std::exception& e) {
    return Json{{"error", e.what()}}.dump();
  }
  Json j = Json::array();
  for (const Request& r : requests) j.push_back({r.key, r.begin, r.end});
  return Json{{"requests", j}}.dump();
}

std::vector<std::vector<Request>> parse_requests(const comm::ProcessGroup& pg, const std::vector<std::string>& texts) {
  std::vector<std::vector<Request>> all(texts.size());
  for (size_t r = 0; r < texts.size(); ++r) {
    const Json j = Json::parse(texts[r]);
    if (j.contains("error")) {
      TORCH_CHECK(false, pg.describe(), " load_from_peers: rank ", r, " could not load: ", j.at("error").get<std::string>());
    }
    for (const Json& q : j.at("requests")) all[r].push_back({q.at(0).get<std::string>(), q.at(1).get<int64_t>(), q.at(2).get<int64_t>()});
  }
  return all;
}

int64_t item_size(const Index& index, const std::string& key) {
  return static_cast<int64_t>(c10::elementSize(index.keys.at(key).dtype));
}

}  // namespace

PeerLoadStats load_from_peers(const comm::ProcessGroup& pg, const HeldState& held,
                              const std::function<void(const Reader&)>& load) {
  const int me = pg.rank(), world = pg.size();
  for (const Piece& p : held.pieces) {
    TORCH_CHECK(p.data.device().is_cpu() && p.data.is_contiguous(), pg.describe(), " load_from_peers: the piece of \"",
                p.key, "\" must be a contiguous CPU tensor (copy it to the host first)");
  }
  const Index index = merge(pg, comm::all_gather_text(pg, index_text(held)));
  std::vector<Request> mine;
  const auto all = parse_requests(pg, comm::all_gather_text(pg, record_requests(index, load, mine)));
  // What this rank sends each requester (the parts it supplies, in request order) and receives from each holder.
  std::vector<int64_t> send_sizes(world, 0), recv_sizes(world, 0);
  int64_t moved = 0;  // (by every rank: none anywhere skips the exchange on every rank alike)
  for (int j = 0; j < world; ++j) {
    for (const Request& r : all[j]) {
      const int64_t item = item_size(index, r.key);
      for_each_part(pg, index, r, [&](const Segment& s, int64_t lo, int64_t hi) {
        moved += hi - lo;
        if (s.rank == me) send_sizes[j] += (hi - lo) * item;
        if (j == me) recv_sizes[s.rank] += (hi - lo) * item;
      });
    }
  }
  int64_t send_total = 0, recv_total = 0;
  for (int r = 0; r < world; ++r) send_total += send_sizes[r], recv_total += recv_sizes[r];
  at::Tensor out = at::empty({send_total}, at::kByte);
  char* w = static_cast<char*>(out.data_ptr());
  for (int j = 0; j < world; ++j) {
    for (const Request& r : all[j]) {
      const int64_t item = item_size(index, r.key);
      for_each_part(pg, index, r, [&](const Segment& s, int64_t lo, int64_t hi) {
        if (s.rank != me) return;
        const at::Tensor& data = held.pieces.at(s.piece).data;
        std::memcpy(w, static_cast<const char*>(data.data_ptr()) + (lo - s.begin) * item, static_cast<size_t>((hi - lo) * item));
        w += (hi - lo) * item;
      });
    }
  }
  at::Tensor in = at::empty({recv_total}, at::kByte);
  if (moved > 0) {
    comm::all_to_all(pg, in, out, comm::AllToAllOptions().input_split_sizes(send_sizes).output_split_sizes(recv_sizes));
  }
  // Each request's bytes assembled from its holders' parts (each holder's in order).
  std::vector<int64_t> from(world, 0);
  for (int r = 1; r < world; ++r) from[r] = from[r - 1] + recv_sizes[r - 1];
  std::map<std::tuple<std::string, int64_t, int64_t>, at::Tensor> got;
  for (const Request& r : mine) {
    const int64_t item = item_size(index, r.key);
    at::Tensor bytes = at::empty({(r.end - r.begin) * item}, at::kByte);
    for_each_part(pg, index, r, [&](const Segment& s, int64_t lo, int64_t hi) {
      std::memcpy(static_cast<char*>(bytes.data_ptr()) + (lo - r.begin) * item,
                  static_cast<const char*>(in.data_ptr()) + from[s.rank], static_cast<size_t>((hi - lo) * item));
      from[s.rank] += (hi - lo) * item;
    });
    got[{r.key, r.begin, r.end}] = bytes;
  }
  std::string failed;  // (the second run's outcome, agreed: no rank goes on while another stopped)
  try {
    load(reader_over(index, [&](const std::string& key, int64_t begin, int64_t end, char* dst) {
      auto it = got.find({key, begin, end});
      TORCH_CHECK(it != got.end(), "the loader asked for elements [", begin, ", ", end, ") of \"", key,
                  "\" only the second time (its reads must not depend on the values read)");
      std::memcpy(dst, it->second.data_ptr(), static_cast<size_t>(it->second.numel()));
    }));
  } catch (const std::exception& e) {
    failed = e.what();
  }
  const std::vector<std::string> outcomes = comm::all_gather_text(pg, failed);
  for (size_t r = 0; r < outcomes.size(); ++r) {
    TORCH_CHECK(outcomes[r].empty(), pg.describe(), " load_from_peers: rank ", r, " could not load: ", outcomes[r]);
  }
  return {send_total - send_sizes[me], recv_total - recv_sizes[me]};
}

}  // namespace dtrain::checkpoint
