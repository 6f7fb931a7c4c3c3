// Compile-time check that tools/cuda_driver.h (the CLI's own declarations of the CUDA driver calls that
// `run` and `bench` make) uses cuda.h's values for every constant it declares. Building this file is the
// test; the program only reports that it was built.
#include <cstdio>

#include "cuda_driver.h"

// Copied out before cuda.h is included: several of these names are macros or enumerators there.
namespace mine {
namespace cu = dp::tools::cuda;
constexpr int success = cu::CUDA_SUCCESS;
constexpr unsigned stream_non_blocking = cu::CU_STREAM_NON_BLOCKING;
constexpr int capture_thread_local = cu::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
constexpr unsigned record_external = cu::CU_EVENT_RECORD_EXTERNAL;
constexpr int attr_sms = cu::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
constexpr int attr_l2 = cu::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE;
constexpr int jit_error_log = cu::CU_JIT_ERROR_LOG_BUFFER;
constexpr int jit_error_log_size = cu::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES;
constexpr size_t jit_option_size = sizeof(cu::CUjit_option);
}  // namespace mine

#include <cuda.h>

static_assert(mine::success == CUDA_SUCCESS);
static_assert(mine::stream_non_blocking == CU_STREAM_NON_BLOCKING);
static_assert(mine::capture_thread_local == CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
static_assert(mine::record_external == CU_EVENT_RECORD_EXTERNAL);
static_assert(mine::attr_sms == CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
static_assert(mine::attr_l2 == CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE);
static_assert(mine::jit_error_log == CU_JIT_ERROR_LOG_BUFFER);
static_assert(mine::jit_error_log_size == CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES);
static_assert(mine::jit_option_size == sizeof(CUjit_option));  // cuModuleLoadDataEx takes an array of them

int main() {
  std::printf("tools/cuda_driver.h matches cuda.h (CUDA_VERSION %d)\n", CUDA_VERSION);
  return 0;
}
