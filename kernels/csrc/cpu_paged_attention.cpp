// Paged attention on the CPU that reads K/V in place, through the block tables, and the KV-cache
// write beside it.
//
// Same contracts as kvserve.kernels.torch_attention.paged_attention / write_kv_cache (cache layout
// [num_blocks, num_kv_heads, block_size, head_dim]); built and loaded by cpu_kernel_build.py.
//
// One work item = (request, KV head, tile of that request's query tokens):
//
//     rows of a tile   r = (token - t0) * group + g      g = query head within the KV head's group
//     for each block b of the request (up to the tile's last causal position):
//         K rows of block b, KV head h  ->  fp32 scratch   (read ONCE for all rows of the tile)
//         scores[r, j] = q[r] . k[j]                      (q pre-scaled by scale * k_scale)
//         online softmax in fp32: m[r], l[r], acc[r] rescaled when the running max grows
//         V rows -> fp32 scratch; acc[r] += p[r, j] * v[j]
//     out[r] = acc[r] * v_scale / l[r]
//
// A decode is one tile of `group` rows, so the GQA heads sharing a KV head read each block once.
// Threads pull items from an atomic counter (prompt chunks, the expensive ones, first), so one long
// chunk next to many short decodes does not leave a thread idle. Metadata is bounds-checked as it
// is read: a bad block id is an error, never an out-of-bounds read.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kRowsPerTile = 16;  // query rows that share one pass over the K/V blocks
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
typedef int32_t I32x16 __attribute__((vector_size(64)));

// ---- loading 16 elements as fp32 ---------------------------------------------------------------

inline Vec load16(const float* src) {
  Vec v;
  std::memcpy(&v, src, sizeof(v));
  return v;
}

inline Vec load16(const c10::BFloat16* src) {  // bf16 is the top half of an fp32
  U16x16 bits;
  std::memcpy(&bits, src, sizeof(bits));
  return (Vec)(__builtin_convertvector(bits, U32x16) << 16);
}

inline Vec load16(const c10::Half* src) {
#ifdef __FLT16_MAX__
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
  U8x16 codes;
  std::memcpy(&codes, src, sizeof(codes));
  // Widened in two steps: GCC turns a direct u8 -> u32 conversion into 16 scalar inserts.
  const U32x16 wide = __builtin_convertvector(__builtin_convertvector(codes, U16x16), U32x16);
  const I32x16 magnitude = (I32x16)(wide & 0x7f);
  const Vec normal = (Vec)((magnitude << 20) + (120 << 23));
  const Vec subnormal = __builtin_convertvector(magnitude, Vec) * 0x1p-9f;
  const Vec unsigned_value = magnitude < 8 ? subnormal : normal;
  const Vec value = (Vec)((U32x16)unsigned_value | ((wide & 0x80) << 24));
  return magnitude == 0x7f ? Vec{} + std::numeric_limits<float>::quiet_NaN() : value;
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

inline float hmax(Vec v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

// exp for x <= 0 (scores minus their running max), Cephes' expf polynomial (~1 ulp), in vector
// operations: libm's expf is scalar, and a third of the time went there. Below -70 the result is
// 0: such a weight (< 4e-31 against the row's largest, 1) changes nothing in fp32, and products
// of tinier weights with V would be fp32 subnormals, which cost a microcode assist each. -inf
// (masked) gives 0 too.
inline Vec exp_nonpositive(Vec x) {
  const Vec zero{};
  const Vec cutoff = zero - 70.0f;
  const Vec clamped = x > cutoff ? x : cutoff;
  const Vec round_magic = zero + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const Vec n = (clamped * 1.44269504088896341f + round_magic) - round_magic;
  const Vec r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  Vec p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const Vec two_n = (Vec)((__builtin_convertvector(n, I32x16) + 127) << 23);
  return x > cutoff ? p * two_n : zero;
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
};

struct Problem {
  const void* query;
  int64_t q_stride_t, q_stride_h;
  const void* key_cache;
  const void* value_cache;
  int64_t k_stride_b, k_stride_h, k_stride_s;
  int64_t v_stride_b, v_stride_h, v_stride_s;
  void* out;
  int64_t num_blocks, block_size, head_dim, num_heads, group, tokens_per_tile;
  IndexView block_tables, seq_lens, query_start_loc;
  int64_t max_blocks_per_seq;
  float score_scale, out_scale;
};

// Per-thread fp32 scratch, allocated once per call and thread.
struct Scratch {
  std::vector<Vec> q, acc, k, v, scores;  // scores: one row of ceil(block_size / 16) Vecs per query row
  std::vector<float> row_max, row_sum;
  Scratch(int64_t rows, int64_t block_size, int64_t vectors)
      : q(rows * vectors), acc(rows * vectors), k(block_size * vectors), v(block_size * vectors),
        scores(rows * ((block_size + kLanes - 1) / kLanes)), row_max(rows), row_sum(rows) {}
};

// kVectors = head_dim / 16 when it is a compile-time constant (the common head dims), else 0.
template <typename q_t, typename kv_t, int kVectors>
void attend_tile(const Problem& p, const WorkItem& item, Scratch& s) {
  const int64_t NV = kVectors > 0 ? kVectors : p.head_dim / kLanes;
  const int64_t B = p.block_size, group = p.group;
  const int64_t SV = (B + kLanes - 1) / kLanes;  // Vecs per row of scores
  const int64_t q_start = p.query_start_loc(item.seq);
  const int64_t q_len = p.query_start_loc(item.seq + 1) - q_start;
  const int64_t context_before = p.seq_lens(item.seq) - q_len;  // positions before this step's queries
  const int64_t t0 = item.tile * p.tokens_per_tile;
  const int64_t t1 = std::min(q_len, t0 + p.tokens_per_tile);
  const int64_t rows = (t1 - t0) * group;
  const int64_t first_head = item.kv_head * group;

  const q_t* query = static_cast<const q_t*>(p.query);
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t g = 0; g < group; ++g) {
      const q_t* src = query + (q_start + t) * p.q_stride_t + (first_head + g) * p.q_stride_h;
      Vec* q_row = s.q.data() + ((t - t0) * group + g) * NV;
      for (int64_t i = 0; i < NV; ++i) q_row[i] = load16(src + i * kLanes) * p.score_scale;
    }
  }
  std::fill(s.acc.begin(), s.acc.begin() + rows * NV, Vec{});
  std::fill(s.row_max.begin(), s.row_max.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(s.row_sum.begin(), s.row_sum.begin() + rows, 0.0f);

  const kv_t* key_cache = static_cast<const kv_t*>(p.key_cache);
  const kv_t* value_cache = static_cast<const kv_t*>(p.value_cache);
  const int64_t num_keys = context_before + t1;  // the tile's last token sees keys [0, num_keys)
  const int64_t num_blocks = (num_keys + B - 1) / B;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t block = p.block_tables(item.seq, b);
    TORCH_CHECK_VALUE(block >= 0 && block < p.num_blocks, "block_tables[", item.seq, ", ", b, "] = ", block,
                      " is outside the KV cache's ", p.num_blocks, " blocks");
    const int64_t first_key = b * B;
    const int64_t n = std::min(B, num_keys - first_key);
    const kv_t* k_block = key_cache + block * p.k_stride_b + item.kv_head * p.k_stride_h;
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t i = 0; i < NV; ++i) s.k[j * NV + i] = load16(k_block + j * p.k_stride_s + i * kLanes);
    }

    for (int64_t r = 0; r < rows; ++r) {
      // Row r is token t0 + r / group, at position context_before + t0 + r / group: it sees keys up to there.
      const int64_t visible = std::min(n, context_before + t0 + r / group - first_key + 1);
      if (visible <= 0) continue;
      Vec* score_vecs = s.scores.data() + r * SV;
      float* scores = reinterpret_cast<float*>(score_vecs);
      const Vec* q_row = s.q.data() + r * NV;
      for (int64_t j = 0; j < visible; ++j) {
        const Vec* k_row = s.k.data() + j * NV;
        Vec sum = q_row[0] * k_row[0];
        for (int64_t i = 1; i < NV; ++i) sum += q_row[i] * k_row[i];
        scores[j] = hsum(sum);
      }
      std::fill(scores + visible, scores + SV * kLanes, -std::numeric_limits<float>::infinity());
      Vec maxima = score_vecs[0];
      for (int64_t c = 1; c < SV; ++c) maxima = maxima > score_vecs[c] ? maxima : score_vecs[c];
      const float new_max = std::max(s.row_max[r], hmax(maxima));
      Vec sums{};
      for (int64_t c = 0; c < SV; ++c) {
        score_vecs[c] = exp_nonpositive(score_vecs[c] - new_max);
        sums += score_vecs[c];
      }
      const float block_sum = hsum(sums);
      if (new_max > s.row_max[r]) {
        const float correction = std::exp(s.row_max[r] - new_max);  // 0 on the first block (max was -inf)
        Vec* acc = s.acc.data() + r * NV;
        for (int64_t i = 0; i < NV; ++i) acc[i] *= correction;
        s.row_sum[r] *= correction;
        s.row_max[r] = new_max;
      }
      s.row_sum[r] += block_sum;
    }

    const kv_t* v_block = value_cache + block * p.v_stride_b + item.kv_head * p.v_stride_h;
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t i = 0; i < NV; ++i) s.v[j * NV + i] = load16(v_block + j * p.v_stride_s + i * kLanes);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = std::min(n, context_before + t0 + r / group - first_key + 1);
      const float* weights = reinterpret_cast<const float*>(s.scores.data() + r * SV);
      Vec acc[kMaxVectors];  // in registers when NV is a constant
      for (int64_t i = 0; i < NV; ++i) acc[i] = s.acc[r * NV + i];
      for (int64_t j = 0; j < visible; ++j) {
        const Vec* v_row = s.v.data() + j * NV;
        for (int64_t i = 0; i < NV; ++i) acc[i] += weights[j] * v_row[i];
      }
      for (int64_t i = 0; i < NV; ++i) s.acc[r * NV + i] = acc[i];
    }
  }

  // out is [num_tokens, num_heads, head_dim], contiguous.
  q_t* out = static_cast<q_t*>(p.out);
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = (t - t0) * group + g;
      const Vec normalised_scale = Vec{} + p.out_scale / s.row_sum[r];
      q_t* out_row = out + ((q_start + t) * p.num_heads + first_head + g) * p.head_dim;
      for (int64_t i = 0; i < NV; ++i) {
        const Vec value = s.acc[r * NV + i] * normalised_scale;
        for (int64_t lane = 0; lane < kLanes; ++lane) out_row[i * kLanes + lane] = static_cast<q_t>(value[lane]);
      }
    }
  }
}

template <typename q_t, typename kv_t, int kVectors>
void run_items(const Problem& p, const std::vector<WorkItem>& items) {
  const int64_t rows = p.tokens_per_tile * p.group;
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(rows, p.block_size, p.head_dim / kLanes);
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
        attend_tile<q_t, kv_t, kVectors>(p, items[i], scratch);
      }
    }
  });
}

template <typename q_t, typename kv_t>
void run_items(const Problem& p, const std::vector<WorkItem>& items) {
  switch (p.head_dim) {  // fully unrolled inner loops for the common head dims
    case 64: return run_items<q_t, kv_t, 4>(p, items);
    case 128: return run_items<q_t, kv_t, 8>(p, items);
    default: return run_items<q_t, kv_t, 0>(p, items);
  }
}

// Checks lengths and offsets (O(num_seqs)); returns the work items, prompt chunks first.
std::vector<WorkItem> plan_items(const Problem& p, int64_t num_seqs, int64_t num_tokens, int64_t num_kv_heads) {
  TORCH_CHECK_VALUE(p.query_start_loc(0) == 0, "query_start_loc must start at 0, got ", p.query_start_loc(0));
  TORCH_CHECK_VALUE(p.query_start_loc(num_seqs) == num_tokens, "query_start_loc ends at ", p.query_start_loc(num_seqs),
                    " but query has ", num_tokens, " rows");
  std::vector<WorkItem> items;
  items.reserve(num_seqs * num_kv_heads);
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
      const int64_t tiles = (q_len + p.tokens_per_tile - 1) / p.tokens_per_tile;
      for (int64_t tile = 0; tile < tiles; ++tile) {
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          items.push_back(WorkItem{static_cast<int32_t>(seq), static_cast<int32_t>(tile), static_cast<int32_t>(h)});
        }
      }
    }
  }
  return items;
}

at::Tensor paged_attention(const at::Tensor& query_in, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens_in,
                           const at::Tensor& query_start_loc_in, double score_scale, double out_scale) {
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
  const std::vector<WorkItem> items = plan_items(p, num_seqs, num_tokens, num_kv_heads);

  const at::ScalarType q_type = query.scalar_type(), kv_type = key_cache.scalar_type();
  TORCH_CHECK_VALUE(value_cache.scalar_type() == kv_type, "key_cache and value_cache must have the same dtype");
  const bool fp8 = kv_type == at::kFloat8_e4m3fn;
  TORCH_CHECK_VALUE(fp8 || kv_type == q_type, "KV cache dtype must equal the query dtype or be float8_e4m3fn");
  switch (q_type) {
    case at::kFloat:
      fp8 ? run_items<float, c10::Float8_e4m3fn>(p, items) : run_items<float, float>(p, items);
      break;
    case at::kHalf:
      fp8 ? run_items<c10::Half, c10::Float8_e4m3fn>(p, items) : run_items<c10::Half, c10::Half>(p, items);
      break;
    case at::kBFloat16:
      fp8 ? run_items<c10::BFloat16, c10::Float8_e4m3fn>(p, items) : run_items<c10::BFloat16, c10::BFloat16>(p, items);
      break;
    default:
      TORCH_CHECK_VALUE(false, "query dtype must be float32, float16 or bfloat16, got ", q_type);
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

template <typename cache_t>
void write_rows_from(const at::Tensor& rows, const at::Tensor& cache, const int64_t* slots, float scale) {
  switch (rows.scalar_type()) {
    case at::kFloat: return write_rows<float, cache_t>(rows, cache, slots, scale);
    case at::kHalf: return write_rows<c10::Half, cache_t>(rows, cache, slots, scale);
    case at::kBFloat16: return write_rows<c10::BFloat16, cache_t>(rows, cache, slots, scale);
    default: TORCH_CHECK_VALUE(false, "key/value must be float32, float16 or bfloat16, got ", rows.scalar_type());
  }
}

void write_cache(const at::Tensor& rows_in, const at::Tensor& cache, const int64_t* slots, float scale) {
  const at::Tensor rows = rows_in.stride(2) == 1 ? rows_in : rows_in.contiguous();
  switch (cache.scalar_type()) {
    case at::kFloat: return write_rows_from<float>(rows, cache, slots, scale);
    case at::kHalf: return write_rows_from<c10::Half>(rows, cache, slots, scale);
    case at::kBFloat16: return write_rows_from<c10::BFloat16>(rows, cache, slots, scale);
    case at::kFloat8_e4m3fn: return write_rows_from<c10::Float8_e4m3fn>(rows, cache, slots, scale);
    default: TORCH_CHECK_VALUE(false, "KV cache dtype must be float32, float16, bfloat16 or float8_e4m3fn, got ", cache.scalar_type());
  }
}

// Scatters this step's K/V rows into their slots: the same contract as
// torch_attention.write_kv_cache, in one pass without the index tensors torch would build.
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache, const at::Tensor& value_cache,
                    const at::Tensor& slot_mapping, double k_scale, double v_scale) {
  for (const at::Tensor* t : {&key, &value, &key_cache, &value_cache, &slot_mapping}) {
    TORCH_CHECK_VALUE(t->device().is_cpu(), "every tensor must be on the CPU");
  }
  TORCH_CHECK_VALUE(key.dim() == 3 && key.sizes() == value.sizes() && key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
                    "key/value must be [tokens, kv_heads, head_dim] and both caches [blocks, kv_heads, block_size, head_dim]");
  TORCH_CHECK_VALUE(key.size(1) == key_cache.size(1) && key.size(2) == key_cache.size(3), "key/value rows do not fit the cache");
  TORCH_CHECK_VALUE(key_cache.stride(3) == 1 && value_cache.stride(3) == 1, "KV caches must be contiguous in head_dim");
  TORCH_CHECK_VALUE(key_cache.scalar_type() == value_cache.scalar_type(), "key_cache and value_cache must have the same dtype");
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0), "slot_mapping needs one entry per key/value row");
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t num_slots = key_cache.size(0) * key_cache.size(2);
  for (int64_t t = 0; t < slots.size(0); ++t) {  // all checked before anything is written
    const int64_t slot = slots.data_ptr<int64_t>()[t];
    TORCH_CHECK_VALUE(slot >= -1 && slot < num_slots, "slot_mapping holds slot ", slot, "; slots are in [0, ", num_slots,
                      "), or -1 for padding that is not written");
  }
  write_cache(key, key_cache, slots.data_ptr<int64_t>(), static_cast<float>(k_scale));
  write_cache(value, value_cache, slots.data_ptr<int64_t>(), static_cast<float>(v_scale));
}

}  // namespace

TORCH_LIBRARY(kvserve_cpu, m) {
  m.def(
      "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_start_loc, float score_scale, float out_scale) -> Tensor");
  m.def(
      "write_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, "
      "float k_scale, float v_scale) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv_cache", &write_kv_cache);
}
