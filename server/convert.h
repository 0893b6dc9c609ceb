// Between the wire contract and the engine: GenerateRequest -> GenerateParams (with the proto
// field named in every error), engine results -> responses, engine errors -> gRPC statuses
// carrying google.rpc details (BadRequest, RetryInfo). Pure functions; thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>

#include "engine/scheduler/request.h"
#include "imagegen/v1/imagegen.pb.h"

namespace imagegen::server {

// A call's outcome label for metrics: its status code's name in lower case (codes a call is not
// expected to end with count as internal).
std::string OutcomeLabel(grpc::StatusCode c);

// INVALID_ARGUMENT with a google.rpc.BadRequest naming `field`.
grpc::Status BadField(const std::string& field, const std::string& description);
// PERMISSION_DENIED with the same detail: a valid value the caller's API key may not ask for.
grpc::Status DeniedField(const std::string& field, const std::string& description);

// RESOURCE_EXHAUSTED with a google.rpc.RetryInfo asking the client to wait `retry_seconds`.
grpc::Status Overloaded(const std::string& message, double retry_seconds);
// UNAVAILABLE with the same RetryInfo: this replica cannot serve the call now (its engine is
// unhealthy); a client's retry policy takes it elsewhere, or here after the delay.
grpc::Status UnavailableFor(const std::string& message, double retry_seconds);

// Fills `out` (everything but the deadline) from `req`; `default_method` when req.method is
// empty. Errors name the proto field ("top_p", "policy.tree_depth", "class_name", ...).
grpc::Status ToParams(const v1::GenerateRequest& req, const std::string& default_method,
                      GenerateParams* out);

// The proto field an engine error is about, as the request spelled it.
std::string ProtoField(const std::string& engine_field, const v1::GenerateRequest& req);

// An engine error as a gRPC status (codes map one to one; INVALID_ARGUMENT gains a BadRequest,
// RESOURCE_EXHAUSTED a RetryInfo of `retry_seconds`).
grpc::Status ToGrpc(const Status& s, const v1::GenerateRequest& req, double retry_seconds);

// The label value of a request's method for metrics: a preset name, or "custom" when explicit
// policy parts were given (bounded, whatever clients send).
std::string MethodLabel(const v1::GenerateRequest& req, const std::string& default_method);
// The method a request without one gets: `default_method`, or mar when the model it names (the
// first model when it names none) takes continuous tokens.
std::string DefaultMethodFor(const std::vector<ModelInfo>& models, const std::string& model,
                             const std::string& default_method);

// Who a request is for (GenerateParams::client): "user:" + its user when it names one, else
// the caller's address (TrustedProxies::ClientAddress: "ipv4:10.1.2.3", "ipv6:[::1]", no port).
std::string ClientOf(const std::string& user, const std::string& address);
// The PNG upscaling the request asks for (output.scale; 0 means 1).
int OutputScale(const v1::GenerateRequest& req);
// The largest output.scale for a model: 16, or less where the upscaled image would be over
// kMaxOutputSide pixels a side. PNGs (finals and every preview) are encoded on the shared
// encoder pool, and a 384-px image at 16x is 113 MB of pixels to compress a preview.
constexpr int64_t kMaxOutputSide = 4096;
int MaxScale(const ModelInfo& model);
// The result and the step updates with their images encoded as PNG here, in the calling
// (gRPC handler) thread, never on the engine thread. INTERNAL if encoding fails.
grpc::Status FillResponse(const RequestResult& r, int scale, bool include_tokens,
                          double total_seconds, v1::GenerateResponse* resp);
void FillStep(const StepEvent& e, int scale, v1::StepUpdate* s);
void FillModels(const std::vector<ModelInfo>& models, const std::string& default_method,
                v1::ListModelsResponse* resp);

}  // namespace imagegen::server
