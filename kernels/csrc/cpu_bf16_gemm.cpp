// bf16 x bf16 -> bf16 linear layers for decode steps (1-128 rows) on AVX-512 (BF16 and AMX where
// the CPU has them), for prompt chunks too (up to 2,048 rows) on AVX-512 BF16 CPUs without AMX, and
// for every row count on AVX-512 CPUs without BF16, where oneDNN emulates bf16.
//
// At 1-16 rows a linear layer is a pass over its weights: each weight is used by a handful of
// rows only, so the time is the bytes read over the memory bandwidth. oneDNN's prepacked bf16
// matmul reaches ~10 GB/s at those row counts on kvserve's 2-core Xeon against ~28 GB/s the memory
// gives (benchmarks/bf16_gemm.py); this kernel streams the weights once per call for all rows.
//
// Layout (pack_bf16 in kernels/cpu_bf16_gemm.py builds it): [N/16][K/2][16][2] bf16, N and K
// zero-padded to multiples of 16 and 2. Element (c, 2p + j) of a tile of 16 output channels sits at
// [p][c][j]: one 64-byte load holds 2 inputs of all 16 channels, which `vdpbf16ps` multiplies by
// one broadcast pair of an activation row into 16 fp32 sums, one per lane (no horizontal sums);
// without AVX-512 BF16 a shift and a mask widen the weight pair to two fp32 vectors for two FMAs
// against the activations, widened to fp32 once per call (pass below).
// A pass reads T tiles side by side (T independent streams, T x R accumulators in registers) for
// up to max_rows_per_pass rows; more rows loop over row blocks while the tiles are still in L2. Threads split
// the tiles (at::parallel_for over N). fp32 accumulation; the bias is added in fp32; the result is
// rounded to bf16 once, to nearest even (as torch rounds). Above 4 rows, on CPUs with AMX, the same
// layout feeds tile multiplies instead (amx_gemm below): 5-16 rows as one row block against 4
// channel tiles at a time, more rows in blocks of 32 rows x 32 channels (2 x 2 tiles). Up to ~128
// rows that beats oneDNN's prepacked matmul on the model's shapes; prompt chunks stay on oneDNN
// there (engine/model/packed_linear.py: FEW_ROWS_MAX, NARROW_ROWS_MAX). Without AMX the vector
// passes beat it up to 2,048 rows (VECTOR_ROWS_MAX).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/neg.h>
#include <ATen/ops/to.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>
#ifdef __AMX_BF16__
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "cpu_bf16_gemm needs AVX-512 (F, BW)"
#endif

namespace {

constexpr int kTile = 16;     // output channels per tile: one 16-lane fp32 vector
constexpr int kMaxTiles = 6;  // tiles per pass
// Software prefetch distance along each tile's stream: a few cache lines ahead of the loads.
constexpr int kPrefetchBytes = 8 * 64;

using BF16 = c10::BFloat16;

// Unrolled before GCC decides where arrays live, so a pass's accumulators stay in registers (left
// to -O3's later unrolling, acc[R][T] went to the stack: a load and a store around every FMA).
#define UNROLL _Pragma("GCC unroll 16")

// A pass's shape: up to max_rows_per_pass rows x tiles_per_pass tiles, as many accumulators as the
// 32 vector registers hold beside the pass's weight vectors and activations.
// bf16 activations (vdpbf16ps): 4 rows x 6 tiles, 24 accumulators + 6 weight vectors + 1 broadcast
// pair. Each broadcast feeds 6 products (8 rows x 2 tiles fed 2, 6 x 4 fed 4): the broadcasts,
// not the weight loads, held the loop under vdpbf16ps' rate. SmolLM2-135M's 121 matrices on a
// 2-core AMD EPYC Zen 4, same bits: 6 x 4 was 0.91-0.97x 8 x 2's time at 5-128 rows; 4 x 6 is
// 0.90-0.97x 6 x 4's at 32-2048 rows (87-94% of the measured vdpbf16ps peak at 64), level at 16,
// and its six weight streams read faster at one row (0.86-0.90x in 3 of 4 rounds). 5 x 5 measured
// level with it, 3 x 7 slower.
// fp32 activations (AVX-512 without BF16) widen each weight vector into two (2T registers) and
// broadcast two inputs: 8 rows x 2 tiles there (wider would spill), up to 4 tiles at 1-4 rows.
template <typename In>
constexpr int max_rows_per_pass() { return std::is_same_v<In, BF16> ? 4 : 8; }

template <typename In>
constexpr int tiles_per_pass(int rows) {
  if constexpr (std::is_same_v<In, BF16>) return kMaxTiles;
  return rows <= 4 ? 4 : (rows == 5 ? 3 : 2);
}

// The lanes of the channel tile starting at column c0 that hold one of the n real channels.
inline __mmask16 channel_mask(int64_t c0, int64_t n) {
  const int64_t valid = std::min<int64_t>(kTile, n - c0);
  return valid >= kTile ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
}

// 16 fp32 values rounded to bf16 to nearest even in integer arithmetic, as torch's vectorised
// conversion does: subnormals kept (a NaN stays a NaN).
inline __m256i to_bf16_keeping_subnormals(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

// 16 fp32 sums rounded to bf16, to nearest even as torch rounds (a NaN stays a NaN). AVX-512 BF16's
// conversion flushes subnormals to zero, which a matmul's sums never come near.
inline __m256i to_bf16(__m512 v) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  return to_bf16_keeping_subnormals(v);
#endif
}

// 16 bf16 values (their bits) as fp32: bf16 is the top half of an fp32.
inline __m512 widen_bf16(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }

// Up to 16 values (the lanes in `mask`; the others 0) as fp32: a bias, a row of logits, activations.
inline __m512 load_fp32(const BF16* src, __mmask16 mask = 0xFFFF) { return widen_bf16(_mm256_maskz_loadu_epi16(mask, src)); }

inline __m512 load_fp32(const float* src, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, src); }

inline void store_row(BF16* out, __mmask16 mask, __m512 v) { _mm256_mask_storeu_epi16(out, mask, to_bf16(v)); }

const float* silu_table();  // bf16 gate -> its fp32 silu (silu_mul below)

// silu(gate) * up for 16 bf16 gates (their bits) and their ups in fp32, rounded to bf16 as torch
// rounds: silu_mul's step, and a gated pass's (so both give the same bits). Lanes outside `mask` 0.
inline __m256i silu_times_up(const float* table, __mmask16 mask, __m256i gate, __m512 up) {
  const __m512 silu = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, _mm512_cvtepu16_epi32(gate), table, 4);
  return to_bf16_keeping_subnormals(_mm512_mul_ps(silu, up));
}

// Where a gated pass's tile t of `width` lies from its first: the first half are gate tiles side by
// side, the second half their up tiles, up_tiles further on.
inline int64_t gated_tile(int t, int width, int64_t up_tiles) { return t < width / 2 ? t : t - width / 2 + up_tiles; }

// Where more than one row block shares a pass group's tiles, the first block streams them from memory
// while the vector units wait; so each block also asks for a share of the tiles the thread's next
// group reads (into L2): block `block` of `blocks` for the pair steps p with p % blocks == block, the
// group's blocks together the whole next panel once, while they compute. SmolLM2-135M's 121 matrices,
// 2-core AMD EPYC Zen 4, weights from memory: 0.85x the time at 8 rows, 0.83x at 16, 0.96x at 32,
// 0.97x at 64, level at 128; a single row block (up to 4 bf16 rows: bandwidth-bound) does not take it.
struct NextPanel {
  const BF16* w = nullptr;  // the next group's first tile (tile_elems apart, as the pass's own); none where
                            // this group is the thread's last
  int width = 0;  // its tiles
  int64_t block = 0, blocks = 1;
};

// R rows x T tiles: w points at the first tile, tile_elems apart; out at column n0 of row 0.
// kGated: a gated MLP's gate_up layer ([gate | up] channels, up_tiles tiles of each), whose first
// T / 2 tiles are gate channels and the last T / 2 the matching up channels, up_tiles further on;
// the pass writes silu(gate) * up for its gate channels (n of them in all) instead of its sums,
// as silu_mul computes it from the bf16 output this pass would otherwise write: same bits, no
// [rows, 2 x up] output written and read back (bias: none).
// In is the activations' type (the bias has it too). bf16 activations multiply
// pairs in vdpbf16ps (CPUs with AVX-512 BF16); fp32 ones (bf16 activations widened once per call,
// on AVX-512 CPUs without BF16) meet each weight pair widened in registers (the low half of a 32-bit
// lane is input 2p, the high half 2p + 1: a shift and a mask make both fp32) in two FMAs. Either
// way the products are exact in fp32 and the sums fp32; they differ only in the order of roundings.
template <int R, int T, typename In, bool kGated>
void pass(const BF16* w, int64_t tile_elems, int64_t pairs, const In* x, int64_t ldx, const In* bias,
          BF16* out, int64_t ldo, int64_t n0, int64_t n, bool prefetch, const NextPanel& next, int64_t up_tiles) {
  static_assert(!kGated || T % 2 == 0, "a gated pass pairs each gate tile with its up tile");
  constexpr int kHalf = kGated ? T / 2 : T;
  __m512 acc[R][T];
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  const char* wt[T];
  UNROLL for (int t = 0; t < T; ++t) {
    wt[t] = reinterpret_cast<const char*>(w + (kGated ? gated_tile(t, T, up_tiles) : t) * tile_elems);
  }
  const __m512i high_half = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i wv[T];
    UNROLL for (int t = 0; t < T; ++t) {
      // One cache line per tile and step: the prefetch runs ahead of exactly one stream line each.
      if (prefetch) _mm_prefetch(wt[t] + p * 64 + kPrefetchBytes, _MM_HINT_T0);
      wv[t] = _mm512_loadu_si512(wt[t] + p * 64);
    }
    // A counter in place of the modulo measured no faster (one more register live across the loop).
    if (next.w != nullptr && p % next.blocks == next.block) {
      for (int t = 0; t < next.width; ++t) {
        const int64_t tile = kGated ? gated_tile(t, next.width, up_tiles) : t;
        _mm_prefetch(reinterpret_cast<const char*>(next.w + tile * tile_elems) + p * 64, _MM_HINT_T1);
      }
    }
    if constexpr (std::is_same_v<In, BF16>) {
#ifdef __AVX512BF16__
      UNROLL for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * ldx + 2 * p, sizeof(pair));
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        UNROLL for (int t = 0; t < T; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], a, (__m512bh)wv[t]);
      }
#endif
    } else {
      __m512 even[T], odd[T];
      UNROLL for (int t = 0; t < T; ++t) {
        even[t] = _mm512_castsi512_ps(_mm512_slli_epi32(wv[t], 16));
        odd[t] = _mm512_castsi512_ps(_mm512_and_si512(wv[t], high_half));
      }
      UNROLL for (int r = 0; r < R; ++r) {
        const __m512 a0 = _mm512_set1_ps(x[r * ldx + 2 * p]), a1 = _mm512_set1_ps(x[r * ldx + 2 * p + 1]);
        UNROLL for (int t = 0; t < T; ++t) {
          acc[r][t] = _mm512_fmadd_ps(a1, odd[t], _mm512_fmadd_ps(a0, even[t], acc[r][t]));
        }
      }
    }
  }
  if constexpr (kGated) {
    const float* table = silu_table();
    UNROLL for (int t = 0; t < kHalf; ++t) {
      const int64_t c0 = n0 + t * kTile;
      const __mmask16 mask = channel_mask(c0, n);
      UNROLL for (int r = 0; r < R; ++r) {  // from the bf16 gate and up the plain pass would store
        const __m256i product = silu_times_up(table, mask, to_bf16(acc[r][t]), widen_bf16(to_bf16(acc[r][t + kHalf])));
        _mm256_mask_storeu_epi16(out + r * ldo + c0, mask, product);
      }
    }
  } else {
    UNROLL for (int t = 0; t < T; ++t) {
      const int64_t c0 = n0 + t * kTile;
      const __mmask16 mask = channel_mask(c0, n);
      const __m512 b = bias != nullptr ? load_fp32(bias + c0, mask) : _mm512_setzero_ps();
      UNROLL for (int r = 0; r < R; ++r) store_row(out + r * ldo + c0, mask, _mm512_add_ps(acc[r][t], b));
    }
  }
}

template <typename In>
using PassFn = void (*)(const BF16*, int64_t, int64_t, const In*, int64_t, const In*, BF16*, int64_t, int64_t,
                        int64_t, bool, const NextPanel&, int64_t);

// The tiles one pass group takes at `rows` rows: gate tiles of a gated pass (each brings its up tile).
template <typename In, bool kGated>
constexpr int group_tiles(int rows) {
  return kGated ? std::max(1, tiles_per_pass<In>(rows) / 2) : tiles_per_pass<In>(rows);
}

template <int R, typename In, bool kGated>
PassFn<In> pass_for_tiles(int t) {  // t: the group's tiles (gate tiles where kGated)
  if constexpr (kGated) {
    if constexpr (std::is_same_v<In, BF16>) {
      if (t == 3) return &pass<R, 6, In, true>;
    }
    return t == 2 ? &pass<R, 4, In, true> : &pass<R, 2, In, true>;
  } else {
    if constexpr (std::is_same_v<In, BF16>) {  // only bf16 passes go wider than 4 tiles
      if (t == 6) return &pass<R, 6, In, false>;
      if (t == 5) return &pass<R, 5, In, false>;
    }
    return t == 4 ? &pass<R, 4, In, false> : t == 3 ? &pass<R, 3, In, false> : t == 2 ? &pass<R, 2, In, false>
                                                                                      : &pass<R, 1, In, false>;
  }
}

template <typename In, bool kGated>
PassFn<In> pass_for(int rows, int tiles) {  // rows <= max_rows_per_pass<In>()
  const int width = std::min(tiles, group_tiles<In, kGated>(rows));
  if constexpr (max_rows_per_pass<In>() > 4) {
    switch (rows) {
      case 8: return pass_for_tiles<8, In, kGated>(width);
      case 7: return pass_for_tiles<7, In, kGated>(width);
      case 6: return pass_for_tiles<6, In, kGated>(width);
      case 5: return pass_for_tiles<5, In, kGated>(width);
      default: break;
    }
  }
  switch (rows) {
    case 4: return pass_for_tiles<4, In, kGated>(width);
    case 3: return pass_for_tiles<3, In, kGated>(width);
    case 2: return pass_for_tiles<2, In, kGated>(width);
    default: return pass_for_tiles<1, In, kGated>(width);
  }
}

#ifdef __AMX_BF16__
// ---- more rows through AMX -----------------------------------------------------------------
// Above kVectorMaxRows rows the vector loop is bound by vdpbf16ps' throughput (one row x 16
// channels x 2 inputs an instruction); a tile multiply does 16 rows x 16 channels x 32 inputs
// (measured: 1.1-2.8x the vector loop at 6-16 rows, ~1.2x oneDNN's AMX matmul at 5-16). The packed layout is already AMX's B layout: 16 consecutive pairs of a tile
// are a 16 x 64-byte B tile, 1 KB contiguous. A tile: up to 16 rows x 32 inputs of x. Needs
// K % 32 == 0 (the model shapes; others take the vector loop).
constexpr int64_t kVectorMaxRows = 4;
constexpr int64_t kAmxRows = 16;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3 accumulate 4 channel tiles (rows x 16 fp32), 4 holds x's rows x 32 inputs, 5 and 6
// alternate as B (16 pairs x 16 channels).
TileConfig tile_config(int rows) {
  TileConfig c;
  for (int t = 0; t < 5; ++t) {
    c.rows[t] = static_cast<uint8_t>(rows);
    c.colsb[t] = 64;
  }
  for (int t = 5; t < 7; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  return c;
}

bool amx_usable() {
  static const bool usable = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return usable;
}

// A tile's fp32 sums (rows x 16, as _tile_stored wrote them) plus the bias, rounded to bf16 into
// columns c0.. of `rows` rows of out (only the real channels).
void store_tile_rows(const float* sums, int rows, const BF16* bias, BF16* out, int64_t ldo, int64_t c0, int64_t n) {
  if (c0 >= n) return;
  const __mmask16 mask = channel_mask(c0, n);
  const __m512 bv = bias != nullptr ? load_fp32(bias + c0, mask) : _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r) {
    store_row(out + r * ldo + c0, mask, _mm512_add_ps(_mm512_loadu_ps(sums + r * 16), bv));
  }
}

// What a tile's sums become: `epilogue(sums, rows, row0, c0, n)` gets the fp32 sums of rows
// row0.. and channels c0.. (rows x 16, as _tile_stored wrote them). A linear layer stores them as
// bf16 rows (StoreRows); greedy sampling keeps only each row's argmax (ArgmaxLanes, below).
// `for_thread()` gives the epilogue a thread uses: a thread's own state where it keeps any.
struct StoreRows {
  const BF16* bias;
  BF16* out;
  int64_t ldo;
  StoreRows& for_thread() { return *this; }
  void operator()(const float* sums, int rows, int64_t row0, int64_t c0, int64_t n) const {
    store_tile_rows(sums, rows, bias, out + row0 * ldo, ldo, c0, n);
  }
};

// `width` (1-4) tiles from tile t0 for `rows` rows (the configured ones) into the epilogue.
template <typename Epilogue>
void amx_pass(const BF16* w, int64_t tile_elems, int64_t pairs, const BF16* x, int64_t ldx, int rows, int width,
              Epilogue& epilogue, int64_t n0, int64_t n, float* scratch) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const char* wt = reinterpret_cast<const char*>(w);
  const int64_t tile_bytes = tile_elems * 2;
  for (int64_t kb = 0; kb < pairs / 16; ++kb) {
    _tile_loadd(4, x + kb * 32, ldx * 2);
    const char* b = wt + kb * 1024;
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (width > 1) {
      _tile_loadd(6, b + tile_bytes, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if (width > 2) {
      _tile_loadd(5, b + 2 * tile_bytes, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if (width > 3) {
      _tile_loadd(6, b + 3 * tile_bytes, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  // scratch: [4 tiles][16 rows][16] fp32
  _tile_stored(0, scratch, 64);
  if (width > 1) _tile_stored(1, scratch + 256, 64);
  if (width > 2) _tile_stored(2, scratch + 512, 64);
  if (width > 3) _tile_stored(3, scratch + 768, 64);
  for (int t = 0; t < width; ++t) epilogue(scratch + t * 256, rows, 0, n0 + t * kTile, n);
}

// Above 16 rows: blocks of 32 rows x 32 channels, the C sums in tiles 0-3 (rows ra of the first
// 16-row half: 0, 1; rb of the second: 2, 3), x's two halves in 4 and 5, two channel tiles of B in
// 6 and 7. Each tile loaded feeds two multiplies: the 1 x 4 pass above loads 5 tiles for 4, and past
// its first row block those are the weights again, from L2 (measured: that reload, not the
// multiplies, set the time of the extra row blocks).
TileConfig tile_config_2x2(int ra, int rb) {
  TileConfig c;
  const int rows[8] = {ra, ra, rb, rb, ra, rb, 16, 16};
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = static_cast<uint8_t>(rows[t]);
    c.colsb[t] = 64;
  }
  return c;
}

// One 32-row x 32-channel block from row r0 (rb == 0: 16 rows or fewer; width 1: one channel tile).
template <typename Epilogue>
void amx_block_2x2(const BF16* w, int64_t tile_elems, int64_t pairs, const BF16* x, int64_t ldx, int ra, int rb,
                   int width, Epilogue& epilogue, int64_t r0, int64_t n0, int64_t n, float* scratch) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const char* b0 = reinterpret_cast<const char*>(w);
  const char* b1 = b0 + tile_elems * 2;
  const BF16* x1 = x + 16 * ldx;
  const int64_t steps = pairs / 16;
  for (int64_t kb = 0; kb < steps; ++kb) {
    _tile_loadd(4, x + kb * 32, ldx * 2);
    _tile_loadd(6, b0 + kb * 1024, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (rb > 0) {
      _tile_loadd(5, x1 + kb * 32, ldx * 2);
      _tile_dpbf16ps(2, 5, 6);
    }
    if (width > 1) {
      _tile_loadd(7, b1 + kb * 1024, 64);
      _tile_dpbf16ps(1, 4, 7);
      if (rb > 0) _tile_dpbf16ps(3, 5, 7);
    }
  }
  // scratch: [4 tiles][16 rows][16] fp32
  _tile_stored(0, scratch, 64);
  epilogue(scratch, ra, r0, n0, n);
  if (width > 1) {
    _tile_stored(1, scratch + 256, 64);
    epilogue(scratch + 256, ra, r0, n0 + kTile, n);
  }
  if (rb > 0) {
    _tile_stored(2, scratch + 512, 64);
    epilogue(scratch + 512, rb, r0 + 16, n0, n);
    if (width > 1) {
      _tile_stored(3, scratch + 768, 64);
      epilogue(scratch + 768, rb, r0 + 16, n0 + kTile, n);
    }
  }
}

// Rows per chunk above 16 rows: a chunk's x (256 rows x K bf16: 288 KB at K = 576, 768 KB at
// 1536) stays in L2 while every channel pair of the thread's share passes over it.
constexpr int64_t kRowChunk = 256;

// n: the real channels (tiles x 16 or fewer).
template <typename Epilogue>
void amx_gemm(const BF16* x, int64_t m, int64_t ldx, const BF16* w, int64_t tiles, int64_t pairs, Epilogue& shared,
              int64_t n) {
  const int64_t tile_elems = pairs * 2 * kTile;
  if (m <= kAmxRows) {
    at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
      auto& epilogue = shared.for_thread();
      alignas(64) float scratch[4 * 256];
      const TileConfig config = tile_config(static_cast<int>(m));
      _tile_loadconfig(&config);
      for (int64_t t0 = begin; t0 < end; t0 += 4) {
        const int width = static_cast<int>(std::min<int64_t>(4, end - t0));
        amx_pass(w + t0 * tile_elems, tile_elems, pairs, x, ldx, static_cast<int>(m), width, epilogue, t0 * kTile,
                 n, scratch);
      }
      _tile_release();
    });
    return;
  }
  at::parallel_for(0, tiles, 2, [&](int64_t begin, int64_t end) {
    auto& epilogue = shared.for_thread();
    alignas(64) float scratch[4 * 256];
    int configured_ra = -1, configured_rb = -1;
    for (int64_t c0 = 0; c0 < m; c0 += kRowChunk) {
      const int64_t chunk_end = std::min<int64_t>(m, c0 + kRowChunk);
      // Channel pairs outer, row blocks inner: a pair's weights come from memory once per chunk,
      // later row blocks find them in L2.
      for (int64_t t0 = begin; t0 < end; t0 += 2) {
        const int width = static_cast<int>(std::min<int64_t>(2, end - t0));
        for (int64_t r0 = c0; r0 < chunk_end; r0 += 32) {
          const int ra = static_cast<int>(std::min<int64_t>(16, chunk_end - r0));
          const int rb = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(16, chunk_end - r0 - 16)));
          if (ra != configured_ra || rb != configured_rb) {
            // Unused tiles get one row: a configured tile may not have zero rows.
            const TileConfig config = tile_config_2x2(ra, std::max(rb, 1));
            _tile_loadconfig(&config);
            configured_ra = ra;
            configured_rb = rb;
          }
          amx_block_2x2(w + t0 * tile_elems, tile_elems, pairs, x + r0 * ldx, ldx, ra, rb, width, epilogue, r0,
                        t0 * kTile, n, scratch);
        }
      }
    }
    if (configured_ra >= 0) _tile_release();
  });
}
#endif

// The vector passes over all rows: threads split the tiles, each pass takes up to max_rows_per_pass rows.
// kGated: `tiles` gate tiles, each with its up tile `tiles` further on; out [m, n] is silu(gate) * up.
template <typename In, bool kGated = false>
void vector_gemm(const In* x, int64_t m, int64_t ldx, const BF16* w, int64_t tiles, int64_t pairs, const In* bias,
                 BF16* out, int64_t n) {
  const int64_t tile_elems = pairs * 2 * kTile;
  constexpr int64_t kMaxRows = max_rows_per_pass<In>();
  constexpr int kPerTile = kGated ? 2 : 1;  // tiles a pass reads per tile of output
  const int group = group_tiles<In, kGated>(static_cast<int>(std::min<int64_t>(m, kMaxRows)));
  // Whole groups per thread where the layer is large enough; the small layers still split in two.
  at::parallel_for(0, tiles, group, [&](int64_t begin, int64_t end) {
    for (int64_t t0 = begin; t0 < end; t0 += group) {
      const int width = static_cast<int>(std::min<int64_t>(group, end - t0));
      NextPanel next;
      if (t0 + group < end && m > kMaxRows) {
        next.w = w + (t0 + group) * tile_elems;
        next.width = kPerTile * static_cast<int>(std::min<int64_t>(group, end - t0 - group));
        next.blocks = (m + kMaxRows - 1) / kMaxRows;
      }
      for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m - r0));
        next.block = r0 / kMaxRows;
        // Only the first row block streams the tiles from memory; later blocks find them in L2.
        pass_for<In, kGated>(rows, width)(w + t0 * tile_elems, tile_elems, pairs, x + r0 * ldx, ldx, bias, out + r0 * n,
                                          n, t0 * kTile, n, r0 == 0, next, tiles);
      }
    }
  });
}

// bf16 activations: AMX tiles above kVectorMaxRows rows where the CPU has them, vdpbf16ps on
// AVX-512 BF16; without either, the rows are widened to fp32 once and take the FMA passes.
void gemm(const at::Tensor& rows, const BF16* w, int64_t tiles, int64_t pairs, const at::Tensor& bias,
          at::Tensor& out) {
  const int64_t m = rows.size(0), n = out.size(1);
#ifdef __AVX512BF16__
  const BF16* b = bias.defined() ? bias.data_ptr<BF16>() : nullptr;
#ifdef __AMX_BF16__
  if (m > kVectorMaxRows && pairs % 16 == 0 && amx_usable()) {
    StoreRows store{b, out.data_ptr<BF16>(), n};
    amx_gemm(rows.data_ptr<BF16>(), m, rows.size(1), w, tiles, pairs, store, n);
    return;
  }
#endif
  vector_gemm<BF16>(rows.data_ptr<BF16>(), m, rows.size(1), w, tiles, pairs, b, out.data_ptr<BF16>(), n);
#else
  const at::Tensor wide = rows.to(at::kFloat);
  const at::Tensor wide_bias = bias.defined() ? bias.to(at::kFloat) : at::Tensor();
  vector_gemm<float>(wide.data_ptr<float>(), m, wide.size(1), w, tiles, pairs,
                     wide_bias.defined() ? wide_bias.data_ptr<float>() : nullptr, out.data_ptr<BF16>(), n);
#endif
}

std::vector<int64_t> out_shape(const at::Tensor& x, int64_t out_features) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  return shape;
}

// x's rows [M, K + K % 2] (the packed weights' zero column padded in), checked against the weights.
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && packed.device().is_cpu(), "bf16 linear: tensors must be on the CPU");
  TORCH_CHECK_VALUE(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
                    "bf16 linear: x and the packed weights must be bfloat16, got ", x.scalar_type(), " and ",
                    packed.scalar_type());
  TORCH_CHECK_VALUE(packed.dim() == 4 && packed.size(2) == kTile && packed.size(3) == 2 && packed.is_contiguous(),
                    "bf16 linear: packed weights must be contiguous [N/16, K/2, 16, 2] from kvserve's bf16 packing");
  TORCH_CHECK_VALUE(x.dim() >= 1, "bf16 linear: x must have at least one dimension");
  const int64_t tiles = packed.size(0), pairs = packed.size(1), k = x.size(-1);
  TORCH_CHECK_VALUE(k == 2 * pairs || k == 2 * pairs - 1, "bf16 linear: x has K = ", k, ", the weights ", 2 * pairs);
  TORCH_CHECK_VALUE(out_features > (tiles - 1) * kTile && out_features <= tiles * kTile,
                    "bf16 linear: out_features ", out_features, " does not fit ", tiles, " tiles of ", kTile);
  at::Tensor rows = x.reshape({-1, k}).contiguous();
  if (k % 2 == 1) rows = at::constant_pad_nd(rows, {0, 1});  // the packed weights' zero column
  return rows;
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features) {
  const at::Tensor rows = linear_rows(x, packed, out_features);
  const int64_t tiles = packed.size(0), pairs = packed.size(1);
  at::Tensor out = at::empty({rows.size(0), out_features}, x.options());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == out_features, "bf16 linear: bias must be [",
                      out_features, "], got ", bias->sizes());
    b = bias->to(at::kBFloat16).contiguous();
  }
  if (rows.size(0) > 0) gemm(rows, packed.data_ptr<BF16>(), tiles, pairs, b, out);
  return out.view(out_shape(x, out_features));
}

at::Tensor bf16_linear_meta(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                            int64_t out_features) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = out_features;
  return at::empty_symint(shape, x.options());
}

// ---- greedy sampling: each row's argmax -----------------------------------------------------
// The lm_head's bf16 logits, [rows, vocab], read once each at memory speed: torch's argmax over
// bf16 (and its amax) widens element by element (64 x 49152 logits: ~5 ms, and 0.64 ms for the
// chunked amax + argmax kvserve used instead). argmax's rules: the first maximum wins, a NaN counts
// as the maximum (the first NaN), an all -inf row gives 0.

// Index of the first NaN of the row, or -1.
int64_t first_nan(const BF16* row, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(static_cast<float>(row[i]))) return i;
  }
  return -1;
}

constexpr __mmask16 kAllLanes = 0xFFFF;

int64_t row_argmax(const BF16* row, int64_t n) {
  const int64_t vector_end = n / kTile * kTile;
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  for (int64_t i = 0; i < vector_end; i += kTile) {
    const __m512 v = load_fp32(row + i, kAllLanes);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, v);
  }
  float max = _mm512_reduce_max_ps(best);
  for (int64_t i = vector_end; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    if (std::isnan(v)) nan = 1;
    max = std::max(max, v);
  }
  if (nan) return first_nan(row, n);
  const __m512 target = _mm512_set1_ps(max);
  for (int64_t i = 0; i < vector_end; i += kTile) {
    const __mmask16 hit = _mm512_cmp_ps_mask(load_fp32(row + i, kAllLanes), target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  for (int64_t i = vector_end; i < n; ++i) {
    if (static_cast<float>(row[i]) == max) return i;
  }
  return 0;  // every entry -inf
}

// Rows per thread of the argmax: a 49152-entry row is ~96 KB, a few microseconds.
constexpr int64_t kArgmaxGrain = 4;

at::Tensor bf16_row_argmax(const at::Tensor& logits) {
  TORCH_CHECK_VALUE(logits.device().is_cpu() && logits.scalar_type() == at::kBFloat16 && logits.dim() == 2 &&
                        logits.is_contiguous() && logits.size(1) > 0,
                    "bf16 row argmax: logits must be a contiguous, non-empty [rows, vocab] bfloat16 CPU tensor");
  const int64_t rows = logits.size(0), n = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const BF16* data = logits.data_ptr<BF16>();
  int64_t* result = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, kArgmaxGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) result[r] = row_argmax(data + r * n, n);
  });
  return out;
}

at::Tensor bf16_row_argmax_meta(const at::Tensor& logits) {
  return at::empty_symint({logits.sym_size(0)}, logits.options().dtype(at::kLong));
}

// ---- greedy sampling straight from the lm_head's sums ---------------------------------------
// Each row's argmax of the bf16 logits bf16_linear would return, without them: at 64 rows x 49,152
// the logits are 6 MB, written (each line read for ownership first) and then read back by the
// argmax, ~25% on top of the 56 MB of weights the lm_head streams. The sums are rounded to bf16
// exactly as the linear rounds them, so the answer is bf16_row_argmax(bf16_linear(...)) (argmax's
// rules: the first maximum, the first NaN, 0 for a row of -inf).
#ifdef __AMX_BF16__
// Per thread: 16 lanes of running maxima per row and the first column of each (a later equal
// value replaces it only from a smaller column: a thread's chunks need not come in order).
struct ArgmaxLanes {
  static constexpr int32_t kNone = std::numeric_limits<int32_t>::max();
  std::vector<float> best;         // [rows][16]
  std::vector<int32_t> column;     // [rows][16]; kNone: the lane has seen only -inf
  std::vector<int64_t> first_nan;  // [rows]; -1: none
  explicit ArgmaxLanes(int64_t rows)
      : best(rows * kTile, -std::numeric_limits<float>::infinity()), column(rows * kTile, kNone),
        first_nan(rows, -1) {}

  void operator()(const float* sums, int rows, int64_t row0, int64_t c0, int64_t n) {
    if (c0 >= n) return;
    const __mmask16 mask = channel_mask(c0, n);
    const __m512i columns = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(c0)),
                                             _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    for (int r = 0; r < rows; ++r) {
      const int64_t row = row0 + r;
      const __m256i rounded = to_bf16(_mm512_loadu_ps(sums + r * kTile));  // as store_row rounds
      const __m512 logit = widen_bf16(rounded);
      float* best_row = best.data() + row * kTile;
      const __m512 current = _mm512_loadu_ps(best_row);
      // Most tiles hold no lane's new maximum: one compare (>= or NaN) rules them out.
      if (!_mm512_mask_cmp_ps_mask(mask, logit, current, _CMP_NLT_UQ)) continue;
      const __mmask16 nan = _mm512_mask_cmp_ps_mask(mask, logit, logit, _CMP_UNORD_Q);
      if (nan) {
        const int64_t first = c0 + __builtin_ctz(nan);
        if (first_nan[row] < 0 || first < first_nan[row]) first_nan[row] = first;
      }
      int32_t* column_row = column.data() + row * kTile;
      const __mmask16 earlier = _mm512_mask_cmplt_epi32_mask(
          _mm512_mask_cmp_ps_mask(mask, logit, current, _CMP_EQ_OQ), columns, _mm512_loadu_si512(column_row));
      const __mmask16 better = _mm512_mask_cmp_ps_mask(mask, logit, current, _CMP_GT_OQ) | earlier;
      _mm512_mask_storeu_ps(best_row, better, logit);
      _mm512_mask_storeu_epi32(column_row, better, columns);
    }
  }
};

// One ArgmaxLanes per thread of the pool, each thread taking its own.
struct ArgmaxEpilogue {
  std::vector<ArgmaxLanes> threads;
  ArgmaxEpilogue(int64_t rows, int num_threads) : threads(num_threads, ArgmaxLanes(rows)) {}
  ArgmaxLanes& for_thread() { return threads[at::get_thread_num()]; }

  // Lanes and threads merged: the largest value, the smallest column among its equals.
  int64_t row_argmax(int64_t row) const {
    int64_t nan = -1, best_column = -1;
    float best = 0;
    for (const ArgmaxLanes& lanes : threads) {
      if (lanes.first_nan[row] >= 0 && (nan < 0 || lanes.first_nan[row] < nan)) nan = lanes.first_nan[row];
      for (int lane = 0; lane < kTile; ++lane) {
        const int32_t column = lanes.column[row * kTile + lane];
        if (column == ArgmaxLanes::kNone) continue;
        const float value = lanes.best[row * kTile + lane];
        if (best_column < 0 || value > best || (value == best && column < best_column)) {
          best = value;
          best_column = column;
        }
      }
    }
    return nan >= 0 ? nan : std::max<int64_t>(best_column, 0);
  }
};
#endif

at::Tensor bf16_linear_argmax(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  const at::Tensor rows = linear_rows(x, packed, out_features);
  const int64_t m = rows.size(0), tiles = packed.size(0), pairs = packed.size(1);
#if defined(__AVX512BF16__) && defined(__AMX_BF16__)
  if (m > kVectorMaxRows && pairs % 16 == 0 && amx_usable()) {
    ArgmaxEpilogue argmax(m, at::get_num_threads());
    amx_gemm(rows.data_ptr<BF16>(), m, rows.size(1), packed.data_ptr<BF16>(), tiles, pairs, argmax, out_features);
    at::Tensor out = at::empty({m}, x.options().dtype(at::kLong));
    int64_t* result = out.data_ptr<int64_t>();
    for (int64_t r = 0; r < m; ++r) result[r] = argmax.row_argmax(r);
    return out;
  }
#endif
  // A few rows (their logits stay in cache) or no AMX: the logits, then their argmax.
  return bf16_row_argmax(bf16_linear(rows, packed, c10::nullopt, out_features));
}

at::Tensor bf16_linear_argmax_meta(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  return at::empty_symint({x.sym_numel() / x.sym_size(-1)}, x.options().dtype(at::kLong));
}

// ---- the gated MLP's activation: silu(gate) * up -------------------------------------------
// gate_up's rows are [gate | up], bf16 (the gate_up matmul's output). The compiled forward's own
// kernel widens each gate to fp32 and computes gate / (exp(-gate) + 1) (an exp and a division per
// element: 54 us a layer in a 64-row decode step, 931 us at 1,889 rows with its input in cache),
// times up, rounded to bf16. A bf16 gate has only 65,536 values, so that fp32 quotient comes from a
// table instead, computed once by the same ATen exp and division: the products and their rounding
// are the ones the compiled kernel makes, bit for bit, at a gather per 16 elements.
const float* silu_table() {
  static const at::Tensor table = [] {
    const at::Tensor gates =
        at::arange(65536, at::TensorOptions().dtype(at::kInt)).to(at::kShort).view(at::kBFloat16).to(at::kFloat);
    return at::div(gates, at::add(at::exp(at::neg(gates)), 1)).contiguous();
  }();
  return table.data_ptr<float>();
}

// Elements per thread of silu_mul: below this a call stays on one thread (one decode row is 1,536).
constexpr int64_t kSiluGrainElements = 16384;

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK_VALUE(gate_up.device().is_cpu() && gate_up.scalar_type() == at::kBFloat16 && gate_up.dim() >= 1 &&
                        gate_up.size(-1) % 2 == 0,
                    "silu_mul: gate_up must be a bfloat16 CPU tensor whose last dimension [gate | up] is even, got ",
                    gate_up.scalar_type(), " ", gate_up.sizes());
  const at::Tensor rows = gate_up.reshape({-1, gate_up.size(-1)}).contiguous();
  const int64_t count = rows.size(0), width = rows.size(1) / 2;
  at::Tensor out = at::empty(out_shape(gate_up, width), gate_up.options());
  if (count == 0 || width == 0) return out;
  const float* table = silu_table();
  const auto* in = reinterpret_cast<const uint16_t*>(rows.data_ptr<BF16>());
  BF16* result = out.data_ptr<BF16>();
  at::parallel_for(0, count, std::max<int64_t>(1, kSiluGrainElements / width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* gate = in + r * 2 * width;
      const BF16* up = reinterpret_cast<const BF16*>(gate + width);
      for (int64_t i = 0; i < width; i += kTile) {
        const __mmask16 mask = channel_mask(i, width);
        const __m256i product = silu_times_up(table, mask, _mm256_maskz_loadu_epi16(mask, gate + i), load_fp32(up + i, mask));
        _mm256_mask_storeu_epi16(result + r * width + i, mask, product);
      }
    }
  });
  return out;
}

at::Tensor silu_mul_meta(const at::Tensor& gate_up) {
  std::vector<c10::SymInt> shape(gate_up.sym_sizes().begin(), gate_up.sym_sizes().end());
  shape.back() = shape.back() / 2;
  return at::empty_symint(shape, gate_up.options());
}

// silu_mul(bf16_linear(x, packed, None, 2 * intermediate)), bit for bit, for a gated MLP's gate_up
// weights ([gate | up] rows, `intermediate` of each, a multiple of 16 so that gate tile t and up
// tile t + intermediate / 16 hold the same channels): the vector passes take each gate tile beside
// its up tile and write silu(gate) * up from their sums (pass's kGated), so the [rows, 2 x
// intermediate] output is neither written nor read back. Where AMX computes the rows, the matmul
// and silu_mul run one after the other.
at::Tensor bf16_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t intermediate) {
  TORCH_CHECK_VALUE(intermediate > 0 && intermediate % kTile == 0,
                    "bf16_linear_silu_mul: intermediate must be a positive multiple of ", kTile, ", got ", intermediate);
  const at::Tensor rows = linear_rows(x, packed, 2 * intermediate);
  TORCH_CHECK_VALUE(packed.size(0) == 2 * intermediate / kTile, "bf16_linear_silu_mul: the packed weights hold ",
                    packed.size(0), " tiles, not the ", 2 * intermediate / kTile, " of 2 x ", intermediate, " channels");
  at::Tensor out = at::empty(out_shape(x, intermediate), x.options());
  const int64_t m = rows.size(0), pairs = packed.size(1), gate_tiles = intermediate / kTile;
  if (m == 0) return out;
  silu_table();  // built before the threads start, not inside their region
  const BF16* w = packed.data_ptr<BF16>();
#ifdef __AVX512BF16__
#ifdef __AMX_BF16__
  if (m > kVectorMaxRows && pairs % 16 == 0 && amx_usable()) {
    at::Tensor gate_up = at::empty({m, 2 * intermediate}, x.options());
    gemm(rows, w, packed.size(0), pairs, at::Tensor(), gate_up);
    return silu_mul(gate_up).view(out_shape(x, intermediate));
  }
#endif
  vector_gemm<BF16, true>(rows.data_ptr<BF16>(), m, rows.size(1), w, gate_tiles, pairs, nullptr, out.data_ptr<BF16>(),
                          intermediate);
#else
  const at::Tensor wide = rows.to(at::kFloat);
  vector_gemm<float, true>(wide.data_ptr<float>(), m, wide.size(1), w, gate_tiles, pairs, nullptr, out.data_ptr<BF16>(),
                           intermediate);
#endif
  return out;
}

at::Tensor bf16_linear_silu_mul_meta(const at::Tensor& x, const at::Tensor& packed, int64_t intermediate) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = intermediate;
  return at::empty_symint(shape, x.options());
}


// ---- a Llama block's decode step, every layer in one call ----------------------------------
// A decode step of a small model is mostly per-call overhead outside the matmuls: the compiled
// forward enters Python for each of a layer's ~12 ops and kernels (~90 us a layer at one row, ~135
// at 64 rows, measured on SmolLM2: 2.7 and 4.1 ms a step). decoder_layers runs a whole stack of
// Llama blocks (pre-norm RMSNorm, fused qkv, rotate-half rope, paged attention, o_proj, residual,
// RMSNorm, fused gate_up, SiLU x up, down_proj, residual; no biases) for steps whose rows all fit
// this file's linear kernel, with no Python between ops. The matmuls and SiLU are this file's ops,
// the KV write and attention kvserve_cpu's.
// The elementwise parts compute what the compiled forward's fused kernels compute, in the same
// order: fp32 throughout, no intermediate bf16 rounding (the residual h = x + attn stays fp32 into
// the second norm and the final sum), the sum of squares in two 16-lane accumulators over 32-element
// steps then ATen's shuffle reduction, and torch's rounding to bf16. Same inputs, same bits.

// The compiled kernels are built with -ffp-contract=off (inductor's flags); g++ contracts a * b + c
// into one FMA by default in C++, which rounds once instead of twice and changes the bits.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// ATen's vec_reduce_all for 16 fp32 lanes (functional_base.h): halves, quarters, pairs, lanes.
inline float reduce_add(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
  v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0x4E));
  v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0xB1));
  return _mm512_cvtss_f32(v);
}

// RMSNorm of `rows` rows of width (a multiple of 32): out = bf16(w * (h * rsqrt(mean(h^2) + eps)))
// with h = x, or h = x + residual (the block's second norm, h never rounded). Rows in parallel.
void rms_norm_rows(const BF16* x, const BF16* residual, const BF16* weight, BF16* out, int64_t rows, int64_t width,
                   float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const BF16* xr = x + r * width;
      const BF16* rr = residual == nullptr ? nullptr : residual + r * width;
      const auto h = [&](int64_t i) {
        const __m512 v = load_fp32(xr + i);
        return rr == nullptr ? v : _mm512_add_ps(v, load_fp32(rr + i));
      };
      __m512 low = _mm512_setzero_ps(), high = _mm512_setzero_ps();
      for (int64_t i = 0; i < width; i += 2 * kTile) {
        const __m512 a = h(i), b = h(i + kTile);
        low = _mm512_add_ps(low, _mm512_mul_ps(a, a));
        high = _mm512_add_ps(high, _mm512_mul_ps(b, b));
      }
      const float mean = reduce_add(_mm512_add_ps(low, high)) / static_cast<float>(width);
      const __m512 scale = _mm512_set1_ps(1 / std::sqrt(mean + eps));
      for (int64_t i = 0; i < width; i += kTile) {
        const __m512 normed = _mm512_mul_ps(load_fp32(weight + i), _mm512_mul_ps(h(i), scale));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * width + i), to_bf16_keeping_subnormals(normed));
      }
    }
  });
}

// Rotate-half rope of `heads` heads (head_dim a multiple of 32) starting at column `first` of each
// qkv row: out = bf16(x * cos + rotate_half(x) * sin), rotate_half(x) = [-x2, x1]; cos and sin are
// [rows, head_dim]. out is [rows, heads, head_dim].
void rope_rows(const BF16* qkv, int64_t qkv_width, int64_t first, int64_t heads, int64_t head_dim, const BF16* cos,
               const BF16* sin, BF16* out, int64_t rows) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        const BF16* x = qkv + r * qkv_width + first + h * head_dim;
        BF16* y = out + (r * heads + h) * head_dim;
        for (int64_t i = 0; i < head_dim; i += kTile) {
          const bool first_half = i < half;
          const __m512 rotated = first_half ? _mm512_sub_ps(_mm512_setzero_ps(), load_fp32(x + i + half)) : load_fp32(x + i - half);
          const __m512 sum = _mm512_add_ps(_mm512_mul_ps(load_fp32(x + i), load_fp32(cos + r * head_dim + i)),
                                           _mm512_mul_ps(rotated, load_fp32(sin + r * head_dim + i)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), to_bf16_keeping_subnormals(sum));
        }
      }
    }
  });
}

// The block's output: bf16((x + attn) + mlp), in place of x.
void residual_rows(BF16* x, const BF16* attn, const BF16* mlp, int64_t count) {
  at::parallel_for(0, count / kTile, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t v = begin; v < end; ++v) {
      const int64_t i = v * kTile;
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(load_fp32(x + i), load_fp32(attn + i)), load_fp32(mlp + i));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + i), to_bf16_keeping_subnormals(sum));
    }
  });
}

#pragma GCC pop_options

using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, int64_t);
using SiluMul = at::Tensor(const at::Tensor&);
using LinearSiluMul = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t);
using PagedAttention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, double, double, int64_t, double,
                                  const std::optional<at::Tensor>&, const std::optional<at::Tensor>&);
using WriteKVCache = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          double, double, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&);

at::Tensor decoder_layers(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, at::TensorList input_norms,
                          at::TensorList qkv_weights, at::TensorList o_weights, at::TensorList post_norms,
                          at::TensorList gate_up_weights, at::TensorList down_weights, at::TensorList key_caches,
                          at::TensorList value_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t num_heads,
                          int64_t num_kv_heads, int64_t intermediate_size, double eps, double scale) {
  // Every op goes through the dispatcher (looked up once; ~1 us a call), so that torch.profiler
  // sees each as in the compiled forward. The kvserve_cpu ops are loaded before this op is called
  // (the caller checks).
  static const auto linear = c10::Dispatcher::singleton()
      .findSchemaOrThrow("kvserve_bf16::bf16_linear", "").typed<Linear>();
  static const auto silu = c10::Dispatcher::singleton().findSchemaOrThrow("kvserve_bf16::silu_mul", "").typed<SiluMul>();
  static const auto linear_silu = c10::Dispatcher::singleton()
      .findSchemaOrThrow("kvserve_bf16::bf16_linear_silu_mul", "").typed<LinearSiluMul>();
  static const auto attention = c10::Dispatcher::singleton()
      .findSchemaOrThrow("kvserve_cpu::paged_attention", "").typed<PagedAttention>();
  static const auto write_kv = c10::Dispatcher::singleton()
      .findSchemaOrThrow("kvserve_cpu::write_kv_cache", "").typed<WriteKVCache>();
  const int64_t layers = static_cast<int64_t>(input_norms.size());
  TORCH_CHECK_VALUE(layers > 0 && qkv_weights.size() == input_norms.size() && o_weights.size() == input_norms.size() &&
                        post_norms.size() == input_norms.size() && gate_up_weights.size() == input_norms.size() &&
                        down_weights.size() == input_norms.size() && key_caches.size() == input_norms.size() &&
                        value_caches.size() == input_norms.size(),
                    "decoder_layers: every per-layer list needs one entry per layer");
  TORCH_CHECK_VALUE(x_in.device().is_cpu() && x_in.scalar_type() == at::kBFloat16 && x_in.dim() == 2 &&
                        x_in.size(1) % (2 * kTile) == 0,
                    "decoder_layers: x must be bf16 CPU [rows, hidden] with hidden a multiple of 32, got ",
                    x_in.scalar_type(), " ", x_in.sizes());
  const int64_t rows = x_in.size(0), hidden = x_in.size(1);
  const int64_t head_dim = key_caches[0].dim() == 4 ? key_caches[0].size(3) : 0;
  TORCH_CHECK_VALUE(head_dim > 0 && head_dim % (2 * kTile) == 0 && num_heads > 0 && num_kv_heads > 0 &&
                        num_heads % num_kv_heads == 0,
                    "decoder_layers: head_dim (the caches' last dimension, ", head_dim,
                    ") must be a multiple of 32 and the heads a multiple of the KV heads");
  for (const at::Tensor* table : {&cos, &sin}) {
    TORCH_CHECK_VALUE(table->scalar_type() == at::kBFloat16 && table->is_contiguous() &&
                          table->sizes() == at::IntArrayRef({rows, head_dim}),
                      "decoder_layers: cos and sin must be contiguous bf16 [rows, head_dim]");
  }
  for (int64_t l = 0; l < layers; ++l) {
    for (const at::Tensor* norm : {&input_norms[l], &post_norms[l]}) {
      TORCH_CHECK_VALUE(norm->scalar_type() == at::kBFloat16 && norm->is_contiguous() &&
                            norm->sizes() == at::IntArrayRef({hidden}),
                        "decoder_layers: norm weights must be contiguous bf16 [hidden]");
    }
    TORCH_CHECK_VALUE(key_caches[l].scalar_type() == at::kBFloat16 && value_caches[l].scalar_type() == at::kBFloat16 &&
                          key_caches[l].dim() == 4 && key_caches[l].size(3) == head_dim,
                      "decoder_layers: caches must be bf16 [blocks, kv_heads, block_size, head_dim]");
  }
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
  at::Tensor x = x_in.clone();  // the residual stream, updated in place layer by layer
  if (rows == 0) return x;
  const auto options = x.options();
  at::Tensor normed = at::empty({rows, hidden}, options);
  at::Tensor queries = at::empty({rows, num_heads, head_dim}, options);
  at::Tensor keys = at::empty({rows, num_kv_heads, head_dim}, options);
  const BF16* cos_data = cos.data_ptr<BF16>();
  const BF16* sin_data = sin.data_ptr<BF16>();
  BF16* x_data = x.data_ptr<BF16>();
  for (int64_t l = 0; l < layers; ++l) {
    rms_norm_rows(x_data, nullptr, input_norms[l].data_ptr<BF16>(), normed.data_ptr<BF16>(), rows, hidden,
                  static_cast<float>(eps));
    const at::Tensor qkv = linear.call(normed, qkv_weights[l], c10::nullopt, qkv_size);
    rope_rows(qkv.data_ptr<BF16>(), qkv_size, 0, num_heads, head_dim, cos_data, sin_data, queries.data_ptr<BF16>(), rows);
    rope_rows(qkv.data_ptr<BF16>(), qkv_size, q_size, num_kv_heads, head_dim, cos_data, sin_data, keys.data_ptr<BF16>(),
              rows);
    const at::Tensor values = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, num_kv_heads, head_dim});
    write_kv.call(keys, values, key_caches[l], value_caches[l], slot_mapping, 1.0, 1.0, c10::nullopt, c10::nullopt);
    const at::Tensor attended = attention.call(queries, key_caches[l], value_caches[l], block_tables, seq_lens,
                                               query_start_loc, scale, 1.0, 0, 0.0, c10::nullopt, c10::nullopt);
    const at::Tensor projected = linear.call(attended.view({rows, q_size}), o_weights[l], c10::nullopt, hidden);
    rms_norm_rows(x_data, projected.data_ptr<BF16>(), post_norms[l].data_ptr<BF16>(), normed.data_ptr<BF16>(), rows,
                  hidden, static_cast<float>(eps));
    const at::Tensor activated =
        intermediate_size % kTile == 0
            ? linear_silu.call(normed, gate_up_weights[l], intermediate_size)
            : silu.call(linear.call(normed, gate_up_weights[l], c10::nullopt, 2 * intermediate_size));
    const at::Tensor mlp = linear.call(activated, down_weights[l], c10::nullopt, hidden);
    residual_rows(x_data, projected.data_ptr<BF16>(), mlp.data_ptr<BF16>(), rows * hidden);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY(kvserve_bf16, m) {
  m.def("bf16_linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor");
  m.def("bf16_row_argmax(Tensor logits) -> Tensor");
  m.def("bf16_linear_argmax(Tensor x, Tensor packed_weight, int out_features) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("bf16_linear_silu_mul(Tensor x, Tensor packed_weight, int intermediate) -> Tensor");
  m.def("decoder_layers(Tensor x, Tensor cos, Tensor sin, Tensor[] input_norms, Tensor[] qkv_weights, "
        "Tensor[] o_weights, Tensor[] post_norms, Tensor[] gate_up_weights, Tensor[] down_weights, "
        "Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor slot_mapping, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, int num_heads, int num_kv_heads, int intermediate_size, "
        "float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_bf16, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
  m.impl("bf16_row_argmax", &bf16_row_argmax);
  m.impl("bf16_linear_argmax", &bf16_linear_argmax);
  m.impl("silu_mul", &silu_mul);
  m.impl("bf16_linear_silu_mul", &bf16_linear_silu_mul);
  m.impl("decoder_layers", &decoder_layers);
}

TORCH_LIBRARY_IMPL(kvserve_bf16, Meta, m) {
  m.impl("bf16_linear", &bf16_linear_meta);
  m.impl("bf16_row_argmax", &bf16_row_argmax_meta);
  m.impl("bf16_linear_argmax", &bf16_linear_argmax_meta);
  m.impl("silu_mul", &silu_mul_meta);
  m.impl("bf16_linear_silu_mul", &bf16_linear_silu_mul_meta);
}
