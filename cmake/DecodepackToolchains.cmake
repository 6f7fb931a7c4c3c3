# Locates the device toolchains the compiler drives at run time. Neither is needed to build
# decodepack itself; a missing one is reported here and again, with the fix, when a build asks for it.
set(DP_CUDA_ROOT "/usr/local/cuda" CACHE PATH "CUDA toolkit root (nvcc, NVRTC, ptxas)")
if(EXISTS "${DP_CUDA_ROOT}/bin/nvcc")
  set(DP_HAVE_CUDA ON)
  message(STATUS "decodepack: CUDA toolkit at ${DP_CUDA_ROOT}")
else()
  set(DP_HAVE_CUDA OFF)
  message(STATUS "decodepack: no CUDA toolkit at ${DP_CUDA_ROOT} (nvcc missing); sm_XX targets will be refused "
                 "at build time. Set -DDP_CUDA_ROOT=<dir> to point at one.")
endif()

find_program(DP_CLANG_HIP NAMES clang++-19 clang++ PATHS /usr/lib/llvm-19/bin NO_DEFAULT_PATH)
if(NOT DP_CLANG_HIP)
  find_program(DP_CLANG_HIP NAMES clang++-19)
endif()
if(DP_CLANG_HIP)
  message(STATUS "decodepack: HIP device compiler ${DP_CLANG_HIP}")
else()
  message(STATUS "decodepack: clang++-19 not found; gfx targets will be refused at build time "
                 "(apt-get install clang-19 lld-19, or pass --hip-clang)")
endif()
