// Damaged checkpoints: each kind of damage gives its own error naming the file and the field,
// never a crash or a wrong tensor.
#include <gtest/gtest.h>


#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "checkpoint_testing.h"
#include "dtrain/checkpoint/manifest.h"
#include "dtrain/checkpoint/sha256.h"
#include "dtrain/checkpoint/store.h"
#include "dtrain/util/fs.h"
#include "testing/testing.h"

using namespace dtrain;
using namespace dtrain::checkpoint;
using dtrain::checkpoint::testing::read_bytes;
using dtrain::checkpoint::testing::write_bytes;
namespace fs = dtrain::util::fs;
using Json = nlohmann::json;

namespace {

const at::Tensor& w_values() {
  static const at::Tensor w = at::arange(10, at::kFloat) * 0.5;
  return w;
}
const at::Tensor& mask_values() {
  static const at::Tensor m = at::tensor({1, 0, 0, 1, 1, 0}).to(at::kBool);
  return m;
}

// A checkpoint of step 3 saved by 2 ranks; returns its directory.
std::string make_checkpoint() {
  const std::string root = dtrain::testing::temp_dir();
  dtrain::testing::run_ranks(2, [&](comm::ProcessGroup& pg) {
    std::vector<Piece> pieces{*replicated_piece("model/w", w_values(), pg.rank(), 2),
                              *replicated_piece("model/mask", mask_values(), pg.rank(), 2)};
    if (pg.rank() == 1) pieces.push_back(whole_piece("model/ids", at::arange(3, at::kLong)));
    save(root, 3, pg, pieces, {{"k", "v"}});
  });
  return root + "/step-00000003";
}

Json manifest_of(const std::string& dir) { return Json::parse(read_bytes(dir + "/manifest.json")); }
void write_manifest(const std::string& dir, const Json& m) { write_bytes(dir + "/manifest.json", m.dump(1)); }
// The manifest as format_version 1 (no content_sha256, so read without that check): how the tests
// below reach the checks behind it.
Json as_v1(Json m) {
  m["format_version"] = 1;
  m.erase("content_sha256");
  return m;
}
// Writes `m` sealed again (a fresh content_sha256), as a forger that keeps the manifest consistent would.
void write_sealed(const std::string& dir, const Json& m) {
  write_bytes(dir + "/manifest.json", encode_manifest(parse_manifest(as_v1(m).dump(), "forged")));
}

// Replaces `from` by `to` (same length) inside a rank file and updates the manifest's hash, as a
// forger (or a bug) that keeps the manifest consistent would.
void forge(const std::string& dir, const std::string& file, const std::string& from, const std::string& to) {
  std::string bytes = read_bytes(dir + "/" + file);
  const auto at = bytes.find(from);
  ASSERT_NE(at, std::string::npos) << from;
  ASSERT_EQ(from.size(), to.size());
  bytes.replace(at, from.size(), to);
  write_bytes(dir + "/" + file, bytes);
  Json m = manifest_of(dir);
  for (auto& f : m["files"]) {
    if (f["name"] == file) f["sha256"] = sha256_hex(bytes.data(), bytes.size());
  }
  write_sealed(dir, m);
}

}  // namespace

TEST(Corruption, IntactCheckpointReads) {
  const std::string dir = make_checkpoint();
  const Reader r = Reader::open(dir);
  EXPECT_TRUE(at::equal(r.read("model/w"), w_values()));
  EXPECT_TRUE(at::equal(r.read("model/mask"), mask_values()));
  EXPECT_TRUE(at::equal(r.read("model/ids"), at::arange(3, at::kLong)));
}

TEST(Corruption, TruncatedFile) {
  const std::string dir = make_checkpoint();
  const std::string file = dir + "/rank-00001.safetensors";
  const auto file_size = fs::file_size(file);
  ASSERT_TRUE(file_size);
  const uint64_t size = *file_size;
  ASSERT_EQ(fs::resize_file(file, size - 10), 0);
  EXPECT_ERROR_WITH(Reader::open(dir), "checkpoint " + file + ": " + std::to_string(size - 10) +
                                           " bytes, but the manifest says " + std::to_string(size) + " (truncated or replaced?)");
}

TEST(Corruption, FlippedByteIsAHashMismatchBeforeAnyByteIsUsed) {
  const std::string dir = make_checkpoint();
  const std::string file = dir + "/rank-00000.safetensors";
  std::string bytes = read_bytes(file);
  bytes[bytes.size() - 3] ^= 0x10;  // inside model/w's data: the header is still valid
  write_bytes(file, bytes);
  const Reader r = Reader::open(dir);  // sizes match: opening works
  EXPECT_ERROR_WITH(r.read("model/w"), "checkpoint " + file + ": SHA-256 ");
  EXPECT_ERROR_WITH(r.read("model/w"), "does not match the manifest's sha256");
  EXPECT_ERROR_WITH(r.read("model/w", 0, 1), "does not match");  // also a range whose bytes are intact
  // A key stored only in the intact file still reads.
  EXPECT_TRUE(at::equal(r.read("model/ids"), at::arange(3, at::kLong)));
}

TEST(Corruption, MissingFile) {
  const std::string dir = make_checkpoint();
  ASSERT_EQ(fs::remove(dir + "/rank-00001.safetensors"), 0);
  EXPECT_ERROR_WITH(Reader::open(dir), "checkpoint " + dir + "/rank-00001.safetensors: listed in the manifest but cannot be read");
  EXPECT_ERROR_WITH(Reader::open(dir), "(missing file?)");
}

TEST(Corruption, EditedManifest) {
  const std::string dir = make_checkpoint();
  const Json good = manifest_of(dir);
  const std::string where = "checkpoint " + dir + "/manifest.json: ";
  auto with = [&](const std::function<void(Json&)>& edit) {
    Json m = good;
    edit(m);
    write_manifest(dir, as_v1(m));
  };
  with([](Json& m) { m["tensors"]["model/w"]["pieces"][1]["begin"] = 4; });
  EXPECT_ERROR_WITH(Reader::open(dir), where + "tensor \"model/w\": piece [4, 9) (rank-00001.safetensors tensor \"model/w@5\") overlaps piece [0, 5)");
  with([](Json& m) { m["tensors"]["model/w"]["pieces"].erase(1); });
  EXPECT_ERROR_WITH(Reader::open(dir), where + "tensor \"model/w\": elements [5, 10) of 10 are in no piece (missing piece?)");
  with([](Json& m) { m["tensors"]["model/w"]["dtype"] = "F33"; });
  EXPECT_ERROR_WITH(Reader::open(dir), where + "tensor \"model/w\": unknown dtype \"F33\"");
  with([](Json& m) { m["tensors"]["model/w"]["shape"] = {11}; });
  EXPECT_ERROR_WITH(Reader::open(dir), where + "tensor \"model/w\": elements [10, 11) of 11 are in no piece");
  with([](Json& m) { m["tensors"]["model/w"]["shape"] = {-10}; });
  EXPECT_ERROR_WITH(Reader::open(dir), where + "tensor \"model/w\": shape[0] = -10 is below 0");
  with([](Json& m) { m["files"][0]["sha256"] = "zz"; });
  EXPECT_ERROR_WITH(Reader::open(dir), "is not 64 lowercase hex digits");
  with([](Json& m) { m["step"] = 4; });
  EXPECT_ERROR_WITH(Reader::open(dir), "step 4 but the directory is named step-00000003");
  // The same dtype edited consistently in the manifest: now the manifest and the file disagree.
  with([](Json& m) { m["tensors"]["model/w"]["dtype"] = "I32"; });
  EXPECT_ERROR_WITH(Reader::open(dir).read("model/w"), "tensor \"model/w@0\": dtype F32 but the manifest says I32 for \"model/w\"");
  write_bytes(dir + "/manifest.json", "{\"format\": ");
  EXPECT_ERROR_WITH(Reader::open(dir), where + "not valid JSON");
  write_bytes(dir + "/manifest.json", "");
  EXPECT_ERROR_WITH(Reader::open(dir), "not valid JSON");
  ASSERT_EQ(fs::remove(dir + "/manifest.json"), 0);
  EXPECT_ERROR_WITH(Reader::open(dir), "no manifest.json");
}

// Issue 15: one changed value in manifest.json loaded silently and trained to another result.
TEST(Corruption, AnyChangedManifestValueFailsItsContentHash) {
  const std::string dir = make_checkpoint();
  const Json good = manifest_of(dir);
  ASSERT_EQ(good["format_version"], 2);
  ASSERT_TRUE(good.contains("content_sha256"));
  EXPECT_NO_THROW(Reader::open(dir));
  const std::string mismatch = "manifest.json: its content does not match its content_sha256";
  auto with = [&](const std::function<void(Json&)>& edit) {
    Json m = good;
    edit(m);
    write_manifest(dir, m);
  };
  ASSERT_FALSE(good["metadata"].empty());
  with([](Json& m) { m["metadata"].begin().value() = m["metadata"].begin().value().get<std::string>() + "0"; });
  EXPECT_ERROR_WITH(Reader::open(dir), mismatch);
  with([](Json& m) { m["metadata"]["extra"] = "x"; });
  EXPECT_ERROR_WITH(Reader::open(dir), mismatch);
  with([](Json& m) { m["world_size"] = m["world_size"].get<int>() + 1; });
  EXPECT_ERROR_WITH(Reader::open(dir), mismatch);
  with([](Json& m) { m["files"][0]["size"] = m["files"][0]["size"].get<uint64_t>() + 0; m["files"][0]["sha256"] = std::string(64, 'a'); });
  EXPECT_ERROR_WITH(Reader::open(dir), mismatch);
  with([](Json& m) { m["content_sha256"] = std::string(64, '0'); });
  EXPECT_ERROR_WITH(Reader::open(dir), mismatch);
  with([](Json& m) { m.erase("content_sha256"); });
  EXPECT_ERROR_WITH(Reader::open(dir), "field \"content_sha256\" is missing");
  // Whitespace and key order are not content: the same values re-indented still load.
  write_bytes(dir + "/manifest.json", good.dump(4));
  EXPECT_NO_THROW(Reader::open(dir));
}

TEST(Corruption, FileHeaderThatContradictsAConsistentManifest) {
  {
    const std::string dir = make_checkpoint();
    forge(dir, "rank-00000.safetensors", "\"F32\"", "\"I32\"");
    EXPECT_ERROR_WITH(Reader::open(dir).read("model/w"),
                      "rank-00000.safetensors: tensor \"model/w@0\": dtype I32 but the manifest says F32");
  }
  {
    const std::string dir = make_checkpoint();
    // model/w@0 holds 5 floats at [0, 20): claim [0, 90] (same number of characters).
    forge(dir, "rank-00000.safetensors", "\"data_offsets\":[0,20]", "\"data_offsets\":[0,90]");
    EXPECT_ERROR_WITH(Reader::open(dir).read("model/w"), "tensor \"model/w@0\": data_offsets [0, 90] end beyond the");
  }
  {
    const std::string dir = make_checkpoint();
    forge(dir, "rank-00000.safetensors", "\"shape\":[5]", "\"shape\":[4]");
    EXPECT_ERROR_WITH(Reader::open(dir).read("model/w"), "tensor \"model/w@0\": shape [4] of F32 needs 16 bytes");
  }
  {
    const std::string dir = make_checkpoint();
    forge(dir, "rank-00001.safetensors", "\"model/ids\"", "\"model/idz\"");
    EXPECT_ERROR_WITH(Reader::open(dir).read("model/ids"),
                      "tensor \"model/ids\" (piece of \"model/ids\" in the manifest) is not in the file's header");
  }
  {
    // A BOOL byte that is neither 0 nor 1 (mask elements 0..2 are rank 0's, after model/w's 20 bytes).
    const std::string dir = make_checkpoint();
    std::string bytes = read_bytes(dir + "/rank-00000.safetensors");
    const std::string bools("\x01\x00\x00", 3);
    const auto at = bytes.rfind(bools);
    ASSERT_NE(at, std::string::npos);
    forge(dir, "rank-00000.safetensors", bytes.substr(at - 4, 7), bytes.substr(at - 4, 4) + std::string("\x02\x00\x00", 3));
    EXPECT_ERROR_WITH(Reader::open(dir).read("model/mask"), "\"model/mask\" element 0 is a BOOL with byte value 2");
  }
  {
    const std::string dir = make_checkpoint();
    std::string bytes = read_bytes(dir + "/rank-00000.safetensors");
    forge(dir, "rank-00000.safetensors", bytes.substr(0, 8), std::string(8, '\xff'));
    EXPECT_ERROR_WITH(Reader::open(dir).read("model/w"), "above the 100000000-byte limit");
  }
}
