// The rotary embedding and the scatters of a layer of the static forward (Gpt::StaticForward
// with LoadOptions::rope_scatter) in one pass. From the layer's qkv projection, every token's
// query and key rotated by its position's (cos, sin), LlamaGen's complex multiply in float32:
//
//   (x0, x1) -> (x0 c - x1 s, x0 s + x1 c)   for each pair (2i, 2i + 1) of a head's elements
//
// then the query written to its row of attention's query buffer and the key and value to the
// token's cache entry. It replaces ApplyRopeComplex (a cast to float32, the complex multiply and
// a cast back: three kernels in bf16) and three index_copy_ (key, value, query): six launches a
// layer, one here. The arithmetic is ATen's complex multiply (two products, then their sum or
// difference, each rounded; rope_scatter.cu is built without fused multiply-adds), so the host
// path and the kernel agree bit for bit and both agree with ATen's where it rounds so too.
// Header-only and free of CUDA: the engine's CPU path and the tests include it.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/philox_rounds.h"  // IMAGEGEN_HD

namespace imagegen::kernels {

enum class RopeDtype : int32_t { kFloat32 = 0, kBFloat16 = 1 };

struct RopeScatterArgs {
  // [tokens, row_stride] elements of `dtype`: each token's query, key and value ([heads,
  // head_dim] each) at columns 0, heads * head_dim and 2 * heads * head_dim.
  const void* qkv = nullptr;
  int64_t row_stride = 0;
  const float* table = nullptr;  // [tokens, head_dim / 2, 2]: cos and sin of the token's position
  const int64_t* dst = nullptr;  // [tokens]: the cache entry (slot * capacity + position)
  const int64_t* qin = nullptr;  // [tokens]: the query buffer's row
  void* k_cache = nullptr;       // [entries, heads, head_dim] of `dtype`, contiguous
  void* v_cache = nullptr;
  void* queries = nullptr;  // [rows, heads, head_dim] of `dtype`, contiguous
  int64_t tokens = 0, heads = 0, head_dim = 0;
  RopeDtype dtype = RopeDtype::kFloat32;
};

// bfloat16 as c10::BFloat16 converts: the upper half of the float32's bits, rounded to nearest
// even; NaN to the canonical quiet NaN.
IMAGEGEN_HD float RopeBf16ToFloat(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
IMAGEGEN_HD uint16_t RopeFloatToBf16(float f) {
  if (f != f) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>((u + 0x7FFFU + ((u >> 16) & 1U)) >> 16);
}

IMAGEGEN_HD float RopeLoad(const void* p, int64_t i, RopeDtype d) {
  return d == RopeDtype::kBFloat16 ? RopeBf16ToFloat(static_cast<const uint16_t*>(p)[i])
                                   : static_cast<const float*>(p)[i];
}
IMAGEGEN_HD void RopeStore(void* p, int64_t i, float v, RopeDtype d) {
  if (d == RopeDtype::kBFloat16) {
    static_cast<uint16_t*>(p)[i] = RopeFloatToBf16(v);
  } else {
    static_cast<float*>(p)[i] = v;
  }
}

// One unit of work: token t, head h, pair i of the head's elements. Its query and key pairs
// rotated and written, its value pair copied.
IMAGEGEN_HD void RopeScatterUnit(const RopeScatterArgs& a, int64_t unit) {
  const int64_t half = a.head_dim / 2;
  const int64_t i = unit % half;
  const int64_t h = (unit / half) % a.heads;
  const int64_t t = unit / (half * a.heads);
  const int64_t width = a.heads * a.head_dim;  // D
  const int64_t e = h * a.head_dim + 2 * i;    // the pair's first element within [heads, head_dim]
  const int64_t in = t * a.row_stride + e;
  const float c = a.table[(t * half + i) * 2], s = a.table[(t * half + i) * 2 + 1];
  const int64_t q_out = a.qin[t] * width + e, kv_out = a.dst[t] * width + e;
  for (int part = 0; part < 2; ++part) {  // query, key
    const float x0 = RopeLoad(a.qkv, in + part * width, a.dtype);
    const float x1 = RopeLoad(a.qkv, in + part * width + 1, a.dtype);
    const float ac = x0 * c, bd = x1 * s, ad = x0 * s, bc = x1 * c;
    void* out = part == 0 ? a.queries : a.k_cache;
    const int64_t o = part == 0 ? q_out : kv_out;
    RopeStore(out, o, ac - bd, a.dtype);
    RopeStore(out, o + 1, ad + bc, a.dtype);
  }
  // The value as is, bit for bit.
  for (int64_t j = 0; j < 2; ++j) {
    if (a.dtype == RopeDtype::kBFloat16) {
      static_cast<uint16_t*>(a.v_cache)[kv_out + j] =
          static_cast<const uint16_t*>(a.qkv)[in + 2 * width + j];
    } else {
      static_cast<float*>(a.v_cache)[kv_out + j] =
          static_cast<const float*>(a.qkv)[in + 2 * width + j];
    }
  }
}

IMAGEGEN_HD int64_t RopeScatterUnits(const RopeScatterArgs& a) {
  return a.tokens * a.heads * (a.head_dim / 2);
}

// The host path: every unit in turn.
inline void RopeScatterOnHost(const RopeScatterArgs& a) {
  const int64_t n = RopeScatterUnits(a);
  for (int64_t u = 0; u < n; ++u) RopeScatterUnit(a, u);
}

// The kernel (rope_scatter.cu) on `stream` (a cudaStream_t; null: the legacy default stream);
// returns the cudaError_t of the launch (0: success).
int LaunchRopeScatter(const RopeScatterArgs& args, void* stream);

}  // namespace imagegen::kernels
