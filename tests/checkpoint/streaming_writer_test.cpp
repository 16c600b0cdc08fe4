// StreamingWriter: one plain safetensors file written tensor by tensor, visible only when finished.
#include <gtest/gtest.h>

#include <cstring>

#include <ATen/ATen.h>

#include "checkpoint_testing.h"
#include "dtrain/checkpoint/safetensors.h"
#include "dtrain/checkpoint/sha256.h"
#include "dtrain/checkpoint/streaming_writer.h"
#include "dtrain/util/fs.h"
#include "testing/testing.h"

using namespace dtrain::checkpoint;
using dtrain::checkpoint::testing::read_bytes;
namespace fs = dtrain::util::fs;

namespace {

// The tensor `name` of a safetensors file's bytes, via the format parser.
at::Tensor tensor_from(const std::string& bytes, const std::string& name, at::ScalarType dtype) {
  const auto h = parse_safetensors_prefix(bytes, bytes.size(), "test");
  const auto* e = h.find(name);
  EXPECT_NE(e, nullptr) << name;
  if (!e) return at::Tensor();
  at::Tensor t = at::empty(e->shape, dtype);
  std::memcpy(t.data_ptr(), bytes.data() + h.buffer_offset + e->begin, e->end - e->begin);
  return t;
}

std::vector<std::string> entries_of(const std::string& dir) {
  return fs::list_directory(dir);
}

}  // namespace

TEST(StreamingWriter, WritesTensorsInHeaderOrderAndChunks) {
  const std::string dir = dtrain::testing::temp_dir();
  const std::string path = dir + "/model.safetensors";
  const auto a = at::randn({3, 4});
  const auto b = at::randn({5}).to(at::kBFloat16);
  const auto c = at::arange(7, at::kLong);
  StreamingWriter w(path, {{"a", {3, 4}, at::kFloat}, {"empty", {0}, at::kFloat}, {"b", {5}, at::kBFloat16}, {"c", {7}, at::kLong}},
                    {{"format", "pt"}});
  EXPECT_EQ(w.next_name(), "a");
  w.write("a", a.t().contiguous().t());  // any strides: written in a's row-major order
  EXPECT_EQ(w.next_name(), "b");          // an empty tensor needs no data
  w.write("empty", at::empty({0}));
  w.write("b", b);
  w.append(c.slice(0, 0, 3));  // c in two chunks
  EXPECT_EQ(w.next_name(), "c");
  EXPECT_FALSE(fs::exists(path)) << "visible before finish()";
  w.append(c.slice(0, 3, 7));
  EXPECT_EQ(w.next_name(), "");
  const WrittenFile f = w.finish();
  EXPECT_EQ(f.path, path);
  const std::string bytes = read_bytes(path);
  EXPECT_EQ(f.size, bytes.size());
  EXPECT_EQ(f.sha256, sha256_hex(bytes.data(), bytes.size()));
  EXPECT_TRUE(at::equal(tensor_from(bytes, "a", at::kFloat), a));
  EXPECT_TRUE(at::equal(tensor_from(bytes, "b", at::kBFloat16), b));
  EXPECT_TRUE(at::equal(tensor_from(bytes, "c", at::kLong), c));
  EXPECT_EQ(parse_safetensors_prefix(bytes, bytes.size(), "t").metadata.at("format"), "pt");
  EXPECT_EQ(entries_of(dir), std::vector<std::string>{"model.safetensors"});  // no temporary left
  EXPECT_ERROR_WITH(w.write("a", a), "the writer is finished");
}

TEST(StreamingWriter, MisuseIsAnErrorAndAnUnfinishedFileNeverAppears) {
  const std::string dir = dtrain::testing::temp_dir();
  const std::string path = dir + "/x.safetensors";
  {
    StreamingWriter w(path, {{"a", {2}, at::kFloat}, {"b", {3}, at::kFloat}});
    EXPECT_ERROR_WITH(w.write("b", at::ones({3})), "write(\"b\") out of order: the header's next tensor is \"a\"");
    EXPECT_ERROR_WITH(w.write("zz", at::ones({3})), "write(\"zz\"): no such tensor in the header");
    EXPECT_ERROR_WITH(w.write("a", at::ones({3})), "tensor \"a\" has 2 elements (shape [2]) but 3 were passed");
    EXPECT_ERROR_WITH(w.append(at::ones({2}, at::kDouble)), "tensor \"a\" is declared Float but got Double");
    EXPECT_ERROR_WITH(w.append(at::ones({5})), "a chunk of 5 elements runs past its end (2 of 2 left)");
    w.write("a", at::ones({2}));
    EXPECT_ERROR_WITH(w.finish(), "finish() before tensor \"b\" was written");
    EXPECT_EQ(entries_of(dir).size(), 1u);  // the temporary file
  }
  EXPECT_TRUE(entries_of(dir).empty()) << "the destructor removes an unfinished file";
  EXPECT_ERROR_WITH(StreamingWriter(path, {{"a", {2}, at::kFloat}, {"a", {2}, at::kFloat}}), "two tensors have this name");
  EXPECT_ERROR_WITH(StreamingWriter(path, {{"c", {2}, at::kComplexFloat}}), "cannot be stored in safetensors");
  EXPECT_ERROR_WITH(StreamingWriter(dir + "/no/such/dir/x.safetensors", {}), "cannot create the file");
  EXPECT_TRUE(entries_of(dir).empty());
}
