// The libtorch-free layer: SHA-256 (NIST vectors), the safetensors header parser and the manifest parser.
#include <gtest/gtest.h>

#include <string>

#include "dtrain/checkpoint/manifest.h"
#include "dtrain/checkpoint/safetensors.h"
#include "dtrain/checkpoint/sha256.h"

using namespace dtrain::checkpoint;

namespace {

// Runs f and returns the FormatError's text ("" if none was thrown).
template <class F>
std::string format_error(F&& f) {
  try {
    f();
  } catch (const FormatError& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_FORMAT_ERROR(stmt, needle)                              \
  do {                                                                 \
    const std::string msg_ = format_error([&] { stmt; });              \
    EXPECT_NE(msg_.find(needle), std::string::npos)                    \
        << "expected an error containing: " << (needle) << "\n got: " << msg_; \
  } while (0)

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

// A file: length + header JSON + `buffer` zero bytes.
std::string file_with(const std::string& json, size_t buffer) { return le64(json.size()) + json + std::string(buffer, '\0'); }

SafetensorsHeader parse_file(const std::string& file) { return parse_safetensors_prefix(file, file.size(), "f.safetensors"); }

}  // namespace

TEST(Sha256, NistVectors) {
  EXPECT_EQ(sha256_hex("", 0), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc", 3), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const std::string two_blocks = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  EXPECT_EQ(sha256_hex(two_blocks.data(), two_blocks.size()),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  const std::string long_msg =
      "abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu";
  EXPECT_EQ(sha256_hex(long_msg.data(), long_msg.size()),
            "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
  const std::string million(1000000, 'a');
  EXPECT_EQ(sha256_hex(million.data(), million.size()),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, IncrementalUpdatesInAnyChunksEqualOneShot) {
  std::string data;
  for (int i = 0; i < 1000; ++i) data += static_cast<char>(i * 7 + 3);
  const std::string whole = sha256_hex(data.data(), data.size());
  for (size_t chunk : {1, 3, 55, 56, 63, 64, 65, 127, 999}) {
    Sha256 h;
    for (size_t at = 0; at < data.size(); at += chunk) h.update(data.data() + at, std::min(chunk, data.size() - at));
    EXPECT_EQ(h.hex_digest(), whole) << "chunk " << chunk;
  }
}

TEST(Dtypes, NamesSizesAndNumel) {
  for (auto d : {Dtype::F64, Dtype::F32, Dtype::F16, Dtype::BF16, Dtype::I64, Dtype::I32, Dtype::I16, Dtype::I8,
                 Dtype::U8, Dtype::BOOL}) {
    EXPECT_EQ(dtype_from_name(dtype_name(d)), d);
  }
  EXPECT_EQ(dtype_size(Dtype::BF16), 2);
  EXPECT_EQ(dtype_size(Dtype::I64), 8);
  EXPECT_FALSE(dtype_from_name("F8_E4M3"));
  EXPECT_FALSE(dtype_from_name("f32"));
  EXPECT_EQ(checked_numel({}), 1);
  EXPECT_EQ(checked_numel({2, 0, 5}), 0);
  EXPECT_FALSE(checked_numel({-1}));
  EXPECT_FALSE(checked_numel({1 << 30, 1 << 30, 1 << 30}));
}

TEST(SafetensorsHeader, LayOutThenParseRoundTrips) {
  std::string prefix;
  const auto laid = lay_out_safetensors({{"a", Dtype::F32, {2, 3}}, {"b", Dtype::BF16, {}}, {"empty", Dtype::I64, {0}},
                                         {"c", Dtype::BOOL, {5}}},
                                        {{"format", "pt"}}, &prefix, "f.safetensors");
  EXPECT_EQ(prefix.size() % 8, 0u);  // the buffer starts aligned
  EXPECT_EQ(laid.buffer_bytes, 24u + 2u + 0u + 5u);
  const std::string file = prefix + std::string(laid.buffer_bytes, '\0');
  const auto h = parse_file(file);
  EXPECT_EQ(h.buffer_offset, prefix.size());
  EXPECT_EQ(h.buffer_bytes, laid.buffer_bytes);
  EXPECT_EQ(h.metadata.at("format"), "pt");
  ASSERT_EQ(h.entries.size(), 4u);
  const auto* a = h.find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a->begin, 0u);
  EXPECT_EQ(a->end, 24u);
  EXPECT_EQ(h.find("b")->shape, std::vector<int64_t>{});
  EXPECT_EQ(h.find("c")->begin, 26u);
  EXPECT_EQ(h.find("nope"), nullptr);
}

TEST(SafetensorsHeader, LayOutRejectsBadTensors) {
  EXPECT_FORMAT_ERROR(lay_out_safetensors({{"a", Dtype::F32, {1}}, {"a", Dtype::F32, {1}}}, {}, nullptr, "f"),
                      "two tensors have this name");
  EXPECT_FORMAT_ERROR(lay_out_safetensors({{"__metadata__", Dtype::F32, {1}}}, {}, nullptr, "f"), "reserved");
  EXPECT_FORMAT_ERROR(lay_out_safetensors({{"a", Dtype::F32, {-2}}}, {}, nullptr, "f"), "negative");
  EXPECT_FORMAT_ERROR(lay_out_safetensors({{"bad\xff", Dtype::F32, {1}}}, {}, nullptr, "f"), "UTF-8");
}

TEST(SafetensorsHeader, ValidFilesParse) {
  const auto h = parse_file(file_with(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                      R"("__metadata__":{"k":"v"}}   )",
                                      8));
  EXPECT_EQ(h.entries.size(), 1u);
  EXPECT_EQ(h.metadata.at("k"), "v");
  // No tensors at all, and an empty buffer.
  EXPECT_EQ(parse_file(file_with("{}", 0)).entries.size(), 0u);
}

TEST(SafetensorsHeader, EveryFieldIsValidated) {
  const std::string w = R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  EXPECT_FORMAT_ERROR(parse_safetensors_prefix("abc", 3, "f.safetensors"), "too short for the 8-byte header length");
  EXPECT_FORMAT_ERROR(parse_file(le64(100) + "{}"), "header length 100 goes beyond the 10-byte file");
  EXPECT_FORMAT_ERROR(parse_file(le64(uint64_t(1) << 62) + "{}"), "above the 100000000-byte limit");
  EXPECT_FORMAT_ERROR(parse_file(file_with("[1, 2]", 0)), "does not start with '{'");
  EXPECT_FORMAT_ERROR(parse_file(file_with("{\"w\": ", 0)), "not valid JSON");
  EXPECT_FORMAT_ERROR(parse_file(file_with("{" + w + "," + w + "}", 8)), "appears twice");
  EXPECT_FORMAT_ERROR(parse_file(file_with(R"({"w":{"dtype":"F8","shape":[2],"data_offsets":[0,2]}})", 2)),
                      "tensor \"w\": unknown dtype \"F8\"");
  EXPECT_FORMAT_ERROR(parse_file(file_with(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8)),
                      "tensor \"w\": shape[0] = -2 is below 0");
  EXPECT_FORMAT_ERROR(parse_file(file_with(R"({"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8)),
                      "must be an integer");
  EXPECT_FORMAT_ERROR(parse_file(file_with(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8)),
                      "shape [3] of F32 needs 12 bytes but data_offsets [0, 8] hold 8");
  EXPECT_FORMAT_ERROR(parse_file(file_with(R"({"w":{"dtype":"F32","shape":[100],"data_offsets":[0,400]}})", 396)),
                      "checkpoint f.safetensors: tensor \"w\": data_offsets [0, 400] end beyond the 396-byte buffer");
  EXPECT_FORMAT_ERROR(parse_file(file_with(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})", 8)),
                      "begin after end");
  EXPECT_FORMAT_ERROR(parse_file(file_with(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8)),
                      "data_offsets must have 2 entries");
  EXPECT_FORMAT_ERROR(parse_file(file_with(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,-8]}})", 8)),
                      "negative");
  EXPECT_FORMAT_ERROR(parse_file(file_with(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", 8)),
                      "unknown field \"x\"");
  EXPECT_FORMAT_ERROR(parse_file(file_with(R"({"w":{"dtype":"F32","shape":[2]}})", 8)), "\"data_offsets\" is missing");
  EXPECT_FORMAT_ERROR(parse_file(file_with(R"({"w":[1]})", 8)), "expected a JSON object");
  EXPECT_FORMAT_ERROR(parse_file(file_with(R"({"__metadata__":{"k":1}})", 0)), "value of \"k\" must be a string");
  // Overlap, hole, trailing bytes.
  EXPECT_FORMAT_ERROR(parse_file(file_with(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                                           12)),
                      "tensor \"b\": data_offsets [4, 12] overlap tensor \"a\"");
  EXPECT_FORMAT_ERROR(parse_file(file_with(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8)),
                      "bytes [0, 4) of the buffer before it belong to no tensor");
  EXPECT_FORMAT_ERROR(parse_file(file_with("{" + w + "}", 12)), "trailing bytes belong to no tensor");
  // Deep nesting is rejected, not recursed into.
  EXPECT_FORMAT_ERROR(parse_file(file_with("{\"__metadata__\":" + std::string(5000, '[') + std::string(5000, ']') + "}", 0)),
                      "nested deeper");
}

namespace {

Manifest small_manifest() {
  Manifest m;
  m.step = 12;
  m.world_size = 2;
  m.metadata = {{"strategy", "ddp"}};
  const std::string hash(64, 'a');
  m.files = {{"rank-00000.safetensors", 1000, hash}, {"rank-00001.safetensors", 1000, hash}};
  m.tensors["model/w"] = {{4, 3}, Dtype::F32, {{"rank-00001.safetensors", "model/w@6", 6, 6},
                                                {"rank-00000.safetensors", "model/w@0", 0, 6}}};
  m.tensors["step"] = {{}, Dtype::I64, {{"rank-00000.safetensors", "step", 0, 1}}};
  m.tensors["empty"] = {{0, 5}, Dtype::BF16, {}};
  return m;
}

std::string replaced(std::string s, const std::string& from, const std::string& to) {
  const auto at = s.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) s.replace(at, from.size(), to);
  return s;
}

}  // namespace

TEST(Manifest, EncodeParseRoundTripsAndSortsPieces) {
  Manifest m = small_manifest();
  const std::string text = encode_manifest(m);
  const Manifest back = parse_manifest(text, "m.json");
  EXPECT_EQ(back.step, 12);
  EXPECT_EQ(back.world_size, 2);
  EXPECT_EQ(back.metadata, m.metadata);
  ASSERT_EQ(back.files.size(), 2u);
  EXPECT_EQ(back.files[1].name, "rank-00001.safetensors");
  const auto& w = back.tensors.at("model/w");
  EXPECT_EQ(w.shape, (std::vector<int64_t>{4, 3}));
  ASSERT_EQ(w.pieces.size(), 2u);
  EXPECT_EQ(w.pieces[0].begin, 0);  // sorted by begin
  EXPECT_EQ(w.pieces[1].tensor, "model/w@6");
  EXPECT_EQ(back.tensors.at("step").shape, std::vector<int64_t>{});
  EXPECT_TRUE(back.tensors.at("empty").pieces.empty());
  const std::string sorted = encode_manifest(back);
  EXPECT_EQ(encode_manifest(parse_manifest(sorted, "m.json")), sorted);
}

TEST(Manifest, EveryFieldIsValidated) {
  const std::string good = encode_manifest(small_manifest());
  auto parse = [](const std::string& s) { return parse_manifest(s, "ckpt/manifest.json"); };
  EXPECT_FORMAT_ERROR(parse("{"), "ckpt/manifest.json: not valid JSON");
  EXPECT_FORMAT_ERROR(parse(replaced(good, "\"format_version\": 2", "\"format_version\": 3")),
                      "format_version 3 is not supported (this dtrain reads 1 and 2)");
  EXPECT_FORMAT_ERROR(parse(replaced(good, "\"dtrain-checkpoint\"", "\"other\"")),
                      "not a dtrain checkpoint manifest (its \"format\" is not \"dtrain-checkpoint\")");
  // Bytes of a file that is not a manifest are never quoted (nlohmann's "last read: '...'").
  try {
    parse("{\"format\": TOP-SECRET-VALUE}");
    ADD_FAILURE() << "no error";
  } catch (const std::exception& e) {
    EXPECT_EQ(std::string(e.what()).find("TOP"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("not valid JSON"), std::string::npos) << e.what();
  }
  EXPECT_FORMAT_ERROR(parse(replaced(good, "\"step\": 12", "\"step\": -1")), "field \"step\" = -1 is below 0");
  EXPECT_FORMAT_ERROR(parse(replaced(good, "\"world_size\": 2", "\"world_size\": 0")), "world_size");
  EXPECT_FORMAT_ERROR(parse(replaced(good, "\"dtype\": \"F32\"", "\"dtype\": \"F31\"")),
                      "tensor \"model/w\": unknown dtype \"F31\"");
  EXPECT_FORMAT_ERROR(parse(replaced(good, "\"step\": 12,", "\"step\": 12, \"step\": 13,")), "appears twice");
  EXPECT_FORMAT_ERROR(parse(replaced(good, "\"step\": 12,", "\"step\": 12, \"extra\": 1,")), "unknown field \"extra\"");
  EXPECT_FORMAT_ERROR(parse(replaced(good, "\"name\": \"rank-00000.safetensors\"", "\"name\": \"../x\"")),
                      "must be a plain file name");
  EXPECT_FORMAT_ERROR(parse(replaced(good, std::string(64, 'a'), "abc")), "is not 64 lowercase hex digits");
  EXPECT_FORMAT_ERROR(parse(replaced(good, "\"size\": 1000", "\"size\": -5")), "is negative");
  // Coverage: overlap, a missing piece, a piece past the end, a shape that no longer matches.
  EXPECT_FORMAT_ERROR(parse(replaced(good, "\"begin\": 6", "\"begin\": 4")),
                      "tensor \"model/w\": piece [4, 10) (rank-00001.safetensors tensor \"model/w@6\") overlaps piece [0, 6)");
  EXPECT_FORMAT_ERROR(parse(replaced(good, "\"begin\": 6,\n     \"numel\": 6", "\"begin\": 6,\n     \"numel\": 5")),
                      "tensor \"model/w\": elements [11, 12) of 12 are in no piece (missing piece?)");
  EXPECT_FORMAT_ERROR(parse(replaced(good, "\"shape\": [\n    4,", "\"shape\": [\n    5,")),
                      "tensor \"model/w\": elements [12, 15) of 15 are in no piece");
  EXPECT_FORMAT_ERROR(parse(replaced(good, "\"shape\": [\n    4,", "\"shape\": [\n    3,")),
                      "are not a non-empty range inside the tensor's 9 elements");
  EXPECT_FORMAT_ERROR(parse(replaced(good, "\"shape\": [\n    4,", "\"shape\": [\n    -4,")), "is below 0");
  EXPECT_FORMAT_ERROR(parse(replaced(good, "\"file\": \"rank-00001.safetensors\"", "\"file\": \"rank-00007.safetensors\"")),
                      "file is not in \"files\"");
  EXPECT_FORMAT_ERROR(parse(replaced(good, "\"numel\": 1", "\"numel\": 0")), "field \"numel\" = 0 is below 1");
}

TEST(Manifest, SameFileTensorTwiceIsRejected) {
  Manifest m = small_manifest();
  m.tensors["model/w"].pieces[0].file = "rank-00000.safetensors";
  m.tensors["model/w"].pieces[0].tensor = "model/w@0";
  EXPECT_FORMAT_ERROR(validate_manifest(m, "m"), "this file tensor is used by two pieces");
}
