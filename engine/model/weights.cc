#include "engine/model/weights.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "engine/util/read_file.h"

namespace imagegen {

namespace fs = std::filesystem;

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

StatusOr<Json> ReadModelConfig(const std::string& dir) {
  const std::string path = (fs::path(dir) / "config.json").string();
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    return NotFound(path + ": not found (a model directory holds config.json)");
  }
  // A config is a few KiB; the cap keeps a wrong or hostile file from being read whole.
  ASSIGN_OR_RETURN(const std::string text, ReadFile(path, size_t{1} << 20));
  StatusOr<Json> parsed = ParseJson(text);
  if (!parsed.ok()) return FailedPrecondition(path + ": " + parsed.status().message());
  if (!parsed->is_object()) return FailedPrecondition(path + ": must hold a JSON object");
  return parsed;
}

StatusOr<std::unique_ptr<WeightStore>> WeightStore::Open(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return NotFound(dir + ": model directory not found");
  std::vector<std::string> paths;
  fs::directory_iterator it(dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    if (it->path().extension() == ".safetensors" && fs::is_regular_file(it->path(), ec)) {
      paths.push_back(it->path().string());
    }
  }
  if (ec) return NotFound(dir + ": cannot list: " + ec.message());
  std::sort(paths.begin(), paths.end());
  if (paths.empty()) return NotFound(dir + ": no *.safetensors files");
  auto store = std::unique_ptr<WeightStore>(new WeightStore());
  store->dir_ = dir;
  std::set<std::string> seen;
  for (const auto& p : paths) {
    ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(p));
    for (const auto& [name, info] : file->tensors()) {
      if (!seen.insert(name).second) {
        return DataLoss(dir + ": tensor '" + name + "' appears in more than one file");
      }
    }
    store->files_.push_back(std::move(file));
  }
  return store;
}

bool WeightStore::Has(const std::string& name) const {
  for (const auto& f : files_) {
    if (f->tensors().count(name)) return true;
  }
  return false;
}

StatusOr<at::Tensor> WeightStore::Take(const std::string& name, const std::vector<int64_t>& shape,
                                       const LoadOptions& opts, bool keep_fp32) {
  for (const auto& f : files_) {
    auto it = f->tensors().find(name);
    if (it == f->tensors().end()) continue;
    const TensorInfo& info = it->second;
    if (info.shape != shape) {
      return FailedPrecondition(f->path() + ": tensor '" + name + "' has shape " +
                                ShapeString(info.shape) + " but config.json implies " +
                                ShapeString(shape));
    }
    if (info.dtype != "F32" && info.dtype != "F16" && info.dtype != "BF16" && info.dtype != "F64") {
      return FailedPrecondition(f->path() + ": tensor '" + name + "' has dtype " + info.dtype +
                                ", expected a floating-point type");
    }
    ASSIGN_OR_RETURN(at::Tensor t, f->Read(name));
    // NaN or Inf weights load and run, and every image comes out as one repeated token: refuse
    // them here, and values that overflow the serving dtype too.
    if (const int64_t bad = (~at::isfinite(t)).sum().item<int64_t>(); bad > 0) {
      return DataLoss(f->path() + ": tensor '" + name + "' has " + std::to_string(bad) +
                      " non-finite values (NaN or Inf)");
    }
    taken_.insert(name);
    at::Tensor out = t.to(opts.device, keep_fp32 ? at::kFloat : opts.dtype).contiguous();
    if (out.scalar_type() != t.scalar_type() && !at::isfinite(out).all().item<bool>()) {
      return FailedPrecondition(f->path() + ": tensor '" + name + "' overflows " +
                                std::string(c10::toString(out.scalar_type())));
    }
    return out;
  }
  return FailedPrecondition(dir_ + ": missing tensor '" + name + "' (expected shape " +
                            ShapeString(shape) + ")");
}

Status WeightStore::Finish(const std::vector<std::string>& ignored_prefixes) const {
  std::vector<std::string> unexpected;
  for (const auto& f : files_) {
    for (const auto& [name, info] : f->tensors()) {
      if (taken_.count(name)) continue;
      bool ignored = false;
      for (const auto& p : ignored_prefixes) {
        ignored |= p.size() > 1 && p[0] == '*' ? name.find(p.substr(1)) != std::string::npos
                                               : name.rfind(p, 0) == 0;
      }
      if (!ignored) unexpected.push_back(name);
    }
  }
  if (unexpected.empty()) return OkStatus();
  std::string list;
  for (size_t i = 0; i < unexpected.size() && i < 5; ++i) list += (i ? ", " : "") + unexpected[i];
  if (unexpected.size() > 5) list += ", ... (" + std::to_string(unexpected.size()) + " in all)";
  return FailedPrecondition(dir_ + ": unexpected tensors not used by the model: " + list);
}

}  // namespace imagegen
