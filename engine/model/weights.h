// WeightStore: the tensors of one model directory (all *.safetensors in it), handed out by
// name with shape checks, converted to the model's device and dtype.
//
// Errors name the directory and the tensor: missing tensors, shape mismatches, non-float
// data where floats are expected, and, at Finish(), tensors the model did not use. Not
// thread-safe; used only while a model loads.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "engine/model/safetensors.h"
#include "engine/util/json.h"
#include "engine/util/status.h"

namespace imagegen {

struct LoadOptions {
  c10::Device device = c10::Device(c10::kCPU);
  // Compute dtype for float weights (fp32 on CPU; bf16/fp16 on CUDA where supported).
  at::ScalarType dtype = at::kFloat;
  // GPT models: the static-shape forward (the one CUDA graphs capture) runs each layer through
  // fewer, fused kernels: rms_norm (one kernel on CUDA, where the reference RMSNorm is eight),
  // the rotary embedding as one complex multiply (LlamaGen's own formulation), the gate and up
  // projections of the MLP as one GEMM (w1 and w3 become views of their concatenation: no
  // more memory), and the residual adds in the output GEMMs (addmm_). Its logits equal the
  // reference layer's within rounding. Unset: on CUDA devices only (the CPU's eager forward,
  // which the golden grids and LlamaGen parity pin, never runs it either way).
  std::optional<bool> fused_static_forward;
  // With the fused layer, for LlamaGen-layout models in fp32 or bf16: the rotary embedding and
  // the writes of each layer's new queries, keys and values in one kernel
  // (kernels/rope_scatter.h; the same arithmetic on the CPU's host path) instead of six
  // launches. The same values as the fused layer's, within a rounding of the complex multiply.
  // Unset: on where the environment has IMAGEGEN_ROPE_SCATTER=1, off otherwise (the kernel has
  // not yet run on a GPU: bench/gpu/graphs_lease.sh measures it).
  std::optional<bool> rope_scatter;
  // GPT models on the CPU in fp32: the forward's attention runs every row in one call of a
  // kernel whose outputs are each computed from their own row alone
  // (engine/model/row_attention.h), instead of one SDPA call per row group on copies of its
  // keys and values (batch-invariant forwards) or one SDPA call over the batch padded to its
  // longest row (the others, since 2026-12-07). Its logits equal SDPA's within rounding, not
  // bit for bit. Unset: on. The golden grids (tests/golden) were recorded with it off.
  std::optional<bool> row_attention;
  // GPT models on the CPU in fp32: the batch-invariant forward's linear layers on fewer than
  // kInvariantMinRows rows run SmallRowsLinear's kernel (engine/model/small_gemm.h), which
  // rounds them exactly as the BLAS rounds them among 16 or more (checked per weight at load:
  // a weight it does not reproduce keeps the padded product), instead of the BLAS on the rows
  // padded to 16; and on more rows too, up to where the kernel was timed faster than the BLAS
  // at load (SmallRowsLinear::Prepare). The same logits bit for bit, faster for a few rows; a
  // second copy of the linear weights (models of up to kSmallGemmMaxWeightBytes of them).
  // Unset: on.
  std::optional<bool> small_rows_gemm;
  // The most rows the few-row kernel takes: 0, what Prepare's timing at load chose (at most
  // kSmallRowsMeasuredMax); more, that many; -1, fewer than 16 only (SmallRowsLinear::
  // tile_rows; as before the timing). For A/B comparisons: any count gives the same bits.
  int64_t small_rows_gemm_rows = 0;
  // GPT models on the CPU in fp32, the eager forward: every linear layer's product runs
  // SmallRowsLinear's kernel (SmallRowsLinear::EveryRow), at every row count and any model size,
  // never the BLAS. Batch-invariant by construction: no padding of a few rows to 16, no check
  // against the BLAS's rounding, which the kernel cannot reproduce for some widths (GPT-L's K of
  // 1,024 and 2,816 against MKL on the dev VM) and does not even try to above
  // kSmallGemmMaxWeightBytes. Other logits than the BLAS's (fp32 rounding: other images for a
  // seed than the default), a second, packed copy of the linear weights; needs small_rows_gemm
  // (not off) and a CPU the kernel runs on (SmallRowsLinear::Supported). Off by default.
  bool engine_linear = false;
  // GPT models on the CPU in fp32: the reference layer's RMSNorm (six ATen ops) and rotary
  // embedding (about ten) each run as one kernel that computes the same bits (engine/model/
  // norm_rope.h; checked at load, and the ops kept where the check fails). Unset: on.
  std::optional<bool> fused_norm_rope;
  // GPT models on the CPU in fp32, the eager forward (the one the CPU serves): every linear
  // layer's product in bf16 on the AMX tiles (engine/model/amx_gemm.h: x and the weight rounded
  // to bf16, sums in fp32), for any number of rows, instead of the few-row kernel and the BLAS
  // in fp32. A matmul precision of "medium" in PyTorch's terms: other logits than fp32's (by
  // bf16's rounding), batch-invariant by construction, about 2-4x faster products on the dev
  // VM's Xeon. A bf16 copy of the linear weights. Where the CPU or the kernel has no AMX, the
  // products stay fp32 (Gpt::bf16_matmul_linears() says 0). Off by default.
  bool bf16_matmul = false;
};

// Reads and parses <dir>/config.json.
StatusOr<Json> ReadModelConfig(const std::string& dir);

class WeightStore {
 public:
  static StatusOr<std::unique_ptr<WeightStore>> Open(const std::string& dir);

  // The tensor `name`, checked against `shape`, as a float tensor of `dtype` on `device`.
  StatusOr<at::Tensor> Take(const std::string& name, const std::vector<int64_t>& shape,
                            const LoadOptions& opts, bool keep_fp32 = false);
  bool Has(const std::string& name) const;

  // Fails if a tensor was never taken, unless its name starts with one of `ignored_prefixes`
  // (an entry "*text" instead ignores names containing text).
  Status Finish(const std::vector<std::string>& ignored_prefixes) const;

  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::set<std::string> taken_;
};

std::string ShapeString(const std::vector<int64_t>& shape);

}  // namespace imagegen
