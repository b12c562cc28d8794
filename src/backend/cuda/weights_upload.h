// Repacking host matrices (as the loader typed them) into the device layout
// the decode kernels read (kernels.h): rows of 16-byte chunks, affine scale and
// bias interleaved per group. MLX 4/8-bit stays 4/8-bit, bf16 stays bf16, f16
// becomes f32 (exact). Matrices without data (synthetic shells) are filled
// with random codes and plausible scales on the device instead.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/cuda/cuda_util.h"
#include "backend/cuda/kernels.h"
#include "model/weights.h"

namespace lily::cuda {

// A device matrix that owns its memory.
struct DevMat {
  DevMatView v;
  DeviceBuffer w, sb;
  bool empty() const { return v.rows == 0; }
};

// Builds one device matrix from rows of host matrices that share format,
// width, group size and scale dtype, in the order they are added.
class MatPacker {
 public:
  // `proto` fixes the format; `rows` is the total row count to be added.
  MatPacker(const Matrix& proto, int rows);
  void add_rows(const Matrix& m, int first, int count);
  void add_all(const Matrix& m) { add_rows(m, 0, m.rows); }
  // Rows a[0], b[0], a[1], b[1], ... (gate/up pairs for a fused SwiGLU).
  void add_interleaved(const Matrix& a, const Matrix& b);
  // Uploads (or, for data-less synthetic matrices, generates) and returns.
  DevMat finish(uint64_t seed);

 private:
  void check_compatible(const Matrix& m) const;
  void pack_row(const Matrix& m, int row);

  const Matrix proto_;
  DevMatView v_;
  bool synthetic_ = false;
  int added_ = 0;
  size_t row_w_bytes_ = 0;
  std::vector<uint8_t> w_;
  std::vector<uint32_t> sb_;
};

DevMat upload_matrix(const Matrix& m, uint64_t seed);
DevMat upload_interleaved(const Matrix& a, const Matrix& b, uint64_t seed);

}  // namespace lily::cuda
