#include "dtrain/util/fs.h"

// Design note [no std::filesystem] (dtrain/util/fs.h): POSIX only, no <filesystem>.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace dtrain::util::fs {

namespace {

std::string strip_trailing_separators(const std::string& p) {
  std::string s = p;
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return s;
}

// Removes the entry `name` in the directory `dirfd`, recursing into directories without following
// links. Returns 0 or an errno value (the first failure; the rest is still attempted).
int remove_all_at(int dirfd, const char* name) {
  struct stat st;
  if (::fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) return errno == ENOENT ? 0 : errno;
  if (!S_ISDIR(st.st_mode)) return ::unlinkat(dirfd, name, 0) == 0 || errno == ENOENT ? 0 : errno;
  const int fd = ::openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return errno;
  DIR* dir = ::fdopendir(fd);
  if (!dir) {
    const int e = errno;
    ::close(fd);
    return e;
  }
  int first_error = 0;
  std::vector<std::string> names;
  while (const dirent* d = ::readdir(dir)) {
    if (std::strcmp(d->d_name, ".") == 0 || std::strcmp(d->d_name, "..") == 0) continue;
    names.emplace_back(d->d_name);
  }
  for (const auto& n : names) {
    const int e = remove_all_at(fd, n.c_str());
    if (e && !first_error) first_error = e;
  }
  ::closedir(dir);  // closes fd
  if (::unlinkat(dirfd, name, AT_REMOVEDIR) != 0 && errno != ENOENT && !first_error) first_error = errno;
  return first_error;
}

}  // namespace

std::string join(const std::string& a, const std::string& b) {
  if (a.empty() || (!b.empty() && b.front() == '/')) return b;
  if (b.empty()) return a;
  return a.back() == '/' ? a + b : a + "/" + b;
}

std::string parent_path(const std::string& p) {
  const std::string s = strip_trailing_separators(p);
  const auto slash = s.find_last_of('/');
  if (slash == std::string::npos) return "";
  if (slash == 0) return "/";
  return strip_trailing_separators(s.substr(0, slash));
}

std::string filename(const std::string& p) {
  const std::string s = strip_trailing_separators(p);
  if (s == "/") return "";
  const auto slash = s.find_last_of('/');
  return slash == std::string::npos ? s : s.substr(slash + 1);
}

bool exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

bool is_directory(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool is_regular_file(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool is_symlink(const std::string& p) {
  struct stat st;
  return ::lstat(p.c_str(), &st) == 0 && S_ISLNK(st.st_mode);
}

std::optional<uint64_t> file_size(const std::string& p) {
  struct stat st;
  if (::stat(p.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return std::nullopt;
  return static_cast<uint64_t>(st.st_size);
}

std::vector<std::string> list_directory(const std::string& dir, int* err) {
  std::vector<std::string> names;
  if (err) *err = 0;
  DIR* d = ::opendir(dir.c_str());
  if (!d) {
    if (err) *err = errno;
    return names;
  }
  errno = 0;
  while (const dirent* e = ::readdir(d)) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) names.emplace_back(e->d_name);
    errno = 0;
  }
  if (errno && err) *err = errno;
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

int create_directory(const std::string& p) {
  if (::mkdir(p.c_str(), 0777) == 0) return 0;
  const int e = errno;
  if (e == EEXIST) return is_directory(p) ? 0 : EEXIST;
  return e;
}

int create_directories(const std::string& p) {
  const std::string s = strip_trailing_separators(p);
  if (s.empty() || is_directory(s)) return 0;
  const std::string parent = parent_path(s);
  if (!parent.empty() && parent != s) {
    if (const int e = create_directories(parent)) return e;
  }
  const int e = create_directory(s);
  return e == EEXIST && is_directory(s) ? 0 : e;  // (another process made it meanwhile)
}

int remove(const std::string& p) {
  if (::unlink(p.c_str()) == 0) return 0;
  int e = errno;
  if (e == ENOENT) return 0;
  if (e == EISDIR || e == EPERM) {  // Linux reports EISDIR; POSIX allows EPERM
    if (::rmdir(p.c_str()) == 0) return 0;
    e = errno;
    return e == ENOENT ? 0 : e;
  }
  return e;
}

int remove_all(const std::string& p) {
  // A trailing '/' would make the kernel resolve a symbolic link in the last component (and then
  // delete inside its target): strip it. "." and ".." name no entry that could be removed.
  const std::string s = strip_trailing_separators(p);
  const std::string last = filename(s);
  if (s.empty() || last == "." || last == "..") return EINVAL;
  return remove_all_at(AT_FDCWD, s.c_str());
}

int rename(const std::string& from, const std::string& to) {
  return std::rename(from.c_str(), to.c_str()) == 0 ? 0 : errno;
}

int create_symlink(const std::string& target, const std::string& link) {
  return ::symlink(target.c_str(), link.c_str()) == 0 ? 0 : errno;
}

int resize_file(const std::string& p, uint64_t size) {
  return ::truncate(p.c_str(), static_cast<off_t>(size)) == 0 ? 0 : errno;
}

std::optional<std::string> canonical(const std::string& p) {
  char* resolved = ::realpath(p.c_str(), nullptr);
  if (!resolved) return std::nullopt;
  std::string out(resolved);
  std::free(resolved);
  return out;
}

std::optional<std::string> read_symlink(const std::string& p) {
  std::vector<char> buf(256);
  for (;;) {
    const ssize_t n = ::readlink(p.c_str(), buf.data(), buf.size());
    if (n < 0) return std::nullopt;
    if (static_cast<size_t>(n) < buf.size()) return std::string(buf.data(), static_cast<size_t>(n));
    if (buf.size() >= (1u << 20)) return std::nullopt;
    buf.resize(buf.size() * 2);
  }
}

std::string temp_directory() {
  if (const char* t = std::getenv("TMPDIR"); t && *t && is_directory(t)) return t;
  return "/tmp";
}

std::string error_text(int err) { return std::strerror(err); }

}  // namespace dtrain::util::fs
