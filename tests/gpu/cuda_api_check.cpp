// Compile-time check that runtime/driver/cuda.h (the project's one declaration of the CUDA driver ABI
// subset that libdecodepack, the tools and the GPU tests call) matches the toolkit's cuda.h: every
// constant, struct layout and handle type. Building this file is the test; the program only reports
// that it was built.
#include <cstddef>
#include <cstdio>
#include <type_traits>

#include "driver/cuda.h"

// Copied out before cuda.h is included: several of these names are macros there.
namespace mine {
namespace cu = dp::cu;
constexpr int attr_priority = cu::CU_LAUNCH_ATTRIBUTE_PRIORITY;
constexpr int attr_carveout = cu::CU_LAUNCH_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT;
constexpr unsigned host_portable = cu::CU_MEMHOSTALLOC_PORTABLE;
constexpr unsigned host_devicemap = cu::CU_MEMHOSTALLOC_DEVICEMAP;
constexpr unsigned stream_non_blocking = cu::CU_STREAM_NON_BLOCKING;
constexpr unsigned event_disable_timing = cu::CU_EVENT_DISABLE_TIMING;
constexpr int capture_thread_local = cu::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
constexpr unsigned record_external = cu::CU_EVENT_RECORD_EXTERNAL;
constexpr int jit_error_log = cu::CU_JIT_ERROR_LOG_BUFFER;
constexpr int jit_error_log_size = cu::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES;
constexpr size_t jit_option_size = sizeof(cu::CUjit_option);
constexpr unsigned ipc_lazy_peer = cu::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS;
constexpr size_t ipc_handle_size = sizeof(cu::CUipcMemHandle);
constexpr int dev_attrs[] = {
    cu::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, cu::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X,
    cu::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y, cu::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z,
    cu::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X, cu::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y,
    cu::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z, cu::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK,
    cu::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK, cu::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    cu::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY, cu::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE,
    cu::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, cu::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
    cu::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
};
constexpr int func_attrs[] = {cu::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, cu::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                              cu::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, cu::CU_FUNC_ATTRIBUTE_NUM_REGS,
                              cu::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES};
constexpr size_t config_size = sizeof(cu::CUlaunchConfig), attr_size = sizeof(cu::CUlaunchAttribute),
                 value_size = sizeof(cu::CUlaunchAttributeValue);
constexpr size_t off_stream = offsetof(cu::CUlaunchConfig, hStream), off_attrs = offsetof(cu::CUlaunchConfig, attrs),
                 off_num = offsetof(cu::CUlaunchConfig, numAttrs), off_shmem = offsetof(cu::CUlaunchConfig, sharedMemBytes),
                 off_value = offsetof(cu::CUlaunchAttribute, value);
}  // namespace mine

#include <cuda.h>

static_assert(mine::attr_priority == CU_LAUNCH_ATTRIBUTE_PRIORITY);
static_assert(mine::attr_carveout == CU_LAUNCH_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT);
static_assert(mine::host_portable == CU_MEMHOSTALLOC_PORTABLE);
static_assert(mine::host_devicemap == CU_MEMHOSTALLOC_DEVICEMAP);
static_assert(mine::stream_non_blocking == CU_STREAM_NON_BLOCKING);
static_assert(mine::event_disable_timing == CU_EVENT_DISABLE_TIMING);
static_assert(mine::capture_thread_local == CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
static_assert(mine::record_external == CU_EVENT_RECORD_EXTERNAL);
static_assert(mine::jit_error_log == CU_JIT_ERROR_LOG_BUFFER);
static_assert(mine::jit_error_log_size == CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES);
static_assert(mine::jit_option_size == sizeof(CUjit_option));  // cuModuleLoadDataEx takes an array of them
// The handle types are cuda.h's own (declared at global scope in both), so code that includes both
// headers passes its handles to the table unchanged.
static_assert(std::is_same_v<dp::cu::CUcontext, CUcontext> && std::is_same_v<dp::cu::CUmodule, CUmodule> &&
              std::is_same_v<dp::cu::CUfunction, CUfunction> && std::is_same_v<dp::cu::CUstream, CUstream> &&
              std::is_same_v<dp::cu::CUevent, CUevent> && std::is_same_v<dp::cu::CUgraph, CUgraph> &&
              std::is_same_v<dp::cu::CUgraphExec, CUgraphExec> && std::is_same_v<dp::cu::CUdeviceptr, CUdeviceptr> &&
              std::is_same_v<dp::cu::CUdevice, CUdevice>);
static_assert(mine::dev_attrs[0] == CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK);
static_assert(mine::dev_attrs[1] == CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X);
static_assert(mine::dev_attrs[2] == CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y);
static_assert(mine::dev_attrs[3] == CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z);
static_assert(mine::dev_attrs[4] == CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X);
static_assert(mine::dev_attrs[5] == CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y);
static_assert(mine::dev_attrs[6] == CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z);
static_assert(mine::dev_attrs[7] == CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK);
static_assert(mine::dev_attrs[8] == CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK);
static_assert(mine::dev_attrs[9] == CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
static_assert(mine::dev_attrs[10] == CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY);
static_assert(mine::dev_attrs[11] == CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE);
static_assert(mine::dev_attrs[12] == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
static_assert(mine::dev_attrs[13] == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
static_assert(mine::dev_attrs[14] == CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
static_assert(mine::func_attrs[0] == CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK);
static_assert(mine::func_attrs[1] == CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES);
static_assert(mine::func_attrs[2] == CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES);
static_assert(mine::func_attrs[3] == CU_FUNC_ATTRIBUTE_NUM_REGS);
static_assert(mine::func_attrs[4] == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES);
static_assert(mine::ipc_lazy_peer == CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
static_assert(mine::ipc_handle_size == sizeof(CUipcMemHandle));
static_assert(mine::config_size == sizeof(CUlaunchConfig));
static_assert(mine::attr_size == sizeof(CUlaunchAttribute));
static_assert(mine::value_size == sizeof(CUlaunchAttributeValue));
static_assert(mine::off_stream == offsetof(CUlaunchConfig, hStream));
static_assert(mine::off_attrs == offsetof(CUlaunchConfig, attrs));
static_assert(mine::off_num == offsetof(CUlaunchConfig, numAttrs));
static_assert(mine::off_shmem == offsetof(CUlaunchConfig, sharedMemBytes));
static_assert(mine::off_value == offsetof(CUlaunchAttribute, value));
static_assert(CU_LAUNCH_PARAM_END_AS_INT == 0 && CU_LAUNCH_PARAM_BUFFER_POINTER_AS_INT == 1 &&
              CU_LAUNCH_PARAM_BUFFER_SIZE_AS_INT == 2);
static_assert(CUDA_SUCCESS == 0 && CUDA_ERROR_NO_DEVICE == 100 && CUDA_ERROR_INVALID_DEVICE == 101);

int main() {
  std::printf("runtime/driver/cuda.h matches cuda.h (CUDA_VERSION %d)\n", CUDA_VERSION);
  return 0;
}
