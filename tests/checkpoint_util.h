// Builds modified copies of fixture checkpoints in a temporary directory, for
// tests of the loader's strictness and of the alternative layouts.
#pragma once

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fixture_util.h"

namespace lily::test {

// A safetensors file held in memory as header JSON + data section.
struct RawSafetensors {
  nlohmann::ordered_json header;
  std::vector<uint8_t> data;

  static RawSafetensors read(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), {});
    uint64_t n;
    std::memcpy(&n, bytes.data(), 8);
    RawSafetensors r;
    r.header = nlohmann::ordered_json::parse(bytes.begin() + 8, bytes.begin() + 8 + n);
    r.data.assign(bytes.begin() + 8 + n, bytes.end());
    return r;
  }

  void write(const std::string& path) const {
    std::string h = header.dump();
    uint64_t n = h.size();
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(&n), 8);
    out.write(h.data(), h.size());
    out.write(reinterpret_cast<const char*>(data.data()), data.size());
  }

  std::vector<uint8_t> bytes_of(const std::string& name) const {
    const auto& off = header.at(name).at("data_offsets");
    size_t b = off[0].get<size_t>(), e = off[1].get<size_t>();
    return {data.begin() + b, data.begin() + e};
  }

  // Appends a tensor at the end of the data section.
  void add(const std::string& name, const std::string& dtype, std::vector<int64_t> shape,
           const std::vector<uint8_t>& bytes) {
    size_t b = data.size();
    data.insert(data.end(), bytes.begin(), bytes.end());
    header[name] = {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {b, data.size()}}};
  }
};

// A fresh temporary directory holding a copy of a fixture's config.json
// (and generation_config.json); removed on destruction.
class TempModelDir {
 public:
  explicit TempModelDir(const std::string& fixture) {
    namespace fs = std::filesystem;
    std::string tmpl = (fs::temp_directory_path() / "lily-test-XXXXXX").string();
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back(0);
    char* made = mkdtemp(buf.data());
    if (made == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = made;
    for (const char* f : {"config.json", "generation_config.json"}) {
      fs::path src = fs::path(fixture_dir(fixture)) / f;
      if (fs::exists(src)) fs::copy_file(src, fs::path(path_) / f);
    }
  }
  ~TempModelDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

}  // namespace lily::test
