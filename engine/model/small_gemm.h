#pragma once

// Linear layers of a few rows for the batch-invariant forward on the CPU.
//
// The batch-invariant forward cannot hand the BLAS a matrix of fewer than kInvariantMinRows
// rows: MKL switches to other kernels for those, which round differently, so it pads them to
// 16 rows (about 4x the time of the rows themselves on the dev VM: a 2-row, 192 x 576 product
// 5 us, padded 21 us plus the padding's copies). SmallRowsLinear computes such rows itself,
// rounded exactly as the BLAS rounds the same rows in a matrix of 16 or more: each output as
// sequential fused multiply-adds over k, in the BLAS's blocks of k, the blocks' sums added in
// order. Which blocks the BLAS uses depends on its build and on the CPU, so Prepare finds them
// by comparing candidates bit for bit with at::linear on 16 rows, once per weight at load; where
// none reproduces it (another BLAS, a CPU without AVX2 and FMA, another architecture) it is not
// ok and the forward pads as before. Either way a row's logits are the same bits.
//
// EveryRow (LoadOptions::engine_linear, --cpu_linear=engine) gives up following the BLAS: fixed
// blocks, the kernel on every row count, so the forward never calls the BLAS and is
// batch-invariant by construction, for any width and any model size, at the price of its own
// rounding (other bits than the BLAS's where the BLAS blocks k otherwise).
//
// Where the kernel is also faster than the BLAS on 16 rows or more, it takes those too: the
// BLAS's speed on a few dozen rows differs between CPUs more than the kernel's (MKL on the dev
// VM's AVX-512 Xeon was as fast at 14 rows; on its AMD EPYC, AVX2 only, the kernel took
// 0.5-0.6x MKL's time at 16 rows and 0.8-0.9x at 64). So Prepare times both at 16, 32, 64, 128
// and 256 rows, once per weight shape in a process, and the kernel takes the rows up to where it
// stops being clearly faster (ChooseMaxRows), each count checked bit for bit against the BLAS.

#include <ATen/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "engine/util/status.h"

namespace imagegen {

// Models whose linear weights take more bytes than this keep the padded products (the kernel
// keeps a second, packed copy of every weight), unless the user asked for the kernel on every
// row count (EveryRow, LoadOptions::engine_linear).
inline constexpr int64_t kSmallGemmMaxWeightBytes = int64_t{512} << 20;

// Prepare times the kernel against the BLAS on up to this many rows.
inline constexpr int64_t kSmallRowsMeasuredMax = 256;

// One row count of Prepare's timing: the fastest of a few calls of each, and whether the
// kernel's rows were the BLAS's bits.
struct SmallRowsTiming {
  int64_t rows = 0;
  double kernel_seconds = 0, blas_seconds = 0;
  bool same_bits = false;
};

// One choice of Prepare's timing: the rows the kernel takes for a weight shape, k-blocking,
// tile width and intra-op thread count (SmallRowsLinear::MeasuredRows, RememberRows).
struct SmallRowsChoice {
  int64_t n = 0, k = 0;
  std::vector<int64_t> blocks;
  bool avx512 = false;
  int threads = 0;
  int64_t rows = 0;
  bool operator==(const SmallRowsChoice&) const = default;
};

// The choices as the engine keeps them in its cache directory (JSON), and back; errors name
// `where` and the field.
std::string SerializeSmallRowsChoices(const std::vector<SmallRowsChoice>& choices);
StatusOr<std::vector<SmallRowsChoice>> ParseSmallRowsChoices(const std::string& text,
                                                             const std::string& where);

class SmallRowsLinear {
 public:
  SmallRowsLinear() = default;
  // w [N, K]: CPU, fp32. Packs a copy of it (the same bytes again) and finds the k-blocking
  // that reproduces at::linear on 16 rows bit for bit; not ok() where none does. max_rows: the
  // most rows the forward gives the kernel; 0: measured (ChooseMaxRows over the timings at 16
  // to kSmallRowsMeasuredMax rows; once per weight shape, k-blocking, tile width and thread
  // count in a process, then reused); negative: tile_rows().
  static SmallRowsLinear Prepare(const at::Tensor& w, int64_t max_rows = 0);
  // The rows the kernel takes, from timings at ascending row counts from 16: the largest count
  // of the run of timings, from the first, where the kernel computed the BLAS's bits in at
  // most kFaster of the BLAS's time; `below` (the tile's own limit under 16 rows) where the
  // first timing fails. The margin keeps the BLAS where the two are within a noisy machine's
  // spread of each other.
  static constexpr double kFaster = 0.9;
  static int64_t ChooseMaxRows(const std::vector<SmallRowsTiming>& timings, int64_t below);
  // The kernel with the given k-blocks (summing to K), unchecked (tests); avx512 false: the
  // AVX2 tiles even where the CPU has AVX-512 (the same bits, which tests check).
  static SmallRowsLinear WithBlocks(const at::Tensor& w, std::vector<int64_t> blocks,
                                    bool avx512 = true);
  // The kernel for every row count, never the BLAS (LoadOptions::engine_linear): k-blocks of
  // kEveryRowBlock (the last the rest), not checked against the BLAS, so other bits than its
  // (fp32 rounding), the same for a row at any row count; max_rows() unbounded. Not ok where
  // !Supported().
  static SmallRowsLinear EveryRow(const at::Tensor& w);
  static constexpr int64_t kEveryRowBlock = 256;
  // The process's choices so far (measured or remembered), and choices to take instead of
  // timing: a later Prepare of a remembered shape takes its rows without measuring (a choice
  // already made in this process is replaced). The timing's choice can fall anywhere from 32
  // to 256 rows between two starts of a noisy machine where the kernel and the BLAS are close;
  // the engine keeps the choices beside its step-cost calibration, so that every start of one
  // machine gives the kernel the same rows (EngineOptions::cache_dir).
  static std::vector<SmallRowsChoice> MeasuredRows();
  static void RememberRows(const std::vector<SmallRowsChoice>& choices);
  // The kernel runs on this CPU: an x86-64 build, AVX2 and FMA.
  static bool Supported();

  bool ok() const { return !blocks_.empty(); }
  // Made by EveryRow: the forward gives it every row count, batch-invariant or not.
  bool every_row() const { return every_row_; }
  // The most rows the forward gives the kernel (more go to the BLAS, padded to 16 if fewer).
  // Where the kernel is not faster than the BLAS on 16 rows (or Prepare was not asked to
  // measure): every count below kInvariantMinRows with AVX-512 tiles; 11 with AVX2 ones, which
  // on the dev VM's Xeon took 0.64-0.67x the padded forward's time at 2-4 rows and 0.83-0.88x
  // at 8, but 1.03-1.11x at 14 (against MKL's AVX-512). Else what Prepare measured or was given.
  int64_t max_rows() const { return max_rows_ > 0 ? max_rows_ : tile_rows(); }
  // The limit below 16 rows (above).
  int64_t tile_rows() const;
  const std::vector<int64_t>& blocks() const { return blocks_; }
  // x [m, K] fp32 on the CPU (any m; the forward gives it up to max_rows()): x w^T.
  at::Tensor operator()(const at::Tensor& x) const;

 private:
  // Prepare's timing against the BLAS (ChooseMaxRows), once per shape in a process.
  int64_t MeasureMaxRows(const at::Tensor& w) const;

  at::Tensor packed_;  // [ceil(N / 16), K, 16]: 16 output columns a panel, zero-padded
  int64_t n_ = 0, k_ = 0;
  std::vector<int64_t> blocks_;  // k-blocks, in order; empty: not ok
  bool avx512_ = false;          // AVX-512 tiles (the CPU has them, and not turned off)
  int64_t max_rows_ = 0;         // 0: tile_rows()
  bool every_row_ = false;       // EveryRow
};

}  // namespace imagegen
