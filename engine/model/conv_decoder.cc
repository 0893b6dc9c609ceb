#include "engine/model/conv_decoder.h"

#include <ATen/ATen.h>

#include <cmath>

namespace imagegen {

Status CheckConvDecoderSpec(const ConvDecoderSpec& c, int64_t image_size,
                            const std::string& where) {
  auto bad = [&](const std::string& what) { return FailedPrecondition(where + ": " + what); };
  if (c.z_channels <= 0 || c.ch <= 0 || c.num_res_blocks < 0 || c.out_channels <= 0 ||
      c.num_groups <= 0 || c.ch_mult.empty()) {
    return bad("decoder sizes must be positive and 'ch_mult' non-empty");
  }
  if (c.z_channels > 65536 || c.ch > 65536 || c.num_res_blocks > 64 || c.out_channels > 4 ||
      image_size > 8192) {
    return bad("decoder sizes out of range");
  }
  for (int64_t m : c.ch_mult) {
    if (m <= 0 || m > 64 || (c.ch * m) % c.num_groups != 0) {
      return bad("every ch * ch_mult entry must be a positive multiple of 'num_groups'");
    }
  }
  if (c.ch_mult.size() > 8 || image_size <= 0 ||
      image_size % (int64_t{1} << (c.ch_mult.size() - 1)) != 0) {
    return bad("the image size must be divisible by 2^(len(ch_mult) - 1)");
  }
  return OkStatus();
}

StatusOr<ConvDecoder> ConvDecoder::Load(WeightStore& store, const ConvDecoderSpec& spec,
                                        const LoadOptions& opts) {
  ConvDecoder m;
  m.num_groups_ = spec.num_groups;
  const bool ldm = spec.naming == ConvDecoderSpec::Naming::kLdm;
  auto conv = [&](const std::string& name, int64_t cout, int64_t cin, int64_t k,
                  Conv& out) -> Status {
    ASSIGN_OR_RETURN(out.w, store.Take(name + ".weight", {cout, cin, k, k}, opts));
    ASSIGN_OR_RETURN(out.b, store.Take(name + ".bias", {cout}, opts));
    return OkStatus();
  };
  auto norm = [&](const std::string& name, int64_t c, Norm& out) -> Status {
    ASSIGN_OR_RETURN(out.w, store.Take(name + ".weight", {c}, opts));
    ASSIGN_OR_RETURN(out.b, store.Take(name + ".bias", {c}, opts));
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

  const auto n = static_cast<int64_t>(spec.ch_mult.size());
  int64_t c = spec.ch * spec.ch_mult.back();
  RETURN_IF_ERROR(conv("decoder.conv_in", c, spec.z_channels, 3, m.conv_in_));
  RETURN_IF_ERROR(res(ldm ? "decoder.mid.block_1" : "decoder.mid.0", c, c, m.mid_res0_));
  RETURN_IF_ERROR(attn(ldm ? "decoder.mid.attn_1" : "decoder.mid.1", c, m.mid_attn_));
  RETURN_IF_ERROR(res(ldm ? "decoder.mid.block_2" : "decoder.mid.2", c, c, m.mid_res1_));
  for (int64_t i = 0; i < n; ++i) {
    // LDM numbers levels by resolution (up.0 is the highest); LlamaGen in execution order.
    const std::string p = ldm ? "decoder.up." + std::to_string(n - 1 - i)
                              : "decoder.conv_blocks." + std::to_string(i);
    const std::string res_name = ldm ? ".block." : ".res.";
    const int64_t cout = spec.ch * spec.ch_mult[n - 1 - i];
    Level lv;
    for (int64_t j = 0; j <= spec.num_res_blocks; ++j) {
      Res r;
      RETURN_IF_ERROR(res(p + res_name + std::to_string(j), c, cout, r));
      lv.res.push_back(std::move(r));
      c = cout;
      if (i == 0 && spec.attn_at_lowest_level) {
        Attn a;
        RETURN_IF_ERROR(attn(p + ".attn." + std::to_string(j), c, a));
        lv.attn.push_back(std::move(a));
      }
    }
    if (i != n - 1) RETURN_IF_ERROR(conv(p + ".upsample.conv", c, c, 3, lv.upsample));
    m.levels_.push_back(std::move(lv));
  }
  RETURN_IF_ERROR(norm("decoder.norm_out", c, m.norm_out_));
  RETURN_IF_ERROR(conv("decoder.conv_out", spec.out_channels, c, 3, m.conv_out_));
  return m;
}

at::Tensor ConvDecoder::GroupNorm(const at::Tensor& x, const Norm& n) const {
  return at::group_norm(x, num_groups_, n.w, n.b, 1e-6);
}

at::Tensor ConvDecoder::ResForward(const at::Tensor& x, const Res& r) const {
  const auto pad = std::vector<int64_t>{1, 1};
  at::Tensor h = at::conv2d(at::silu(GroupNorm(x, r.norm1)), r.conv1.w, r.conv1.b, 1, pad);
  h = at::conv2d(at::silu(GroupNorm(h, r.norm2)), r.conv2.w, r.conv2.b, 1, pad);
  at::Tensor skip = r.nin.w.defined() ? at::conv2d(x, r.nin.w, r.nin.b) : x;
  return skip + h;
}

at::Tensor ConvDecoder::AttnForward(const at::Tensor& x, const Attn& a) const {
  const int64_t b = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
  at::Tensor y = GroupNorm(x, a.norm);
  at::Tensor q = at::conv2d(y, a.q.w, a.q.b).reshape({b, c, h * w}).transpose(1, 2);
  at::Tensor k = at::conv2d(y, a.k.w, a.k.b).reshape({b, c, h * w});
  at::Tensor v = at::conv2d(y, a.v.w, a.v.b).reshape({b, c, h * w});
  at::Tensor attn = at::softmax(at::bmm(q, k) * std::pow(static_cast<double>(c), -0.5), 2);
  at::Tensor o = at::bmm(v, attn.transpose(1, 2)).reshape({b, c, h, w});
  return x + at::conv2d(o, a.proj.w, a.proj.b);
}

at::Tensor ConvDecoder::Forward(const at::Tensor& z) const {
  const auto pad = std::vector<int64_t>{1, 1};
  at::Tensor h = at::conv2d(z, conv_in_.w, conv_in_.b, 1, pad);
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

}  // namespace imagegen
