// Kernel launches with launch attributes (programmatic dependent launch,
// clusters) and the device side of PDL, shared by the decode and the
// prefill kernels.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "core/error.h"

namespace lily::cuda {

// Programmatic dependent launch: a kernel launched with the PDL attribute may
// start before its predecessor ends; it must wait before touching anything the
// predecessor writes. Without the attribute both are no-ops.
#ifdef __CUDACC__
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
#endif

// Launch with (optionally) the programmatic-stream-serialization attribute
// and (cluster > 1) clusters of that many blocks along x.
template <typename... KArgs, typename... Args>
void launch_kernel_ex(const char* name, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                      cudaStream_t s, bool pdl, unsigned cluster, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n++].val.clusterDim = {cluster, 1, 1};
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (e != cudaSuccess)
    fail("CUDA error launching ", name, ": ", cudaGetErrorName(e), ": ", cudaGetErrorString(e));
}
template <typename... KArgs, typename... Args>
void launch_kernel(const char* name, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t s, bool pdl, Args&&... args) {
  launch_kernel_ex(name, kernel, grid, block, smem, s, pdl, 1u, std::forward<Args>(args)...);
}

}  // namespace lily::cuda
