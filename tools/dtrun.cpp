// dtrun: the launcher (torchrun's contract, in C++). See docs/launch.md and `dtrun --help`.
#include <string>
#include <vector>

#include "dtrain/launch/agent.h"

int main(int argc, char** argv) {
  return dtrain::launch::dtrun_main(std::vector<std::string>(argv + 1, argv + argc));
}
