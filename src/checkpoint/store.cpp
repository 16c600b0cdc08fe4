// save() and latest(): the write side of checkpoints. See docs/checkpoint.md.
#include "dtrain/checkpoint/store.h"

#include <fcntl.h>
#include <signal.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <regex>
#include <set>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "dtrain/checkpoint/manifest.h"
#include "dtrain/checkpoint/streaming_writer.h"
#include "dtrain/comm/all_gather.h"
#include "dtrain/util/fs.h"
#include "dtypes.h"
#include "io.h"

namespace dtrain::checkpoint {

namespace fs = util::fs;
using Json = nlohmann::json;

namespace {

std::string message_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

// One phase of the save protocol: every rank runs `local` (which may throw), then all ranks
// exchange "ok"/the error plus `payload`, and every rank throws if any rank failed, naming them.
// Returns every rank's payload.
template <class F>
std::vector<std::string> agree(const comm::ProcessGroup& pg, const std::string& what, F&& local,
                               const std::function<void()>& on_failure = {}) {
  Json mine = {{"ok", true}, {"payload", ""}};
  try {
    mine["payload"] = local();
  } catch (const std::exception& e) {
    mine = {{"ok", false}, {"error", message_of(e)}};
  }
  const auto all = comm::all_gather_text(pg, mine.dump(-1, ' ', false, Json::error_handler_t::replace));
  std::vector<std::string> payloads;
  std::string errors;
  for (size_t r = 0; r < all.size(); ++r) {
    const Json j = Json::parse(all[r]);
    if (j.at("ok").get<bool>()) {
      payloads.push_back(j.at("payload").get<std::string>());
    } else {
      errors += "\n  rank " + std::to_string(r) + ": " + j.at("error").get<std::string>();
    }
  }
  if (!errors.empty()) {
    if (on_failure) on_failure();
    TORCH_CHECK(false, pg.describe(), " ", what, " failed:", errors);
  }
  return payloads;
}

// Crash injection for the atomicity tests: DTRAIN_CHECKPOINT_CRASH_AT="<point>:<step>" makes the
// process SIGKILL itself at that point of the save of that step (points: before-manifest,
// before-rename, after-rename, after-latest).
void crash_point(const char* point, int64_t step) {
  static const char* spec = std::getenv("DTRAIN_CHECKPOINT_CRASH_AT");
  if (spec && std::string(spec) == std::string(point) + ":" + std::to_string(step)) ::raise(SIGKILL);
}

std::string file_name_of_rank(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank-%05d.safetensors", rank);
  return buf;
}

// A rank's pieces as it will write them, plus the index it sends to rank 0.
struct LocalPlan {
  std::vector<TensorSpec> specs;        // the rank file's tensors, in file order
  std::vector<const Piece*> sources;    // the piece behind each spec
  Json index = Json::array();           // one entry per piece (empty ones too: they carry shape/dtype)
};

LocalPlan plan_pieces(const std::vector<Piece>& pieces, int rank) {
  LocalPlan plan;
  std::set<std::string> names;
  for (const auto& p : pieces) {
    const std::string where = "piece of key \"" + p.key + "\" at element " + std::to_string(p.begin);
    TORCH_CHECK(!p.key.empty() && p.key != kSafetensorsMetadataKey, where, ": the key must be non-empty and not \"",
                kSafetensorsMetadataKey, "\"");
    TORCH_CHECK(p.data.defined(), where, ": data is undefined");
    const auto numel = checked_numel(p.shape);
    TORCH_CHECK(numel, where, ": shape ", shape_string(p.shape), " has a negative or too large dimension");
    const Dtype dtype = detail::require_dtype(p.data.scalar_type(), where);
    TORCH_CHECK(p.begin >= 0 && p.begin <= *numel && p.data.numel() <= *numel - p.begin, where, ": elements [",
                p.begin, ", ", p.begin + p.data.numel(), ") lie outside the tensor's ", *numel,
                " elements (shape ", shape_string(p.shape), ")");
    std::string tensor;
    if (p.data.numel() > 0) {
      const bool whole = p.begin == 0 && p.data.numel() == *numel;
      tensor = whole ? p.key : p.key + "@" + std::to_string(p.begin);
      TORCH_CHECK(names.insert(tensor).second, where, ": rank ", rank, " has two pieces named \"", tensor,
                  "\" (the same key and begin twice, or a key that ends in @<number>)");
      plan.specs.push_back({tensor, whole ? p.shape : std::vector<int64_t>{p.data.numel()}, p.data.scalar_type()});
      plan.sources.push_back(&p);
    }
    plan.index.push_back({{"key", p.key}, {"shape", p.shape}, {"dtype", dtype_name(dtype)}, {"tensor", tensor},
                          {"begin", p.begin}, {"numel", p.data.numel()}});
  }
  return plan;
}

std::string range_string(int64_t b, int64_t e) { return "[" + std::to_string(b) + ", " + std::to_string(e) + ")"; }

// Rank 0: the manifest from every rank's index, checking what only the union shows (equal
// shapes/dtypes, exact coverage, equal step/metadata), with errors naming the key and the ranks.
Manifest build_manifest(const std::vector<std::string>& payloads, int64_t step) {
  Manifest m;
  m.step = step;
  m.world_size = static_cast<int64_t>(payloads.size());
  struct Range {
    int64_t begin, numel;
    int rank;
  };
  std::map<std::string, std::vector<Range>> ranges;
  std::map<std::string, int> first_rank;
  for (size_t r = 0; r < payloads.size(); ++r) {
    const Json j = Json::parse(payloads[r]);
    const int rank = static_cast<int>(r);
    TORCH_CHECK(j.at("step").get<int64_t>() == step, "rank ", rank, " saves step ", j.at("step").get<int64_t>(),
                " but rank 0 saves step ", step, " (every rank must pass the same step)");
    const auto md = j.at("metadata").get<std::map<std::string, std::string>>();
    if (rank == 0) {
      m.metadata = md;
    } else if (md != m.metadata) {
      std::string diff;
      for (const auto& [k, v] : md) {
        auto it = m.metadata.find(k);
        if (it == m.metadata.end() || it->second != v) diff = "\"" + k + "\"";
      }
      for (const auto& [k, v] : m.metadata) {
        if (!md.count(k)) diff = "\"" + k + "\"";
      }
      TORCH_CHECK(false, "rank ", rank, "'s metadata differs from rank 0's (at key ", diff,
                  "): every rank must pass the same metadata");
    }
    const Json& file = j.at("file");
    m.files.push_back({file.at("name").get<std::string>(), file.at("size").get<uint64_t>(),
                       file.at("sha256").get<std::string>()});
    for (const Json& p : j.at("pieces")) {
      const auto key = p.at("key").get<std::string>();
      const auto shape = p.at("shape").get<std::vector<int64_t>>();
      const auto dtype = *dtype_from_name(p.at("dtype").get<std::string>());
      auto [it, fresh] = m.tensors.try_emplace(key, ManifestTensor{shape, dtype, {}});
      if (fresh) {
        first_rank[key] = rank;
      } else {
        TORCH_CHECK(it->second.shape == shape && it->second.dtype == dtype, "key \"", key, "\": rank ",
                    first_rank[key], " saved shape ", shape_string(it->second.shape), " ",
                    dtype_name(it->second.dtype), ", rank ", rank, " saved shape ", shape_string(shape), " ",
                    dtype_name(dtype));
      }
      const auto numel = p.at("numel").get<int64_t>();
      if (numel == 0) continue;
      const auto begin = p.at("begin").get<int64_t>();
      ranges[key].push_back({begin, numel, rank});
      it->second.pieces.push_back({m.files.back().name, p.at("tensor").get<std::string>(), begin, numel});
    }
  }
  for (auto& [key, t] : m.tensors) {
    auto& rs = ranges[key];
    std::sort(rs.begin(), rs.end(), [](const Range& a, const Range& b) { return std::tie(a.begin, a.rank) < std::tie(b.begin, b.rank); });
    const int64_t numel = t.numel();
    int64_t at = 0;
    for (size_t i = 0; i < rs.size(); ++i) {
      const auto& r = rs[i];
      TORCH_CHECK(r.begin >= at, "key \"", key, "\": elements ", range_string(r.begin, r.begin + r.numel),
                  " saved by rank ", r.rank, " overlap ", range_string(rs[i - 1].begin, rs[i - 1].begin + rs[i - 1].numel),
                  " saved by rank ", rs[i - 1].rank, " (each element must be saved by exactly one rank)");
      TORCH_CHECK(r.begin == at, "key \"", key, "\": elements ", range_string(at, r.begin), " of ", numel,
                  " are saved by no rank (", i ? "rank " + std::to_string(rs[i - 1].rank) + " ends at " + std::to_string(at) + ", " : std::string(),
                  "rank ", r.rank, " starts at ", r.begin, ")");
      at = r.begin + r.numel;
    }
    TORCH_CHECK(at == numel, "key \"", key, "\": elements ", range_string(at, numel), " of ", numel,
                " are saved by no rank", rs.empty() ? std::string() : " (the last piece, from rank " + std::to_string(rs.back().rank) + ", ends at " + std::to_string(at) + ")");
  }
  try {
    validate_manifest(m, "manifest of step " + std::to_string(step));
  } catch (const FormatError& e) {
    TORCH_CHECK(false, e.what());
  }
  return m;
}

std::optional<int64_t> committed_step(const std::string& name) {
  static const std::regex re("step-([0-9]{1,18})");
  std::smatch m;
  if (!std::regex_match(name, m, re)) return std::nullopt;
  return std::stoll(m[1].str());
}

bool is_leftover(const std::string& name) {
  static const std::regex re("(step-[0-9]{1,18}\\.tmp-[0-9a-f]+|latest\\.tmp-[0-9a-f]+)");
  return std::regex_match(name, re);
}

// Puts the complete directory `tmp` at `target`. A `target` left by an earlier run (a save of the
// same step that was never named by `latest`, or one that was) is swapped out atomically where the
// file system can (renameat2 RENAME_EXCHANGE), so `latest` never names a missing directory.
void move_into_place(const std::string& tmp, const std::string& target) {
  if (std::rename(tmp.c_str(), target.c_str()) == 0) return;
  const int e = errno;
  TORCH_CHECK(e == ENOTEMPTY || e == EEXIST, "checkpoint ", target, ": cannot rename ", tmp, " to it: ", std::strerror(e));
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) != 0) {
    // No atomic exchange here: move the old one aside first (a crash in between leaves no
    // directory under the name until the next save).
    const std::string aside = target + ".tmp-" + detail::nonce();  // a leftover name: cleaned up if we crash
    TORCH_CHECK(std::rename(target.c_str(), aside.c_str()) == 0, "checkpoint ", target, ": cannot move the existing directory aside: ", std::strerror(errno));
    TORCH_CHECK(std::rename(tmp.c_str(), target.c_str()) == 0, "checkpoint ", target, ": cannot rename ", tmp, " to it: ", std::strerror(errno));
    fs::remove_all(aside);
    return;
  }
  fs::remove_all(tmp);  // now the old directory
}

// After a commit: deletes leftovers of interrupted saves and the committed checkpoints beyond
// `keep_last` among those with a step below `step` (later steps belong to an abandoned run and are
// left for the next save of that step to replace). Failures are warnings: the commit stands.
void clean_up(const std::string& root, int64_t step, int64_t keep_last) {
  std::vector<std::pair<int64_t, std::string>> older;
  for (const auto& name : fs::list_directory(root)) {
    const std::string path = fs::join(root, name);
    if (is_leftover(name)) {
      fs::remove_all(path);
      continue;
    }
    auto s = committed_step(name);
    if (s && *s < step) older.emplace_back(*s, path);
  }
  if (keep_last <= 0) return;
  std::sort(older.rbegin(), older.rend());
  for (size_t i = static_cast<size_t>(keep_last - 1); i < older.size(); ++i) {
    // Renamed to a leftover name first, so that a crash while deleting never leaves a partly
    // deleted directory under a checkpoint's name.
    const std::string doomed = older[i].second + ".tmp-" + detail::nonce();
    int err = fs::rename(older[i].second, doomed);
    if (!err) err = fs::remove_all(doomed);
    if (err) std::cerr << "dtrain checkpoint: warning: cannot delete " << older[i].second << ": " << fs::error_text(err) << "\n";
  }
}

}  // namespace

std::string step_dir_name(int64_t step) {
  TORCH_CHECK(step >= 0, "checkpoint: step ", step, " is negative");
  char buf[40];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

int64_t TensorInfo::numel() const { return checked_numel(shape).value_or(-1); }

std::string save(const std::string& root, int64_t step, const comm::ProcessGroup& pg,
                 const std::vector<Piece>& pieces, const std::map<std::string, std::string>& metadata,
                 const SaveOptions& options) {
  SavePlanCache none;
  return save(root, step, pg, pieces, metadata, options, none);
}

// Design note [a cached save plan]: a save's first phase exists to check every rank's pieces and to
// let rank 0 make the temporary directory and tell the others its name. A run that saves again
// needs neither as a collective: the name's random suffix is agreed once (the first save's) and
// every rank creates the directory itself (an existing one is fine), and a rank's own pieces are
// checked inside the write phase, whose agreement reports a failure on every rank. What rank 0
// checks across ranks (coverage, shapes, dtypes) it checks on the gathered indexes at every save.
// So from the second save on, a save runs two agreements: the file indexes to rank 0 once every
// rank has written, and the commit's outcome to every rank. (PyTorch DCP caches its save plans for
// the same reason: the planning collectives of a large job cost seconds.)
std::string save(const std::string& root, int64_t step, const comm::ProcessGroup& pg,
                 const std::vector<Piece>& pieces, const std::map<std::string, std::string>& metadata,
                 const SaveOptions& options, SavePlanCache& cache) {
  const int rank = pg.rank();
  const std::string final_name = step_dir_name(step);
  const std::string what = "checkpoint save of step " + std::to_string(step) + " to " + root;

  // Phase 1: check the pieces; rank 0 creates the temporary directory.
  LocalPlan plan;
  std::string tmp_name;
  auto remove_tmp = [&] {
    if (rank == 0 && !tmp_name.empty()) {
      fs::remove_all(fs::join(root, tmp_name));
    }
  };
  const bool cached = !cache.nonce.empty();
  if (cached) {
    tmp_name = final_name + ".tmp-" + cache.nonce;
  } else {
    const auto names = agree(pg, what, [&] {
      plan = plan_pieces(pieces, rank);
      if (rank != 0) return std::string();
      int err = fs::create_directories(root);
      TORCH_CHECK(!err, "checkpoint ", root, ": cannot create the directory: ", fs::error_text(err));
      tmp_name = final_name + ".tmp-" + detail::nonce();
      err = fs::create_directory(fs::join(root, tmp_name));
      TORCH_CHECK(!err, "checkpoint ", root, "/", tmp_name, ": cannot create the directory: ", fs::error_text(err));
      return tmp_name;
    }, remove_tmp);
    tmp_name = names[0];
  }
  const std::string tmp_dir = fs::join(root, tmp_name);
  const std::string suffix = tmp_name.substr(tmp_name.rfind(".tmp-") + 5);  // (tmp_name is cleared at the commit)

  // Phase 2: every rank writes its file; rank 0 gathers the indexes. Nothing is committed unless
  // every rank succeeded.
  const auto indexes = agree(pg, what, [&] {
    if (cached) {  // (Design note [a cached save plan]: this rank's checks and directory, no collective)
      plan = plan_pieces(pieces, rank);
      int err = fs::create_directories(tmp_dir);
      TORCH_CHECK(!err, "checkpoint ", tmp_dir, ": cannot create the directory: ", fs::error_text(err));
    }
    const std::string file = file_name_of_rank(rank);
    StreamingWriter writer(fs::join(tmp_dir, file), plan.specs,
                           {{"format", "dtrain-checkpoint-shard"}, {"rank", std::to_string(rank)},
                            {"step", std::to_string(step)}},
                           StreamingWriterOptions().fsync(options.fsync()));
    for (size_t i = 0; i < plan.specs.size(); ++i) writer.write(plan.specs[i].name, plan.sources[i]->data);
    const WrittenFile written = writer.finish();
    const Json index = {{"step", step}, {"metadata", metadata}, {"pieces", plan.index},
                        {"file", {{"name", file}, {"size", written.size}, {"sha256", written.sha256}}}};
    return index.dump(-1, ' ', false, Json::error_handler_t::replace);
  }, remove_tmp);

  // Phase 3: rank 0 validates the union, writes the manifest and commits; every rank learns the outcome.
  const std::string target = fs::join(root, final_name);
  agree(pg, what, [&] {
    if (rank != 0) return std::string();
    crash_point("before-manifest", step);
    const Manifest manifest = build_manifest(indexes, step);
    const std::string manifest_path = fs::join(tmp_dir, kManifestFileName);
    detail::File f = detail::File::create(manifest_path);
    const std::string text = encode_manifest(manifest);
    f.write_all(text.data(), text.size());
    if (options.fsync()) {
      f.fsync();
      for (const auto& file : manifest.files) detail::File::open_read(fs::join(tmp_dir, file.name)).fsync();
      detail::fsync_dir(tmp_dir);
    }
    f.close();
    crash_point("before-rename", step);
    move_into_place(tmp_dir, target);
    tmp_name.clear();  // committed: nothing to remove on failure now
    if (options.fsync()) detail::fsync_dir(root);
    crash_point("after-rename", step);
    detail::write_file_atomic(fs::join(root, "latest"), final_name, options.fsync());
    crash_point("after-latest", step);
    clean_up(root, step, options.keep_last());
    return std::string();
  }, remove_tmp);
  cache.nonce = suffix;
  return target;
}

std::optional<std::string> latest(const std::string& root) {
  const std::string pointer = fs::join(root, "latest");
  if (!fs::exists(pointer)) return std::nullopt;
  std::string name = detail::read_file(pointer, 4096);
  while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();
  // (The pointer's bytes are not quoted: --resume may name a directory holding anything.)
  TORCH_CHECK(committed_step(name), "checkpoint ", pointer, ": does not hold a checkpoint directory name like "
              "step-00000012 (", name.size(), " bytes of something else)");
  const std::string dir = fs::join(root, name);
  TORCH_CHECK(fs::is_directory(dir), "checkpoint ", pointer, ": names ", name, ", but ", dir,
              " does not exist (deleted by hand?)");
  return dir;
}

std::vector<std::string> committed_checkpoints(const std::string& root) {
  std::vector<std::pair<int64_t, std::string>> found;
  if (!fs::is_directory(root)) return {};
  for (const auto& name : fs::list_directory(root)) {
    auto s = committed_step(name);
    if (s && fs::is_directory(fs::join(root, name))) found.emplace_back(*s, fs::join(root, name));
  }
  std::sort(found.rbegin(), found.rend());
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(std::move(f.second));
  return out;
}

}  // namespace dtrain::checkpoint
