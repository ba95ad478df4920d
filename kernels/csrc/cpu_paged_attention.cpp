// Paged attention on the CPU that reads K/V in place, through the block tables, and the KV-cache
// write beside it.
//
// Same contracts as kvserve.kernels.torch_attention.paged_attention / write_kv_cache (cache layout
// [num_blocks, num_kv_heads, block_size, head_dim]); built and loaded by cpu_kernel_build.py.
//
// One work item = (request, KV head, tile of that request's query tokens):
//
//     rows of a tile   r = (token - t0) * group + g      g = query head within the KV head's group
//     for each chunk of 16 keys of the request (up to the tile's last causal position):
//         for each block of <= 4 rows (their accumulators in registers):
//             parts[r, j] = q[r] * k[j], lane-wise      (q pre-scaled by scale * k_scale)
//             scores[r, :] = reduce16(parts[r, :])      (16 dot products finished in one shuffle tree)
//             online softmax in fp32: m[r], l[r], acc[r] rescaled when the running max grows
//             acc[r] += p[r, j] * v[j]
//     out[r] = acc[r] * v_scale / l[r]
//
// A decode is one tile of `group` rows, so the GQA heads sharing a KV head read each block once;
// a wider tile (prompt chunks) converts each chunk of K/V to fp32 once for all its row blocks.
// The next block is prefetched while one computes (blocks lie anywhere in memory; the bf16 decode
// route asks further ahead, see segment_dot). Threads pull
// items from an atomic counter (prompt chunks, the expensive ones, first), so one long chunk next
// to many short decodes does not leave a thread idle; small calls run on the calling thread.
// Metadata is bounds-checked as it is read: a bad block id is an error, never an out-of-bounds read.
// A sliding window w (sliding_window > 0) starts each item at the block of its first row's window
// (the blocks before it are never read: a window group gives them back) and masks each row's
// keys before its own window start in the chunks it reads. A soft cap c > 0 (Gemma 2) turns each
// scaled score s into c * tanh(s / c) before the softmax, in both routes below.
//
// int8 caches carry a float32 scale per (token, KV head) beside the blocks: a key's scale multiplies
// its score (after the dot product), a value's its softmax weight (after the row sum, before P.V);
// tiles that convert a chunk to fp32 once multiply the scales in as they convert.
//
// bf16 caches on CPUs with AMX take another route for tiles of <= 16 rows (decodes included): the
// two products as tile matrix multiplications, the softmax per segment of 256 keys (segment_amx).
// bf16 chunks of 8 or more tokens (prompts, later chunks of one) on a bf16 or fp8 cache take a
// route of their own wherever AVX-512 BF16 is built: tiles of 16 tokens of one query head against
// K/V packed once per work item in the tile layouts (attend_prompt), multiplied in AMX tiles, or
// where there are none in vdpbf16ps; elsewhere fresh prompts of 64+ tokens go to torch's SDPA
// (kSdpaMinTokens).
// Without AMX, a bf16 tile of one token's rows (a decode) with AVX-512 BF16 (AMD Zen 4 and later,
// Cooper Lake) takes both products in vdpbf16ps on the cache's bf16 rows as they are, or on an
// fp8 or int8 cache's rows widened to bf16 (segment_dot: segments of 256 keys, one softmax step
// each, as the AMX route), instead of converting every K/V row to fp32 first. On AVX2 CPUs without
// AVX-512 (AMD Zen 2/3, older Intel), fp32, bf16 and fp16 caches take each tile's rows one at a
// time through a chunk in native 8-lane registers (chunk_avx2).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#ifdef __AMX_BF16__
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kRowsPerTile = 16;  // query rows that share one pass over the K/V blocks
constexpr int64_t kChunk = 16;        // keys per softmax step: one Vec of scores per row
constexpr int kRowBlock = 4;          // rows computed together, their accumulators in registers
// Below this much work (query rows x keys) one thread does it all: waking the pool and splitting
// costs more than a few microseconds of work saves (1 decode row of a small model is ~1k).
constexpr int64_t kMinParallelWork = int64_t{1} << 14;
constexpr int64_t kLanes = 16;        // floats per Vec
constexpr int64_t kMaxVectors = 16;   // head_dim <= 256

// A portable SIMD type (GCC/Clang vector extensions): 16 floats, one AVX-512 register where the
// machine has them, two or four narrower ones elsewhere. Explicit vectors rather than loops the
// compiler might vectorise: the first version, plain loops, ran at a third of this speed.
typedef float Vec __attribute__((vector_size(64)));
typedef float Vec8 __attribute__((vector_size(32)));
typedef float Vec4 __attribute__((vector_size(16)));
typedef uint16_t U16x16 __attribute__((vector_size(32)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));
#ifdef __FLT16_MAX__  // _Float16 exists (GCC >= 12, Clang >= 15 on x86-64)
typedef _Float16 F16x16 __attribute__((vector_size(32)));
#endif
typedef uint8_t U8x16 __attribute__((vector_size(16)));
typedef int8_t I8x16 __attribute__((vector_size(16)));
typedef int16_t I16x16 __attribute__((vector_size(32)));
typedef int32_t I32x16 __attribute__((vector_size(64)));
typedef int32_t I32x8 __attribute__((vector_size(32)));

// ---- loading 16 elements as fp32 ---------------------------------------------------------------

inline Vec load16(const float* src) {
  Vec v;
  std::memcpy(&v, src, sizeof(v));
  return v;
}

// GCC lowers the generic widening conversions below to several 128-bit pieces (each load of
// 16 bf16 cost 5 shuffle-port instructions; fp16 was converted one scalar at a time): with
// AVX-512 each load is one widening instruction instead. The generic code serves elsewhere.
inline Vec load16(const c10::BFloat16* src) {  // bf16 is the top half of an fp32
#ifdef __AVX512F__
  return (Vec)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))), 16);
#else
  U16x16 bits;
  std::memcpy(&bits, src, sizeof(bits));
  return (Vec)(__builtin_convertvector(bits, U32x16) << 16);
#endif
}

inline Vec load16(const c10::Half* src) {
#ifdef __AVX512F__
  return (Vec)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
#elif defined(__FLT16_MAX__)
  F16x16 halves;
  std::memcpy(&halves, src, sizeof(halves));
  return __builtin_convertvector(halves, Vec);
#else
  Vec v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(src[i]);
  return v;
#endif
}

// e4m3fn -> fp32 in integer vector ops: a normal code's exponent and mantissa bits, shifted into
// fp32's fields, need only the exponent rebiased (+120); subnormal codes (exponent 0) are
// mantissa * 2^-9. No arithmetic on fp32 subnormals: the CPU's microcode assist for those made
// an earlier multiply-by-2^120 version 3x slower. 0x7f/0xff are NaN in e4m3fn.
inline Vec load16(const c10::Float8_e4m3fn* src) {
#ifdef __AVX512F__
  const U32x16 wide = (U32x16)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
#else
  U8x16 codes;
  std::memcpy(&codes, src, sizeof(codes));
  // Widened in two steps: GCC turns a direct u8 -> u32 conversion into 16 scalar inserts.
  const U32x16 wide = __builtin_convertvector(__builtin_convertvector(codes, U16x16), U32x16);
#endif
  const I32x16 magnitude = (I32x16)(wide & 0x7f);
  const Vec normal = (Vec)((magnitude << 20) + (120 << 23));
  const Vec subnormal = __builtin_convertvector(magnitude, Vec) * 0x1p-9f;
  const Vec unsigned_value = magnitude < 8 ? subnormal : normal;
  const Vec value = (Vec)((U32x16)unsigned_value | ((wide & 0x80) << 24));
  return magnitude == 0x7f ? Vec{} + std::numeric_limits<float>::quiet_NaN() : value;
}

inline Vec load16(const int8_t* src) {
#ifdef __AVX512F__
  return (Vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
#else
  I8x16 codes;
  std::memcpy(&codes, src, sizeof(codes));
  // In steps, as for e4m3 above: a direct conversion becomes scalar inserts.
  return __builtin_convertvector(__builtin_convertvector(__builtin_convertvector(codes, I16x16), I32x16), Vec);
#endif
}

// n <= 16 per-key scales (an int8 cache's), lanes past n zero: never reads past the block's row.
inline Vec load_scales(const float* src, int64_t n) {
  Vec v{};
  std::memcpy(&v, src, n * sizeof(float));
  return v;
}

// ---- storing 16 fp32 values as the output dtype ----------------------------------------------

inline void store16(float* dst, Vec v) { std::memcpy(dst, &v, sizeof(v)); }

inline void store16(c10::BFloat16* dst, Vec v) {
  // Round to nearest even, NaN to the canonical 0x7fc0: what c10::BFloat16(float) does per element.
  const U32x16 bits = (U32x16)v;
  const U32x16 rounded = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16;
  const U32x16 out = (U32x16)(v != v ? (I32x16{} + 0x7fc0) : (I32x16)rounded);
#ifdef __AVX512F__
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16((__m512i)out));
#else
  const U16x16 narrow = __builtin_convertvector(out, U16x16);
  std::memcpy(dst, &narrow, sizeof(narrow));
#endif
}

inline void store16(c10::Half* dst, Vec v) {
#ifdef __AVX512F__
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  for (int i = 0; i < kLanes; ++i) dst[i] = static_cast<c10::Half>(v[i]);
#endif
}

inline float hsum(Vec v) {
  Vec8 lo, hi;
  std::memcpy(&lo, &v, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
  const Vec8 eight = lo + hi;
  Vec4 a, b;
  std::memcpy(&a, &eight, sizeof(a));
  std::memcpy(&b, reinterpret_cast<const char*>(&eight) + sizeof(a), sizeof(b));
  const Vec4 four = a + b;
  return (four[0] + four[2]) + (four[1] + four[3]);
}

inline Vec vmax(Vec a, Vec b) { return a > b ? a : b; }

// A shuffle tree: 4 steps rather than 15 lane extracts (each a shuffle of its own).
inline float hmax(Vec v) {
  v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}

// exp for x <= 0 (scores minus their running max), Cephes' expf polynomial (~1 ulp), in vector
// operations: libm's expf is scalar, and a third of the time went there. Below -70 the result is
// 0: such a weight (< 4e-31 against the row's largest, 1) changes nothing in fp32, and products
// of tinier weights with V would be fp32 subnormals, which cost a microcode assist each. -inf
// (masked) gives 0 too.
template <typename V, typename I>
inline V exp_nonpositive_of(V x) {
  const V zero{};
  const V cutoff = zero - 70.0f;
  const V clamped = x > cutoff ? x : cutoff;
  const V round_magic = zero + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const V n = (clamped * 1.44269504088896341f + round_magic) - round_magic;
  const V r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  V p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const V two_n = (V)((__builtin_convertvector(n, I) + 127) << 23);
  return x > cutoff ? p * two_n : zero;
}

inline Vec exp_nonpositive(Vec x) { return exp_nonpositive_of<Vec, I32x16>(x); }

// c * tanh(s / c) for each score s: attention-logit soft-capping (Gemma 2), in vector operations
// like exp_nonpositive. tanh|x| = (1 - e) / (1 + e) with e = exp(-2|x|) <= 1; below |x| = 1/16,
// where 1 - e would cancel, its Taylor series to x^5 (truncation < 1e-9 relative there).
inline Vec soft_cap16(Vec s, float cap) {
  const Vec x = s / cap;
  const Vec magnitude = x < 0.0f ? -x : x;
  const Vec e = exp_nonpositive(-2.0f * magnitude);
  const Vec x2 = x * x;
  const Vec series = magnitude * (1.0f + x2 * (-1.0f / 3.0f + x2 * (2.0f / 15.0f)));
  const Vec t = magnitude < 0.0625f ? series : (1.0f - e) / (1.0f + e);
  return (x < 0.0f ? -t : t) * cap;
}

// ---- metadata ------------------------------------------------------------------------------

// seq_lens, query_start_loc and block_tables may each be int32 or int64.
struct IndexView {
  const void* data;
  bool wide;
  int64_t stride;
  int64_t operator()(int64_t i, int64_t j = 0) const {
    const int64_t at = i * stride + j;
    return wide ? static_cast<const int64_t*>(data)[at] : static_cast<const int32_t*>(data)[at];
  }
};

IndexView view_of(const at::Tensor& t) {
  return IndexView{t.data_ptr(), t.scalar_type() == at::kLong, t.dim() == 2 ? t.stride(0) : 1};
}

struct WorkItem {
  int32_t seq;
  int32_t tile;
  int32_t kv_head;
  int32_t prompt;  // 1: a bf16 prompt chunk's item (attend_prompt), tiles of kPromptTokens tokens
};

struct Problem {
  const void* query;
  int64_t q_stride_t, q_stride_h;
  const void* key_cache;
  const void* value_cache;
  int64_t k_stride_b, k_stride_h, k_stride_s;
  int64_t v_stride_b, v_stride_h, v_stride_s;
  const float* key_scales;    // int8 caches: [num_blocks, kv_heads, block_size], contiguous rows; else null
  const float* value_scales;
  int64_t ks_stride_b, ks_stride_h, vs_stride_b, vs_stride_h;
  void* out;
  int64_t num_blocks, block_size, head_dim, num_heads, group, tokens_per_tile;
  IndexView block_tables, seq_lens, query_start_loc;
  int64_t max_blocks_per_seq;
  float score_scale, out_scale;
  int64_t window;  // sliding window w: position p sees keys p - w + 1 .. p; 0: full attention
  float soft_cap;  // c > 0: every scaled score s becomes c * tanh(s / c) (soft_cap16); 0: none
};

// Per-thread fp32 scratch, allocated once per call and thread.
struct Scratch {
  std::vector<Vec> q, acc;    // [rows, vectors]: pre-scaled queries, running outputs
  std::vector<Vec> q_pairs;   // [rows, vectors / 2]: the queries' bf16 as they are (segment_dot)
  std::vector<Vec> k, v;      // [kChunk, vectors]: a chunk of K/V converted once for several row blocks
  std::vector<Vec> parts;     // [kRowBlock, kChunk]: per-key partial dot products before reduce16
  std::vector<float> row_max, row_sum;
  std::vector<int64_t> visible;  // [rows]: keys of the current chunk each row may see
  std::vector<int64_t> hidden;   // [rows]: of those, how many leading ones lie before its window
  Scratch(int64_t rows, int64_t vectors)
      : q(rows * vectors), acc(rows * vectors), q_pairs((rows * vectors + 1) / 2), k(kChunk * vectors),
        v(kChunk * vectors), parts(kRowBlock * kChunk), row_max(rows), row_sum(rows), visible(rows), hidden(rows) {}
};

// Lane j of the result = the sum of parts[j]'s 16 lanes: 16 dot products finished in 15
// shuffle-and-add steps (a transpose folded into the adds), instead of 16 horizontal sums of
// ~8 dependent steps each. The order of the additions is fixed, so results are deterministic.
// reduce16_by combines with another operation (the prompt route's row maxima: vmax).
template <typename Combine>
inline Vec reduce16_by(const Vec* parts, Combine combine) {
  Vec t[8], u[4], v[2];
  for (int i = 0; i < 8; ++i) {  // lanes 0-7: key 2i's 8 partial sums, lanes 8-15: key 2i+1's
    const Vec a = parts[2 * i], b = parts[2 * i + 1];
    t[i] = combine(__builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
                   __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31));
  }
  for (int i = 0; i < 4; ++i) {  // 4 partial sums for each of keys 4i .. 4i+3
    const Vec a = t[2 * i], b = t[2 * i + 1];
    u[i] = combine(__builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27),
                   __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31));
  }
  for (int i = 0; i < 2; ++i) {  // 2 partial sums for each of keys 8i .. 8i+7
    const Vec a = u[2 * i], b = u[2 * i + 1];
    v[i] = combine(__builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29),
                   __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31));
  }
  return combine(__builtin_shufflevector(v[0], v[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
                 __builtin_shufflevector(v[0], v[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31));
}
inline Vec reduce16(const Vec* parts) { return reduce16_by(parts, [](Vec a, Vec b) { return a + b; }); }

// The online-softmax step of kRB rows for one chunk of n <= 16 keys, their scores in lanes:
// rescales the rows' running outputs and sums when their maximum grows, and writes the chunk's
// weights. Returns whether every row sees all n keys (always for decodes); a row that sees none
// is left as it was, its weights unwritten. soft_cap > 0 caps the scores first.
template <int kRB>
bool online_softmax(const Vec* row_scores, int64_t n, const int64_t* visible, const int64_t* hidden, int64_t NV,
                    float soft_cap, Vec* acc_out, float* row_max, float* row_sum, float (*weights)[kChunk]) {
  const Vec lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const Vec minus_inf = Vec{} - std::numeric_limits<float>::infinity();
  bool whole_chunk = true;
  for (int r = 0; r < kRB; ++r) {
    whole_chunk = whole_chunk && visible[r] >= n && hidden[r] <= 0;
    if (visible[r] <= 0 || visible[r] <= hidden[r]) continue;
    // Lanes past `visible` (keys this row may not see, or past the chunk: stale parts) and
    // before `hidden` (outside a sliding window) are masked.
    const Vec capped = soft_cap > 0.0f ? soft_cap16(row_scores[r], soft_cap) : row_scores[r];
    const Vec seen = lane < static_cast<float>(visible[r]) ? capped : minus_inf;
    const Vec scores = lane >= static_cast<float>(hidden[r]) ? seen : minus_inf;
    const float new_max = std::max(row_max[r], hmax(scores));
    const Vec p = exp_nonpositive(scores - new_max);
    std::memcpy(weights[r], &p, sizeof(p));
    if (new_max > row_max[r]) {
      const float correction = std::exp(row_max[r] - new_max);  // 0 on the first chunk (max was -inf)
      for (int64_t i = 0; i < NV; ++i) acc_out[r * NV + i] *= correction;
      row_sum[r] *= correction;
      row_max[r] = new_max;
    }
    row_sum[r] += hsum(p);
  }
  return whole_chunk;
}

// One row block (kRB query rows, a compile-time count so its accumulators live in registers)
// against one chunk of n <= 16 keys: scores, online-softmax update, and P.V. `src_t` is the
// cache's element type when the rows read the cache directly, float when they read a chunk
// converted once for several row blocks. Row r may see keys [hidden[r], visible[r]) of the n.
// k_scales / v_scales: the n keys' and values' scales of an int8 cache read directly (else null).
template <typename src_t, int kVectors, int kRB>
void chunk_rows(const src_t* k_rows, int64_t k_stride, const src_t* v_rows, int64_t v_stride, int64_t n,
                const int64_t* visible, const int64_t* hidden, int64_t vectors, float soft_cap, const Vec* q, Vec* acc_out,
                float* row_max, float* row_sum, Vec* parts, const float* k_scales, const float* v_scales) {
  const int64_t NV = kVectors > 0 ? kVectors : vectors;
  for (int64_t j = 0; j < n; ++j) {
    Vec k[kMaxVectors];
    for (int64_t i = 0; i < NV; ++i) k[i] = load16(k_rows + j * k_stride + i * kLanes);
    for (int r = 0; r < kRB; ++r) {
      Vec sum = q[r * NV] * k[0];
      for (int64_t i = 1; i < NV; ++i) sum += q[r * NV + i] * k[i];
      parts[r * kChunk + j] = sum;
    }
  }
  Vec scores[kRB];
  for (int r = 0; r < kRB; ++r) scores[r] = reduce16(parts + r * kChunk);
  if (k_scales != nullptr) {
    const Vec key_scale = load_scales(k_scales, n);
    for (int r = 0; r < kRB; ++r) scores[r] *= key_scale;
  }
  alignas(64) float weights[kRB][kChunk];
  const bool whole_chunk = online_softmax<kRB>(scores, n, visible, hidden, NV, soft_cap, acc_out, row_max, row_sum, weights);
  if (v_scales != nullptr) {  // the row sums are of the unscaled weights: only P.V sees the scales
    for (int r = 0; r < kRB; ++r)
      for (int64_t j = std::max<int64_t>(0, hidden[r]); j < std::min(n, visible[r]); ++j) weights[r][j] *= v_scales[j];
  }
  if (whole_chunk) {  // keys outer, rows inner: each V row is loaded once for the whole block
    Vec acc[kRB][kMaxVectors];
    for (int r = 0; r < kRB; ++r)
      for (int64_t i = 0; i < NV; ++i) acc[r][i] = acc_out[r * NV + i];
    for (int64_t j = 0; j < n; ++j) {
      Vec v[kMaxVectors];
      for (int64_t i = 0; i < NV; ++i) v[i] = load16(v_rows + j * v_stride + i * kLanes);
      for (int r = 0; r < kRB; ++r)
        for (int64_t i = 0; i < NV; ++i) acc[r][i] += weights[r][j] * v[i];
    }
    for (int r = 0; r < kRB; ++r)
      for (int64_t i = 0; i < NV; ++i) acc_out[r * NV + i] = acc[r][i];
    return;
  }
  // The causal diagonal: a row reads only the V rows it may see (an unseen row may hold
  // anything, and 0 * inf would still poison the sum).
  for (int r = 0; r < kRB; ++r) {
    Vec acc[kMaxVectors];
    for (int64_t i = 0; i < NV; ++i) acc[i] = acc_out[r * NV + i];
    for (int64_t j = std::max<int64_t>(0, hidden[r]); j < visible[r]; ++j) {
      for (int64_t i = 0; i < NV; ++i) acc[i] += weights[r][j] * load16(v_rows + j * v_stride + i * kLanes);
    }
    for (int64_t i = 0; i < NV; ++i) acc_out[r * NV + i] = acc[i];
  }
}

// kLocality: __builtin_prefetch's, 3 into L1 (prefetcht0), 2 into L2 (prefetcht1).
template <int kLocality = 3, typename kv_t>
void prefetch_rows(const kv_t* rows, int64_t count, int64_t stride, int64_t head_dim) {
  const int64_t bytes = head_dim * static_cast<int64_t>(sizeof(kv_t));
  for (int64_t j = 0; j < count; ++j) {
    const char* row = reinterpret_cast<const char*>(rows + j * stride);
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(row + at, 0, kLocality);
  }
}

constexpr int64_t kAmxMaxRows = 16;  // a tile's rows
constexpr int64_t kSegmentChunks = 16;  // keys per softmax step of a decode tile (AMX, vdpbf16ps): 16 chunks of 16

// One chunk of a segment: n <= 16 keys from first_key on, their K / V rows in the cache.
template <typename kv_t>
struct KeyChunkOf {
  const kv_t* k_rows;
  const kv_t* v_rows;
  int64_t n, first_key;
  const float* k_scales = nullptr;  // an int8 cache's n per-key scales (else null)
  const float* v_scales = nullptr;
};
using KeyChunk = KeyChunkOf<c10::BFloat16>;  // the AMX route's
constexpr int64_t kPromptTokens = 64;  // a prompt work item's query tokens (each of the group's heads)

#ifdef __AVX512BF16__
constexpr bool kPromptRoute = true;  // bf16 prompt chunks: attend_prompt
// The prompt route's layouts (see "bf16 prompt chunks" below), the same with AMX tiles or vdpbf16ps.
constexpr int64_t kPromptSegment = 512;   // keys per softmax step of a row tile
// Row strides of the scores (floats) and weights (bf16) buffers: one cache line past the segment,
// so a tile's 16 rows fall in different L1 sets (at a power-of-two stride they shared two).
constexpr int64_t kScoresStride = kPromptSegment + 16, kWeightsStride = kPromptSegment + 32;
constexpr int64_t kKeyGroup = 4 * kChunk;  // keys per S step: four key tiles, four independent accumulators

// Per-thread buffers of the prompt route, sized by the first prompt item a thread takes.
struct PromptScratch {
  std::vector<Vec> k_packed;        // [key tiles][D / 32][16 element pairs][16 keys] of bf16 pairs
  std::vector<Vec> v_packed;        // [key tiles / 2][D / 16][16 key pairs][16 elements] of bf16 pairs
  std::vector<Vec> prompt_scores;   // [16 rows][kPromptSegment] fp32
  std::vector<Vec> prompt_weights;  // [16 rows][kPromptSegment] bf16
  std::vector<Vec> prompt_output;   // [16 rows][D] fp32: one segment's P x V
  std::vector<Vec> prompt_acc;      // [16 rows][D] fp32: the running output
  std::vector<Vec> query_padded;    // [16 rows][D] bf16: a last row tile of fewer than 16 tokens
  // Room for a prompt item's packed K/V (`keys` a multiple of kKeyGroup) and its row tiles.
  void prepare_prompt(int64_t keys, int64_t vectors) {
    const int64_t tiles = keys / kChunk;
    if (static_cast<int64_t>(k_packed.size()) < tiles * vectors / 2 * kChunk) {
      k_packed.resize(tiles * vectors / 2 * kChunk);
      v_packed.resize(tiles * vectors / 2 * kChunk);
    }
    if (prompt_scores.empty()) {
      prompt_scores.resize(kAmxMaxRows * kScoresStride / kLanes);
      prompt_weights.resize(kAmxMaxRows * kWeightsStride / (2 * kLanes));
      prompt_output.resize(kAmxMaxRows * vectors);
      prompt_acc.resize(kAmxMaxRows * vectors);
      query_padded.resize(kAmxMaxRows * vectors / 2);
    }
  }
};
#else
constexpr bool kPromptRoute = false;
#endif

#ifdef __AMX_BF16__
// ---- bf16 caches through AMX ----------------------------------------------------------------
//
// On CPUs with AMX (and where Linux grants the tile state), a bf16 tile of up to 16 query rows
// with head_dim a multiple of 64 does its two products as tile matrix multiplications (16 x 16 x 32
// multiply-adds per instruction; the AVX-512 loop spent two thirds of a decode in arithmetic and
// per-chunk softmax bookkeeping). Keys go in segments of up to 16 chunks of 16:
//   S^T[16 keys, rows] = K_chunk [16 keys, D] x Q^T     per chunk (K tiles loaded from the cache)
//   one online-softmax step per row over the segment    (fp32 vectors, as chunk_rows)
//   O[rows, D] = P [rows, 32 keys] x V_pairs            accumulated in tiles across the segment
// A product of two bf16 numbers is exact in fp32, so the scores differ from the fp32 loop's only
// in the order of their sums; the weights are rounded to bf16 for P x V, as torch's bf16 path
// (the oracle) rounds its softmax before multiplying by V. Interleaving V rows 2m and 2m + 1
// works within 128-bit lanes, so output tile 2i holds elements 32i + {0-3, 8-11, 16-19, 24-27}
// and tile 2i + 1 the others: undone once, at the output. Measured on Sapphire Rapids, one
// thread: a decode step's attention at 16-64 rows x 128 keys 1.2-1.4x faster than the loop.
constexpr bool kAmx = true;

// The kernel's tile shapes for a tile of `rows` query rows.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile registers (GCC's tile intrinsics take them as literals, so the calls below spell the
// numbers): 0 holds a chunk's keys, later its V pairs; 4-7 accumulate four output tiles.
enum Tile { kKeys = 0, kQueryT = 1, kScoresT = 2, kWeights = 3 };

TileConfig tile_config(int64_t rows) {
  TileConfig c;
  const auto set = [&c](Tile t, int64_t r, int64_t bytes) {
    c.rows[t] = static_cast<uint8_t>(r);
    c.colsb[t] = static_cast<uint16_t>(bytes);
  };
  set(kKeys, kChunk, 64);         // 16 keys x 32 elements of D; as V: 16 key pairs x 16 elements
  set(kQueryT, kChunk, 64);       // 16 element pairs of D x 16 query rows (those past `rows` unused)
  set(kScoresT, kChunk, 64);      // 16 keys x 16 query rows, fp32
  set(kWeights, rows, 64);        // rows x 32 keys (two chunks)
  for (int t = 4; t < 8; ++t) set(static_cast<Tile>(t), rows, 64);  // rows x 16 elements of D, fp32
  return c;
}

// The prompt route's tile shapes (TileProducts): all eight tiles 16 rows x 64 bytes.
constexpr int64_t kPromptConfig = kAmxMaxRows + 1;  // AmxScratch::configure's key for them
TileConfig prompt_tile_config() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = kAmxMaxRows;
    c.colsb[t] = 64;
  }
  return c;
}
// Whether this process may use AMX: Linux hands out the tile state on request (once per process).
bool amx_usable() {
  static const bool usable = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return usable;
}

// Per-thread AMX scratch: loads the tile configuration for the rows in use (when they change)
// and releases the tiles when the thread's work is done.
struct AmxScratch : PromptScratch {
  int64_t configured_rows = 0;
  std::vector<Vec> query_t;      // [D / 32][16 pairs][16 rows] of bf16 pairs: Q^T, a tile per 32 elements of D
  std::vector<Vec> keys;         // [16][D] bf16: a partial chunk's keys, zero-padded to 16 rows
  std::vector<Vec> scores_t;     // [kSegmentChunks][16 keys][16 rows] fp32
  std::vector<Vec> scores;       // [kSegmentChunks]: one row's masked, scaled scores
  std::vector<Vec> weights;      // [kSegmentChunks / 2][16 rows][2 chunks x 16 keys] bf16
  std::vector<Vec> value_pairs;  // [4 tiles][16 pairs (two chunks)][16 elements] of bf16 pairs
  std::vector<Vec> output;       // [16 rows][D] fp32, tile order
  std::vector<float> correction;  // [16 rows]
  std::vector<KeyChunk> chunks;  // the segment being gathered
  explicit AmxScratch(int64_t vectors)
      : query_t(vectors / 2 * kChunk), keys(kChunk * vectors / 2), scores_t(kSegmentChunks * kChunk), scores(kSegmentChunks),
        weights(kSegmentChunks / 2 * kAmxMaxRows), value_pairs(4 * kChunk), output(kAmxMaxRows * vectors),
        correction(kAmxMaxRows) {
    chunks.reserve(kSegmentChunks);
  }
  ~AmxScratch() {
    if (configured_rows > 0) _tile_release();
  }
  void configure(int64_t rows) {
    if (rows == configured_rows) return;
    const TileConfig config = rows == kPromptConfig ? prompt_tile_config() : tile_config(rows);
    _tile_loadconfig(&config);
    configured_rows = rows;
  }
};

// Q^T as bf16 pairs for the tile's rows: query_t[i][k][r] = row r's elements 32i + 2k, 32i + 2k + 1.
void transpose_queries(const c10::BFloat16* const* rows_q, int64_t rows, int64_t head_dim, AmxScratch& a) {
  uint32_t* out = reinterpret_cast<uint32_t*>(a.query_t.data());
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(rows_q[r]);
    for (int64_t k = 0; k < head_dim / 2; ++k) out[(k / kChunk) * kChunk * kChunk + (k % kChunk) * kChunk + r] = pairs[k];
  }
}

// The gathered segment (up to kSegmentChunks chunks of one tile) for all `rows` rows: S^T per
// chunk, then one online-softmax step per row over the whole segment, then P x V accumulated in
// tiles across the segment, four output tiles at a time. Row r is at position first_position +
// r / group and sees the keys up to there. acc / row_max / row_sum: the rows' running state, as in chunk_rows.
void segment_amx(int64_t k_stride, int64_t v_stride, int64_t rows, int64_t first_position, int64_t group,
                 int64_t head_dim, float scale, float soft_cap, Vec* acc, float* row_max, float* row_sum, AmxScratch& a) {
  const int64_t NV = head_dim / kLanes, halves = head_dim / (2 * kLanes);
  const int64_t count = static_cast<int64_t>(a.chunks.size());
  for (int64_t c = 0; c < count; ++c) {  // S^T of each chunk
    const KeyChunk& chunk = a.chunks[c];
    // Blocks lie anywhere in memory: ask for the next chunk's keys, and this one's values for P x V.
    if (c + 1 < count) prefetch_rows(a.chunks[c + 1].k_rows, a.chunks[c + 1].n, k_stride, head_dim);
    prefetch_rows(chunk.v_rows, chunk.n, v_stride, head_dim);
    const c10::BFloat16* keys = chunk.k_rows;
    int64_t keys_stride = k_stride;
    if (chunk.n < kChunk) {  // the cache's rows past the chunk may lie past the block (or the cache): pad a copy
      c10::BFloat16* padded = reinterpret_cast<c10::BFloat16*>(a.keys.data());
      for (int64_t j = 0; j < kChunk; ++j) {
        if (j < chunk.n) std::memcpy(padded + j * head_dim, chunk.k_rows + j * k_stride, head_dim * sizeof(c10::BFloat16));
        else std::memset(padded + j * head_dim, 0, head_dim * sizeof(c10::BFloat16));
      }
      keys = padded;
      keys_stride = head_dim;
    }
    _tile_zero(2);
    for (int64_t i = 0; i < halves; ++i) {
      _tile_loadd(0, keys + i * 2 * kLanes, keys_stride * sizeof(c10::BFloat16));
      _tile_loadd(1, a.query_t.data() + i * kChunk, 64);
      _tile_dpbf16ps(2, 0, 1);
    }
    _tile_stored(2, a.scores_t.data() + c * kChunk, 64);
  }

  // Row r's scores are column r of each S^T: the softmax step, weights to bf16 (nearest even).
  const Vec lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const Vec minus_inf = Vec{} - std::numeric_limits<float>::infinity();
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(kChunk));
  const float* scores_t = reinterpret_cast<const float*>(a.scores_t.data());
  // Chunks 2u and 2u + 1 share weight tile u: row r's 32 weights at byte u * 1024 + r * 64.
  char* weights = reinterpret_cast<char*>(a.weights.data());
  const auto weights_at = [weights](int64_t c, int64_t r) { return weights + (c / 2) * kAmxMaxRows * 64 + r * 64 + (c % 2) * 32; };
  if (count % 2 == 1) {  // the last tile's second chunk is missing: no weight
    for (int64_t r = 0; r < rows; ++r) std::memset(weights_at(count, r), 0, 32);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t position = first_position + r / group;
    Vec segment_max = minus_inf;
    for (int64_t c = 0; c < count; ++c) {
      const int64_t visible = std::min(a.chunks[c].n, position - a.chunks[c].first_key + 1);
      const Vec scaled = (Vec)_mm512_i32gather_ps(column, scores_t + c * kChunk * kChunk + r, 4) * scale;
      const Vec scores = soft_cap > 0.0f ? soft_cap16(scaled, soft_cap) : scaled;
      a.scores[c] = lane < static_cast<float>(visible) ? scores : minus_inf;
      segment_max = vmax(segment_max, a.scores[c]);
    }
    const float new_max = std::max(row_max[r], hmax(segment_max));
    a.correction[r] = 1.0f;
    if (new_max == -std::numeric_limits<float>::infinity()) {  // the row sees none of these keys yet
      for (int64_t c = 0; c < count; ++c) std::memset(weights_at(c, r), 0, 32);
      continue;
    }
    Vec sum{};
    for (int64_t c = 0; c < count; ++c) {
      const Vec weight = exp_nonpositive(a.scores[c] - new_max);  // masked keys: 0
      sum += weight;
      const __m256bh rounded = _mm512_cvtneps_pbh((__m512)weight);
      std::memcpy(weights_at(c, r), &rounded, sizeof(rounded));
    }
    if (new_max > row_max[r]) {
      a.correction[r] = std::exp(row_max[r] - new_max);  // 0 on the first keys (max was -inf)
      row_sum[r] *= a.correction[r];
      row_max[r] = new_max;
    }
    row_sum[r] += hsum(sum);
  }

  // O = P x V over the segment, four output tiles (64 elements of D) at a time.
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t g = 0; g < NV; g += 4) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t c = 0; c < count; c += 2) {
      // V rows of chunks c, c + 1 as (key 2m, key 2m + 1) pairs, elements 32 (g / 2 + h) on; rows
      // past a chunk (or of a missing last chunk) are zero, never read.
      for (int64_t m = 0; m < kChunk; ++m) {
        const int64_t n = c + m / 8 < count ? a.chunks[c + m / 8].n : 0, j = 2 * (m % 8);
        const c10::BFloat16* v_rows = n > 0 ? a.chunks[c + m / 8].v_rows : nullptr;
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t at = (g / 2 + h) * 2 * kLanes;
          const __m512i first = j < n ? _mm512_loadu_si512(v_rows + j * v_stride + at) : zero;
          const __m512i second = j + 1 < n ? _mm512_loadu_si512(v_rows + (j + 1) * v_stride + at) : zero;
          _mm512_store_si512(a.value_pairs.data() + (2 * h) * kChunk + m, _mm512_unpacklo_epi16(first, second));
          _mm512_store_si512(a.value_pairs.data() + (2 * h + 1) * kChunk + m, _mm512_unpackhi_epi16(first, second));
        }
      }
      _tile_loadd(3, weights + (c / 2) * kAmxMaxRows * 64, 64);
      _tile_loadd(0, a.value_pairs.data(), 64);
      _tile_dpbf16ps(4, 3, 0);
      _tile_loadd(0, a.value_pairs.data() + kChunk, 64);
      _tile_dpbf16ps(5, 3, 0);
      _tile_loadd(0, a.value_pairs.data() + 2 * kChunk, 64);
      _tile_dpbf16ps(6, 3, 0);
      _tile_loadd(0, a.value_pairs.data() + 3 * kChunk, 64);
      _tile_dpbf16ps(7, 3, 0);
    }
    _tile_stored(4, a.output.data() + g, NV * 64);
    _tile_stored(5, a.output.data() + g + 1, NV * 64);
    _tile_stored(6, a.output.data() + g + 2, NV * 64);
    _tile_stored(7, a.output.data() + g + 3, NV * 64);
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t t = 0; t < NV; ++t) acc[r * NV + t] = acc[r * NV + t] * a.correction[r] + a.output[r * NV + t];
  }
  a.chunks.clear();
}

#else
constexpr bool kAmx = false;
bool amx_usable() { return false; }
#ifdef __AVX512BF16__
struct AmxScratch : PromptScratch {  // the prompt route's buffers only: no tiles here
  explicit AmxScratch(int64_t) {}
};
#else
struct AmxScratch {
  explicit AmxScratch(int64_t) {}
};
#endif
#endif

#ifdef __AVX512BF16__
// Cache rows as bf16, 32 or 16 elements (the prompt route packs them, the decodes' vdpbf16ps route
// multiplies them): a bf16 row as it is; an int8 row through load16's fp32 (|code| <= 128 is
// exact in bf16); an fp8 (e4m3fn) row widened exactly, every e4m3 value being a bf16 value, in
// 16-bit integer lanes: a normal code's exponent and mantissa shifted into bf16's fields, the
// exponent rebiased (+120); a subnormal code (exponent 0) is m * 2^-9, m = 0..7, from a table;
// 0x7f / 0xff are NaN. Through load16's fp32 (16 lanes and a conversion per 16 elements) the
// conversion was most of an fp8 decode's time.
alignas(64) constexpr uint16_t kE4m3SubnormalBf16[32] = {0x0000, 0x3b00, 0x3b80, 0x3bc0, 0x3c00, 0x3c20, 0x3c40, 0x3c60};
inline __m512i e4m3_to_bf16(__m512i code) {  // 32 codes, one per 16-bit lane
  const __m512i magnitude = _mm512_and_si512(code, _mm512_set1_epi16(0x7f));
  __m512i bits = _mm512_add_epi16(_mm512_slli_epi16(magnitude, 4), _mm512_set1_epi16(120 << 7));
  bits = _mm512_mask_permutexvar_epi16(bits, _mm512_cmplt_epu16_mask(magnitude, _mm512_set1_epi16(8)), magnitude,
                                       _mm512_load_si512(kE4m3SubnormalBf16));
  bits = _mm512_mask_mov_epi16(bits, _mm512_cmpeq_epi16_mask(magnitude, _mm512_set1_epi16(0x7f)), _mm512_set1_epi16(0x7fc0));
  return _mm512_or_si512(bits, _mm512_slli_epi16(_mm512_and_si512(code, _mm512_set1_epi16(0x80)), 8));
}
inline __m512bh load32_bf16(const c10::BFloat16* src) { return (__m512bh)_mm512_loadu_si512(src); }
inline __m512bh load32_bf16(const c10::Float8_e4m3fn* src) {
  return (__m512bh)e4m3_to_bf16(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))));
}
inline __m512bh load32_bf16(const int8_t* src) {  // |code| <= 128: exact in bf16
  return _mm512_cvtne2ps_pbh((__m512)load16(src + kLanes), (__m512)load16(src));  // (high half, low half)
}
inline __m256i load16_bf16(const c10::BFloat16* src) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)); }
inline __m256i load16_bf16(const c10::Float8_e4m3fn* src) {
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm512_castsi512_si256(e4m3_to_bf16(_mm512_cvtepu8_epi16(_mm256_zextsi128_si256(codes))));
}

// ---- bf16 prompt chunks: AMX tiles, or vdpbf16ps where there are none -------------------------
//
// A prompt chunk has many tokens for each query head, so this route makes a tile of 16
// consecutive tokens of ONE query head (loaded straight from the query, whose rows lie
// q_stride_t apart) and puts the keys in the other operand. segment_amx's S^T left each row's
// scores in a column (a gather per 16 scores) and chained two products into one accumulator per
// chunk: at 16 x 128-token prompts it ran ~2x vLLM's own kernel, and torch's SDPA (on gathered
// K/V) no faster. A work item (a sequence, a KV head, up to kPromptTokens of its tokens) packs the
// K/V rows it reads once, in the tile layouts, for all its heads' row tiles:
//   k_packed, per 16 keys and 32 elements of D: 16 element pairs x 16 keys  (a 16 x 16 transpose)
//   v_packed, per 32 keys and 16 elements of D: 16 key pairs x 16 elements  (two rows interleaved)
// Then per row tile and segment of up to kPromptSegment keys:
//   S[16 rows, keys] = Q x K^T, four key tiles at a time (four independent accumulators)
//   the online softmax per row over the segment, the scores in order in memory, and only over the
//     keys the row sees (the far side of the causal diagonal is never exponentiated)
//   O[16 rows, D] = P x V, four output tiles at a time; the weights rounded to bf16 as in segment_amx
// Chunks after earlier context work the same way (row r is at position context + its token).
// Without AMX (AMD Zen 4 and later, Cooper Lake; or where Linux refuses the tile state) the two
// products are the same tile operations spelled in vdpbf16ps (DotProducts), on the same packed
// K/V and the same softmax: each instruction multiplies one row's broadcast bf16 pair with a
// packed operand row's 16 pairs, which is what a tile multiply does for every row and pair.
// Without it, such prompts went to torch's SDPA on gathered K/V: 2.2x vLLM's attention time in a
// 2048-token prefill step on a 2-core Zen 4 (benchmarks/prefill_step.py).

constexpr float kLog2e = 1.4426950408889634f;

// 2^t for t <= 0 in ~10 vector operations (the prompt route's softmax is most of its time, and
// exp_nonpositive's range reduction costs more): t = n + f with n an integer and |f| <= 1/2,
// 2^f by Cephes' exp2f polynomial (~1 ulp), times 2^n by vscalefps. t is clamped at -125 first, so
// -inf and tiny weights (< 2^-125 of the row's largest, nothing in fp32 sums) stay normal numbers
// (no subnormal, no NaN from -inf - -inf).
inline __m512 exp2_nonpositive(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-125.0f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Rows r[0..15] of 16 x 32-bit elements -> their transpose, in place: 64 shuffles in 4 rounds.
inline void transpose16x16_epi32(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);      // per 128-bit lane L: r_i[4L], r_i+1[4L], r_i[4L+1], r_i+1[4L+1]
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);  //                      the same of columns 4L+2, 4L+3
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + k], lane L: column 4L + k of rows i .. i + 3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // column 4L + k = lane L of u[k], u[4 + k], u[8 + k], u[12 + k]
    const __m512i low_even = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88), low_odd = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xdd);
    const __m512i high_even = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88), high_odd = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xdd);
    r[k] = _mm512_shuffle_i32x4(low_even, high_even, 0x88);       // lanes 0 of the four
    r[4 + k] = _mm512_shuffle_i32x4(low_odd, high_odd, 0x88);     // lanes 1
    r[8 + k] = _mm512_shuffle_i32x4(low_even, high_even, 0xdd);   // lanes 2
    r[12 + k] = _mm512_shuffle_i32x4(low_odd, high_odd, 0xdd);    // lanes 3
  }
}

// Packs keys [0, padded) of the item's sequence and KV head (those past `num_keys` zero, so
// padding is finite: its scores are masked, its values meet weight 0).
template <typename kv_t>
void pack_prompt_kv(const Problem& p, const WorkItem& item, int64_t num_keys, int64_t padded, PromptScratch& a) {
  static const uint16_t kZeroRow[kLanes * kMaxVectors] = {};  // zero bits: 0 as bf16 and as fp8
  const int64_t D = p.head_dim, steps = D / 32, out_tiles = D / kLanes;
  const auto* key_cache = static_cast<const kv_t*>(p.key_cache);
  const auto* value_cache = static_cast<const kv_t*>(p.value_cache);
  int64_t cached_block_index = -1, block = 0;
  const auto rows_of = [&](int64_t key, const kv_t*& k_row, const kv_t*& v_row) {
    if (key >= num_keys) {
      k_row = v_row = reinterpret_cast<const kv_t*>(kZeroRow);
      return;
    }
    if (key / p.block_size != cached_block_index) {
      cached_block_index = key / p.block_size;
      block = p.block_tables(item.seq, cached_block_index);
      TORCH_CHECK_VALUE(block >= 0 && block < p.num_blocks, "block_tables[", item.seq, ", ", cached_block_index, "] = ", block,
                        " is outside the KV cache's ", p.num_blocks, " blocks");
    }
    const int64_t slot = key % p.block_size;
    k_row = key_cache + block * p.k_stride_b + item.kv_head * p.k_stride_h + slot * p.k_stride_s;
    v_row = value_cache + block * p.v_stride_b + item.kv_head * p.v_stride_h + slot * p.v_stride_s;
  };
  alignas(64) int16_t order[32];  // lane 2i <- the first row's element i, lane 2i + 1 <- the second's
  for (int i = 0; i < 16; ++i) order[2 * i] = static_cast<int16_t>(i), order[2 * i + 1] = static_cast<int16_t>(16 + i);
  const __m512i interleave = _mm512_load_si512(order);
  for (int64_t tile = 0; tile < padded / kChunk; ++tile) {
    const kv_t* k_rows[kChunk];
    const kv_t* v_rows[kChunk];
    for (int64_t j = 0; j < kChunk; ++j) rows_of(tile * kChunk + j, k_rows[j], v_rows[j]);
    for (int64_t s = 0; s < steps; ++s) {  // K: element pairs x keys
      __m512i r[kChunk];
      for (int64_t j = 0; j < kChunk; ++j) r[j] = (__m512i)load32_bf16(k_rows[j] + 32 * s);
      transpose16x16_epi32(r);
      Vec* out = a.k_packed.data() + (tile * steps + s) * kChunk;
      for (int64_t j = 0; j < kChunk; ++j) _mm512_store_si512(out + j, r[j]);
    }
    // V: this tile's 8 key pairs are rows 8 (tile % 2) .. of its 32-key block's tiles
    for (int64_t m = 0; m < kChunk / 2; ++m) {
      const int64_t pair_row = (tile % 2) * (kChunk / 2) + m;
      for (int64_t t = 0; t < out_tiles; ++t) {
        const __m256i first = load16_bf16(v_rows[2 * m] + kLanes * t);
        const __m256i second = load16_bf16(v_rows[2 * m + 1] + kLanes * t);
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1);
        _mm512_store_si512(a.v_packed.data() + ((tile / 2) * out_tiles + t) * kChunk + pair_row, _mm512_permutexvar_epi16(interleave, both));
      }
    }
  }
}

#ifdef __AMX_BF16__
// The route's two products in tiles (the thread's tiles configured for them: kPromptConfig).
struct TileProducts {
  // S[16 rows, 64 keys] += Q x K^T: `k` the first of four packed key tiles, `scores` row stride kScoresStride.
  static void scores(const c10::BFloat16* q, int64_t q_stride, int64_t /*rows*/, const Vec* k, int64_t steps, float* scores) {
    const int64_t next_tile = steps * kChunk;  // Vecs from one key tile's packing to the next
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; ++s) {
      _tile_loadd(4, q + 32 * s, q_stride);
      _tile_loadd(5, k + s * kChunk, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, k + next_tile + s * kChunk, 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, k + 2 * next_tile + s * kChunk, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, k + 3 * next_tile + s * kChunk, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, scores, kScoresStride * 4);
    _tile_stored(1, scores + kChunk, kScoresStride * 4);
    _tile_stored(2, scores + 2 * kChunk, kScoresStride * 4);
    _tile_stored(3, scores + 3 * kChunk, kScoresStride * 4);
  }
  // O[16 rows, 64 elements] = P x V over `pair_blocks` blocks of 32 keys: `v` the first block's
  // first packed tile (blocks NV * 16 Vecs apart), `out` row stride NV Vecs.
  static void values(const c10::BFloat16* weights, int64_t /*rows*/, const Vec* v, int64_t NV, int64_t pair_blocks, Vec* out) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t b = 0; b < pair_blocks; ++b, v += NV * kChunk) {
      _tile_loadd(4, weights + b * 2 * kChunk, kWeightsStride * 2);
      _tile_loadd(5, v, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, v + kChunk, 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, v + 2 * kChunk, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, v + 3 * kChunk, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, out, NV * 64);
    _tile_stored(1, out + 1, NV * 64);
    _tile_stored(2, out + 2, NV * 64);
    _tile_stored(3, out + 3, NV * 64);
  }
};
#endif

// The same two products in vdpbf16ps, four rows at a time (16 accumulators in registers), only
// over the row blocks that hold real rows: a tile multiply's C[r][n] += sum over pairs k of
// A[r][k] . B[k][n] is, per row r and pair k, one vdpbf16ps of A[r][k] broadcast with B's row k.
struct DotProducts {
  static inline __m512 pair_of(const void* at) { return (__m512)_mm512_set1_epi32(*static_cast<const int32_t*>(at)); }
  static void scores(const c10::BFloat16* q, int64_t q_stride, int64_t rows, const Vec* k, int64_t steps, float* scores) {
    const int64_t next_tile = steps * kChunk;
    const char* q_bytes = reinterpret_cast<const char*>(q);
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      __m512 acc[4][4];
      for (auto& row : acc) for (auto& v : row) v = _mm512_setzero_ps();
      for (int64_t s = 0; s < steps; ++s) {
        for (int64_t pair = 0; pair < kChunk; ++pair) {
          const Vec* b = k + s * kChunk + pair;
          const __m512bh b0 = (__m512bh)b[0], b1 = (__m512bh)b[next_tile], b2 = (__m512bh)b[2 * next_tile],
                         b3 = (__m512bh)b[3 * next_tile];
          for (int r = 0; r < 4; ++r) {
            const __m512bh a = (__m512bh)pair_of(q_bytes + (r0 + r) * q_stride + (32 * s + 2 * pair) * 2);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, b2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, b3);
          }
        }
      }
      for (int r = 0; r < 4; ++r) {
        for (int t = 0; t < 4; ++t) _mm512_storeu_ps(scores + (r0 + r) * kScoresStride + t * kChunk, acc[r][t]);
      }
    }
  }
  static void values(const c10::BFloat16* weights, int64_t rows, const Vec* v, int64_t NV, int64_t pair_blocks, Vec* out) {
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      __m512 acc[4][4];
      for (auto& row : acc) for (auto& x : row) x = _mm512_setzero_ps();
      const Vec* block = v;
      for (int64_t b = 0; b < pair_blocks; ++b, block += NV * kChunk) {
        for (int64_t pair = 0; pair < kChunk; ++pair) {
          const __m512bh v0 = (__m512bh)block[pair], v1 = (__m512bh)block[kChunk + pair], v2 = (__m512bh)block[2 * kChunk + pair],
                         v3 = (__m512bh)block[3 * kChunk + pair];
          for (int r = 0; r < 4; ++r) {
            const __m512bh w = (__m512bh)pair_of(weights + (r0 + r) * kWeightsStride + b * 2 * kChunk + 2 * pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w, v0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w, v1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], w, v2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], w, v3);
          }
        }
      }
      for (int r = 0; r < 4; ++r) {
        for (int t = 0; t < 4; ++t) _mm512_storeu_ps(reinterpret_cast<float*>(out + (r0 + r) * NV + t), acc[r][t]);
      }
    }
  }
};

// One row tile: `rows` <= 16 tokens of one query head from `first_position` on (q: their query
// rows, `q_stride` bytes apart, 16 readable), against the packed keys they see; writes the rows'
// outputs to `out` (out_stride elements apart).
template <typename Products>
void prompt_row_tile(const Problem& p, const c10::BFloat16* q, int64_t q_stride, int64_t rows, int64_t first_position,
                     c10::BFloat16* out, int64_t out_stride, PromptScratch& a) {
  const int64_t D = p.head_dim, NV = D / kLanes, steps = D / 32;
  const int64_t keys_seen = first_position + rows;  // the last row sees keys [0, keys_seen)
  const float minus_inf = -std::numeric_limits<float>::infinity();
  // The rows' running state, lane r for row r (in base 2: scores times log2 e).
  Vec row_max = Vec{} + minus_inf, row_sum{};
  alignas(64) float correction[kAmxMaxRows], shift[kAmxMaxRows];
  Vec seen_max[kAmxMaxRows], seen_sum[kAmxMaxRows];  // per row, lane-wise: the segment's maxima, weight sums
  int64_t vectors_of[kAmxMaxRows];
  __mmask16 last_of[kAmxMaxRows];
  std::fill(a.prompt_acc.begin(), a.prompt_acc.begin() + rows * NV, Vec{});
  float* scores = reinterpret_cast<float*>(a.prompt_scores.data());
  c10::BFloat16* weights = reinterpret_cast<c10::BFloat16*>(a.prompt_weights.data());
  for (int64_t s0 = 0; s0 < keys_seen; s0 += kPromptSegment) {
    const int64_t segment_keys = std::min(kPromptSegment, keys_seen - s0);
    const int64_t groups = (segment_keys + kKeyGroup - 1) / kKeyGroup;
    for (int64_t g = 0; g < groups; ++g) {  // S, 64 keys at a time
      const Vec* k = a.k_packed.data() + (s0 + g * kKeyGroup) / kChunk * steps * kChunk;
      Products::scores(q, q_stride, rows, k, steps, scores + g * kKeyGroup);
    }
    const int64_t pair_blocks = (segment_keys + 2 * kChunk - 1) / (2 * kChunk);  // P x V reads 32 keys at a time
    // The softmax step in base 2, in two passes over the rows; their maxima and sums are finished
    // for all 16 rows at once (reduce16_by) rather than one horizontal reduction per row.
    // The rows' largest scores: their raw dot products (the scale is > 0, so it keeps their
    // order), or, soft-capped, the capped scores (written back, in base 2, for the second pass).
    const float to_log2 = p.soft_cap > 0.0f ? 1.0f : p.score_scale * kLog2e;  // multiplies what the second pass reads
    for (int64_t r = 0; r < kAmxMaxRows; ++r) {
      float* row_scores = scores + r * kScoresStride;
      c10::BFloat16* row_weights = weights + r * kWeightsStride;
      const int64_t visible = r < rows ? std::min(segment_keys, first_position + r + 1 - s0) : 0;
      const int64_t vectors = visible > 0 ? (visible + kLanes - 1) / kLanes : 0;
      vectors_of[r] = vectors;
      for (int64_t c = vectors; c < pair_blocks * 2; ++c) {  // keys past the row's (P x V reads them): weight 0
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row_weights + c * kLanes), _mm256_setzero_si256());
      }
      __m512 raw_max = _mm512_set1_ps(minus_inf);  // stays so where the row sees none of these keys (or is padding)
      if (vectors > 0) {
        const __mmask16 last = static_cast<__mmask16>((1u << (visible - (vectors - 1) * kLanes)) - 1);  // the last vector's seen keys
        last_of[r] = last;
        if (p.soft_cap > 0.0f) {
          for (int64_t c = 0; c < vectors; ++c) {
            const Vec capped = soft_cap16(load16(row_scores + c * kLanes) * p.score_scale, p.soft_cap) * kLog2e;
            store16(row_scores + c * kLanes, capped);
            raw_max = _mm512_mask_max_ps(raw_max, c == vectors - 1 ? last : __mmask16(0xffff), raw_max, (__m512)capped);
          }
        } else {
          for (int64_t c = 0; c + 1 < vectors; ++c) raw_max = _mm512_max_ps(raw_max, _mm512_loadu_ps(row_scores + c * kLanes));
          raw_max = _mm512_mask_max_ps(raw_max, last, raw_max, _mm512_loadu_ps(row_scores + (vectors - 1) * kLanes));
        }
      }
      seen_max[r] = (Vec)raw_max;
    }
    const Vec new_max = vmax(row_max, reduce16_by(seen_max, vmax) * to_log2);  // -inf * to_log2 stays -inf
    // A row whose maximum grows rescales what it has: by 2^(old - new), 0 on its first keys
    // (old = -inf); rows whose maximum stays (those that see none of these keys included) by 1.
    const Vec grown_factor = (Vec)exp2_nonpositive((__m512)(row_max - new_max));
    const Vec factor = new_max > row_max ? (row_max == Vec{} + minus_inf ? Vec{} : grown_factor) : Vec{} + 1.0f;
    store16(correction, factor);
    store16(shift, Vec{} - new_max);
    row_max = new_max;
    for (int64_t r = 0; r < kAmxMaxRows; ++r) {  // the weights and their sums
      const float* row_scores = scores + r * kScoresStride;
      c10::BFloat16* row_weights = weights + r * kWeightsStride;
      const int64_t vectors = vectors_of[r];
      const __m512 scale = _mm512_set1_ps(to_log2), row_shift = _mm512_set1_ps(shift[r]);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t c = 0; c < vectors; ++c) {
        __m512 weight = exp2_nonpositive(_mm512_fmadd_ps(_mm512_loadu_ps(row_scores + c * kLanes), scale, row_shift));
        if (c == vectors - 1) weight = _mm512_maskz_mov_ps(last_of[r], weight);  // keys past the row's position: 0
        sum = _mm512_add_ps(sum, weight);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row_weights + c * kLanes), (__m256i)_mm512_cvtneps_pbh(weight));
      }
      seen_sum[r] = (Vec)sum;
    }
    row_sum = row_sum * factor + reduce16(seen_sum);
    for (int64_t d = 0; d < NV; d += 4) {  // O = P x V, 64 elements of D at a time
      Products::values(weights, rows, a.v_packed.data() + (s0 / (2 * kChunk) * NV + d) * kChunk, NV, pair_blocks,
                       a.prompt_output.data() + d);
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < NV; ++i) {
        a.prompt_acc[r * NV + i] = a.prompt_acc[r * NV + i] * correction[r] + a.prompt_output[r * NV + i];
      }
    }
  }
  alignas(64) float sums[kAmxMaxRows];
  store16(sums, row_sum);
  for (int64_t r = 0; r < rows; ++r) {
    const Vec normalised_scale = Vec{} + p.out_scale / sums[r];
    for (int64_t i = 0; i < NV; ++i) {
      const __m256bh rounded = _mm512_cvtneps_pbh((__m512)(a.prompt_acc[r * NV + i] * normalised_scale));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_stride + i * kLanes), (__m256i)rounded);
    }
  }
}

// A prompt work item: its tokens [tile * kPromptTokens, ...) of every query head of its KV head.
template <typename Products, typename kv_t>
void attend_prompt(const Problem& p, const WorkItem& item, PromptScratch& a) {
  const int64_t D = p.head_dim;
  const int64_t q_start = p.query_start_loc(item.seq);
  const int64_t q_len = p.query_start_loc(item.seq + 1) - q_start;
  const int64_t context_before = p.seq_lens(item.seq) - q_len;
  const int64_t t0 = item.tile * kPromptTokens, t1 = std::min(q_len, t0 + kPromptTokens);
  const int64_t num_keys = context_before + t1;
  const int64_t padded = (num_keys + kKeyGroup - 1) / kKeyGroup * kKeyGroup;
  a.prepare_prompt(padded, D / kLanes);
  pack_prompt_kv<kv_t>(p, item, num_keys, padded, a);
  const auto* query = static_cast<const c10::BFloat16*>(p.query);
  auto* out = static_cast<c10::BFloat16*>(p.out);
  for (int64_t g = 0; g < p.group; ++g) {
    const int64_t head = item.kv_head * p.group + g;
    for (int64_t t = t0; t < t1; t += kAmxMaxRows) {
      const int64_t rows = std::min(kAmxMaxRows, t1 - t);
      const c10::BFloat16* q = query + (q_start + t) * p.q_stride_t + head * p.q_stride_h;
      int64_t q_stride = p.q_stride_t * static_cast<int64_t>(sizeof(c10::BFloat16));
      if (rows < kAmxMaxRows) {  // rows past the chunk may lie past the query: a zero-padded copy
        auto* padded_q = reinterpret_cast<c10::BFloat16*>(a.query_padded.data());
        for (int64_t r = 0; r < kAmxMaxRows; ++r) {
          if (r < rows) std::memcpy(padded_q + r * D, q + r * p.q_stride_t, D * sizeof(c10::BFloat16));
          else std::memset(padded_q + r * D, 0, D * sizeof(c10::BFloat16));
        }
        q = padded_q;
        q_stride = D * static_cast<int64_t>(sizeof(c10::BFloat16));
      }
      prompt_row_tile<Products>(p, q, q_stride, rows, context_before + t, out + ((q_start + t) * p.num_heads + head) * D, p.num_heads * D, a);
    }
  }
}

#endif  // __AVX512BF16__

// Undoes the element order of P x V over interleaved key pairs (segment_amx, segment_dot):
// accumulators 2i and 2i + 1 -> elements 32i .. 32i + 31.
inline void unpermute_pairs(Vec low, Vec high, Vec& first, Vec& second) {
  first = __builtin_shufflevector(low, high, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  second = __builtin_shufflevector(low, high, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
}

#ifdef __AVX512BF16__
// ---- bf16 decodes through vdpbf16ps (no AMX) --------------------------------------------------
//
// chunk_rows converts every K and V row to fp32 and multiplies in fp32: on a CPU without AMX
// those conversions and FMAs are most of a decode's attention when its K/V are in cache. Here
// both products take the cache's bf16 rows as they are, a segment of up to kSegmentChunks chunks
// (256 keys) at a time, as the AMX route does:
//   scores: vdpbf16ps of a row's bf16 query with a key row, 32 elements of D an instruction,
//           16 lanes of pair sums finished by reduce16 per chunk, then scaled (score_scale)
//   one online-softmax step per row over the whole segment: one maximum, the exps of all its
//           scores (independent of each other, so they overlap), one rescale of the running output
//   P x V:  the weights rounded to bf16 (as the AMX route and torch's bf16 path round them),
//           multiplied with V rows 2m and 2m + 1 interleaved (unpacklo/hi_epi16) as pairs, the
//           accumulators in registers across the segment; accumulator 2i holds elements
//           32i + {0-3, 8-11, 16-19, 24-27} and 2i + 1 the rest: undone once, at the output
//           (unpermute_pairs)
// K/V come from memory in a decode step, so the reads are asked for ahead, into L2 (prefetcht1;
// into L1 the segment's K would evict itself): attend_tile asks for each block's K rows as it
// gathers the segment, the scores ask for each chunk's V rows (P x V reads them next), and P x V
// asks for the next KV head's K rows of the same chunk: the thread's next work item, as it claims
// every KV head of a sequence at once (items_per_claim). Measured on a 2-core AMD EPYC Zen 4,
// SmolLM2's layer, both threads, 30 layers' caches on huge pages (benchmarks/attention_kernels.py
// --calls --huge-pages --baseline 6831ce5), against the first version (a softmax step per chunk
// of 16, each chunk waiting on the last one's maximum, exp and sum; the next block asked for into
// L1): 64 decodes of 256 tokens 752 -> 480 us a call, of 1024 tokens 2,956 -> 1,771 us. In a
// 64-row decode step of the engine (prompts of 200 tokens) attention fell from 20.2 to 12.9 ms,
// the step from 72 to 63.6 ms.
// An fp8 cache (bf16 queries) takes the same route, its rows widened to bf16 as they are loaded
// (load32_bf16), its scales in score_scale and out_scale as everywhere: 64 decodes of 256 tokens
// 844 -> 468 us a call, against the fp32 loop it took before (measured as above, --dtypes fp8).
// An int8 cache too: its per-key scales multiply the scores, its per-value scales the weights P x V
// reads (the row sums stay of the unscaled weights, as in chunk_rows); W64 offline with
// --kv-cache-dtype int8 1.06x and 1.10x in two alternating pairs against the fp32 loop.
// A bf16 x bf16 product is exact in fp32: the scores differ from chunk_rows' only in the order of
// their sums. Only tiles whose rows are one token's (decodes: every row sees every key of every
// chunk it reads) and no window take it, so a chunk's V rows are all seen and a missing partner
// of an odd last key is zero. next_keys: where the next KV head's K rows lie from this head's
// (elements), 0 if there is none.
template <typename kv_t, int kVectors, int kRB>
void segment_dot(const KeyChunkOf<kv_t>* chunks, int64_t count, int64_t k_stride, int64_t v_stride, int64_t next_keys,
                 float score_scale, float soft_cap, const Vec* q_pairs, Vec* acc_out, float* row_max, float* row_sum, Vec* parts) {
  static_assert(kVectors > 0 && kVectors % 2 == 0, "head_dim must be a multiple of 32");
  constexpr int kPairs = kVectors / 2;  // 64-byte vectors of 32 bf16 per row
  const Vec lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const Vec minus_inf = Vec{} - std::numeric_limits<float>::infinity();
  __m512bh q[kRB][kPairs];
  for (int r = 0; r < kRB; ++r)
    for (int i = 0; i < kPairs; ++i) q[r][i] = (__m512bh)_mm512_load_si512(q_pairs + r * kPairs + i);
  Vec scores[kRB][kSegmentChunks];
  Vec segment_max[kRB];
  for (int r = 0; r < kRB; ++r) segment_max[r] = minus_inf;
  for (int64_t c = 0; c < count; ++c) {
    const KeyChunkOf<kv_t>& chunk = chunks[c];
    prefetch_rows<2>(chunk.v_rows, chunk.n, v_stride, kVectors * kLanes);
    for (int64_t j = 0; j < chunk.n; ++j) {
      __m512bh k[kPairs];
      for (int i = 0; i < kPairs; ++i) k[i] = load32_bf16(chunk.k_rows + j * k_stride + i * 32);
      for (int r = 0; r < kRB; ++r) {
        __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[r][0], k[0]);
        for (int i = 1; i < kPairs; ++i) sum = _mm512_dpbf16_ps(sum, q[r][i], k[i]);
        parts[r * kChunk + j] = (Vec)sum;
      }
    }
    const Vec key_scale = chunk.k_scales ? load_scales(chunk.k_scales, chunk.n) : Vec{} + 1.0f;
    for (int r = 0; r < kRB; ++r) {  // lanes past n hold stale parts: masked
      const Vec scaled = reduce16(parts + r * kChunk) * score_scale * key_scale;
      const Vec capped = soft_cap > 0.0f ? soft_cap16(scaled, soft_cap) : scaled;
      scores[r][c] = lane < static_cast<float>(chunk.n) ? capped : minus_inf;
      segment_max[r] = vmax(segment_max[r], scores[r][c]);
    }
  }
  alignas(64) int32_t weight_pairs[kRB][kSegmentChunks][kChunk / 2];  // (w[2m], w[2m + 1]) as bf16; masked lanes 0
  float correction[kRB];
  for (int r = 0; r < kRB; ++r) {
    const float new_max = std::max(row_max[r], hmax(segment_max[r]));  // finite: every chunk has a key
    Vec sum{};
    for (int64_t c = 0; c < count; ++c) {
      const Vec weight = exp_nonpositive(scores[r][c] - new_max);
      sum += weight;  // the row sums are of the unscaled weights: only P x V sees a value's scale
      const Vec pv_weight = chunks[c].v_scales ? weight * load_scales(chunks[c].v_scales, chunks[c].n) : weight;
      const __m256bh rounded = _mm512_cvtneps_pbh((__m512)pv_weight);
      std::memcpy(weight_pairs[r][c], &rounded, sizeof(rounded));
    }
    correction[r] = new_max > row_max[r] ? std::exp(row_max[r] - new_max) : 1.0f;  // 0 on the first segment
    row_sum[r] = row_sum[r] * correction[r] + hsum(sum);
    row_max[r] = new_max;
  }
  __m512 acc[kRB][kVectors];
  for (int r = 0; r < kRB; ++r)
    for (int i = 0; i < kVectors; ++i) acc[r][i] = (__m512)(acc_out[r * kVectors + i] * correction[r]);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t c = 0; c < count; ++c) {
    const KeyChunkOf<kv_t>& chunk = chunks[c];
    if (next_keys != 0) prefetch_rows<2>(chunk.k_rows + next_keys, chunk.n, k_stride, kVectors * kLanes);
    for (int64_t m = 0; m < chunk.n; m += 2) {
      __m512bh low[kPairs], high[kPairs];
      for (int i = 0; i < kPairs; ++i) {
        const __m512i first = (__m512i)load32_bf16(chunk.v_rows + m * v_stride + i * 32);
        const __m512i second = m + 1 < chunk.n ? (__m512i)load32_bf16(chunk.v_rows + (m + 1) * v_stride + i * 32) : zero;
        low[i] = (__m512bh)_mm512_unpacklo_epi16(first, second);
        high[i] = (__m512bh)_mm512_unpackhi_epi16(first, second);
      }
      for (int r = 0; r < kRB; ++r) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(weight_pairs[r][c][m / 2]);
        for (int i = 0; i < kPairs; ++i) {
          acc[r][2 * i] = _mm512_dpbf16_ps(acc[r][2 * i], low[i], w);
          acc[r][2 * i + 1] = _mm512_dpbf16_ps(acc[r][2 * i + 1], high[i], w);
        }
      }
    }
  }
  for (int r = 0; r < kRB; ++r)
    for (int i = 0; i < kVectors; ++i) acc_out[r * kVectors + i] = (Vec)acc[r][i];
}

// Rows [r0, r0 + rows) of a decode tile against a segment, rows <= kRowBlock (see segment_dot).
template <typename kv_t, int kVectors>
void segment_row_block_dot(int64_t rows, const KeyChunkOf<kv_t>* chunks, int64_t count, int64_t k_stride, int64_t v_stride,
                           int64_t next_keys, float score_scale, float soft_cap, Scratch& s, int64_t r0) {
  const auto args = std::make_tuple(chunks, count, k_stride, v_stride, next_keys, score_scale, soft_cap,
                                    s.q_pairs.data() + r0 * kVectors / 2, s.acc.data() + r0 * kVectors, s.row_max.data() + r0,
                                    s.row_sum.data() + r0, s.parts.data());
  switch (rows) {
    case 1: return std::apply(segment_dot<kv_t, kVectors, 1>, args);
    case 2: return std::apply(segment_dot<kv_t, kVectors, 2>, args);
    case 3: return std::apply(segment_dot<kv_t, kVectors, 3>, args);
    default: return std::apply(segment_dot<kv_t, kVectors, 4>, args);
  }
}
constexpr bool kDotRoute = true;
#else
constexpr bool kDotRoute = false;
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define KVSERVE_AVX2_ROUTE 1
// ---- fp32, bf16 and fp16 caches on AVX2 CPUs (no AVX-512) ---------------------------------------
//
// The loop above, built for AVX2, runs its 16-lane vectors as pairs of 8-lane registers: its
// row blocks' accumulators (4 rows x head_dim floats) no longer fit the 16 registers and reduce16's
// cross-register shuffles turn into many more instructions. Measured on a 2-core AMD EPYC (Zen 3),
// SmolLM2's layer at 64 fp32 decodes x 200 keys from memory: 4.2 ms a call, ~5 GB/s of K/V
// against the ~18 GB/s the memory gives; this route: 1.5 ms (2.6-2.9x at 1-256 decodes,
// `benchmarks/kernels.py --calls --dtypes float32 --context 200 --baseline REV`). Each row of a
// tile goes through a chunk on its own, in native 8-lane registers (the chunk's K/V stay in L1
// between the rows of a tile); no software prefetch of the next block (level or slower with it):
//   scores: a row's query (fp32, pre-scaled) against each of the chunk's keys, two FMA chains a
//           key, the 16 partial vectors finished by a vhaddps tree (reduce8) into 2 x 8 scores
//   softmax: online_softmax's step for one row, in 8-lane registers
//   P x V:  the row's accumulators (64 floats of D at a time) in 8 registers, one broadcast
//           weight and 8 FMAs per visible key
// bf16 and fp16 chunks are converted to fp32 once per chunk, for all the rows of the tile.
constexpr bool kAvx2Route = true;

inline __m256 load8(const float* src) { return _mm256_loadu_ps(src); }
inline __m256 load8(const c10::BFloat16* src) {  // bf16 is the top half of an fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))), 16));
}
inline __m256 load8(const c10::Half* src) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))); }

// Lane j of the result = the sum of p[j]'s 8 lanes (a transpose folded into 7 horizontal adds).
inline __m256 reduce8(const __m256* p) {
  const __m256 t0 = _mm256_hadd_ps(p[0], p[1]), t1 = _mm256_hadd_ps(p[2], p[3]);
  const __m256 t2 = _mm256_hadd_ps(p[4], p[5]), t3 = _mm256_hadd_ps(p[6], p[7]);
  // u0 = [sum of p0's lanes 0-3, p1's, p2's, p3's | the same of lanes 4-7]; u1 likewise for p4-p7
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// One query row against one chunk of n <= 16 fp32 keys and values (rows stride_k / stride_v floats apart);
// the row sees keys [hidden, visible) of them. kVec8 = head_dim / 8, a multiple of 8.
template <int kVec8>
void row_chunk_avx2(const float* q, const float* k_rows, const float* v_rows, int64_t stride_k, int64_t stride_v, int64_t n,
                    const int64_t* visible, const int64_t* hidden, float soft_cap, Vec* acc_out, float* row_max, float* row_sum) {
  static_assert(kVec8 % 8 == 0, "head_dim must be a multiple of 64");
  __m256 parts[kChunk];
  for (int64_t j = 0; j < kChunk; ++j) {
    if (j >= n) {  // lanes past n are masked by online_softmax; zeros keep them finite
      parts[j] = _mm256_setzero_ps();
      continue;
    }
    const float* k = k_rows + j * stride_k;
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
    __m256 b = _mm256_mul_ps(_mm256_loadu_ps(q + 8), _mm256_loadu_ps(k + 8));
    for (int i = 2; i < kVec8; i += 2) {
      a = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * i), _mm256_loadu_ps(k + 8 * i), a);
      b = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * i + 8), _mm256_loadu_ps(k + 8 * i + 8), b);
    }
    parts[j] = _mm256_add_ps(a, b);
  }
  __m256 low = reduce8(parts), high = reduce8(parts + 8);
  if (soft_cap > 0.0f) {  // rare (Gemma 2): through the 16-lane code
    Vec scores;
    std::memcpy(&scores, &low, sizeof(low));
    std::memcpy(reinterpret_cast<char*>(&scores) + sizeof(low), &high, sizeof(high));
    scores = soft_cap16(scores, soft_cap);
    std::memcpy(&low, &scores, sizeof(low));
    std::memcpy(&high, reinterpret_cast<const char*>(&scores) + sizeof(low), sizeof(high));
  }
  // The online-softmax step of online_softmax, in 8-lane registers (its 16-lane code, built for
  // AVX2, went through 128-bit pieces and the stack: as long as the two products together).
  const int64_t first = std::max<int64_t>(0, hidden[0]), last = std::min(n, visible[0]);
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), eight = _mm256_set1_ps(8.0f);
  const __m256 first_lane = _mm256_set1_ps(static_cast<float>(first)), last_lane = _mm256_set1_ps(static_cast<float>(last));
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const auto mask = [&](__m256 scores, __m256 index) {  // keys outside [first, last): -inf
    const __m256 seen = _mm256_and_ps(_mm256_cmp_ps(index, first_lane, _CMP_GE_OQ), _mm256_cmp_ps(index, last_lane, _CMP_LT_OQ));
    return _mm256_blendv_ps(minus_inf, scores, seen);
  };
  low = mask(low, lane);
  high = mask(high, _mm256_add_ps(lane, eight));
  __m256 m = _mm256_max_ps(low, high);
  m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
  m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0x4e));
  m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0xb1));
  const float new_max = std::max(*row_max, _mm256_cvtss_f32(m));
  const __m256 shift = _mm256_set1_ps(new_max);
  const __m256 p_low = (__m256)exp_nonpositive_of<Vec8, I32x8>((Vec8)_mm256_sub_ps(low, shift));
  const __m256 p_high = (__m256)exp_nonpositive_of<Vec8, I32x8>((Vec8)_mm256_sub_ps(high, shift));
  alignas(32) float weights[kChunk];
  _mm256_store_ps(weights, p_low);
  _mm256_store_ps(weights + 8, p_high);
  float correction = 1.0f;  // folded into P x V's loads of the accumulators below
  if (new_max > *row_max) {
    correction = std::exp(*row_max - new_max);  // 0 on the first chunk (max was -inf)
    *row_sum *= correction;
    *row_max = new_max;
  }
  const __m256 p_both = _mm256_add_ps(p_low, p_high);
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(p_both), _mm256_extractf128_ps(p_both, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  *row_sum += _mm_cvtss_f32(sum);
  const __m256 scale = _mm256_set1_ps(correction);
  float* acc = reinterpret_cast<float*>(acc_out);
  for (int i0 = 0; i0 < kVec8; i0 += 8) {  // 64 elements of D at a time: 8 accumulators in registers
    __m256 o[8];
    for (int i = 0; i < 8; ++i) o[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * (i0 + i)), scale);
    for (int64_t j = first; j < last; ++j) {
      const __m256 w = _mm256_broadcast_ss(&weights[j]);
      const float* v = v_rows + j * stride_v + 8 * i0;
      for (int i = 0; i < 8; ++i) o[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * i), o[i]);
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(acc + 8 * (i0 + i), o[i]);
  }
}

// Every row of a tile against one chunk (s.visible / s.hidden set for it).
template <typename kv_t, int kVectors>
void chunk_avx2(const kv_t* k_rows, int64_t k_stride, const kv_t* v_rows, int64_t v_stride, int64_t n, int64_t rows,
                float soft_cap, Scratch& s) {
  constexpr int64_t D = kVectors * kLanes;
  const float* k = reinterpret_cast<const float*>(k_rows);
  const float* v = reinterpret_cast<const float*>(v_rows);
  int64_t ks = k_stride, vs = v_stride;
  if constexpr (!std::is_same<kv_t, float>::value) {  // converted once for all the tile's rows
    float* k32 = reinterpret_cast<float*>(s.k.data());
    float* v32 = reinterpret_cast<float*>(s.v.data());
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t i = 0; i < D; i += 8) {
        _mm256_storeu_ps(k32 + j * D + i, load8(k_rows + j * k_stride + i));
        _mm256_storeu_ps(v32 + j * D + i, load8(v_rows + j * v_stride + i));
      }
    }
    k = k32, v = v32, ks = D, vs = D;
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (s.visible[r] <= 0 || s.visible[r] <= s.hidden[r]) continue;  // the row sees none of this chunk
    row_chunk_avx2<2 * kVectors>(reinterpret_cast<const float*>(s.q.data() + r * kVectors), k, v, ks, vs, n, s.visible.data() + r,
                                 s.hidden.data() + r, soft_cap, s.acc.data() + r * kVectors, s.row_max.data() + r, s.row_sum.data() + r);
  }
}
#else
constexpr bool kAvx2Route = false;
#endif

// Rows [r0, r0 + count) of the tile against one chunk, count <= kRowBlock.
template <typename src_t, int kVectors>
void chunk_row_block(int64_t count, const src_t* k_rows, int64_t k_stride, const src_t* v_rows, int64_t v_stride,
                     int64_t n, const int64_t* visible, int64_t vectors, float soft_cap, Scratch& s, int64_t r0,
                     const float* k_scales, const float* v_scales) {
  const int64_t NV = vectors;
  const auto args = std::make_tuple(k_rows, k_stride, v_rows, v_stride, n, visible + r0, s.hidden.data() + r0, vectors,
                                    soft_cap, s.q.data() + r0 * NV,
                                    s.acc.data() + r0 * NV, s.row_max.data() + r0, s.row_sum.data() + r0, s.parts.data(),
                                    k_scales, v_scales);
  switch (count) {
    case 1: return std::apply(chunk_rows<src_t, kVectors, 1>, args);
    case 2: return std::apply(chunk_rows<src_t, kVectors, 2>, args);
    case 3: return std::apply(chunk_rows<src_t, kVectors, 3>, args);
    default: return std::apply(chunk_rows<src_t, kVectors, 4>, args);
  }
}

// kVectors = head_dim / 16 when it is a compile-time constant (the common head dims), else 0.
template <typename q_t, typename kv_t, int kVectors>
void attend_tile(const Problem& p, const WorkItem& item, Scratch& s, AmxScratch& a) {
  const int64_t NV = kVectors > 0 ? kVectors : p.head_dim / kLanes;
  const int64_t B = p.block_size, group = p.group;
  const int64_t q_start = p.query_start_loc(item.seq);
  const int64_t q_len = p.query_start_loc(item.seq + 1) - q_start;
  const int64_t context_before = p.seq_lens(item.seq) - q_len;  // positions before this step's queries
  const int64_t t0 = item.tile * p.tokens_per_tile;
  const int64_t t1 = std::min(q_len, t0 + p.tokens_per_tile);
  const int64_t rows = (t1 - t0) * group;
  const int64_t first_head = item.kv_head * group;

  // A bf16 tile of up to 16 rows goes through AMX where the CPU and the OS allow it (see segment_amx).
  constexpr bool kAmxType = kAmx && std::is_same<kv_t, c10::BFloat16>::value && kVectors > 0 && kVectors % 4 == 0;
  const bool amx = kAmxType && rows <= kAmxMaxRows && p.window == 0 && amx_usable();  // AMX segments mask causally only
  // Without AMX, one token's rows of a bf16 model on a bf16, fp8 or int8 cache take the bf16 dot
  // products (see segment_dot).
  constexpr bool kDotType = kDotRoute && std::is_same<q_t, c10::BFloat16>::value &&
                            (std::is_same<kv_t, c10::BFloat16>::value || std::is_same<kv_t, c10::Float8_e4m3fn>::value ||
                             std::is_same<kv_t, int8_t>::value) &&
                            kVectors > 0 && kVectors % 2 == 0;
  const bool dot = kDotType && !amx && t1 - t0 == 1 && p.window == 0;
  // On AVX2 CPUs (no AVX-512), every tile of an fp32, bf16 or fp16 cache (see chunk_avx2).
  constexpr bool kAvx2Type = kAvx2Route && kVectors > 0 && kVectors % 4 == 0 &&
                             (std::is_same<kv_t, float>::value || std::is_same<kv_t, c10::BFloat16>::value ||
                              std::is_same<kv_t, c10::Half>::value);
  const bool avx2 = kAvx2Type && !amx && !dot;
  const bool staged = !amx && !dot && !avx2 && rows > kRowBlock;  // several row blocks share each chunk: convert its K/V to fp32 once
  const q_t* query = static_cast<const q_t*>(p.query);
  [[maybe_unused]] const q_t* row_queries[kAmxMaxRows];  // an AMX tile's query rows
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t g = 0; g < group; ++g) {
      const q_t* src = query + (q_start + t) * p.q_stride_t + (first_head + g) * p.q_stride_h;
      const int64_t r = (t - t0) * group + g;
      if (amx) {
        row_queries[r] = src;
        continue;
      }
      if (dot) {  // bf16 as it is: the scale multiplies the scores
        std::memcpy(s.q_pairs.data() + r * NV / 2, src, p.head_dim * sizeof(q_t));
        continue;
      }
      Vec* q_row = s.q.data() + r * NV;
      for (int64_t i = 0; i < NV; ++i) q_row[i] = load16(src + i * kLanes) * p.score_scale;
    }
  }
  const int64_t context_before_tile = context_before + t0;  // row r's position: this + r / group
#ifdef __AMX_BF16__
  if (amx) {
    a.configure(rows);
    transpose_queries(reinterpret_cast<const c10::BFloat16* const*>(row_queries), rows, p.head_dim, a);
  }
  auto amx_segment = [&] {
    segment_amx(p.k_stride_s, p.v_stride_s, rows, context_before_tile, group, p.head_dim, p.score_scale, p.soft_cap, s.acc.data(),
                s.row_max.data(), s.row_sum.data(), a);
  };
#endif
  [[maybe_unused]] KeyChunkOf<kv_t> segment[kSegmentChunks];  // a decode's segment on the vdpbf16ps route (segment_dot)
  int64_t segment_count = 0;
  auto dot_segment = [&] {
#ifdef __AVX512BF16__
    if constexpr (kDotType) {
      const int64_t next_keys = (item.kv_head + 1) * p.group < p.num_heads ? p.k_stride_h : 0;
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
        segment_row_block_dot<kv_t, kVectors>(std::min<int64_t>(kRowBlock, rows - r0), segment, segment_count, p.k_stride_s,
                                        p.v_stride_s, r0 + kRowBlock >= rows ? next_keys : 0, p.score_scale, p.soft_cap, s, r0);
      }
    }
#endif
    segment_count = 0;
  };
  std::fill(s.acc.begin(), s.acc.begin() + rows * NV, Vec{});
  std::fill(s.row_max.begin(), s.row_max.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(s.row_sum.begin(), s.row_sum.begin() + rows, 0.0f);

  const kv_t* key_cache = static_cast<const kv_t*>(p.key_cache);
  const kv_t* value_cache = static_cast<const kv_t*>(p.value_cache);
  const int64_t num_keys = context_before + t1;  // the tile's last token sees keys [0, num_keys)
  const int64_t num_blocks = (num_keys + B - 1) / B;
  // A window: the tile's first row (the earliest) sees nothing before first_seen; the blocks
  // wholly before it are not read (their table entries may hold anything).
  const int64_t first_seen = p.window > 0 ? std::max<int64_t>(0, context_before_tile - p.window + 1) : 0;
  const int64_t first_block = first_seen / B;
  int64_t* visible = s.visible.data();
  int64_t* hidden = s.hidden.data();
  if (p.window == 0) std::fill(hidden, hidden + rows, 0);
  auto block_id = [&](int64_t b) {
    const int64_t block = p.block_tables(item.seq, b);
    TORCH_CHECK_VALUE(block >= 0 && block < p.num_blocks, "block_tables[", item.seq, ", ", b, "] = ", block,
                      " is outside the KV cache's ", p.num_blocks, " blocks");
    return block;
  };
  int64_t block = block_id(first_block);
  for (int64_t b = first_block; b < num_blocks; ++b) {
    const kv_t* k_block = key_cache + block * p.k_stride_b + item.kv_head * p.k_stride_h;
    const kv_t* v_block = value_cache + block * p.v_stride_b + item.kv_head * p.v_stride_h;
    const float* ks_block = p.key_scales ? p.key_scales + block * p.ks_stride_b + item.kv_head * p.ks_stride_h : nullptr;
    const float* vs_block = p.value_scales ? p.value_scales + block * p.vs_stride_b + item.kv_head * p.vs_stride_h : nullptr;
    if (dot) {  // the segment is computed once gathered: ask for this block's keys now (see segment_dot)
      prefetch_rows<2>(k_block, std::min(B, num_keys - b * B), p.k_stride_s, p.head_dim);
    }
    if (b + 1 < num_blocks) {  // blocks lie anywhere in memory: ask for the next one while this one computes
      block = block_id(b + 1);
      // AMX and the bf16 decode route prefetch as they compute; the AVX2 route measured no better with a prefetch
      const int64_t next_n = amx || avx2 || dot ? 0 : std::min(B, num_keys - (b + 1) * B);
      prefetch_rows(key_cache + block * p.k_stride_b + item.kv_head * p.k_stride_h, next_n, p.k_stride_s, p.head_dim);
      prefetch_rows(value_cache + block * p.v_stride_b + item.kv_head * p.v_stride_h, next_n, p.v_stride_s, p.head_dim);
    }
    for (int64_t c0 = 0; c0 < B; c0 += kChunk) {
      const int64_t first_key = b * B + c0;
      const int64_t n = std::min({kChunk, B - c0, num_keys - first_key});
      if (n <= 0) break;
      const kv_t* k_rows = k_block + c0 * p.k_stride_s;
      const kv_t* v_rows = v_block + c0 * p.v_stride_s;
      const float* k_scales = ks_block ? ks_block + c0 : nullptr;
      const float* v_scales = vs_block ? vs_block + c0 : nullptr;
#ifdef __AMX_BF16__
      if constexpr (kAmxType) {
        if (amx) {
          a.chunks.push_back(KeyChunk{reinterpret_cast<const c10::BFloat16*>(k_rows), reinterpret_cast<const c10::BFloat16*>(v_rows), n, first_key});
          if (static_cast<int64_t>(a.chunks.size()) == kSegmentChunks) amx_segment();
          continue;
        }
      }
#endif
#ifdef __AVX512BF16__
      if constexpr (kDotType) {
        if (dot) {  // a decode without a window: every row sees every key, no masks to compute
          segment[segment_count++] = KeyChunkOf<kv_t>{k_rows, v_rows, n, first_key, k_scales, v_scales};
          if (segment_count == kSegmentChunks) dot_segment();
          continue;
        }
      }
#endif
      // Row r is token t0 + r / group: it sees keys up to its position.
      for (int64_t r = 0; r < rows; ++r) visible[r] = std::min(n, context_before_tile + r / group - first_key + 1);
      if (p.window > 0) {  // row r sees keys from its position - w + 1 on
        for (int64_t r = 0; r < rows; ++r) hidden[r] = context_before_tile + r / group - p.window + 1 - first_key;
        if (hidden[0] >= n) continue;  // later rows start later: no row sees this chunk
      }
#ifdef KVSERVE_AVX2_ROUTE
      if constexpr (kAvx2Type) {
        if (avx2) {
          chunk_avx2<kv_t, kVectors>(k_rows, p.k_stride_s, v_rows, p.v_stride_s, n, rows, p.soft_cap, s);
          continue;
        }
      }
#endif
      if (staged) {
        for (int64_t j = 0; j < n; ++j) {
          const float k_scale = k_scales ? k_scales[j] : 1.0f, v_scale = v_scales ? v_scales[j] : 1.0f;
          for (int64_t i = 0; i < NV; ++i) {
            s.k[j * NV + i] = load16(k_rows + j * p.k_stride_s + i * kLanes);
            s.v[j * NV + i] = load16(v_rows + j * p.v_stride_s + i * kLanes);
            if (k_scales) {  // an int8 chunk: dequantised once, for all its row blocks
              s.k[j * NV + i] *= k_scale;
              s.v[j * NV + i] *= v_scale;
            }
          }
        }
      }
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
        const int64_t count = std::min<int64_t>(kRowBlock, rows - r0);
        if (visible[r0 + count - 1] <= 0 || hidden[r0] >= n) continue;  // later rows see more and start later: none of this block sees the chunk
        if (staged) {
          chunk_row_block<float, kVectors>(count, reinterpret_cast<const float*>(s.k.data()), NV * kLanes,
                                           reinterpret_cast<const float*>(s.v.data()), NV * kLanes, n, visible, NV, p.soft_cap, s, r0,
                                           nullptr, nullptr);
        } else {
          chunk_row_block<kv_t, kVectors>(count, k_rows, p.k_stride_s, v_rows, p.v_stride_s, n, visible, NV, p.soft_cap, s, r0,
                                          k_scales, v_scales);
        }
      }
    }
  }

#ifdef __AMX_BF16__
  if (amx && !a.chunks.empty()) amx_segment();  // the last, partial segment
#endif
  if (dot && segment_count > 0) dot_segment();

  // out is [num_tokens, num_heads, head_dim], contiguous.
  q_t* out = static_cast<q_t*>(p.out);
  const bool pairs = amx || dot;  // accumulators in the interleaved pairs' order
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = (t - t0) * group + g;
      const Vec normalised_scale = Vec{} + p.out_scale / s.row_sum[r];
      q_t* out_row = out + ((q_start + t) * p.num_heads + first_head + g) * p.head_dim;
      const Vec* acc = s.acc.data() + r * NV;
      for (int64_t i = 0; i < NV; i += pairs ? 2 : 1) {
        if (pairs) {
          Vec first, second;
          unpermute_pairs(acc[i], acc[i + 1], first, second);
          store16(out_row + i * kLanes, first * normalised_scale);
          store16(out_row + (i + 1) * kLanes, second * normalised_scale);
          continue;
        }
        store16(out_row + i * kLanes, acc[i] * normalised_scale);
      }
    }
  }
}

template <typename q_t, typename kv_t, int kVectors>
void attend_item(const Problem& p, const WorkItem& item, Scratch& s, AmxScratch& a) {
#ifdef __AVX512BF16__
  if constexpr (std::is_same<q_t, c10::BFloat16>::value &&
                (std::is_same<kv_t, c10::BFloat16>::value || std::is_same<kv_t, c10::Float8_e4m3fn>::value)) {
    if (item.prompt) {  // planned only where it applies (plan_items)
#ifdef __AMX_BF16__
      if (amx_usable()) {
        a.configure(kPromptConfig);
        return attend_prompt<TileProducts, kv_t>(p, item, a);
      }
#endif
      return attend_prompt<DotProducts, kv_t>(p, item, a);
    }
  }
#endif
  attend_tile<q_t, kv_t, kVectors>(p, item, s, a);
}

// Items a thread takes at once: every KV head of a (sequence, tile) where each thread still gets
// at least kMinClaimsPerWorker such groups, else one. A block's KV heads lie side by side (the
// cache is [blocks, kv_heads, block_size, head_dim]), so one thread reading all of them reads each
// block's K and V as whole runs, and the lines the hardware prefetcher fetches past one head's
// rows are the next head's, used moments later by the same core. Measured (SmolLM2's layer, 64
// decodes after 256 tokens, K/V cold in memory, Sapphire Rapids, both cores): 624 -> 541 us a
// call; 5-13% at 8-64 decodes and 64-1024 tokens.
constexpr int64_t kMinClaimsPerWorker = 4;

int64_t items_per_claim(int64_t num_items, int64_t num_kv_heads, int64_t workers) {
  return num_items >= kMinClaimsPerWorker * workers * num_kv_heads ? num_kv_heads : 1;
}

template <typename q_t, typename kv_t, int kVectors>
void run_items(const Problem& p, const std::vector<WorkItem>& items, int64_t workers, int64_t num_kv_heads) {
  const int64_t rows = p.tokens_per_tile * p.group;
  const int64_t num_items = static_cast<int64_t>(items.size());
  if (workers <= 1) {  // small work: waking the thread pool would cost more than it saves
    Scratch scratch(rows, p.head_dim / kLanes);
    AmxScratch amx(p.head_dim / kLanes);
    for (const WorkItem& item : items) attend_item<q_t, kv_t, kVectors>(p, item, scratch, amx);
    return;
  }
  // plan_items lists each (sequence, tile)'s KV heads consecutively, so a claim of num_kv_heads
  // items starting at a multiple of it is one (sequence, tile).
  const int64_t claim = items_per_claim(num_items, num_kv_heads, workers);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(rows, p.head_dim / kLanes);
    AmxScratch amx(p.head_dim / kLanes);  // per thread: tile state belongs to the thread
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t i = next.fetch_add(claim); i < num_items; i = next.fetch_add(claim)) {
        for (int64_t j = i; j < std::min(i + claim, num_items); ++j) {
          attend_item<q_t, kv_t, kVectors>(p, items[j], scratch, amx);
        }
      }
    }
  });
}

template <typename q_t, typename kv_t>
void run_items(const Problem& p, const std::vector<WorkItem>& items, int64_t workers, int64_t num_kv_heads) {
  switch (p.head_dim) {  // fully unrolled inner loops for the common head dims
    case 64: return run_items<q_t, kv_t, 4>(p, items, workers, num_kv_heads);
    case 128: return run_items<q_t, kv_t, 8>(p, items, workers, num_kv_heads);
    default: return run_items<q_t, kv_t, 0>(p, items, workers, num_kv_heads);
  }
}

// Where the prompt route does not run (no AVX-512 BF16; fp32 or fp16 queries), a fresh prompt (no
// context before it) of at least this many tokens goes through torch's own
// scaled_dot_product_attention on its gathered K/V: the flash kernel computes tiles of queries x
// keys as matrix products (AMX / VNNI where the CPU has them), measured 2.8x faster than the
// loop here for a 512-token bf16 prompt. A chunk after earlier context needs a bottom-right
// causal mask, which SDPA's CPU flash path does not take: such chunks stay here, as do fp8 and
// int8 caches (SDPA would need a converted copy) and short prompts (gathering is not worth it).
constexpr int64_t kSdpaMinTokens = 64;
// A bf16 chunk of at least this many tokens takes the prompt route where it runs
// (attend_prompt). A tile there is 16 tokens of one head, so shorter chunks fill attend_tile's
// tiles (all the group's heads of a few tokens) better: at 64 chunks after 248 keys (SmolLM2's
// layer, group 3, Sapphire Rapids, both cores) 8 tokens took 0.90x attend_tile's time, 4 tokens 1.27x.
constexpr int64_t kPromptMinTokens = 8;

struct Plan {
  std::vector<WorkItem> items;  // prompt chunks first
  int64_t work = 0;             // query rows x keys they read, summed: what the threads would share
  std::vector<int64_t> prompts;  // sequences for SDPA (see kSdpaMinTokens)
};

// seq's first `len` K or V rows of every KV head as a dense [1, kv_heads, len, head_dim] tensor.
at::Tensor gather_context(const at::Tensor& cache, const Problem& p, int64_t seq, int64_t len) {
  const int64_t kv_heads = cache.size(1), B = p.block_size, row_bytes = p.head_dim * cache.element_size();
  at::Tensor dense = at::empty({1, kv_heads, len, p.head_dim}, cache.options());
  const char* src = static_cast<const char*>(cache.data_ptr());
  char* dst = static_cast<char*>(dense.data_ptr());
  for (int64_t b = 0; b * B < len; ++b) {
    const int64_t block = p.block_tables(seq, b);
    TORCH_CHECK_VALUE(block >= 0 && block < p.num_blocks, "block_tables[", seq, ", ", b, "] = ", block,
                      " is outside the KV cache's ", p.num_blocks, " blocks");
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t j = 0; j < std::min(B, len - b * B); ++j) {
        const int64_t at = block * cache.stride(0) + h * cache.stride(1) + j * cache.stride(2);
        std::memcpy(dst + (h * len + b * B + j) * row_bytes, src + at * cache.element_size(), row_bytes);
      }
    }
  }
  return dense;
}

// Checks lengths and offsets (O(num_seqs)); returns the work items, prompt chunks first.
Plan plan_items(const Problem& p, int64_t num_seqs, int64_t num_tokens, int64_t num_kv_heads, bool sdpa_prompts,
                bool prompt_route) {
  TORCH_CHECK_VALUE(p.query_start_loc(0) == 0, "query_start_loc must start at 0, got ", p.query_start_loc(0));
  TORCH_CHECK_VALUE(p.query_start_loc(num_seqs) == num_tokens, "query_start_loc ends at ", p.query_start_loc(num_seqs),
                    " but query has ", num_tokens, " rows");
  Plan plan;
  plan.items.reserve(num_seqs * num_kv_heads);
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t seq = 0; seq < num_seqs; ++seq) {
      const int64_t q_len = p.query_start_loc(seq + 1) - p.query_start_loc(seq);
      const int64_t seq_len = p.seq_lens(seq);
      if (pass == 0) {
        TORCH_CHECK_VALUE(q_len >= 0, "query_start_loc must be non-decreasing");
        TORCH_CHECK_VALUE(q_len <= seq_len, "sequence ", seq,
                          " has more query tokens than context (seq_lens counts this step's tokens too)");
        TORCH_CHECK_VALUE(seq_len <= p.max_blocks_per_seq * p.block_size, "a sequence of ", seq_len,
                          " tokens needs more than the ", p.max_blocks_per_seq, " blocks of its block table row");
      }
      if ((pass == 0) != (q_len > 1)) continue;  // chunks in the first pass, decodes in the second
      // A window that cannot hide any key of the sequence's is no window: such prompts may go
      // where windows are not masked (SDPA, the prompt route).
      const bool unwindowed = p.window == 0 || seq_len <= p.window;
      if (prompt_route && q_len >= kPromptMinTokens && unwindowed) {
        plan.work += q_len * seq_len * p.num_heads;
        const int64_t tiles = (q_len + kPromptTokens - 1) / kPromptTokens;
        for (int64_t tile = tiles - 1; tile >= 0; --tile) {  // the later tokens see more keys: first, for the threads' balance
          for (int64_t h = 0; h < num_kv_heads; ++h) {
            plan.items.push_back(WorkItem{static_cast<int32_t>(seq), static_cast<int32_t>(tile), static_cast<int32_t>(h), 1});
          }
        }
        continue;
      }
      // SDPA neither masks a window nor caps scores: such prompts stay here.
      if (sdpa_prompts && q_len == seq_len && q_len >= kSdpaMinTokens && unwindowed && p.soft_cap == 0.0f) {
        plan.prompts.push_back(seq);
        continue;
      }
      plan.work += q_len * seq_len * p.num_heads;  // an upper bound (causal rows see less): fine for a threshold
      const int64_t tiles = (q_len + p.tokens_per_tile - 1) / p.tokens_per_tile;
      for (int64_t tile = 0; tile < tiles; ++tile) {
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          plan.items.push_back(WorkItem{static_cast<int32_t>(seq), static_cast<int32_t>(tile), static_cast<int32_t>(h), 0});
        }
      }
    }
  }
  return plan;
}

// An int8 cache's scales, [num_blocks, kv_heads, block_size] on the CPU with contiguous rows: as
// float32, or as the engine's pages hold them, their bytes ([..., 4] int8: kv_quant.row_scales).
struct RowScales {
  float* data;
  int64_t stride_b, stride_h;
};

RowScales row_scales(const at::Tensor& t, const at::Tensor& key_cache) {
  const bool bytes = t.scalar_type() == at::kChar && t.dim() == 4 && t.size(3) == 4 && t.stride(3) == 1 && t.stride(2) == 4 &&
                     t.stride(0) % 4 == 0 && t.stride(1) % 4 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 == 0;
  const bool floats = t.scalar_type() == at::kFloat && t.dim() == 3 && t.stride(2) == 1;
  TORCH_CHECK_VALUE(t.device().is_cpu() && (bytes || floats) && t.size(0) == key_cache.size(0) &&
                        t.size(1) == key_cache.size(1) && t.size(2) == key_cache.size(2),
                    "int8 KV scales must be CPU tensors [num_blocks, kv_heads, block_size] of float32 (or their bytes) "
                    "with contiguous rows");
  const int64_t unit = bytes ? 4 : 1;
  return RowScales{static_cast<float*>(t.data_ptr()), t.stride(0) / unit, t.stride(1) / unit};
}

// Other caches have none.
void check_row_scales(const at::Tensor& key_cache, const std::optional<at::Tensor>& key_scales,
                      const std::optional<at::Tensor>& value_scales) {
  if (key_cache.scalar_type() != at::kChar) {
    TORCH_CHECK_VALUE(!key_scales.has_value() && !value_scales.has_value(), "per-token scales belong to int8 caches only");
    return;
  }
  TORCH_CHECK_VALUE(key_scales.has_value() && value_scales.has_value(),
                    "an int8 KV cache needs key_scales and value_scales (a float32 scale per token and KV head)");
  row_scales(*key_scales, key_cache);
  row_scales(*value_scales, key_cache);
}

at::Tensor paged_attention(const at::Tensor& query_in, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens_in,
                           const at::Tensor& query_start_loc_in, double score_scale, double out_scale, int64_t sliding_window,
                           double soft_cap, const std::optional<at::Tensor>& key_scales,
                           const std::optional<at::Tensor>& value_scales) {
  TORCH_CHECK_VALUE(query_in.dim() == 3 && key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
                    "query must be [tokens, heads, head_dim] and both caches [blocks, kv_heads, block_size, head_dim]");
  for (const at::Tensor* t : {&query_in, &key_cache, &value_cache, &block_tables, &seq_lens_in, &query_start_loc_in}) {
    TORCH_CHECK_VALUE(t->device().is_cpu(), "every tensor must be on the CPU");
  }
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && seq_lens_in.dim() == 1 && query_start_loc_in.dim() == 1,
                    "block_tables must be 2-d, seq_lens and query_start_loc 1-d");
  for (const at::Tensor* t : {&block_tables, &seq_lens_in, &query_start_loc_in}) {
    TORCH_CHECK_VALUE(t->scalar_type() == at::kInt || t->scalar_type() == at::kLong, "index tensors must be int32 or int64");
  }
  const at::Tensor query = query_in.stride(2) == 1 ? query_in : query_in.contiguous();
  const at::Tensor tables = block_tables.stride(1) == 1 ? block_tables : block_tables.contiguous();
  const at::Tensor seq_lens = seq_lens_in.contiguous();
  const at::Tensor query_start_loc = query_start_loc_in.contiguous();
  TORCH_CHECK_VALUE(key_cache.stride(3) == 1 && value_cache.stride(3) == 1, "KV caches must be contiguous in head_dim");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(1), num_seqs = seq_lens.size(0);
  TORCH_CHECK_VALUE(key_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "query heads/head_dim do not fit the cache");
  TORCH_CHECK_VALUE(head_dim % kLanes == 0 && head_dim <= kLanes * kMaxVectors, "head_dim must be a multiple of ", kLanes,
                    " and at most ", kLanes * kMaxVectors, ", got ", head_dim);
  TORCH_CHECK_VALUE(tables.size(0) == num_seqs && query_start_loc.size(0) == num_seqs + 1,
                    "block_tables / query_start_loc do not match seq_lens");

  at::Tensor out = at::empty({num_tokens, num_heads, head_dim}, query.options());
  if (num_tokens == 0) return out;
  const int64_t group = num_heads / num_kv_heads;
  Problem p{};
  p.query = query.data_ptr();
  p.q_stride_t = query.stride(0);
  p.q_stride_h = query.stride(1);
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.k_stride_b = key_cache.stride(0);
  p.k_stride_h = key_cache.stride(1);
  p.k_stride_s = key_cache.stride(2);
  p.v_stride_b = value_cache.stride(0);
  p.v_stride_h = value_cache.stride(1);
  p.v_stride_s = value_cache.stride(2);
  p.out = out.data_ptr();
  p.num_blocks = key_cache.size(0);
  p.block_size = key_cache.size(2);
  p.head_dim = head_dim;
  p.num_heads = num_heads;
  p.group = group;
  p.tokens_per_tile = std::max<int64_t>(1, kRowsPerTile / group);
  p.block_tables = view_of(tables);
  p.seq_lens = view_of(seq_lens);
  p.query_start_loc = view_of(query_start_loc);
  p.max_blocks_per_seq = tables.size(1);
  p.score_scale = static_cast<float>(score_scale);
  p.out_scale = static_cast<float>(out_scale);
  TORCH_CHECK_VALUE(sliding_window >= 0, "sliding_window must be >= 0 (0: full attention), got ", sliding_window);
  p.window = sliding_window;
  TORCH_CHECK_VALUE(soft_cap >= 0.0, "soft_cap must be >= 0 (0: no soft-capping), got ", soft_cap);
  p.soft_cap = static_cast<float>(soft_cap);
  const at::ScalarType q_type = query.scalar_type(), kv_type = key_cache.scalar_type();
  TORCH_CHECK_VALUE(value_cache.scalar_type() == kv_type, "key_cache and value_cache must have the same dtype");
  const bool fp8 = kv_type == at::kFloat8_e4m3fn, int8 = kv_type == at::kChar;
  TORCH_CHECK_VALUE(fp8 || int8 || kv_type == q_type, "KV cache dtype must equal the query dtype or be float8_e4m3fn or int8");
  TORCH_CHECK_VALUE(q_type == at::kFloat || q_type == at::kHalf || q_type == at::kBFloat16,
                    "query dtype must be float32, float16 or bfloat16, got ", q_type);
  check_row_scales(key_cache, key_scales, value_scales);
  if (int8) {
    const RowScales ks = row_scales(*key_scales, key_cache), vs = row_scales(*value_scales, key_cache);
    p.key_scales = ks.data;
    p.value_scales = vs.data;
    p.ks_stride_b = ks.stride_b;
    p.ks_stride_h = ks.stride_h;
    p.vs_stride_b = vs.stride_b;
    p.vs_stride_h = vs.stride_h;
  }
  // bf16 prompt chunks on a bf16 or fp8 cache take the prompt route where it is built (attend_prompt:
  // AMX tiles where the CPU and Linux allow them, vdpbf16ps elsewhere; fp8 rows widened as packed).
  const bool prompt_route = kPromptRoute && q_type == at::kBFloat16 && (kv_type == at::kBFloat16 || fp8) && head_dim % 64 == 0;
  const Plan plan = plan_items(p, num_seqs, num_tokens, num_kv_heads, !fp8 && !int8 && !prompt_route, prompt_route);
  const std::vector<WorkItem>& items = plan.items;
  const int64_t workers = plan.work < kMinParallelWork ? 1 : std::min<int64_t>(at::get_num_threads(), items.size());

  for (const int64_t seq : plan.prompts) {  // SDPA runs its own threads: one prompt at a time
    const int64_t start = p.query_start_loc(seq), len = p.seq_lens(seq);
    const at::Tensor q = query.narrow(0, start, len).permute({1, 0, 2}).unsqueeze(0);  // [1, heads, len, D]
    at::Tensor rows = at::scaled_dot_product_attention(q, gather_context(key_cache, p, seq, len),
                                                       gather_context(value_cache, p, seq, len), std::nullopt, 0.0,
                                                       /*is_causal=*/true, score_scale, /*enable_gqa=*/true)
                          .squeeze(0)
                          .permute({1, 0, 2});
    if (out_scale != 1.0) rows = rows.mul(out_scale);
    out.narrow(0, start, len).copy_(rows);
  }
  switch (q_type) {
    case at::kFloat:
      if (fp8) run_items<float, c10::Float8_e4m3fn>(p, items, workers, num_kv_heads);
      else if (int8) run_items<float, int8_t>(p, items, workers, num_kv_heads);
      else run_items<float, float>(p, items, workers, num_kv_heads);
      break;
    case at::kHalf:
      if (fp8) run_items<c10::Half, c10::Float8_e4m3fn>(p, items, workers, num_kv_heads);
      else if (int8) run_items<c10::Half, int8_t>(p, items, workers, num_kv_heads);
      else run_items<c10::Half, c10::Half>(p, items, workers, num_kv_heads);
      break;
    case at::kBFloat16:
      if (fp8) run_items<c10::BFloat16, c10::Float8_e4m3fn>(p, items, workers, num_kv_heads);
      else if (int8) run_items<c10::BFloat16, int8_t>(p, items, workers, num_kv_heads);
      else run_items<c10::BFloat16, c10::BFloat16>(p, items, workers, num_kv_heads);
      break;
    default:  // refused above
      break;
  }
  return out;
}

// ---- KV-cache write ------------------------------------------------------------------------

template <typename src_t, typename cache_t>
void write_rows(const at::Tensor& rows, const at::Tensor& cache, const int64_t* slots, float scale) {
  const int64_t num_tokens = rows.size(0), num_kv_heads = rows.size(1), head_dim = rows.size(2);
  const int64_t block_size = cache.size(2);
  const src_t* src = static_cast<const src_t*>(rows.data_ptr());
  cache_t* dst = static_cast<cache_t*>(cache.data_ptr());
  const bool fp8 = std::is_same<cache_t, c10::Float8_e4m3fn>::value;
  const bool copy = std::is_same<src_t, cache_t>::value && scale == 1.0f;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;  // padding: not written
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const src_t* in = src + t * rows.stride(0) + h * rows.stride(1);
      cache_t* out = dst + (slot / block_size) * cache.stride(0) + h * cache.stride(1) + (slot % block_size) * cache.stride(2);
      if (copy) {
        std::memcpy(out, in, head_dim * sizeof(cache_t));
        continue;
      }
      // As kv_quant.quantize_for_cache: x / scale in fp32, saturated for fp8, rounded to nearest.
      for (int64_t d = 0; d < head_dim; ++d) {
        float x = static_cast<float>(in[d]) / scale;
        if (fp8) x = std::min(std::max(x, -448.0f), 448.0f);
        out[d] = static_cast<cache_t>(x);
      }
    }
  }
}

// An int8 cache's rows, as kv_quant.quantize_rows_int8: s = absmax / 127 in fp32, q = x / s
// rounded to nearest even (nearbyint in the default rounding mode, as torch.round), so both
// writes agree bit for bit. A zero row: s = 0, q = 0.
template <typename src_t>
void write_rows_int8(const at::Tensor& rows, const at::Tensor& cache, const RowScales& scales, const int64_t* slots) {
  const int64_t num_tokens = rows.size(0), num_kv_heads = rows.size(1), head_dim = rows.size(2);
  const int64_t block_size = cache.size(2);
  const src_t* src = static_cast<const src_t*>(rows.data_ptr());
  int8_t* dst = static_cast<int8_t*>(cache.data_ptr());
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;  // padding: not written
    const int64_t block = slot / block_size, offset = slot % block_size;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const src_t* in = src + t * rows.stride(0) + h * rows.stride(1);
      int8_t* out = dst + block * cache.stride(0) + h * cache.stride(1) + offset * cache.stride(2);
      float absmax = 0.0f;
      for (int64_t d = 0; d < head_dim; ++d) absmax = std::max(absmax, std::abs(static_cast<float>(in[d])));
      const float scale = absmax / 127.0f;
      const float divisor = scale > 0.0f ? scale : 1.0f;
      for (int64_t d = 0; d < head_dim; ++d) {
        const float q = std::nearbyint(static_cast<float>(in[d]) / divisor);
        out[d] = static_cast<int8_t>(std::min(std::max(q, -127.0f), 127.0f));
      }
      scales.data[block * scales.stride_b + h * scales.stride_h + offset] = scale;
    }
  }
}

template <typename cache_t>
void write_rows_from(const at::Tensor& rows, const at::Tensor& cache, const int64_t* slots, float scale,
                     const std::optional<at::Tensor>& scales_in) {
  if constexpr (std::is_same<cache_t, int8_t>::value) {
    const RowScales scales = row_scales(*scales_in, cache);
    switch (rows.scalar_type()) {
      case at::kFloat: return write_rows_int8<float>(rows, cache, scales, slots);
      case at::kHalf: return write_rows_int8<c10::Half>(rows, cache, scales, slots);
      case at::kBFloat16: return write_rows_int8<c10::BFloat16>(rows, cache, scales, slots);
      default: TORCH_CHECK_VALUE(false, "key/value must be float32, float16 or bfloat16, got ", rows.scalar_type());
    }
  } else {
    switch (rows.scalar_type()) {
      case at::kFloat: return write_rows<float, cache_t>(rows, cache, slots, scale);
      case at::kHalf: return write_rows<c10::Half, cache_t>(rows, cache, slots, scale);
      case at::kBFloat16: return write_rows<c10::BFloat16, cache_t>(rows, cache, slots, scale);
      default: TORCH_CHECK_VALUE(false, "key/value must be float32, float16 or bfloat16, got ", rows.scalar_type());
    }
  }
}

void write_cache(const at::Tensor& rows_in, const at::Tensor& cache, const int64_t* slots, float scale,
                 const std::optional<at::Tensor>& row_scales) {
  const at::Tensor rows = rows_in.stride(2) == 1 ? rows_in : rows_in.contiguous();
  switch (cache.scalar_type()) {
    case at::kFloat: return write_rows_from<float>(rows, cache, slots, scale, row_scales);
    case at::kHalf: return write_rows_from<c10::Half>(rows, cache, slots, scale, row_scales);
    case at::kBFloat16: return write_rows_from<c10::BFloat16>(rows, cache, slots, scale, row_scales);
    case at::kFloat8_e4m3fn: return write_rows_from<c10::Float8_e4m3fn>(rows, cache, slots, scale, row_scales);
    case at::kChar: return write_rows_from<int8_t>(rows, cache, slots, scale, row_scales);
    default: TORCH_CHECK_VALUE(false, "KV cache dtype must be float32, float16, bfloat16, float8_e4m3fn or int8, got ", cache.scalar_type());
  }
}

// Scatters this step's K/V rows into their slots: the same contract as
// torch_attention.write_kv_cache, in one pass without the index tensors torch would build.
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache, const at::Tensor& value_cache,
                    const at::Tensor& slot_mapping, double k_scale, double v_scale, const std::optional<at::Tensor>& key_scales,
                    const std::optional<at::Tensor>& value_scales) {
  for (const at::Tensor* t : {&key, &value, &key_cache, &value_cache, &slot_mapping}) {
    TORCH_CHECK_VALUE(t->device().is_cpu(), "every tensor must be on the CPU");
  }
  TORCH_CHECK_VALUE(key.dim() == 3 && key.sizes() == value.sizes() && key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
                    "key/value must be [tokens, kv_heads, head_dim] and both caches [blocks, kv_heads, block_size, head_dim]");
  TORCH_CHECK_VALUE(key.size(1) == key_cache.size(1) && key.size(2) == key_cache.size(3), "key/value rows do not fit the cache");
  TORCH_CHECK_VALUE(key_cache.stride(3) == 1 && value_cache.stride(3) == 1, "KV caches must be contiguous in head_dim");
  TORCH_CHECK_VALUE(key_cache.scalar_type() == value_cache.scalar_type(), "key_cache and value_cache must have the same dtype");
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0), "slot_mapping needs one entry per key/value row");
  check_row_scales(key_cache, key_scales, value_scales);
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t num_slots = key_cache.size(0) * key_cache.size(2);
  for (int64_t t = 0; t < slots.size(0); ++t) {  // all checked before anything is written
    const int64_t slot = slots.data_ptr<int64_t>()[t];
    TORCH_CHECK_VALUE(slot >= -1 && slot < num_slots, "slot_mapping holds slot ", slot, "; slots are in [0, ", num_slots,
                      "), or -1 for padding that is not written");
  }
  write_cache(key, key_cache, slots.data_ptr<int64_t>(), static_cast<float>(k_scale), key_scales);
  write_cache(value, value_cache, slots.data_ptr<int64_t>(), static_cast<float>(v_scale), value_scales);
}

// Shapes only, for torch.compile's fake tensors (symbolic sizes): the ops stay single graph nodes.
at::Tensor paged_attention_meta(const at::Tensor& query, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, double, double, c10::SymInt, double,
                                const std::optional<at::Tensor>&, const std::optional<at::Tensor>&) {
  return at::empty_symint(query.sym_sizes(), query.options());
}

void write_kv_cache_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         double, double, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&) {}

}  // namespace

TORCH_LIBRARY(kvserve_cpu, m) {
  m.def(
      "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_start_loc, float score_scale, float out_scale, SymInt sliding_window=0, float soft_cap=0.0, "
      "Tensor? key_scales=None, Tensor? value_scales=None) -> Tensor");
  m.def(
      "write_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, "
      "float k_scale, float v_scale, Tensor(c!)? key_scales=None, Tensor(d!)? value_scales=None) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv_cache", &write_kv_cache);
}

TORCH_LIBRARY_IMPL(kvserve_cpu, Meta, m) {
  m.impl("paged_attention", &paged_attention_meta);
  m.impl("write_kv_cache", &write_kv_cache_meta);
}
