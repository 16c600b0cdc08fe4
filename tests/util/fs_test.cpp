// dtrain::util::fs: the POSIX file-system helpers that replace <filesystem>
// (Design note [no std::filesystem], include/dtrain/util/fs.h).
#include "dtrain/util/fs.h"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <grp.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

#include "testing/testing.h"

namespace fs = dtrain::util::fs;

namespace {

void write_file(const std::string& p, const std::string& content) {
  std::ofstream out(p, std::ios::binary);
  out << content;
}

}  // namespace

TEST(Fs, PathPieces) {
  EXPECT_EQ(fs::join("a", "b"), "a/b");
  EXPECT_EQ(fs::join("a/", "b"), "a/b");
  EXPECT_EQ(fs::join("", "b"), "b");
  EXPECT_EQ(fs::join("a", "/b"), "/b");
  EXPECT_EQ(fs::join("a", ""), "a");
  EXPECT_EQ(fs::parent_path("a/b/c"), "a/b");
  EXPECT_EQ(fs::parent_path("a/b/"), "a");
  EXPECT_EQ(fs::parent_path("a//b"), "a");
  EXPECT_EQ(fs::parent_path("c"), "");
  EXPECT_EQ(fs::parent_path("/c"), "/");
  EXPECT_EQ(fs::filename("a/b"), "b");
  EXPECT_EQ(fs::filename("a/b//"), "b");
  EXPECT_EQ(fs::filename("b"), "b");
  EXPECT_EQ(fs::filename("/"), "");
}

TEST(Fs, QueriesFollowLinks) {
  const std::string dir = dtrain::testing::temp_dir();
  const std::string f = dir + "/f";
  write_file(f, "12345");
  ASSERT_EQ(fs::create_symlink(f, dir + "/link"), 0);
  ASSERT_EQ(fs::create_symlink(dir + "/missing", dir + "/dangling"), 0);
  EXPECT_TRUE(fs::exists(f));
  EXPECT_TRUE(fs::is_regular_file(dir + "/link"));
  EXPECT_TRUE(fs::is_symlink(dir + "/link"));
  EXPECT_FALSE(fs::is_symlink(f));
  EXPECT_FALSE(fs::exists(dir + "/dangling"));
  EXPECT_TRUE(fs::is_directory(dir));
  EXPECT_FALSE(fs::is_directory(f));
  EXPECT_EQ(fs::file_size(dir + "/link"), 5u);
  EXPECT_FALSE(fs::file_size(dir));
  EXPECT_FALSE(fs::file_size(dir + "/missing"));
  EXPECT_EQ(fs::read_symlink(dir + "/link"), f);
  EXPECT_FALSE(fs::read_symlink(f));
  EXPECT_EQ(fs::canonical(dir + "/link"), fs::canonical(f));
  EXPECT_FALSE(fs::canonical(dir + "/dangling"));
  EXPECT_EQ(fs::list_directory(dir), (std::vector<std::string>{"dangling", "f", "link"}));
  int err = 0;
  EXPECT_TRUE(fs::list_directory(dir + "/missing", &err).empty());
  EXPECT_EQ(err, ENOENT);
  ASSERT_EQ(fs::resize_file(f, 2), 0);
  EXPECT_EQ(fs::file_size(f), 2u);
  EXPECT_TRUE(fs::is_directory(fs::temp_directory()));
}

TEST(Fs, CreateRenameRemove) {
  const std::string dir = dtrain::testing::temp_dir();
  EXPECT_EQ(fs::create_directories(dir + "/a/b/c/"), 0);
  EXPECT_TRUE(fs::is_directory(dir + "/a/b/c"));
  EXPECT_EQ(fs::create_directory(dir + "/a"), 0) << "an existing directory is fine";
  write_file(dir + "/a/file", "x");
  EXPECT_EQ(fs::create_directory(dir + "/a/file"), EEXIST);
  EXPECT_NE(fs::create_directories(dir + "/a/file/sub"), 0) << "a file where a directory should be";
  EXPECT_EQ(fs::rename(dir + "/a/file", dir + "/a/moved"), 0);
  EXPECT_FALSE(fs::exists(dir + "/a/file"));
  EXPECT_EQ(fs::rename(dir + "/a/file", dir + "/a/again"), ENOENT);
  EXPECT_EQ(fs::remove(dir + "/a/moved"), 0);
  EXPECT_EQ(fs::remove(dir + "/a/moved"), 0) << "nothing there is not an error";
  EXPECT_EQ(fs::remove(dir + "/a/b/c"), 0) << "an empty directory";
  EXPECT_EQ(fs::remove(dir + "/a"), ENOTEMPTY);
}

TEST(Fs, RemoveAllNeverFollowsLinks) {
  const std::string dir = dtrain::testing::temp_dir();
  const std::string keep = dir + "/keep";
  ASSERT_EQ(fs::create_directories(keep + "/inner"), 0);
  write_file(keep + "/inner/precious", "do not delete");
  const std::string doomed = dir + "/doomed";
  ASSERT_EQ(fs::create_directories(doomed + "/x/y/z"), 0);
  for (const char* f : {"/a", "/x/b", "/x/y/c", "/x/y/z/d"}) write_file(doomed + f, "data");
  ASSERT_EQ(fs::create_symlink(keep, doomed + "/x/link-to-dir"), 0);
  ASSERT_EQ(fs::create_symlink(keep + "/inner/precious", doomed + "/link-to-file"), 0);
  ASSERT_EQ(fs::create_symlink(dir + "/nowhere", doomed + "/x/y/dangling"), 0);

  EXPECT_EQ(fs::remove_all(doomed), 0);
  EXPECT_FALSE(fs::exists(doomed));
  EXPECT_FALSE(fs::is_symlink(doomed + "/link-to-file"));
  EXPECT_TRUE(fs::is_regular_file(keep + "/inner/precious")) << "followed a link";
  EXPECT_EQ(fs::remove_all(doomed), 0) << "nothing there is not an error";

  // A link given as the path itself: the link goes, its target stays.
  ASSERT_EQ(fs::create_symlink(keep, dir + "/top-link"), 0);
  EXPECT_EQ(fs::remove_all(dir + "/top-link"), 0);
  EXPECT_FALSE(fs::is_symlink(dir + "/top-link"));
  EXPECT_TRUE(fs::is_regular_file(keep + "/inner/precious"));
  // A link given with a trailing '/' (which makes the kernel resolve it): still only the link.
  ASSERT_EQ(fs::create_symlink(keep, dir + "/slash-link"), 0);
  EXPECT_EQ(fs::remove_all(dir + "/slash-link/"), 0);
  EXPECT_FALSE(fs::is_symlink(dir + "/slash-link"));
  EXPECT_TRUE(fs::is_regular_file(keep + "/inner/precious")) << "followed a link named with a trailing slash";
  EXPECT_EQ(fs::remove_all(keep + "/."), EINVAL);
  EXPECT_EQ(fs::remove_all(""), EINVAL);
  EXPECT_TRUE(fs::is_regular_file(keep + "/inner/precious"));
  // A plain file.
  EXPECT_EQ(fs::remove_all(keep + "/inner/precious"), 0);
  EXPECT_FALSE(fs::exists(keep + "/inner/precious"));
}

namespace {

// What remove_all did, run as the calling user, with a tree in `dir` that holds a file it may not
// delete (ro/sub/f, in the read-only ro/sub) beside one it may (ro/other). Plain data: a child
// process sends it back through a pipe.
struct UndeletableOutcome {
  int drop = 0;               // errno of a failed setgroups/setgid/setuid (the child only)
  int setup = 0;              // errno of a failed step before the removal
  bool sub_writable = false;  // the read-only directory took a new file anyway (CAP_DAC_OVERRIDE)
  int first = -1;             // remove_all(ro) while f cannot be deleted
  bool f_left = false;
  bool other_left = true;
  int second = -1;            // remove_all(ro) once ro/sub is writable again
  bool ro_left = true;
};

UndeletableOutcome remove_undeletable(const std::string& dir) {
  UndeletableOutcome r;
  const std::string ro = dir + "/ro", sub = ro + "/sub";
  if ((r.setup = fs::create_directories(sub)) != 0) return r;
  write_file(sub + "/f", "x");
  write_file(ro + "/other", "y");
  if (!fs::is_regular_file(sub + "/f") || !fs::is_regular_file(ro + "/other")) {
    r.setup = EIO;
    return r;
  }
  if (::chmod(sub.c_str(), 0555) != 0) {
    r.setup = errno;
    return r;
  }
  const std::string probe = sub + "/probe";
  const int fd = ::open(probe.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
  if (fd >= 0) {
    ::close(fd);
    ::unlink(probe.c_str());
    r.sub_writable = true;
  } else if (errno != EACCES) {
    r.setup = errno;
  }
  if (r.sub_writable || r.setup) {
    ::chmod(sub.c_str(), 0755);
    return r;
  }
  r.first = fs::remove_all(ro);
  r.f_left = fs::exists(sub + "/f");
  r.other_left = fs::exists(ro + "/other");
  ::chmod(sub.c_str(), 0755);
  r.second = fs::remove_all(ro);
  r.ro_left = fs::exists(ro);
  return r;
}

}  // namespace

// remove_all reports an errno value, not a message: the first failure (EACCES for ro/sub/f, not
// the ENOTEMPTY of the directories above it), after removing what it could. As root (CI), which may
// delete from a read-only directory, the check runs in a child process as nobody (uid and gid
// 65534, no supplementary groups) in a directory given to nobody.
TEST(Fs, RemoveAllReportsWhatItCannotDelete) {
  constexpr uid_t kNobody = 65534;
  const std::string dir = dtrain::testing::temp_dir();
  UndeletableOutcome r;
  if (::geteuid() != 0) {
    r = remove_undeletable(dir);
  } else {
    ASSERT_EQ(::chown(dir.c_str(), kNobody, static_cast<gid_t>(kNobody)), 0) << std::strerror(errno);
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0) << std::strerror(errno);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0) << std::strerror(errno);
    if (pid == 0) {  // the child: no GoogleTest here, and _exit (no atexit cleanup of temp_dir)
      ::close(fds[0]);
      int code = 0;
      try {
        UndeletableOutcome c;
        if (::setgroups(0, nullptr) != 0 || ::setgid(static_cast<gid_t>(kNobody)) != 0 || ::setuid(kNobody) != 0) {
          c.drop = errno;
        } else if (::geteuid() == 0) {
          c.drop = EPERM;
        } else {
          c = remove_undeletable(dir);
        }
        if (::write(fds[1], &c, sizeof c) != static_cast<ssize_t>(sizeof c)) code = 3;
      } catch (...) {
        code = 2;
      }
      ::_exit(code);
    }
    ::close(fds[1]);
    size_t got = 0;
    char* into = reinterpret_cast<char*>(&r);
    while (got < sizeof r) {
      const ssize_t n = ::read(fds[0], into + got, sizeof r - got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    ::close(fds[0]);
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0 && got == sizeof r)
        << "the unprivileged child failed: wait status " << status << ", " << got << " bytes of its result";
    if (r.drop) GTEST_SKIP() << "root that cannot become nobody: " << fs::error_text(r.drop);
  }
  if (r.sub_writable) GTEST_SKIP() << "this user may write into a read-only directory (CAP_DAC_OVERRIDE?)";
  ASSERT_EQ(r.setup, 0) << "could not build the tree in " << dir << ": " << fs::error_text(r.setup);
  EXPECT_EQ(r.first, EACCES) << "got " << r.first << " (" << fs::error_text(r.first) << ")";
  EXPECT_TRUE(r.f_left) << "the file in the read-only directory went";
  EXPECT_FALSE(r.other_left) << "remove_all stopped at the first failure";
  EXPECT_EQ(r.second, 0);
  EXPECT_FALSE(r.ro_left);
}
