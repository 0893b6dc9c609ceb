#include "engine/model/vq_decoder.h"

#include <ATen/ATen.h>

// The complete Json type: ReadModelConfig returns one by value (json.h only declares it).
#include <nlohmann/json.hpp>

namespace imagegen {

StatusOr<VqConfig> ParseVqConfig(const Json& json, const std::string& where) {
  JsonFields f(json, where);
  VqConfig c;
  ASSIGN_OR_RETURN(std::string type, f.String("type", "llamagen-vq"));
  if (type != "llamagen-vq") {
    return FailedPrecondition(where + ": 'type' is \"" + type + "\", expected \"llamagen-vq\"");
  }
  ASSIGN_OR_RETURN(c.codebook_size, f.Int("codebook_size"));
  ASSIGN_OR_RETURN(c.codebook_embed_dim, f.Int("codebook_embed_dim"));
  ASSIGN_OR_RETURN(c.codebook_l2_norm, f.Bool("codebook_l2_norm", true));
  ASSIGN_OR_RETURN(c.z_channels, f.Int("z_channels"));
  ASSIGN_OR_RETURN(c.ch, f.Int("ch"));
  ASSIGN_OR_RETURN(c.ch_mult, f.IntList("ch_mult"));
  ASSIGN_OR_RETURN(c.num_res_blocks, f.Int("num_res_blocks"));
  ASSIGN_OR_RETURN(c.out_channels, f.Int("out_channels", 3));
  ASSIGN_OR_RETURN(c.num_groups, f.Int("num_groups", 32));
  ASSIGN_OR_RETURN(c.image_size, f.Int("image_size"));
  auto bad = [&](const std::string& what) { return FailedPrecondition(where + ": " + what); };
  if (c.codebook_size <= 0 || c.codebook_embed_dim <= 0 || c.z_channels <= 0 || c.ch <= 0 ||
      c.num_res_blocks < 0 || c.out_channels <= 0 || c.num_groups <= 0 || c.ch_mult.empty()) {
    return bad("VQ sizes must be positive and 'ch_mult' non-empty");
  }
  if (c.codebook_size > (1 << 22) || c.codebook_embed_dim > 4096 || c.z_channels > 65536 ||
      c.ch > 65536 || c.num_res_blocks > 64 || c.out_channels > 4 || c.image_size > 8192) {
    return bad("VQ sizes out of range");
  }
  for (int64_t m : c.ch_mult) {
    if (m <= 0 || m > 64 || (c.ch * m) % c.num_groups != 0) {
      return bad("every ch * ch_mult entry must be a positive multiple of 'num_groups'");
    }
  }
  if (c.ch_mult.size() > 8 || c.image_size <= 0 ||
      c.image_size % (int64_t{1} << (c.ch_mult.size() - 1)) != 0) {
    return bad("'image_size' must be divisible by 2^(len(ch_mult) - 1)");
  }
  return c;
}

StatusOr<std::unique_ptr<VqDecoder>> VqDecoder::Load(const std::string& dir,
                                                     const LoadOptions& load_opts) {
  try {
    return LoadImpl(dir, load_opts);
  } catch (const c10::Error& e) {
    return ResourceExhausted(
        dir + ": loading failed in LibTorch (out of memory?): " + e.what_without_backtrace());
  }
}

StatusOr<std::unique_ptr<VqDecoder>> VqDecoder::LoadImpl(const std::string& dir,
                                                         const LoadOptions& load_opts) {
  ASSIGN_OR_RETURN(Json json, ReadModelConfig(dir));
  ASSIGN_OR_RETURN(VqConfig cfg, ParseVqConfig(json, dir + "/config.json"));
  ASSIGN_OR_RETURN(auto store, WeightStore::Open(dir));
  LoadOptions opts = load_opts;
  opts.dtype = at::kFloat;  // the VQ never runs in reduced precision (models.md 2)
  std::unique_ptr<VqDecoder> m(new VqDecoder());
  m->cfg_ = cfg;
  m->opts_ = opts;
  auto conv = [&](const std::string& name, int64_t cout, int64_t cin, int64_t k,
                  Conv& out) -> Status {
    ASSIGN_OR_RETURN(out.w, store->Take(name + ".weight", {cout, cin, k, k}, opts));
    ASSIGN_OR_RETURN(out.b, store->Take(name + ".bias", {cout}, opts));
    return OkStatus();
  };
  auto norm = [&](const std::string& name, int64_t c, Norm& out) -> Status {
    ASSIGN_OR_RETURN(out.w, store->Take(name + ".weight", {c}, opts));
    ASSIGN_OR_RETURN(out.b, store->Take(name + ".bias", {c}, opts));
    return OkStatus();
  };
  auto res = [&](const std::string& name, int64_t cin, int64_t cout, Res& out) -> Status {
    RETURN_IF_ERROR(norm(name + ".norm1", cin, out.norm1));
    RETURN_IF_ERROR(conv(name + ".conv1", cout, cin, 3, out.conv1));
    RETURN_IF_ERROR(norm(name + ".norm2", cout, out.norm2));
    RETURN_IF_ERROR(conv(name + ".conv2", cout, cout, 3, out.conv2));
    if (cin != cout) RETURN_IF_ERROR(conv(name + ".nin_shortcut", cout, cin, 1, out.nin));
    return OkStatus();
  };
  auto attn = [&](const std::string& name, int64_t c, Attn& out) -> Status {
    RETURN_IF_ERROR(norm(name + ".norm", c, out.norm));
    RETURN_IF_ERROR(conv(name + ".q", c, c, 1, out.q));
    RETURN_IF_ERROR(conv(name + ".k", c, c, 1, out.k));
    RETURN_IF_ERROR(conv(name + ".v", c, c, 1, out.v));
    RETURN_IF_ERROR(conv(name + ".proj_out", c, c, 1, out.proj));
    return OkStatus();
  };

  ASSIGN_OR_RETURN(at::Tensor cb, store->Take("quantize.embedding.weight",
                                              {cfg.codebook_size, cfg.codebook_embed_dim}, opts));
  if (cfg.codebook_l2_norm) {
    cb = cb / cb.norm(2, {1}, /*keepdim=*/true).clamp_min(1e-12);
  }
  m->codebook_ = cb;
  RETURN_IF_ERROR(
      conv("post_quant_conv", cfg.z_channels, cfg.codebook_embed_dim, 1, m->post_quant_));
  const auto n = static_cast<int64_t>(cfg.ch_mult.size());
  int64_t c = cfg.ch * cfg.ch_mult.back();
  RETURN_IF_ERROR(conv("decoder.conv_in", c, cfg.z_channels, 3, m->conv_in_));
  RETURN_IF_ERROR(res("decoder.mid.0", c, c, m->mid_res0_));
  RETURN_IF_ERROR(attn("decoder.mid.1", c, m->mid_attn_));
  RETURN_IF_ERROR(res("decoder.mid.2", c, c, m->mid_res1_));
  for (int64_t i = 0; i < n; ++i) {
    const std::string p = "decoder.conv_blocks." + std::to_string(i);
    const int64_t cout = cfg.ch * cfg.ch_mult[n - 1 - i];
    Level lv;
    for (int64_t j = 0; j <= cfg.num_res_blocks; ++j) {
      Res r;
      RETURN_IF_ERROR(res(p + ".res." + std::to_string(j), c, cout, r));
      lv.res.push_back(std::move(r));
      c = cout;
      if (i == 0) {
        Attn a;
        RETURN_IF_ERROR(attn(p + ".attn." + std::to_string(j), c, a));
        lv.attn.push_back(std::move(a));
      }
    }
    if (i != n - 1) RETURN_IF_ERROR(conv(p + ".upsample.conv", c, c, 3, lv.upsample));
    m->levels_.push_back(std::move(lv));
  }
  RETURN_IF_ERROR(norm("decoder.norm_out", c, m->norm_out_));
  RETURN_IF_ERROR(conv("decoder.conv_out", cfg.out_channels, c, 3, m->conv_out_));
  // The encoder side is for training and tooling; the decoder ignores it.
  RETURN_IF_ERROR(store->Finish({"encoder.", "quant_conv.", "quantize.codebook_used"}));
  return m;
}

at::Tensor VqDecoder::GroupNorm(const at::Tensor& x, const Norm& n) const {
  return at::group_norm(x, cfg_.num_groups, n.w, n.b, 1e-6);
}

at::Tensor VqDecoder::ResForward(const at::Tensor& x, const Res& r) const {
  const auto pad = std::vector<int64_t>{1, 1};
  at::Tensor h = at::conv2d(at::silu(GroupNorm(x, r.norm1)), r.conv1.w, r.conv1.b, 1, pad);
  h = at::conv2d(at::silu(GroupNorm(h, r.norm2)), r.conv2.w, r.conv2.b, 1, pad);
  at::Tensor skip = r.nin.w.defined() ? at::conv2d(x, r.nin.w, r.nin.b) : x;
  return skip + h;
}

at::Tensor VqDecoder::AttnForward(const at::Tensor& x, const Attn& a) const {
  const int64_t b = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
  at::Tensor y = GroupNorm(x, a.norm);
  at::Tensor q = at::conv2d(y, a.q.w, a.q.b).reshape({b, c, h * w}).transpose(1, 2);
  at::Tensor k = at::conv2d(y, a.k.w, a.k.b).reshape({b, c, h * w});
  at::Tensor v = at::conv2d(y, a.v.w, a.v.b).reshape({b, c, h * w});
  at::Tensor attn = at::softmax(at::bmm(q, k) * std::pow(static_cast<double>(c), -0.5), 2);
  at::Tensor o = at::bmm(v, attn.transpose(1, 2)).reshape({b, c, h, w});
  return x + at::conv2d(o, a.proj.w, a.proj.b);
}

StatusOr<at::Tensor> VqDecoder::Decode(const at::Tensor& ids_in) const {
  try {
    return DecodeImpl(ids_in);
  } catch (const c10::Error& e) {
    return Internal(std::string("VQ decode failed in LibTorch: ") + e.what_without_backtrace());
  }
}

StatusOr<at::Tensor> VqDecoder::DecodeImpl(const at::Tensor& ids_in) const {
  const int64_t g = cfg_.grid();
  if (ids_in.dim() != 2 || ids_in.size(1) != g * g) {
    return InvalidArgument("VQ decode: ids must be [batch, " + std::to_string(g * g) + "]");
  }
  at::Tensor ids = ids_in.to(opts_.device, at::kLong);
  if (ids.numel() > 0 &&
      (ids.min().item<int64_t>() < 0 || ids.max().item<int64_t>() >= cfg_.codebook_size)) {
    return InvalidArgument("VQ decode: token id outside the codebook");
  }
  const int64_t b = ids.size(0);
  at::Tensor z = codebook_.index_select(0, ids.reshape({-1}))
                     .reshape({b, g, g, cfg_.codebook_embed_dim})
                     .permute({0, 3, 1, 2});
  const auto pad = std::vector<int64_t>{1, 1};
  at::Tensor h = at::conv2d(z, post_quant_.w, post_quant_.b);
  h = at::conv2d(h, conv_in_.w, conv_in_.b, 1, pad);
  h = ResForward(h, mid_res0_);
  h = AttnForward(h, mid_attn_);
  h = ResForward(h, mid_res1_);
  for (const Level& lv : levels_) {
    for (size_t j = 0; j < lv.res.size(); ++j) {
      h = ResForward(h, lv.res[j]);
      if (!lv.attn.empty()) h = AttnForward(h, lv.attn[j]);
    }
    if (lv.upsample.w.defined()) {
      h = at::upsample_nearest2d(h, {h.size(2) * 2, h.size(3) * 2});
      h = at::conv2d(h, lv.upsample.w, lv.upsample.b, 1, pad);
    }
  }
  h = at::silu(GroupNorm(h, norm_out_));
  return at::conv2d(h, conv_out_.w, conv_out_.b, 1, pad);
}

at::Tensor ImageToUint8(const at::Tensor& image) {
  return at::clamp(image.to(at::kFloat) * 127.5 + 128.0, 0, 255)
      .to(at::kByte)
      .permute({0, 2, 3, 1})
      .contiguous()
      .to(at::kCPU);
}

}  // namespace imagegen
