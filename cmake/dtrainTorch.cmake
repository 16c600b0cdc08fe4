# Finds libtorch (Debian's 1.13 or a 2.x from torch.utils.cmake_prefix_path) and describes what
# its c10d offers. Defines the interface target dtrain_torch_c10d carrying the definitions the
# c10d headers need (USE_C10D_GLOO, USE_C10D_NCCL) and the variable DTRAIN_HAVE_NCCL.
find_package(Torch REQUIRED)

# The C++ standard: dtrain needs C++17; a libtorch whose headers need more says so on its torch
# target (2.14: CXX_STANDARD 20, whose ATen.h stops with #error under C++17). Take the larger.
get_target_property(DTRAIN_TORCH_CXX_STANDARD torch CXX_STANDARD)
if(DTRAIN_TORCH_CXX_STANDARD AND DTRAIN_TORCH_CXX_STANDARD GREATER CMAKE_CXX_STANDARD)
  message(STATUS "dtrain: C++${DTRAIN_TORCH_CXX_STANDARD}, as libtorch ${Torch_VERSION} asks")
  set(CMAKE_CXX_STANDARD ${DTRAIN_TORCH_CXX_STANDARD})
endif()

add_library(dtrain_torch_c10d INTERFACE)
target_link_libraries(dtrain_torch_c10d INTERFACE ${TORCH_LIBRARIES})
target_compile_definitions(dtrain_torch_c10d INTERFACE USE_C10D_GLOO)
# Gloo's headers are needed by one source file only (src/comm/process_group.cpp creates the Gloo
# process group), so they are PRIVATE to libdtrain: nothing dtrain installs includes them, and a
# program built on dtrain never needs them. Debian's libtorch-dev depends on libgloo-dev; the
# pytorch.org libtorch zip and the pip wheels ship no gloo headers at all, and Debian 12's
# libgloo-dev headers (/usr/include/gloo) build against them (checked with torch 2.11+cu130).
find_path(DTRAIN_GLOO_INCLUDE gloo/algorithm.h HINTS ${TORCH_INCLUDE_DIRS}
          DOC "directory holding gloo/algorithm.h (Debian: libgloo-dev puts it in /usr/include)")
if(NOT DTRAIN_GLOO_INCLUDE)
  message(FATAL_ERROR "dtrain: Gloo's headers (gloo/algorithm.h) were not found next to libtorch "
    "${Torch_VERSION} (${TORCH_INCLUDE_DIRS}) nor on the system. The pytorch.org libtorch and the pip "
    "wheels do not ship them. On Debian/Ubuntu: apt-get install libgloo-dev (or run "
    "scripts/install-deps.sh); elsewhere pass -DDTRAIN_GLOO_INCLUDE=<dir containing gloo/algorithm.h>, "
    "e.g. a checkout of https://github.com/facebookincubator/gloo.")
endif()
set(DTRAIN_HAVE_NCCL OFF)
if(TORCH_CUDA_LIBRARIES OR CUDA_FOUND)
  find_path(DTRAIN_NCCL_HEADER torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp HINTS ${TORCH_INCLUDE_DIRS})
  if(DTRAIN_NCCL_HEADER)
    set(DTRAIN_HAVE_NCCL ON)
    target_compile_definitions(dtrain_torch_c10d INTERFACE USE_C10D_NCCL DTRAIN_WITH_NCCL=1 DTRAIN_WITH_CUDA=1)
  endif()
endif()
message(STATUS "dtrain: libtorch ${Torch_VERSION} (${Torch_DIR}), C++${CMAKE_CXX_STANDARD}, NCCL ${DTRAIN_HAVE_NCCL}, Gloo headers ${DTRAIN_GLOO_INCLUDE}")
