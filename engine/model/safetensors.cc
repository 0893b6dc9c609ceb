#include "engine/model/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "engine/util/json.h"
#include "engine/util/read_file.h"

namespace imagegen {
namespace {

struct DtypeEntry {
  const char* name;
  at::ScalarType type;
  size_t size;
};

constexpr DtypeEntry kDtypes[] = {
    {"F64", at::kDouble, 8},    {"F32", at::kFloat, 4}, {"F16", at::kHalf, 2},
    {"BF16", at::kBFloat16, 2}, {"I64", at::kLong, 8},  {"I32", at::kInt, 4},
    {"I16", at::kShort, 2},     {"I8", at::kChar, 1},   {"U8", at::kByte, 1},
    {"BOOL", at::kBool, 1},
};

const DtypeEntry* FindDtype(const std::string& name) {
  for (const auto& e : kDtypes) {
    if (name == e.name) return &e;
  }
  return nullptr;
}

const DtypeEntry* FindDtype(at::ScalarType t) {
  for (const auto& e : kDtypes) {
    if (t == e.type) return &e;
  }
  return nullptr;
}

// One tensor's header entry, checked against itself and the size of the data section.
StatusOr<TensorInfo> ParseTensorEntry(const Json& entry, const std::string& where,
                                      uint64_t data_size) {
  if (!entry.is_object()) return DataLoss(where + ": entry is not an object");
  const auto dtype = entry.find("dtype"), shape = entry.find("shape");
  const auto offsets = entry.find("data_offsets");
  if (dtype == entry.end() || !dtype->is_string()) return DataLoss(where + ": missing dtype");
  if (shape == entry.end() || !shape->is_array()) return DataLoss(where + ": missing shape");
  if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2) {
    return DataLoss(where + ": data_offsets must be [begin, end]");
  }
  TensorInfo info;
  info.dtype = dtype->get<std::string>();
  const DtypeEntry* dt = FindDtype(info.dtype);
  if (dt == nullptr) return DataLoss(where + ": unsupported dtype " + info.dtype);
  uint64_t numel = 1;
  for (const Json& d : *shape) {
    const std::optional<int64_t> n = JsonInt(d);
    if (!n || *n < 0) return DataLoss(where + ": bad shape entry");
    const auto u = static_cast<uint64_t>(*n);
    if (u != 0 && numel > (uint64_t{1} << 48) / u) return DataLoss(where + ": shape too large");
    numel *= u;
    info.shape.push_back(*n);
  }
  const std::optional<int64_t> begin = JsonInt((*offsets)[0]), end = JsonInt((*offsets)[1]);
  if (!begin || !end || *begin < 0 || *end < 0) return DataLoss(where + ": bad data_offsets");
  info.begin = static_cast<uint64_t>(*begin);
  info.end = static_cast<uint64_t>(*end);
  if (info.end < info.begin) return DataLoss(where + ": data_offsets end before begin");
  if (info.end - info.begin != numel * dt->size) {
    return DataLoss(where + ": data_offsets span " + std::to_string(info.end - info.begin) +
                    " bytes but dtype " + info.dtype + " x shape needs " +
                    std::to_string(numel * dt->size));
  }
  if (info.end > data_size) {
    return DataLoss(where + ": data ends at byte " + std::to_string(info.end) +
                    " but the file holds only " + std::to_string(data_size) +
                    " data bytes (truncated file?)");
  }
  return info;
}

}  // namespace

size_t SafetensorsDtypeSize(const std::string& dtype) {
  const DtypeEntry* e = FindDtype(dtype);
  return e ? e->size : 0;
}

StatusOr<SafetensorsHeader> ParseSafetensorsHeader(const uint8_t* bytes, size_t size,
                                                   const std::string& where) {
  if (size < 8) {
    return DataLoss(where + ": truncated: " + std::to_string(size) +
                    " bytes, a safetensors file needs at least an 8-byte header length");
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
  if (header_len > size - 8) {
    return DataLoss(where + ": truncated or corrupt: header length " + std::to_string(header_len) +
                    " exceeds the file size " + std::to_string(size));
  }
  if (header_len > (uint64_t{100} << 20)) {
    return DataLoss(where + ": header length " + std::to_string(header_len) +
                    " exceeds the 100 MiB limit");
  }
  SafetensorsHeader h;
  h.data_start = 8 + header_len;
  std::string_view text(reinterpret_cast<const char*>(bytes + 8), header_len);
  StatusOr<Json> parsed = ParseJson(text);
  if (!parsed.ok()) return DataLoss(where + ": bad header: " + parsed.status().message());
  const Json& root = parsed.value();
  if (!root.is_object()) return DataLoss(where + ": bad header: not a JSON object");

  const uint64_t data_size = size - h.data_start;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, entry] : root.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) return DataLoss(where + ": __metadata__ is not an object");
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string()) return DataLoss(where + ": __metadata__ values must be strings");
        h.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    ASSIGN_OR_RETURN(TensorInfo info,
                     ParseTensorEntry(entry, where + ": tensor " + Quoted(name), data_size));
    ranges.emplace_back(info.begin, info.end);
    h.tensors.emplace(name, std::move(info));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) {
      return DataLoss(where + ": tensors overlap in the data section");
    }
  }
  return h;
}

StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return OpenError(path, errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return DataLoss(path + ": cannot stat");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return DataLoss(path + ": not a regular file");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < 8) {  // (mmap of an empty file fails; the parser says what is wrong)
    ::close(fd);
    const uint8_t none[8] = {};
    return ParseSafetensorsHeader(none, size, path).status();
  }
  void* m = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) return DataLoss(path + ": mmap failed: " + std::strerror(errno));
  f->map_ = static_cast<const uint8_t*>(m);
  f->map_size_ = size;
  ASSIGN_OR_RETURN(SafetensorsHeader h, ParseSafetensorsHeader(f->map_, size, path));
  f->data_start_ = h.data_start;
  f->tensors_ = std::move(h.tensors);
  f->metadata_ = std::move(h.metadata);
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(const_cast<uint8_t*>(map_), map_size_);
}

StatusOr<at::Tensor> SafetensorsFile::Read(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) return NotFound(path_ + ": no tensor '" + name + "'");
  const TensorInfo& info = it->second;
  const DtypeEntry* dt = FindDtype(info.dtype);
  at::Tensor t = at::empty(info.shape, at::TensorOptions().dtype(dt->type));
  if (info.end > info.begin) {
    std::memcpy(t.data_ptr(), map_ + data_start_ + info.begin, info.end - info.begin);
  }
  return t;
}

Status WriteSafetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors) {
  // Header built by hand: names are escaped for quotes and backslashes only (tools' names).
  std::ostringstream h;
  h << "{";
  uint64_t offset = 0;
  std::vector<at::Tensor> blobs;
  bool first = true;
  for (const auto& [name, tensor] : tensors) {
    const DtypeEntry* dt = FindDtype(tensor.scalar_type());
    if (dt == nullptr) return InvalidArgument("WriteSafetensors: unsupported dtype for " + name);
    at::Tensor c = tensor.detach().to(at::kCPU).contiguous();
    if (!first) h << ",";
    first = false;
    h << '"';
    for (char ch : name) {
      if (ch == '"' || ch == '\\') h << '\\';
      h << ch;
    }
    const uint64_t nbytes = c.numel() * dt->size;
    h << "\":{\"dtype\":\"" << dt->name << "\",\"shape\":[";
    for (int64_t i = 0; i < c.dim(); ++i) h << (i ? "," : "") << c.size(i);
    h << "],\"data_offsets\":[" << offset << "," << offset + nbytes << "]}";
    offset += nbytes;
    blobs.push_back(c);
  }
  h << "}";
  std::string header = h.str();
  while ((8 + header.size()) % 8 != 0) header += ' ';
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return NotFound(path + ": cannot create");
  uint64_t n = header.size();
  char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  out.write(len, 8);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  for (const at::Tensor& b : blobs) {
    out.write(static_cast<const char*>(b.data_ptr()),
              static_cast<std::streamsize>(b.numel() * b.element_size()));
  }
  if (!out) return Internal(path + ": write failed");
  return OkStatus();
}

}  // namespace imagegen
