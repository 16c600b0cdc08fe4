#pragma once
// TensorBoard event files (the format PyTorch's SummaryWriter and Lightning write), written by
// rank 0 of the library loop with --tensorboard DIR: one scalar per tag and step (loss, tokens/s,
// learning rate, gradient norm, loss scale, memory). No protobuf or TensorFlow dependency: the few
// messages needed are encoded here.
//
// File: DIR/events.out.tfevents.<unix time>.<host>.<pid>, a sequence of TFRecords
//   uint64 length | uint32 masked_crc32c(length) | data[length] | uint32 masked_crc32c(data)
// (little endian; masked_crc = ((crc >> 15) | (crc << 17)) + 0xa282ead8, CRC-32C), each holding one
// tensorflow.Event: the first {wall_time, file_version "brain.Event:2"}, then
// {wall_time, step, summary {value {tag, simple_value}}} per scalar.
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

namespace dtrain::train {

// CRC-32C (Castagnoli) of `n` bytes, and TFRecord's masked form of it.
uint32_t crc32c(const void* data, size_t n);
uint32_t masked_crc32c(const void* data, size_t n);

class TensorBoardWriter {
 public:
  TensorBoardWriter() = default;  // disabled
  // Creates `dir` (and parents) and a new event file in it; throws with the reason when it cannot.
  explicit TensorBoardWriter(const std::string& dir);
  bool enabled() const { return out_.is_open(); }
  const std::string& path() const { return path_; }
  void add_scalar(const std::string& tag, double value, int64_t step);
  void flush();

 private:
  void write_record(const std::string& data);
  std::ofstream out_;
  std::string path_;
};

// One decoded scalar event (what tests and tools read back).
struct ScalarEvent {
  double wall_time = 0;
  int64_t step = 0;
  std::string tag;
  float value = 0;
};
// Reads an event file: checks every record's framing and both CRCs (throws naming the record and
// what is wrong), returns the file_version and the scalars.
std::vector<ScalarEvent> read_scalar_events(const std::string& path, std::string* file_version = nullptr);

}  // namespace dtrain::train
