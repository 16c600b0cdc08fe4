// A tiny multi-process worker for comm tests: comm_test_worker <mode> <rank> <world> <store file>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include <ATen/ATen.h>

#include "dtrain/comm.h"

using namespace dtrain::comm;

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: comm_test_worker <mode> <rank> <world> <store file>\n");
    return 2;
  }
  const std::string mode = argv[1];
  const int rank = std::atoi(argv[2]);
  const int world = std::atoi(argv[3]);
  auto pg = init_process_group(InitOptions().init_method(std::string("file://") + argv[4]).rank(rank)
                                   .world_size(world).backend("gloo").timeout(std::chrono::seconds(30))
                                   .configure_threads(false));
  if (mode == "peer-death") {
    if (rank == 1) return 7;  // leaves without a word
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    try {
      auto t = at::ones({1000});
      all_reduce(pg, t);
    } catch (const CommError& e) {
      std::fprintf(stderr, "%s\n", e.what());
      return 3;
    }
    return 0;
  }
  std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
  return 2;
}
