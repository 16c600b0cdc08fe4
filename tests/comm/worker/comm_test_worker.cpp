// A tiny multi-process worker for comm tests: comm_test_worker <mode> <rank> <world> <store>
// (<store>: a file for file://, or a whole init method such as tcp://127.0.0.1:PORT)
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
  const std::string store = argv[4];
  const std::string method = store.find("://") == std::string::npos ? "file://" + store : store;
  auto pg = init_process_group(InitOptions().init_method(method).rank(rank)
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
  if (mode == "all-reduce") {  // prints the sum of every rank's rank + 1
    auto t = at::full({1}, static_cast<float>(rank + 1));
    all_reduce(pg, t);
    std::printf("rank %d: sum %g\n", rank, t.item<float>());
    return 0;
  }
  std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
  return 2;
}
