#pragma once
// One plain safetensors file written tensor by tensor: the header (names, dtypes, shapes) is known
// in advance, then the tensors' data arrive one at a time in header order. A caller exporting full
// weights for inference can gather one unit, write it and free it, so it never holds more than one
// unit. The file appears under its name only when finish() succeeds (temporary file, fsync, rename,
// fsync of the directory); a writer destroyed before finish() removes its temporary file.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>
#include <torch/nn/module.h>

namespace dtrain::checkpoint {

// A tensor as the header lists it.
struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
};

struct StreamingWriterOptions {
  TORCH_ARG(bool, fsync) = true;  // fsync the file and its directory at finish()
};

// What finish() wrote.
struct WrittenFile {
  std::string path;
  uint64_t size = 0;    // bytes
  std::string sha256;   // lowercase hex of the whole file
};

class StreamingWriter {
 public:
  // Creates `path`.tmp-<nonce> and writes the header. Supported dtypes: double, float, half,
  // bfloat16, int64, int32, int16, int8, uint8, bool. Names must be unique and not "__metadata__".
  StreamingWriter(std::string path, std::vector<TensorSpec> tensors,
                  std::map<std::string, std::string> metadata = {}, const StreamingWriterOptions& options = {});
  StreamingWriter(StreamingWriter&&) noexcept;
  StreamingWriter& operator=(StreamingWriter&&) noexcept;
  ~StreamingWriter();

  // The name of the tensor the next write() expects ("" once all are written).
  const std::string& next_name() const;
  // The whole data of the next tensor, which must be `name`: numel and dtype as declared (any
  // shape with that numel, any device, any strides).
  void write(const std::string& name, const at::Tensor& data);
  // Part of the next tensor (its following elements in row-major order); a tensor may arrive in
  // several chunks, and a chunk may not run past the tensor's end.
  void append(const at::Tensor& chunk);
  // Checks that every tensor was written, then makes the file durable and visible under `path`.
  WrittenFile finish();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Plain full weights as one safetensors file at `path` (atomic, streamed tensor by tensor):
// `tensors` in this order; returns the path.
std::string export_named_weights(const std::vector<std::pair<std::string, at::Tensor>>& tensors, const std::string& path);
// An unwrapped (whole) module's: named_parameters() in order, each tensor once (a tied alias is
// left out under its later names), then named_buffers().
std::string export_module_weights(const torch::nn::Module& module, const std::string& path);

}  // namespace dtrain::checkpoint
