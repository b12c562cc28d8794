#ifdef LILY_HAVE_CUDA

#include "backend/cuda/weights_upload.h"

#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/half.h"

namespace lily::cuda {

namespace {

QFmt device_format(const Matrix& m) {
  switch (m.format) {
    case WeightFormat::Affine4: return QFmt::Q4;
    case WeightFormat::Affine8: return QFmt::Q8;
    case WeightFormat::BF16: return QFmt::BF16;
    case WeightFormat::F16:
    case WeightFormat::F32: return QFmt::F32;
  }
  return QFmt::F32;
}

}  // namespace

MatPacker::MatPacker(const Matrix& proto, int rows) : proto_(proto) {
  v_.fmt = device_format(proto);
  v_.rows = rows;
  v_.cols = proto.cols;
  const int fpc = floats_per_chunk(v_.fmt);
  v_.chunks = (proto.cols + fpc - 1) / fpc;
  synthetic_ = proto.data == nullptr;
  if (proto.quantized()) {
    if (proto.group_size <= 0 || proto.cols % proto.group_size != 0 || proto.group_size % fpc != 0)
      fail(proto.name, ": affine group size ", proto.group_size, " with ", proto.cols,
           " inputs is not supported by the cuda backend (needs a multiple of ", fpc, ")");
    if (!synthetic_ && proto.scale_dtype != DType::BF16 && proto.scale_dtype != DType::F16)
      fail(proto.name, ": ", dtype_name(proto.scale_dtype),
           " scales are not supported by the cuda backend (bf16 or f16)");
    v_.groups = proto.cols / proto.group_size;
    v_.chunks_per_group = proto.group_size / fpc;
    if (!chunks_per_group_ok(v_.fmt, v_.chunks_per_group))
      fail(proto.name, ": affine group size ", proto.group_size,
           " is not supported by the cuda backend (needs a power of two times ", fpc, ")");
    v_.sb_f16 = proto.scale_dtype == DType::F16 ? 1 : 0;
  }
  row_w_bytes_ = size_t(v_.chunks) * 16;
  if (!synthetic_) {
    w_.assign(row_w_bytes_ * rows, 0);
    sb_.assign(size_t(v_.groups) * rows, 0);
  }
}

void MatPacker::check_compatible(const Matrix& m) const {
  if (m.format != proto_.format || m.cols != proto_.cols || m.group_size != proto_.group_size ||
      (m.quantized() && m.scale_dtype != proto_.scale_dtype) || (m.data == nullptr) != synthetic_)
    fail(m.name, ": format ", weight_format_name(m.format), " [", m.rows, " x ", m.cols,
         "] cannot be fused with ", proto_.name, " (", weight_format_name(proto_.format), " [",
         proto_.rows, " x ", proto_.cols, "]) on the cuda backend");
}

void MatPacker::pack_row(const Matrix& m, int row) {
  if (added_ >= v_.rows) fail("MatPacker: more rows than declared for ", proto_.name);
  const int dst = added_++;
  if (synthetic_) return;
  uint8_t* out = &w_[row_w_bytes_ * dst];
  const uint8_t* src = m.data + m.row_bytes() * row;
  switch (m.format) {
    case WeightFormat::Affine4:
    case WeightFormat::Affine8:
    case WeightFormat::BF16:
    case WeightFormat::F32:
      std::memcpy(out, src, m.row_bytes());
      break;
    case WeightFormat::F16:
      for (int i = 0; i < m.cols; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        const float f = f16_to_f32(h);
        std::memcpy(out + 4 * i, &f, 4);
      }
      break;
  }
  if (m.quantized()) {
    const size_t g0 = size_t(row) * v_.groups;
    for (int g = 0; g < v_.groups; ++g) {
      uint16_t s, b;
      std::memcpy(&s, m.scales + 2 * (g0 + g), 2);
      std::memcpy(&b, m.biases + 2 * (g0 + g), 2);
      sb_[size_t(dst) * v_.groups + g] = uint32_t(s) | (uint32_t(b) << 16);
    }
  }
}

void MatPacker::add_rows(const Matrix& m, int first, int count) {
  check_compatible(m);
  if (first < 0 || first + count > m.rows) fail("MatPacker: rows out of range for ", m.name);
  for (int r = first; r < first + count; ++r) pack_row(m, r);
}

void MatPacker::add_interleaved(const Matrix& a, const Matrix& b) {
  check_compatible(a);
  check_compatible(b);
  if (a.rows != b.rows) fail(a.name, " and ", b.name, " differ in rows (", a.rows, " vs ", b.rows, ")");
  for (int r = 0; r < a.rows; ++r) {
    pack_row(a, r);
    pack_row(b, r);
  }
}

DevMat MatPacker::finish(uint64_t seed) {
  if (added_ != v_.rows)
    fail("MatPacker: ", added_, " rows added for ", proto_.name, ", declared ", v_.rows);
  DevMat d;
  d.v = v_;
  const size_t wbytes = row_w_bytes_ * v_.rows;
  const size_t nsb = size_t(v_.groups) * v_.rows;
  d.w.alloc(wbytes);
  if (nsb) d.sb.alloc(nsb * 4);
  if (synthetic_) {
    if (v_.fmt != QFmt::Q4 && v_.fmt != QFmt::Q8)
      fail(proto_.name, ": synthetic matrices must be affine 4- or 8-bit");
    // Weights with zero mean and standard deviation 1/sqrt(cols), so that
    // activations keep their scale through the layers.
    const float sigma = 1.f / std::sqrt(static_cast<float>(v_.cols));
    const float code_std = v_.fmt == QFmt::Q4 ? 4.61f : 73.9f;
    const float mid = v_.fmt == QFmt::Q4 ? 7.5f : 127.5f;
    fill_random_u32(d.w.as<uint32_t>(), wbytes / 4, seed, nullptr);
    fill_random_scale_bias(d.sb.as<uint32_t>(), nsb, sigma / code_std, 0.25f, -mid, seed ^ 0x5bd1e995u,
                           nullptr);
    LILY_CUDA(cudaDeviceSynchronize());
  } else {
    LILY_CUDA(cudaMemcpy(d.w.get(), w_.data(), wbytes, cudaMemcpyHostToDevice));
    if (nsb) LILY_CUDA(cudaMemcpy(d.sb.get(), sb_.data(), nsb * 4, cudaMemcpyHostToDevice));
  }
  d.v.w = d.w.as<const uint4>();
  d.v.sb = nsb ? d.sb.as<const uint32_t>() : nullptr;
  w_.clear();
  w_.shrink_to_fit();
  sb_.clear();
  sb_.shrink_to_fit();
  return d;
}

DevMat upload_matrix(const Matrix& m, uint64_t seed) {
  MatPacker p(m, m.rows);
  p.add_all(m);
  return p.finish(seed);
}

DevMat upload_interleaved(const Matrix& a, const Matrix& b, uint64_t seed) {
  MatPacker p(a, a.rows + b.rows);
  p.add_interleaved(a, b);
  return p.finish(seed);
}

}  // namespace lily::cuda

#endif  // LILY_HAVE_CUDA
