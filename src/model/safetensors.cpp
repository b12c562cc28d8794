#include "model/safetensors.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace lily {

namespace {

struct DTypeInfo {
  const char* name;
  DType dtype;
  size_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {"F64", DType::F64, 8},  {"F32", DType::F32, 4},   {"F16", DType::F16, 2},
    {"BF16", DType::BF16, 2}, {"I64", DType::I64, 8},  {"I32", DType::I32, 4},
    {"U32", DType::U32, 4},  {"I16", DType::I16, 2},   {"U16", DType::U16, 2},
    {"I8", DType::I8, 1},    {"U8", DType::U8, 1},     {"BOOL", DType::BOOL, 1},
};

// Headers larger than this are refused: real ones are well under 10 MB.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

}  // namespace

const char* dtype_name(DType d) {
  for (const auto& i : kDTypes)
    if (i.dtype == d) return i.name;
  return "?";
}

size_t dtype_size(DType d) {
  for (const auto& i : kDTypes)
    if (i.dtype == d) return i.size;
  return 0;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorView::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

SafetensorsFile::SafetensorsFile(const std::string& path)
    : file_(std::make_unique<MappedFile>(path)) {
  const uint8_t* base = file_->data();
  const size_t size = file_->size();
  if (size < 8) fail(path, ": truncated safetensors file (", size, " bytes, no header length)");
  uint64_t header_len = 0;
  std::memcpy(&header_len, base, 8);  // little-endian on every supported host
  if (header_len > kMaxHeaderBytes) fail(path, ": header length ", header_len, " is implausible");
  if (header_len > size - 8)
    fail(path, ": truncated safetensors file (header of ", header_len, " bytes, file has ",
         size - 8, " after the length)");
  const char* hdr = reinterpret_cast<const char*>(base + 8);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(hdr, hdr + header_len);
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": malformed safetensors header JSON: ", e.what());
  }
  if (!j.is_object()) fail(path, ": safetensors header is not a JSON object");
  const size_t data_start = 8 + header_len;
  const size_t data_size = size - data_start;

  struct Span {
    size_t begin, end;
    const std::string* name;
  };
  std::vector<Span> spans;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) fail(path, ": __metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m)
        if (m.value().is_string()) metadata_[m.key()] = m.value().get<std::string>();
      continue;
    }
    auto where = [&] { return str_cat(path, ": tensor '", name, "'"); };
    if (!v.is_object()) fail(where(), ": entry is not an object");
    if (!v.contains("dtype") || !v["dtype"].is_string()) fail(where(), ": missing dtype");
    if (!v.contains("shape") || !v["shape"].is_array()) fail(where(), ": missing shape");
    if (!v.contains("data_offsets") || !v["data_offsets"].is_array() ||
        v["data_offsets"].size() != 2)
      fail(where(), ": data_offsets must be [begin, end]");
    TensorView t;
    t.name = name;
    t.file = path;
    const std::string dt = v["dtype"].get<std::string>();
    bool known = false;
    for (const auto& i : kDTypes)
      if (dt == i.name) {
        t.dtype = i.dtype;
        known = true;
      }
    if (!known) fail(where(), ": unsupported dtype ", dt);
    uint64_t numel = 1;
    for (const auto& d : v["shape"]) {
      if (!d.is_number_unsigned()) fail(where(), ": shape entries must be non-negative integers");
      uint64_t dim = d.get<uint64_t>();
      if (dim != 0 && numel > std::numeric_limits<uint64_t>::max() / 16 / dim)
        fail(where(), ": shape too large");
      numel *= dim;
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    const auto& off = v["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      fail(where(), ": data_offsets must be non-negative integers");
    uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    if (b > e) fail(where(), ": data_offsets begin ", b, " > end ", e);
    if (e > data_size)
      fail(where(), ": data_offsets [", b, ", ", e, ") outside the data section of ", data_size,
           " bytes (truncated file?)");
    uint64_t expect = numel * dtype_size(t.dtype);
    if (e - b != expect)
      fail(where(), ": byte size ", e - b, " != ", dt, " x ", t.shape_str(), " = ", expect);
    t.data = base + data_start + b;
    t.nbytes = static_cast<size_t>(e - b);
    auto [pos, inserted] = tensors_.emplace(name, std::move(t));
    if (!inserted) fail(where(), ": duplicate tensor");
    if (e > b) spans.push_back({static_cast<size_t>(b), static_cast<size_t>(e), &pos->first});
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < spans.size(); ++i)
    if (spans[i].begin < spans[i - 1].end)
      fail(path, ": tensors '", *spans[i - 1].name, "' and '", *spans[i].name, "' overlap");
}

Checkpoint::Checkpoint(const std::string& dir) : dir_(dir) {
  const std::string index = dir + "/model.safetensors.index.json";
  if (file_exists(index)) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(read_text_file(index));
    } catch (const nlohmann::json::exception& e) {
      fail(index, ": malformed JSON: ", e.what());
    }
    if (!j.contains("weight_map") || !j["weight_map"].is_object())
      fail(index, ": missing object field 'weight_map'");
    std::map<std::string, std::string> expected;  // tensor -> shard
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string()) fail(index, ": weight_map['", it.key(), "'] is not a string");
      std::string shard = it.value().get<std::string>();
      if (shard.find('/') != std::string::npos || shard.find("..") != std::string::npos)
        fail(index, ": weight_map['", it.key(), "'] names a file outside the directory: ", shard);
      expected[it.key()] = shard;
      if (std::find(files_.begin(), files_.end(), shard) == files_.end()) files_.push_back(shard);
    }
    std::sort(files_.begin(), files_.end());
    for (const auto& f : files_) {
      shards_.push_back(std::make_unique<SafetensorsFile>(dir + "/" + f));
      for (const auto& [name, t] : shards_.back()->tensors()) {
        auto e = expected.find(name);
        if (e == expected.end() || e->second != f)
          fail(dir, "/", f, ": tensor '", name, "' is not listed for this shard in ", index);
        if (!tensors_.emplace(name, t).second) fail(dir, "/", f, ": duplicate tensor '", name, "'");
      }
    }
    for (const auto& [name, shard] : expected)
      if (!tensors_.count(name)) fail(index, ": tensor '", name, "' is missing from ", shard);
  } else {
    const std::string single = dir + "/model.safetensors";
    if (!file_exists(single))
      fail(dir, ": no model.safetensors or model.safetensors.index.json");
    files_.push_back("model.safetensors");
    shards_.push_back(std::make_unique<SafetensorsFile>(single));
    tensors_ = shards_.back()->tensors();
  }
}

const TensorView& Checkpoint::get(const std::string& name) {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) fail(dir_, ": missing tensor '", name, "'");
  used_.insert(name);
  return it->second;
}

std::vector<std::string> Checkpoint::unused() const {
  std::vector<std::string> out;
  for (const auto& [name, t] : tensors_)
    if (!used_.count(name)) out.push_back(name);
  return out;
}

std::map<std::string, std::string> Checkpoint::metadata() const {
  std::map<std::string, std::string> m;
  for (const auto& s : shards_)
    for (const auto& kv : s->metadata()) m.insert(kv);
  return m;
}

}  // namespace lily
