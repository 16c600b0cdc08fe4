#pragma once
// File-system helpers over POSIX calls: what dtrain needs of <filesystem>, without it.
//
// Design note [no std::filesystem]
// ---------------------------------
// The libtorch most users install (the pytorch.org zip, the pip wheels) links its own static
// libstdc++ and exports that copy's std::filesystem symbols from libtorch.so / libtorch_cpu.so
// (pytorch/pytorch#133437). A program linked to it binds its std::filesystem calls to whichever
// copy the dynamic linker finds first, and libtorch's copy is not built for the caller's
// libstdc++: std::filesystem::remove_all jumped to address 0 in dtrain-gpt and the test suite
// against torch 2.11+cu130 (issue 13), and every other std::filesystem call bound to the same
// foreign copy. PyTorch itself stopped using <filesystem> on Linux for the same reason
// (pytorch/pytorch#134494). So nothing dtrain builds (library, dtrun, demo, tests, benchmarks)
// uses <filesystem>: paths are std::string, and these functions call POSIX directly. CTest's
// `no_std_filesystem` test fails if any built ELF file imports a std::filesystem symbol
// (scripts/check-no-filesystem.sh).
//
// Errors: functions that change something return 0 or the errno value of the failure (describe it
// with error_text); queries return false / std::nullopt. None throws.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dtrain::util::fs {

// "a" + "b" -> "a/b" (one separator; `b` absolute or `a` empty -> `b`).
std::string join(const std::string& a, const std::string& b);
// The path without its last component: "a/b/c" -> "a/b", "a/b/" -> "a", "c" -> "", "/c" -> "/".
std::string parent_path(const std::string& p);
// The last component, trailing separators ignored: "a/b" -> "b", "a/b/" -> "b", "/" -> "".
std::string filename(const std::string& p);

// These follow symbolic links (a dangling link does not exist).
bool exists(const std::string& p);
bool is_directory(const std::string& p);
bool is_regular_file(const std::string& p);
bool is_symlink(const std::string& p);  // the link itself
std::optional<uint64_t> file_size(const std::string& p);

// The names in a directory ("." and ".." left out), sorted. On failure errno in *err, and the names
// read before it (none when the directory could not be opened).
std::vector<std::string> list_directory(const std::string& dir, int* err = nullptr);

// 0 when the directory exists afterwards (made now or before); EEXIST for a non-directory there.
int create_directory(const std::string& p);
// Every missing parent too (mode 0777 before the umask).
int create_directories(const std::string& p);
// A file, a link or an empty directory; 0 when nothing is there.
int remove(const std::string& p);
// Everything under p and p itself; never follows symbolic links (a link is removed, not its
// target, also when p ends in '/'). 0 when nothing is there; EINVAL for "", "." or "..".
int remove_all(const std::string& p);
int rename(const std::string& from, const std::string& to);
int create_symlink(const std::string& target, const std::string& link);
int resize_file(const std::string& p, uint64_t size);

// The absolute path with every link and "."/".." resolved (realpath); nullopt when p is missing.
std::optional<std::string> canonical(const std::string& p);
// The target a symbolic link holds; nullopt when p is not a link.
std::optional<std::string> read_symlink(const std::string& p);
// $TMPDIR when set and a directory, else /tmp.
std::string temp_directory();

// strerror of an errno value, for messages.
std::string error_text(int err);

}  // namespace dtrain::util::fs
