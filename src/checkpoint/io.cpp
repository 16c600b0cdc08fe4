#include "io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>

#include <c10/util/Exception.h>

#include "dtrain/util/fs.h"

namespace dtrain::checkpoint::detail {

namespace {
std::string err() { return std::strerror(errno); }
}  // namespace

File File::create(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "checkpoint ", path, ": cannot create the file: ", err());
  return File(fd, path);
}

File File::open_read(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "checkpoint ", path, ": cannot open the file: ", err());
  return File(fd, path);
}

File::File(File&& other) noexcept : fd_(other.fd_), path_(std::move(other.path_)) { other.fd_ = -1; }

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    path_ = std::move(other.path_);
    other.fd_ = -1;
  }
  return *this;
}

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

void File::write_all(const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd_, p, std::min<size_t>(bytes, size_t(1) << 30));
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, "checkpoint ", path_, ": write failed: ", n < 0 ? err() : std::string("wrote nothing"));
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void File::pread_all(void* data, size_t bytes, uint64_t offset) const {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd_, p, std::min<size_t>(bytes, size_t(1) << 30), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n >= 0, "checkpoint ", path_, ": read at byte ", offset, " failed: ", err());
    TORCH_CHECK(n > 0, "checkpoint ", path_, ": file ends at byte ", offset, " but ", bytes,
                " more bytes were expected (truncated while open?)");
    p += n;
    bytes -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

uint64_t File::size() const {
  struct stat st {};
  TORCH_CHECK(::fstat(fd_, &st) == 0, "checkpoint ", path_, ": fstat failed: ", err());
  return static_cast<uint64_t>(st.st_size);
}

void File::fsync() { TORCH_CHECK(::fsync(fd_) == 0, "checkpoint ", path_, ": fsync failed: ", err()); }

void File::close() {
  if (fd_ < 0) return;
  const int fd = fd_;
  fd_ = -1;
  TORCH_CHECK(::close(fd) == 0, "checkpoint ", path_, ": close failed: ", err());
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "checkpoint ", dir, ": cannot open the directory to fsync it: ", err());
  const int rc = ::fsync(fd);
  const std::string e = rc == 0 ? "" : err();
  ::close(fd);
  TORCH_CHECK(rc == 0, "checkpoint ", dir, ": fsync of the directory failed: ", e);
}

std::string read_file(const std::string& path, uint64_t max_bytes) {
  File f = File::open_read(path);
  const uint64_t size = f.size();
  TORCH_CHECK(size <= max_bytes, "checkpoint ", path, ": ", size, " bytes is larger than the ", max_bytes,
              "-byte limit for this file");
  std::string s(size, '\0');
  f.pread_all(s.data(), size, 0);
  return s;
}

void write_file_atomic(const std::string& path, const std::string& content, bool sync) {
  const std::string tmp = path + ".tmp-" + nonce();
  try {
    File f = File::create(tmp);
    f.write_all(content.data(), content.size());
    if (sync) f.fsync();
    f.close();
    TORCH_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "checkpoint ", path, ": cannot rename ", tmp,
                " to it: ", err());
  } catch (...) {
    util::fs::remove(tmp);
    throw;
  }
  if (sync) fsync_dir(parent_dir(path));
}

std::string nonce() {
  // Fresh randomness each call (also right after a fork, where a seeded generator would repeat).
  std::random_device rd;
  const uint64_t x = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(x));
  return buf;
}

std::string parent_dir(const std::string& path) {
  auto p = util::fs::parent_path(path);
  return p.empty() ? "." : p;
}

}  // namespace dtrain::checkpoint::detail
