// The rank files are plain safetensors: a 20-line Python reader written from the format's spec
// (no safetensors package: it is not in Debian) loads them with torch and gets what C++ saved.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "checkpoint_testing.h"
#include "dtrain/checkpoint/store.h"
#include "dtrain/checkpoint/streaming_writer.h"
#include "testing/testing.h"

using namespace dtrain;
using namespace dtrain::checkpoint;

namespace {

// The reader from docs/checkpoint.md, printing each tensor as JSON (values as float64).
const char* kReader = R"PY(
import json, struct, sys, torch
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
          "U8": torch.uint8, "BOOL": torch.bool}

def load_safetensors(path):
    with open(path, "rb") as f:
        data = bytearray(f.read())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n].decode("utf-8"))
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = DTYPES[info["dtype"]]
        count = (end - begin) // torch.empty(0, dtype=dtype).element_size()
        flat = torch.frombuffer(data, dtype=dtype, count=count, offset=8 + n + begin) if count else torch.empty(0, dtype=dtype)
        tensors[name] = flat.reshape(info["shape"])
    return tensors, header.get("__metadata__", {})

out = []
for path in sys.argv[1:]:
    tensors, metadata = load_safetensors(path)
    out.append({"metadata": metadata, "tensors": {k: {"dtype": str(t.dtype), "shape": list(t.shape),
                "values": t.double().flatten().tolist()} for k, t in tensors.items()}})
print(json.dumps(out))
)PY";

bool python_has_torch() {
  return dtrain::testing::run_command("/usr/bin/python3 -c 'import torch' 2>/dev/null", 120).exit_code == 0;
}

// One JSON object per file (one Python start for all of them: importing torch takes seconds).
nlohmann::json load_with_python(const std::vector<std::string>& files) {
  const std::string script = dtrain::testing::temp_dir() + "/reader.py";
  dtrain::checkpoint::testing::write_bytes(script, kReader);
  std::string command = "/usr/bin/python3 " + script;
  for (const auto& f : files) command += " " + f;
  const auto r = dtrain::testing::run_command(command + " 2>&1", 120);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return r.exit_code == 0 ? nlohmann::json::parse(r.output) : nlohmann::json::array();
}

void expect_values(const nlohmann::json& t, const at::Tensor& expected, const std::string& dtype) {
  EXPECT_EQ(t["dtype"], dtype);
  EXPECT_EQ(t["shape"].get<std::vector<int64_t>>(), expected.sizes().vec());
  EXPECT_EQ(t["values"].get<std::vector<double>>(), [&] {
    const auto d = expected.to(at::kDouble).contiguous().reshape({-1});
    return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
  }());
}

}  // namespace

TEST(Python, RankFilesLoadWithAReaderWrittenFromTheSpec) {
  if (!python_has_torch()) GTEST_SKIP() << "/usr/bin/python3 cannot import torch";
  const std::string root = dtrain::testing::temp_dir();
  at::manual_seed(5);
  const auto w = at::randn({4, 6});
  const auto h = at::randn({5}).to(at::kBFloat16);
  const auto ids = at::randint(-50, 50, {2, 3}, at::kLong);
  const auto mask = at::randn({7}) > 0;
  dtrain::testing::run_ranks(2, [&](comm::ProcessGroup& pg) {
    std::vector<Piece> pieces{*replicated_piece("model/w", w, pg.rank(), 2), *replicated_piece("model/mask", mask, pg.rank(), 2)};
    if (pg.rank() == 0) pieces.push_back(whole_piece("model/ids", ids));
    if (pg.rank() == 1) pieces.push_back(whole_piece("model/h", h));
    save(root, 1, pg, pieces, {});
  });
  const auto loaded = load_with_python({root + "/step-00000001/rank-00000.safetensors", root + "/step-00000001/rank-00001.safetensors"});
  ASSERT_EQ(loaded.size(), 2u);
  const auto& r0 = loaded[0];
  const auto& r1 = loaded[1];
  EXPECT_EQ(r0["metadata"]["rank"], "0");
  expect_values(r0["tensors"]["model/w@0"], w.reshape({-1}).slice(0, 0, 12), "torch.float32");
  expect_values(r1["tensors"]["model/w@12"], w.reshape({-1}).slice(0, 12, 24), "torch.float32");
  expect_values(r0["tensors"]["model/mask@0"], mask.slice(0, 0, 4), "torch.bool");
  expect_values(r1["tensors"]["model/mask@4"], mask.slice(0, 4, 7), "torch.bool");
  expect_values(r0["tensors"]["model/ids"], ids, "torch.int64");  // whole tensors keep their shape and name
  expect_values(r1["tensors"]["model/h"], h, "torch.bfloat16");
}

TEST(Python, StreamingWriterExportLoads) {
  if (!python_has_torch()) GTEST_SKIP() << "/usr/bin/python3 cannot import torch";
  const std::string file = dtrain::testing::temp_dir() + "/model.safetensors";
  const auto a = at::randn({3, 2}, at::kDouble);
  const auto b = at::randn({4}).to(at::kHalf);
  StreamingWriter writer(file, {{"a", {3, 2}, at::kDouble}, {"b", {4}, at::kHalf}, {"s", {}, at::kInt}});
  writer.write("a", a);
  writer.write("b", b);
  writer.write("s", at::scalar_tensor(9, at::kInt));
  writer.finish();
  const auto loaded = load_with_python({file});
  ASSERT_EQ(loaded.size(), 1u);
  const auto& j = loaded[0];
  expect_values(j["tensors"]["a"], a, "torch.float64");
  expect_values(j["tensors"]["b"], b, "torch.float16");
  expect_values(j["tensors"]["s"], at::scalar_tensor(9, at::kInt), "torch.int32");
}
