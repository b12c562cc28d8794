// Host-side CUDA helpers: every runtime call's error becomes a lily::Error
// naming the call, and device / pinned memory is owned by RAII buffers.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>
#include <utility>

#include "core/error.h"

namespace lily::cuda {

inline void check(cudaError_t e, const char* call, const char* file, int line) {
  if (e != cudaSuccess)
    fail("CUDA error in ", call, " (", file, ":", line, "): ", cudaGetErrorName(e), ": ",
         cudaGetErrorString(e));
}

// After a kernel launch: launch-configuration errors are reported at once,
// naming the kernel.
inline void check_launch(const char* kernel) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    fail("CUDA error launching ", kernel, ": ", cudaGetErrorName(e), ": ", cudaGetErrorString(e));
}

#define LILY_CUDA(call) ::lily::cuda::check((call), #call, __FILE__, __LINE__)

// Device memory, freed on destruction. Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) { alloc(bytes); }
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  void alloc(size_t bytes) {
    reset();
    if (bytes == 0) return;
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
      cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      const bool known = cudaMemGetInfo(&free_b, &total_b) == cudaSuccess;
      auto mib = [](size_t b) { return std::to_string((b + (1u << 20) - 1) >> 20) + " MiB"; };
      fail("cudaMalloc of ", bytes, " bytes (", mib(bytes), ") failed: ", cudaGetErrorName(e), ": ",
           cudaGetErrorString(e), known ? " (the GPU has " + mib(free_b) + " free of " + mib(total_b) + ")" : "");
    }
    p_ = p;
    n_ = bytes;
  }
  void reset() {
    if (p_) cudaFree(p_);
    p_ = nullptr;
    n_ = 0;
  }
  void* get() const { return p_; }
  template <typename T>
  T* as() const { return static_cast<T*>(p_); }
  size_t bytes() const { return n_; }
  explicit operator bool() const { return p_ != nullptr; }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

// Page-locked host memory (asynchronous copies need it). Move-only.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() { reset(); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void ensure(size_t bytes) {
    if (bytes <= n_) return;
    reset();
    LILY_CUDA(cudaMallocHost(&p_, bytes));
    n_ = bytes;
  }
  void reset() {
    if (p_) cudaFreeHost(p_);
    p_ = nullptr;
    n_ = 0;
  }
  template <typename T>
  T* as() const { return static_cast<T*>(p_); }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

template <typename T>
void upload(DeviceBuffer& dst, const T* src, size_t count) {
  dst.alloc(count * sizeof(T));
  if (count) LILY_CUDA(cudaMemcpy(dst.get(), src, count * sizeof(T), cudaMemcpyHostToDevice));
}

}  // namespace lily::cuda
