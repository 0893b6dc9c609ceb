// The ImageGeneration gRPC service (synchronous API: one handler thread per call). A call is
// validated, submitted to the engine, and then the handler relays the engine's events: step
// messages for GenerateStream, the final image for both. The handler polls for client
// cancellation and deadline expiry and cancels the engine request, which frees its KV slots at
// the next engine step. Thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <string>

#include "engine/scheduler/engine.h"
#include "imagegen/v1/imagegen.grpc.pb.h"
#include "server/auth.h"
#include "server/metrics.h"

namespace imagegen::server {

class ImageGenerationService final : public v1::ImageGeneration::Service {
 public:
  // `metrics` must outlive the service.
  ImageGenerationService(Metrics* metrics, TokenAuth auth, std::string default_method);

  // Calls before SetEngine are UNAVAILABLE ("models are loading"); the engine must outlive
  // every call.
  void SetEngine(Engine* engine);
  // From now on new calls are UNAVAILABLE; calls in flight go on.
  void SetDraining();

  grpc::Status Generate(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                        v1::GenerateResponse* resp) override;
  grpc::Status GenerateStream(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                              grpc::ServerWriter<v1::GenerateStreamResponse>* writer) override;
  grpc::Status ListModels(grpc::ServerContext* ctx, const v1::ListModelsRequest* req,
                          v1::ListModelsResponse* resp) override;

 private:
  grpc::Status Run(grpc::ServerContext* ctx, const v1::GenerateRequest& req,
                   grpc::ServerWriter<v1::GenerateStreamResponse>* writer,
                   v1::GenerateResponse* unary);

  Metrics* metrics_;
  const TokenAuth auth_;
  const std::string default_method_;
  std::atomic<Engine*> engine_{nullptr};
  std::atomic<bool> draining_{false};
};

}  // namespace imagegen::server
