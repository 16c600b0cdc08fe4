#pragma once
// POSIX file helpers for checkpoints: every failure is a c10::Error naming the path and errno's text.
#include <cstdint>
#include <string>

namespace dtrain::checkpoint::detail {

// An open file descriptor (closed by the destructor).
class File {
 public:
  File() = default;
  // A new file (fails if it exists), write-only.
  static File create(const std::string& path);
  static File open_read(const std::string& path);
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  bool is_open() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }
  void write_all(const void* data, size_t bytes);
  // Reads exactly `bytes` at `offset`; a short read is an error ("file shorter than expected").
  void pread_all(void* data, size_t bytes, uint64_t offset) const;
  uint64_t size() const;
  void fsync();
  void close();  // reports a failing close (a delayed write error)

 private:
  File(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_ = -1;
  std::string path_;
};

// fsync of a directory, so that the names created/renamed in it are durable.
void fsync_dir(const std::string& dir);
// The whole content of a small file; errors if it is larger than `max_bytes`.
std::string read_file(const std::string& path, uint64_t max_bytes);
// Replaces `path` atomically: writes `path`.tmp-<nonce>, fsyncs it (if `sync`), renames it over
// `path`, fsyncs the directory (if `sync`).
void write_file_atomic(const std::string& path, const std::string& content, bool sync);
// 16 random hex digits (temporary names).
std::string nonce();
// The directory part of `path` ("." if none).
std::string parent_dir(const std::string& path);

}  // namespace dtrain::checkpoint::detail
