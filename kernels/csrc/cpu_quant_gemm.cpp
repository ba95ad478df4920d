// Quantized-weight x int8-activation matrix products for the CPU (AVX-512 VNNI): the few-row
// matmuls of a decode step in kvserve's int4 mode (engine/quantization/int4_linear.py) and of
// int8 layers (int8_linear.py: the int8 mode, and the int4 mode's output layer).
//
// int4_gemm:
// Weights: 4-bit q in 0..15 per element, groups of 32 along K, each with an fp16 scale s and an
// fp16 minimum m (w = q * s + m: llama.cpp's Q4_1). Activations: each row's groups of 32 are
// quantized on the fly to int8 with one float scale d (x ~= d * xq: llama.cpp's Q8_1), so a
// group's dot product is s * d * sum(q * xq) + m * d * sum(xq), its integer part one
// `vpdpbusd` (unsigned q bytes x signed xq bytes) per 4 elements of 16 output channels.
//
// Layout (pack_int4 in kernels/cpu_quant_gemm.py builds it): per tile of 16 output channels and group of 32 inputs,
// 320 bytes: four 64-byte vectors of nibbles, then the 16 scales, then the 16 minima (fp16).
// Byte 4 * r + b of vector v holds, for channel r, element 8 v + b in its low nibble and element
// 8 v + 4 + b in its high one: a vector's low nibbles times one broadcast 4-byte word of xq give
// 16 channels' partial sums in 16 lanes, with no horizontal reduction anywhere. A tile's weights
// are read once per call for all rows (up to kRowBlock rows per pass, from L1 after the first).
//
// int8_gemm: int8 weights w with one float scale per output channel (symmetric), stored as
// u = w + 128 so that `vpdpbusd` (unsigned x signed) applies: sum(w * xq) = sum(u * xq) -
// 128 * sum(xq). Per tile of 16 channels: per group of 32 inputs, eight 64-byte vectors (byte
// 4 r + b of vector j: channel r, element 4 j + b), then the 16 fp32 scales.
//
// Why our own: at one row torch's _weight_int4pack_mm_for_cpu and _weight_int8pack_mm convert
// the weights to float and are compute-bound, ~2x the time of integer products over the same
// bytes (benchmarks/quant_gemm.py), which is what llama.cpp's q4_1 x q8_1 dot does.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VNNI__)
#error "cpu_quant_gemm needs AVX-512 (F, BW) and AVX-512 VNNI"
#endif

namespace {

constexpr int kTile = 16;        // output channels per tile: one 16-lane vector
constexpr int kGroup = 32;       // inputs per quantization group
constexpr int kTileBytes = 320;  // 4 x 64 nibble bytes + 16 fp16 scales + 16 fp16 minima
constexpr int kRowBlock = 4;     // activation rows per pass over a tile: their accumulators stay in registers
constexpr int kInt8GroupBytes = kTile * kGroup;  // int8 weights: 16 channels x 32 inputs per group

template <typename T>
inline __m512 load16(const T* p);

template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }

template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

template <>
inline __m512 load16<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// One row of K inputs -> int8 groups (xq), their scales d and d * sum(xq).
template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* xq, float* d, float* dsum) {
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const __m512 a = load16(x + g * kGroup), b = load16(x + g * kGroup + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float scale = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + g * kGroup), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + g * kGroup + 16), _mm512_cvtsepi32_epi8(qb));
    d[g] = scale;
    dsum[g] = scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
  }
}

template <typename T>
inline void store16(T* out, __m512 v) {
  alignas(64) float lanes[kTile];
  _mm512_store_ps(lanes, v);
  for (int i = 0; i < kTile; ++i) out[i] = static_cast<T>(lanes[i]);
}

template <>
inline void store16<float>(float* out, __m512 v) { _mm512_storeu_ps(out, v); }

// Rows [0, R) of one tile: out[r, 16 channels] for every r.
template <int R, typename T>
void tile_rows(const uint8_t* tile, int64_t groups, const int8_t* xq, const float* d, const float* dsum, int64_t k,
               T* out, int64_t n) {
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* p = tile + g * kTileBytes;
    __m512i w[8];
    for (int v = 0; v < 4; ++v) {
      const __m512i raw = _mm512_loadu_si512(p + 64 * v);
      w[2 * v] = _mm512_and_si512(raw, low_mask);
      w[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low_mask);
    }
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 256)));
    const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 288)));
    for (int r = 0; r < R; ++r) {
      const int32_t* words = reinterpret_cast<const int32_t*>(xq + r * k + g * kGroup);
      __m512i dot = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) dot = _mm512_dpbusd_epi32(dot, w[j], _mm512_set1_epi32(words[j]));
      const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(d[r * groups + g]));
      acc[r] = _mm512_fmadd_ps(scaled, scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(dsum[r * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store16(out + r * n, acc[r]);
}

// int8 weights, rows [0, R) of one tile; `correction` per row: 128 * sum over groups of d * sum(xq).
template <int R, typename T>
void tile_rows_int8(const uint8_t* tile, int64_t groups, const int8_t* xq, const float* d, const float* correction,
                    int64_t k, T* out, int64_t n) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* p = tile + g * kInt8GroupBytes;
    __m512i w[8];
    for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(p + 64 * j);
    for (int r = 0; r < R; ++r) {
      const int32_t* words = reinterpret_cast<const int32_t*>(xq + r * k + g * kGroup);
      __m512i dot = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) dot = _mm512_dpbusd_epi32(dot, w[j], _mm512_set1_epi32(words[j]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(d[r * groups + g]), acc[r]);
    }
  }
  const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(tile + groups * kInt8GroupBytes));
  for (int r = 0; r < R; ++r) store16(out + r * n, _mm512_mul_ps(_mm512_sub_ps(acc[r], _mm512_set1_ps(correction[r])), scale));
}

enum class Weights { kInt4, kInt8 };

template <typename T>
void gemm_typed(Weights weights, const at::Tensor& x, const at::Tensor& packed, at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), groups = k / kGroup, tiles = n / kTile;
  std::vector<int8_t> xq(m * k);
  std::vector<float> d(m * groups), dsum(m * groups), correction(m);
  const T* xp = x.data_ptr<T>();
  for (int64_t r = 0; r < m; ++r) {
    quantize_row(xp + r * k, k, xq.data() + r * k, d.data() + r * groups, dsum.data() + r * groups);
    double total = 0.0;
    for (int64_t g = 0; g < groups; ++g) total += dsum[r * groups + g];
    correction[r] = static_cast<float>(128.0 * total);
  }
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int64_t tile_bytes = packed.numel() / packed.size(0);
  T* op = out.data_ptr<T>();
  // A tile is ~5-10 KB of weights at K = 576: a few per task keeps the second core busy on small layers.
  const int64_t grain = std::max<int64_t>(1, 2048 / std::max<int64_t>(1, groups * m));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = wp + t * tile_bytes;
      for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowBlock, m - r0));
        const int8_t* xr = xq.data() + r0 * k;
        const float* dr = d.data() + r0 * groups;
        T* o = op + r0 * n + t * kTile;
        if (weights == Weights::kInt4) {
          const float* sr = dsum.data() + r0 * groups;
          switch (rows) {
            case 4: tile_rows<4>(tile, groups, xr, dr, sr, k, o, n); break;
            case 3: tile_rows<3>(tile, groups, xr, dr, sr, k, o, n); break;
            case 2: tile_rows<2>(tile, groups, xr, dr, sr, k, o, n); break;
            default: tile_rows<1>(tile, groups, xr, dr, sr, k, o, n); break;
          }
        } else {
          const float* cr = correction.data() + r0;
          switch (rows) {
            case 4: tile_rows_int8<4>(tile, groups, xr, dr, cr, k, o, n); break;
            case 3: tile_rows_int8<3>(tile, groups, xr, dr, cr, k, o, n); break;
            case 2: tile_rows_int8<2>(tile, groups, xr, dr, cr, k, o, n); break;
            default: tile_rows_int8<1>(tile, groups, xr, dr, cr, k, o, n); break;
          }
        }
      }
    }
  });
}

at::Tensor gemm(Weights weights, const at::Tensor& x, const at::Tensor& packed, int64_t groups) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && packed.device().is_cpu(), "quantized gemm: tensors must be on the CPU");
  TORCH_CHECK_VALUE(x.dim() == 2, "quantized gemm: x must be [rows, K], got ", x.dim(), " dims");
  TORCH_CHECK_VALUE(groups * kGroup == x.size(1), "quantized gemm: x has K = ", x.size(1), ", the weights ",
                    groups * kGroup);
  const at::Tensor xc = x.contiguous();
  const at::Tensor pc = packed.contiguous();
  at::Tensor out = at::empty({x.size(0), packed.size(0) * kTile}, x.options());
  if (x.size(0) == 0) return out;
  switch (x.scalar_type()) {
    case at::kFloat: gemm_typed<float>(weights, xc, pc, out); break;
    case at::kBFloat16: gemm_typed<c10::BFloat16>(weights, xc, pc, out); break;
    case at::kHalf: gemm_typed<c10::Half>(weights, xc, pc, out); break;
    default: TORCH_CHECK_VALUE(false, "quantized gemm: x must be float32, bfloat16 or float16, got ", x.scalar_type());
  }
  return out;
}

at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK_VALUE(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(2) == kTileBytes,
                    "int4 gemm: packed weights must be uint8 [N/16, K/32, 320] from kvserve's int4 packing");
  return gemm(Weights::kInt4, x, packed, packed.size(1));
}

at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK_VALUE(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.size(1) % kInt8GroupBytes == 64,
                    "int8 gemm: packed weights must be uint8 [N/16, K/32 * 512 + 64] from kvserve's int8 packing");
  return gemm(Weights::kInt8, x, packed, packed.size(1) / kInt8GroupBytes);
}

at::Tensor gemm_meta(const at::Tensor& x, const at::Tensor& packed) {
  return at::empty_symint({x.sym_size(0), packed.sym_size(0) * kTile}, x.options());
}

}  // namespace

TORCH_LIBRARY(kvserve_quant, m) {
  m.def("int4_gemm(Tensor x, Tensor packed) -> Tensor");
  m.def("int8_gemm(Tensor x, Tensor packed) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_quant, CPU, m) {
  m.impl("int4_gemm", &int4_gemm);
  m.impl("int8_gemm", &int8_gemm);
}

TORCH_LIBRARY_IMPL(kvserve_quant, Meta, m) {
  m.impl("int4_gemm", &gemm_meta);
  m.impl("int8_gemm", &gemm_meta);
}
