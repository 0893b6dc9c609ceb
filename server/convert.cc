#include "server/convert.h"

#include <google/protobuf/any.pb.h>

#include <algorithm>
#include <cctype>
#include <cmath>

#include "engine/decoding/policy.h"
#include "engine/image/png.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"

namespace imagegen::server {
namespace {

grpc::Status WithDetail(grpc::StatusCode code, const std::string& message,
                        const google::protobuf::Message& detail) {
  google::rpc::Status st;
  st.set_code(static_cast<int>(code));
  st.set_message(message);
  st.add_details()->PackFrom(detail);
  return grpc::Status(code, message, st.SerializeAsString());
}

bool HasPolicyPart(const v1::DecodingPolicy& p, const std::string& name) {
  if (name == "draft") return p.draft() != v1::DRAFT_SOURCE_UNSPECIFIED;
  if (name == "coupling") return p.coupling() != v1::COUPLING_UNSPECIFIED;
  if (name == "acceptance") return p.acceptance() != v1::ACCEPTANCE_UNSPECIFIED;
  if (name == "tree_branches") return p.has_tree_branches();
  if (name == "tree_depth") return p.has_tree_depth();
  if (name == "uniform_init_q") return p.has_uniform_init_q();
  if (name == "gsd_group") return p.has_gsd_group();
  if (name == "gsd_delta") return p.has_gsd_delta();
  if (name == "gsd_distance") return p.has_gsd_distance();
  if (name == "cool_delta") return p.has_cool_delta();
  if (name == "cool_nu") return p.has_cool_nu();
  return false;
}

bool AnyPolicyPart(const v1::GenerateRequest& req) {
  if (!req.has_policy()) return false;
  for (const char* n :
       {"draft", "coupling", "acceptance", "tree_branches", "tree_depth", "uniform_init_q",
        "gsd_group", "gsd_delta", "gsd_distance", "cool_delta", "cool_nu"}) {
    if (HasPolicyPart(req.policy(), n)) return true;
  }
  return false;
}

}  // namespace

// The call's outcome label: its status code's name in lower case. The label values are fixed
// (dashboards and alerts select on them), so codes a call is not expected to end with count
// as internal.
std::string OutcomeLabel(grpc::StatusCode c) {
  switch (c) {
    case grpc::StatusCode::OK:
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::CANCELLED:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::UNAUTHENTICATED:
    case grpc::StatusCode::PERMISSION_DENIED:
    case grpc::StatusCode::ABORTED:
      break;
    default:
      c = grpc::StatusCode::INTERNAL;
  }
  std::string label = StatusCodeName(static_cast<int>(c));
  std::transform(label.begin(), label.end(), label.begin(),
                 [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
  return label;
}

namespace {

grpc::Status FieldStatus(grpc::StatusCode code, const std::string& field,
                         const std::string& description) {
  google::rpc::BadRequest br;
  auto* v = br.add_field_violations();
  v->set_field(field);
  v->set_description(description);
  return WithDetail(code, field + ": " + description, br);
}

grpc::Status RetryLater(grpc::StatusCode code, const std::string& message, double retry_seconds) {
  google::rpc::RetryInfo ri;
  const double s = std::max(retry_seconds, 0.0);
  ri.mutable_retry_delay()->set_seconds(static_cast<int64_t>(s));
  ri.mutable_retry_delay()->set_nanos(static_cast<int32_t>((s - std::floor(s)) * 1e9));
  return WithDetail(code, message, ri);
}

}  // namespace

grpc::Status BadField(const std::string& field, const std::string& description) {
  return FieldStatus(grpc::StatusCode::INVALID_ARGUMENT, field, description);
}

grpc::Status DeniedField(const std::string& field, const std::string& description) {
  return FieldStatus(grpc::StatusCode::PERMISSION_DENIED, field, description);
}

grpc::Status Overloaded(const std::string& message, double retry_seconds) {
  return RetryLater(grpc::StatusCode::RESOURCE_EXHAUSTED, message, retry_seconds);
}

grpc::Status UnavailableFor(const std::string& message, double retry_seconds) {
  return RetryLater(grpc::StatusCode::UNAVAILABLE, message, retry_seconds);
}

std::string ProtoField(const std::string& f, const v1::GenerateRequest& req) {
  if (req.has_policy() && HasPolicyPart(req.policy(), f)) return "policy." + f;
  if (f == "tree_branches" || f == "tree_depth" || f == "coupling" || f == "gsd_group" ||
      f == "gsd_delta" || f == "gsd_distance" || f == "cool_delta" || f == "cool_nu") {
    // A preset's own part that does not fit: the window the client chose, or the method.
    return req.has_window() ? "window" : "method";
  }
  if (f == "num_iter" || f == "cfg_schedule" || f == "prefill" || f == "inner_temperature" ||
      f == "residual_rounds") {
    return "continuous." + f;
  }
  // The engine names the condition "prompt" or "prompt_token_ids"; the request's own field.
  if (f == "prompt" || f == "prompt_token_ids") {
    return req.prompt_token_ids_size() > 0 && req.prompt().empty() ? "prompt_token_ids" : "prompt";
  }
  if (f == "negative_prompt" || f == "negative_prompt_token_ids") {
    return req.negative_prompt_token_ids_size() > 0 && req.negative_prompt().empty()
               ? "negative_prompt_token_ids"
               : "negative_prompt";
  }
  return f;  // model, class_id, class_name, seed, cfg_scale, temperature, top_k, top_p, method, ...
}

// The engine's codes carry gRPC's numbers, so StatusCodeName names both.
static_assert(static_cast<int>(Code::kCancelled) == grpc::StatusCode::CANCELLED);
static_assert(static_cast<int>(Code::kInvalidArgument) == grpc::StatusCode::INVALID_ARGUMENT);
static_assert(static_cast<int>(Code::kDeadlineExceeded) == grpc::StatusCode::DEADLINE_EXCEEDED);
static_assert(static_cast<int>(Code::kNotFound) == grpc::StatusCode::NOT_FOUND);
static_assert(static_cast<int>(Code::kPermissionDenied) == grpc::StatusCode::PERMISSION_DENIED);
static_assert(static_cast<int>(Code::kResourceExhausted) == grpc::StatusCode::RESOURCE_EXHAUSTED);
static_assert(static_cast<int>(Code::kFailedPrecondition) == grpc::StatusCode::FAILED_PRECONDITION);
static_assert(static_cast<int>(Code::kInternal) == grpc::StatusCode::INTERNAL);
static_assert(static_cast<int>(Code::kUnavailable) == grpc::StatusCode::UNAVAILABLE);
static_assert(static_cast<int>(Code::kDataLoss) == grpc::StatusCode::DATA_LOSS);

grpc::Status ToGrpc(const Status& s, const v1::GenerateRequest& req, double retry_seconds) {
  switch (s.code()) {
    case Code::kOk:
      return grpc::Status::OK;
    case Code::kInvalidArgument:
      if (!s.field().empty()) {
        const std::string field = ProtoField(s.field(), req);
        const std::string& m = s.message();
        const std::string text =
            m.rfind(s.field() + ": ", 0) == 0 ? m.substr(s.field().size() + 2) : m;
        return BadField(field, text);
      }
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, s.message());
    case Code::kNotFound:
      return grpc::Status(grpc::StatusCode::NOT_FOUND, s.message());
    case Code::kResourceExhausted:
      return Overloaded(s.message(), retry_seconds);
    case Code::kCancelled:
      return grpc::Status(grpc::StatusCode::CANCELLED, s.message());
    case Code::kDeadlineExceeded:
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, s.message());
    case Code::kUnavailable:
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, s.message());
    case Code::kFailedPrecondition:
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, s.message());
    case Code::kDataLoss:
    case Code::kInternal:
    case Code::kPermissionDenied:  // the daemon's own files: not the client's permission
      break;
  }
  return grpc::Status(grpc::StatusCode::INTERNAL, s.message());
}

std::string MethodLabel(const v1::GenerateRequest& req, const std::string& default_method) {
  if (AnyPolicyPart(req)) return "custom";
  const std::string& m = req.method().empty() ? default_method : req.method();
  for (const auto& p : PresetNames()) {
    if (p == m) return m;
  }
  for (const auto& p : ContinuousPresetNames()) {
    if (p == m) return m;
  }
  return "unknown";
}

std::string DefaultMethodFor(const std::vector<ModelInfo>& models, const std::string& model,
                             const std::string& default_method) {
  for (size_t i = 0; i < models.size(); ++i) {
    if ((model.empty() && i == 0) || models[i].name == model) {
      return models[i].continuous ? "mar" : default_method;
    }
  }
  return default_method;
}

grpc::Status ToParams(const v1::GenerateRequest& req, const std::string& default_method,
                      GenerateParams* out) {
  out->model = req.model();
  if (!req.prompt().empty() && req.prompt_token_ids_size() > 0) {
    return BadField("prompt_token_ids", "set prompt or prompt_token_ids, not both");
  }
  for (int32_t id : req.prompt_token_ids()) {
    if (id < 0) return BadField("prompt_token_ids", "ids must be >= 0");
    out->prompt_token_ids.push_back(id);
  }
  if (!req.negative_prompt().empty() && req.negative_prompt_token_ids_size() > 0) {
    return BadField("negative_prompt_token_ids",
                    "set negative_prompt or negative_prompt_token_ids, not both");
  }
  for (int32_t id : req.negative_prompt_token_ids()) {
    if (id < 0) return BadField("negative_prompt_token_ids", "ids must be >= 0");
    out->negative_prompt_token_ids.push_back(id);
  }
  switch (req.class_case()) {
    case v1::GenerateRequest::kClassId:
      if (req.class_id() < 0) return BadField("class_id", "must be >= 0");
      out->class_id = req.class_id();
      break;
    case v1::GenerateRequest::kClassName:
      if (req.class_name().empty()) return BadField("class_name", "must not be empty");
      out->class_name = req.class_name();
      break;
    default:  // none: the engine names what the model needs (a class, or a prompt)
      break;
  }
  if (req.has_seed()) out->seed = req.seed();
  if (req.has_cfg_scale()) out->cfg_scale = req.cfg_scale();
  if (req.has_temperature()) out->temperature = req.temperature();
  if (req.has_top_k()) out->top_k = req.top_k();
  if (req.has_top_p()) out->top_p = req.top_p();
  if (req.has_cfg_interval()) out->cfg_interval = req.cfg_interval();
  if (req.has_window() && req.window() < 1) return BadField("window", "must be >= 1");
  const std::string method = req.method().empty() ? default_method : req.method();
  StatusOr<DecodingPolicy> pol = PolicyFromPreset(method, req.has_window() ? req.window() : 0);
  if (!pol.ok()) return ToGrpc(pol.status(), req, 0);
  DecodingPolicy& p = *pol;
  if (req.has_policy()) {
    const v1::DecodingPolicy& q = req.policy();
    switch (q.draft()) {
      case v1::DRAFT_SOURCE_UNSPECIFIED:
        break;
      case v1::DRAFT_SOURCE_NONE:
        p.draft = DraftSource::kNone;
        break;
      case v1::DRAFT_SOURCE_JACOBI:
        p.draft = DraftSource::kJacobi;
        break;
      case v1::DRAFT_SOURCE_DRAFT_MODEL:
        p.draft = DraftSource::kDraftModel;
        break;
      default:
        return BadField("policy.draft", "unknown value " + std::to_string(q.draft()));
    }
    switch (q.coupling()) {
      case v1::COUPLING_UNSPECIFIED:
        break;
      case v1::COUPLING_INDEPENDENT:
        p.coupling = Coupling::kIndependent;
        break;
      case v1::COUPLING_MAXIMAL:
        p.coupling = Coupling::kMaximal;
        break;
      case v1::COUPLING_GUMBEL:
        p.coupling = Coupling::kGumbel;
        break;
      default:
        return BadField("policy.coupling", "unknown value " + std::to_string(q.coupling()));
    }
    switch (q.acceptance()) {
      case v1::ACCEPTANCE_UNSPECIFIED:
        break;
      case v1::ACCEPTANCE_EXACT:
        p.acceptance = Acceptance::kExact;
        break;
      case v1::ACCEPTANCE_GROUPED:
        p.acceptance = Acceptance::kGrouped;
        break;
      case v1::ACCEPTANCE_RELAXED:
        p.acceptance = Acceptance::kRelaxed;
        break;
      case v1::ACCEPTANCE_MATCH:
        p.acceptance = Acceptance::kMatch;
        break;
      default:
        return BadField("policy.acceptance", "unknown value " + std::to_string(q.acceptance()));
    }
    if (q.has_tree_branches()) p.tree_branches = q.tree_branches();
    if (q.has_tree_depth()) p.tree_depth = q.tree_depth();
    if (q.has_uniform_init_q()) p.uniform_init_q = q.uniform_init_q();
    if (q.has_gsd_group()) p.gsd_group = q.gsd_group();
    if (q.has_gsd_delta()) p.gsd_delta = q.gsd_delta();
    if (q.has_gsd_distance()) p.gsd_distance = q.gsd_distance();
    if (q.has_cool_delta()) p.cool_delta = q.cool_delta();
    if (q.has_cool_nu()) p.cool_nu = q.cool_nu();
    if (AnyPolicyPart(req)) p.preset = "custom";
  }
  if (req.has_continuous()) {
    const v1::ContinuousOptions& c = req.continuous();
    ContinuousPolicy& cp = p.cont;
    if (c.has_num_iter()) {
      if (c.num_iter() < 1) return BadField("continuous.num_iter", "must be >= 1");
      cp.num_iter = c.num_iter();
    }
    if (c.cfg_schedule() == "linear") {
      cp.cfg_schedule = 1;
    } else if (c.cfg_schedule() == "constant") {
      cp.cfg_schedule = 0;
    } else if (!c.cfg_schedule().empty()) {
      return BadField("continuous.cfg_schedule", "must be linear or constant");
    }
    if (c.has_final_noise()) cp.final_noise = c.final_noise();
    if (c.has_prefill()) cp.prefill = c.prefill();
    if (c.has_trajectory_alignment()) cp.aligned = c.trajectory_alignment();
    if (c.has_inner_temperature()) cp.inner_temperature = c.inner_temperature();
    cp.invert_sigma = c.invert_sigma();
    if (c.has_residual_rounds()) cp.residual_rounds = c.residual_rounds();
    cp.zero_fallback = c.zero_fallback();
    cp.draft_mean = c.draft_mean();
    cp.verified_context = c.verified_context();
  }
  out->policy = p;
  if (req.preview_every() < 0 || req.preview_every() > 1000) {
    return BadField("preview_every", "must be in [0, 1000]");
  }
  out->preview_every = req.preview_every();
  out->stream_drafts = req.stream_drafts();
  if (req.user().size() > 256) {
    return BadField("user", "at most 256 bytes, got " + std::to_string(req.user().size()));
  }
  out->priority = req.priority();
  const v1::OutputOptions& o = req.output();
  if (o.format() != v1::IMAGE_FORMAT_UNSPECIFIED && o.format() != v1::IMAGE_FORMAT_PNG &&
      o.format() != v1::IMAGE_FORMAT_NONE) {
    return BadField("output.format", "unknown value " + std::to_string(o.format()));
  }
  out->decode_image = o.format() != v1::IMAGE_FORMAT_NONE;
  if (o.scale() < 0 || o.scale() > 16) return BadField("output.scale", "must be in [0, 16]");
  return grpc::Status::OK;
}

std::string ClientOf(const std::string& user, const std::string& address) {
  return user.empty() ? address : "user:" + user;
}

int OutputScale(const v1::GenerateRequest& req) { return std::max(req.output().scale(), 1); }

int MaxScale(const ModelInfo& model) {
  const int64_t side = std::max<int64_t>({model.image_width, model.image_height, 1});
  return static_cast<int>(std::clamp<int64_t>(kMaxOutputSide / side, 1, 16));
}

grpc::Status FillResponse(const RequestResult& r, int scale, bool include_tokens,
                          double total_seconds, v1::GenerateResponse* resp) {
  if (!r.image.empty()) {
    StatusOr<std::string> png = EncodePng(r.image, scale);
    if (!png.ok()) return grpc::Status(grpc::StatusCode::INTERNAL, png.status().ToString());
    resp->set_image_png(std::move(png).value());
    resp->set_width(static_cast<int32_t>(r.image.width * scale));
    resp->set_height(static_cast<int32_t>(r.image.height * scale));
    resp->set_channels(static_cast<int32_t>(r.image.channels));
  }
  if (include_tokens) {
    for (int32_t t : r.tokens) resp->add_tokens(t);
  }
  resp->set_grid(static_cast<int32_t>(r.grid));
  v1::GenerationStats* s = resp->mutable_stats();
  s->set_seed(r.seed);
  s->set_model(r.model);
  s->set_class_id(static_cast<int32_t>(r.class_id));
  s->set_method(r.policy.preset);
  s->set_policy(DescribePolicy(r.policy));
  s->set_cfg_scale(r.sampling.cfg_scale);
  s->set_temperature(r.sampling.temperature);
  s->set_top_k(static_cast<int32_t>(r.sampling.top_k));
  s->set_top_p(r.sampling.top_p);
  s->set_cfg_interval(static_cast<int32_t>(r.sampling.cfg_interval));
  const RequestStats& st = r.stats;
  s->set_nfe(st.counters.nfe);
  s->set_draft_forwards(st.counters.draft_forwards);
  s->set_drafts_verified(st.counters.drafts_verified);
  s->set_drafts_accepted(st.counters.drafts_accepted);
  s->set_acceptance_rate(st.acceptance_rate);
  s->set_step_compression(st.step_compression);
  for (int64_t h : st.accepted_length_histogram) s->add_accepted_length_histogram(h);
  s->set_queue_seconds(st.queue_seconds);
  s->set_generation_seconds(st.generation_seconds);
  s->set_first_token_seconds(st.first_token_seconds);
  s->set_total_seconds(total_seconds);
  s->set_mean_window(st.mean_window);
  s->set_expected_tokens(st.expected_tokens);
  s->set_predicted_step_seconds(st.predicted_step_seconds);
  s->set_measured_step_seconds(st.measured_step_seconds);
  s->set_residual_rounds(st.residual_rounds);
  s->set_residual_fallbacks(st.residual_fallbacks);
  s->set_draft_target_sq_dist(st.draft_target_sq_dist);
  s->set_prompt_tokens(static_cast<int32_t>(r.prompt_tokens));
  s->set_prefill_forwards(st.prefill_forwards);
  s->set_preemptions(st.preemptions);
  s->set_decode_seconds(st.decode_seconds);
  return grpc::Status::OK;
}

void FillStep(const StepEvent& e, int scale, v1::StepUpdate* s) {
  s->set_step(static_cast<int32_t>(e.step));
  for (int32_t p : e.positions) s->add_positions(p);
  for (int32_t t : e.tokens) s->add_tokens(t);
  for (int32_t p : e.draft_positions) s->add_draft_positions(p);
  for (int32_t t : e.draft_tokens) s->add_draft_tokens(t);
  s->set_committed(static_cast<int32_t>(e.totals.tokens));
  s->set_total(static_cast<int32_t>(e.total_tokens));
  s->set_nfe(e.totals.nfe);
  s->set_drafts_verified(e.totals.drafts_verified);
  s->set_drafts_accepted(e.totals.drafts_accepted);
  s->set_window(static_cast<int32_t>(e.window));
  if (!e.preview.empty()) {
    StatusOr<std::string> png = EncodePng(e.preview, scale);
    if (png.ok()) s->set_preview_png(std::move(png).value());  // a preview is best effort
  }
}

void FillModels(const std::vector<ModelInfo>& models, const std::string& default_method,
                v1::ListModelsResponse* resp) {
  resp->set_default_method(default_method);
  for (const ModelInfo& m : models) {
    v1::ModelInfo* p = resp->add_models();
    p->set_name(m.name);
    p->set_grid(static_cast<int32_t>(m.grid));
    p->set_vocab_size(static_cast<int32_t>(m.vocab_size));
    p->set_image_width(static_cast<int32_t>(m.image_width));
    p->set_image_height(static_cast<int32_t>(m.image_height));
    p->set_channels(static_cast<int32_t>(m.channels));
    for (int64_t c = 0; c < m.num_classes; ++c) {
      v1::ClassInfo* ci = p->add_classes();
      ci->set_id(static_cast<int32_t>(c));
      if (c < static_cast<int64_t>(m.class_names.size())) ci->set_name(m.class_names[c]);
    }
    for (const auto& meth : m.methods) p->add_methods(meth);
    p->set_draft_model(m.draft_model);
    v1::SamplingDefaults* d = p->mutable_sampling_defaults();
    d->set_cfg_scale(m.sampling_defaults.cfg_scale);
    d->set_temperature(m.sampling_defaults.temperature);
    d->set_top_k(static_cast<int32_t>(m.sampling_defaults.top_k));
    d->set_top_p(m.sampling_defaults.top_p);
    p->set_max_window(static_cast<int32_t>(m.max_window));
    p->set_kv_slots(static_cast<int32_t>(m.kv_slots));
    p->set_continuous(m.continuous);
    p->set_token_dim(static_cast<int32_t>(m.token_dim));
    p->set_default_num_iter(static_cast<int32_t>(m.default_num_iter));
    p->set_prompted(m.prompted);
    p->set_max_prompt_len(static_cast<int32_t>(m.max_prompt_len));
    p->set_text_vocab_size(static_cast<int32_t>(m.text_vocab_size));
    p->set_prompt_template(m.prompt_template);
    p->set_text_prompts(!m.text_tokenizer_path.empty());
  }
}

}  // namespace imagegen::server
