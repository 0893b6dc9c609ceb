// Reader for the safetensors format: 8-byte little-endian header length N, N bytes of JSON
// ({"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}), then
// the tensor data. The file is memory-mapped; tensors are copied out on request.
//
// Every inconsistency is reported as DATA_LOSS naming the file and the tensor: a file shorter
// than its header says, a header that is not JSON or is over 100 MiB, unknown dtypes, offsets
// that overlap or disagree with dtype x shape. (Gaps between tensors are tolerated, as the
// format's own reader does.) The file must not be truncated while open: the map would fault.
// Thread-safe after Open (read-only).
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/util/status.h"

namespace imagegen {

struct TensorInfo {
  std::string dtype;  // "F32", "BF16", ...
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets relative to the data section
};

class SafetensorsFile {
 public:
  static StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // A CPU tensor holding a copy of the named tensor's data, in its stored dtype.
  StatusOr<at::Tensor> Read(const std::string& name) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  const uint8_t* map_ = nullptr;
  size_t map_size_ = 0;
  size_t data_start_ = 0;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// The header of a safetensors file held in memory (`size` bytes: the whole file, so that the
// tensors' offsets are checked against the data section): the same checks and errors as Open,
// with `where` in place of the path. Pure; the fuzz target's entry point.
struct SafetensorsHeader {
  std::map<std::string, TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
  size_t data_start = 0;  // 8 + header length
};
StatusOr<SafetensorsHeader> ParseSafetensorsHeader(const uint8_t* bytes, size_t size,
                                                   const std::string& where);

// Writes tensors (any dtype the reader knows) to a safetensors file; used by tests and tools.
Status WriteSafetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors);

// Size in bytes of one element of a safetensors dtype, or 0 if unknown.
size_t SafetensorsDtypeSize(const std::string& dtype);

}  // namespace imagegen
