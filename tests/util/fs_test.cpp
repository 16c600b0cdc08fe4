// dtrain::util::fs: the POSIX file-system helpers that replace <filesystem>
// (Design note [no std::filesystem], include/dtrain/util/fs.h).
#include "dtrain/util/fs.h"

#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>

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

TEST(Fs, RemoveAllReportsWhatItCannotDelete) {
  if (::geteuid() == 0) GTEST_SKIP() << "root may delete from a read-only directory";
  const std::string dir = dtrain::testing::temp_dir();
  ASSERT_EQ(fs::create_directories(dir + "/ro/sub"), 0);
  write_file(dir + "/ro/sub/f", "x");
  ASSERT_EQ(::chmod((dir + "/ro/sub").c_str(), 0555), 0);
  EXPECT_EQ(fs::remove_all(dir + "/ro"), EACCES);
  EXPECT_TRUE(fs::exists(dir + "/ro/sub/f"));
  ::chmod((dir + "/ro/sub").c_str(), 0755);
  EXPECT_EQ(fs::remove_all(dir + "/ro"), 0);
}
