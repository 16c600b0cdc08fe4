#pragma once
// Precompiled header for dtrain's own sources and tests: the heavy, stable libtorch headers only.
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>
