// Not part of dtrain: code that does call std::filesystem, so that the check
// scripts/check-no-filesystem.sh is shown to fail on it (CTest: elf.check_catches_std_filesystem).
// It is built into build/probe/, outside the directories the real check scans.
#include <filesystem>
#include <iostream>

// (built as a static library: the check reads its object's undefined symbols)
int dtrain_filesystem_probe(int argc, char** argv) {
  if (argc > 1) std::filesystem::remove_all(argv[1]);
  std::cout << std::filesystem::temp_directory_path() << "\n";
  return 0;
}
