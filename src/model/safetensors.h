// Safetensors checkpoints: one file or shards listed by
// model.safetensors.index.json, memory-mapped. Every header is validated in
// full before any tensor is handed out: well-formed JSON, known dtypes,
// offsets inside the file, no overlapping tensors, byte size == dtype x shape.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/mapped_file.h"

namespace lily {

enum class DType { F64, F32, F16, BF16, I64, I32, U32, I16, U16, I8, U8, BOOL };

const char* dtype_name(DType d);
size_t dtype_size(DType d);

struct TensorView {
  std::string name;
  std::string file;  // the shard it lives in, for error messages
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;

  int64_t numel() const;
  std::string shape_str() const;  // "[2, 3]"
};

// One safetensors file, mapped and validated.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::unique_ptr<MappedFile> file_;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// All tensors of a checkpoint directory. Tracks which tensors the loader
// consumed so that anything left over can be reported.
class Checkpoint {
 public:
  explicit Checkpoint(const std::string& dir);

  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  // Fails naming the tensor if it is absent. Marks it consumed.
  const TensorView& get(const std::string& name);
  const std::map<std::string, TensorView>& all() const { return tensors_; }
  void mark_used(const std::string& name) { used_.insert(name); }
  std::vector<std::string> unused() const;
  const std::string& dir() const { return dir_; }
  const std::vector<std::string>& files() const { return files_; }
  std::map<std::string, std::string> metadata() const;

 private:
  std::string dir_;
  std::vector<std::string> files_;
  std::vector<std::unique_ptr<SafetensorsFile>> shards_;
  std::map<std::string, TensorView> tensors_;
  std::set<std::string> used_;
};

}  // namespace lily
