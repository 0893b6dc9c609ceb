// Fuzz target: the bytes of a GenerateRequest, as the daemon receives them, through the parse
// and the conversion to engine parameters (every field checked, errors naming the field), the
// metric label and the error mapping.
#include <cstddef>
#include <cstdint>

#include <google/protobuf/stubs/logging.h>

#include "imagegen/v1/imagegen.pb.h"
#include "server/convert.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Invalid UTF-8 in a string field is a parse failure, which protobuf also logs: not here.
  static const bool quiet = [] {
    google::protobuf::SetLogHandler(nullptr);
    return true;
  }();
  (void)quiet;
  imagegen::v1::GenerateRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  imagegen::GenerateParams params;
  const grpc::Status st = imagegen::server::ToParams(req, "scd-mc", &params);
  const std::string label = imagegen::server::MethodLabel(req, "scd-mc");
  if (label.size() > 32) __builtin_trap();  // label values stay bounded, whatever is sent
  if (!st.ok() && st.error_message().size() > 4096) __builtin_trap();
  for (const char* f : {"class_id", "top_p", "tree_depth", "window", "cool_nu"}) {
    (void)imagegen::server::ProtoField(f, req);
  }
  (void)imagegen::server::ToGrpc(imagegen::FieldError("cfg_scale", "cfg_scale: x"), req, 1.0);
  return 0;
}
