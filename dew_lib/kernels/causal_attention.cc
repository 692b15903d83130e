// Fused causal attention for XLA:CPU, forward and backward, as XLA FFI handlers.
//
// Flash-attention style: queries and keys go by tiles of 64; a tile of scores lives in a
// 16 KB buffer next to the products that make and consume it, the softmax runs online across
// key tiles, and the backward pass rebuilds each tile's weights from the saved log-sum-exp.
// Tiles above the diagonal and tiles whose segments cannot meet are never touched. Inputs keep
// the projections' `[B, S, heads, D]` layout, so no head-major copies are made.
//
// Work is split into independent units (forward: a head's query tile; backward: a key head
// with its query heads) taken in turn by the calling thread and by tasks on XLA's intra-op
// thread pool. Products run through one register-blocked kernel written with GCC vector
// extensions; `-march=native` picks AVX2, AVX-512 or NEON at build time.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kTile = 64;  // queries and keys per tile
constexpr float kMasked = -1e30f;  // finite: a row's masked slots vanish once it sees a key

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8 load(const float* p) {
  v8 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}
inline void store(float* p, v8 x) { std::memcpy(p, &x, sizeof x); }
inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

// e^x for x <= 0 (scores minus their running maximum), to float rounding: 2^n * e^r with
// |r| <= ln(2)/2 and a degree-6 Taylor polynomial for e^r; exactly 0 below -87, where e^x
// leaves float's normal range, so masked slots weigh nothing.
inline v8 exp_nonpositive(v8 x) {
  const v8i tiny = x < splat(-87.0f);
  x = tiny ? splat(-87.0f) : x;
  const v8 shifter = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  v8 n = (x * splat(1.44269504f) + shifter) - shifter;
  v8 r = x - n * splat(0.693145752f) - n * splat(1.42860677e-6f);
  v8 p = splat(1.0f / 720);
  p = p * r + splat(1.0f / 120);
  p = p * r + splat(1.0f / 24);
  p = p * r + splat(1.0f / 6);
  p = p * r + splat(0.5f);
  p = p * r + splat(1.0f);
  p = p * r + splat(1.0f);
  v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return tiny ? v8{} : p * scale;
}

// C[MR, 8*NV] (+)= A[MR, K] B[K, 8*NV]; rows of A, B and C at strides lda, ldb, ldc. With
// AT, `a` holds A transposed (A[m, p] at a[p * lda + m]).
template <int MR, int NV, bool AT>
inline void micro(int k, const float* a, long lda, const float* b, long ldb, float* c, long ldc,
                  bool accumulate) {
  v8 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NV; ++n) acc[m][n] = accumulate ? load(c + m * ldc + 8 * n) : v8{};
  for (int p = 0; p < k; ++p) {
    v8 row[NV];
    for (int n = 0; n < NV; ++n) row[n] = load(b + p * ldb + 8 * n);
    for (int m = 0; m < MR; ++m) {
      v8 x = splat(AT ? a[p * lda + m] : a[m * lda + p]);
      for (int n = 0; n < NV; ++n) acc[m][n] += x * row[n];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NV; ++n) store(c + m * ldc + 8 * n, acc[m][n]);
}

template <int NV, bool AT>
inline void rows(int m, int k, const float* a, long lda, const float* b, long ldb, float* c,
                 long ldc, bool accumulate) {
  const long step = AT ? 1 : lda;  // from one row of A to the next
  int i = 0;
  for (; i + 6 <= m; i += 6) micro<6, NV, AT>(k, a + i * step, lda, b, ldb, c + i * ldc, ldc, accumulate);
  const float* at = a + i * step;
  float* ct = c + i * ldc;
  switch (m - i) {
    case 5: micro<5, NV, AT>(k, at, lda, b, ldb, ct, ldc, accumulate); break;
    case 4: micro<4, NV, AT>(k, at, lda, b, ldb, ct, ldc, accumulate); break;
    case 3: micro<3, NV, AT>(k, at, lda, b, ldb, ct, ldc, accumulate); break;
    case 2: micro<2, NV, AT>(k, at, lda, b, ldb, ct, ldc, accumulate); break;
    case 1: micro<1, NV, AT>(k, at, lda, b, ldb, ct, ldc, accumulate); break;
    default: break;
  }
}

// C[m, n] (+)= A[m, k] B[k, n], n a multiple of 8; with AT, `a` holds A transposed ([k, m]).
template <bool AT = false>
void gemm(int m, int n, int k, const float* a, long lda, const float* b, long ldb, float* c,
          long ldc, bool accumulate) {
  int j = 0;
  for (; j + 16 <= n; j += 16) rows<2, AT>(m, k, a, lda, b + j, ldb, c + j, ldc, accumulate);
  if (j < n) rows<1, AT>(m, k, a, lda, b + j, ldb, c + j, ldc, accumulate);
}

// dst[c, r] = src[r, c] for an r x c block (src rows at stride lds, dst rows at ldd).
void transpose(int r, int c, const float* src, long lds, float* dst, long ldd) {
  for (int i = 0; i < r; ++i)
    for (int j = 0; j < c; ++j) dst[j * ldd + i] = src[i * lds + j];
}

inline float sum_lanes(v8 x) {
  float total = 0;
  for (int e = 0; e < 8; ++e) total += x[e];
  return total;
}

inline float max_lanes(v8 x) {
  float best = x[0];
  for (int e = 1; e < 8; ++e) best = std::max(best, x[e]);
  return best;
}

// Runs fn(0 .. units-1) on the calling thread and the pool's; returns once every unit is done.
// The caller waits only for units already taken, never for a task to start, so a busy pool
// cannot stall it; late tasks find nothing left and return.
void parallel_for(ffi::ThreadPool& pool, int64_t units, std::function<void(int64_t)> fn) {
  struct State {
    std::function<void(int64_t)> fn;
    int64_t units;
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mutex;
    std::condition_variable finished;
    void work() {
      for (int64_t u; (u = next.fetch_add(1)) < units;) {
        fn(u);
        if (done.fetch_add(1) + 1 == units) {
          std::lock_guard<std::mutex> lock(mutex);
          finished.notify_all();
        }
      }
    }
  };
  auto state = std::make_shared<State>();
  state->fn = std::move(fn);
  state->units = units;
  int64_t helpers = std::min<int64_t>(pool.num_threads(), units) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([state] { state->work(); });
  state->work();
  std::unique_lock<std::mutex> lock(state->mutex);
  state->finished.wait(lock, [&] { return state->done.load() == units; });
}

struct Shape {
  int64_t batch, seq, heads, kv_heads, dim;
  int64_t groups() const { return heads / kv_heads; }
  int64_t tiles() const { return (seq + kTile - 1) / kTile; }
};

// Per tile of one row: the least and greatest segment id in it.
struct TileSegments {
  std::vector<int32_t> low, high;
  TileSegments(const int32_t* seg, const Shape& s) : low(s.batch * s.tiles()), high(s.batch * s.tiles()) {
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t t = 0; t < s.tiles(); ++t) {
        const int32_t* first = seg + b * s.seq + t * kTile;
        const int32_t* last = seg + b * s.seq + std::min(s.seq, (t + 1) * kTile);
        auto [lo, hi] = std::minmax_element(first, last);
        low[b * s.tiles() + t] = *lo;
        high[b * s.tiles() + t] = *hi;
      }
  }
  // 0: no query of tile i sees a key of tile j; 1: every pair sees; 2: mask element by element.
  int relation(int64_t b, int64_t i, int64_t j, int64_t tiles) const {
    int64_t qi = b * tiles + i, kj = b * tiles + j;
    if (j > i || high[qi] < low[kj] || high[kj] < low[qi]) return 0;
    bool uniform = low[qi] == high[qi] && low[kj] == high[kj] && low[qi] == low[kj];
    return (uniform && j < i) ? 1 : 2;
  }
};

// Scores of one tile pair with the slots a query may not see at kMasked.
void mask_tile(float* scores, int nq, int nk, int64_t q0, int64_t k0, const int32_t* seg) {
  for (int r = 0; r < nq; ++r)
    for (int c = 0; c < nk; ++c)
      if (k0 + c > q0 + r || seg[q0 + r] != seg[k0 + c]) scores[r * kTile + c] = kMasked;
}

// key (or value) rows [k0, k0 + nk) of one head, transposed into dst[D][kTile], zero-padded.
void pack_transposed(const float* x, long stride, int nk, int64_t dim, float* dst) {
  std::fill(dst, dst + dim * kTile, 0.0f);
  transpose(nk, static_cast<int>(dim), x, stride, dst, kTile);
}

ffi::Error check(const Shape& s, std::string_view what) {
  if (s.dim % 8 != 0 || s.kv_heads < 1 || s.heads % s.kv_heads != 0)
    return ffi::Error::InvalidArgument(std::string(what) +
                                       ": head dim must be a multiple of 8 and heads a multiple of key heads");
  return ffi::Error::Success();
}

ffi::Error forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                   ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> segments, float scale,
                   ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  auto qd = q.dimensions(), kd = k.dimensions();
  Shape s{qd[0], qd[1], qd[2], kd[2], qd[3]};
  if (auto e = check(s, "causal_attention_forward"); e.failure()) return e;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const int32_t* seg = segments.typed_data();
  float *op = out->typed_data(), *lp = lse->typed_data();
  const int64_t tiles = s.tiles(), d = s.dim, g = s.groups();
  const long q_stride = s.heads * d, k_stride = s.kv_heads * d;
  TileSegments spans(seg, s);
  // every key tile transposed once ([B, KV, tiles, D, kTile]), shared by all query tiles
  std::vector<float> keys_t_all(s.batch * s.kv_heads * tiles * d * kTile);
  parallel_for(pool, s.batch * s.kv_heads * tiles, [&](int64_t unit) {
    const int64_t j = unit % tiles, kvh = (unit / tiles) % s.kv_heads, b = unit / (tiles * s.kv_heads);
    const int nk = static_cast<int>(std::min<int64_t>(kTile, s.seq - j * kTile));
    pack_transposed(kp + (b * s.seq + j * kTile) * k_stride + kvh * d, k_stride, nk, d,
                    keys_t_all.data() + unit * d * kTile);
  });

  parallel_for(pool, s.batch * s.heads * tiles, [&](int64_t unit) {
    // longest rows first, so the last units to finish are short ones
    const int64_t i = tiles - 1 - unit % tiles, h = (unit / tiles) % s.heads, b = unit / (tiles * s.heads);
    const int64_t q0 = i * kTile, kvh = h / g;
    const int nq = static_cast<int>(std::min<int64_t>(kTile, s.seq - q0));
    std::vector<float> buffers(kTile * kTile + kTile * d + 2 * kTile);
    float* scores = buffers.data();
    float* acc = scores + kTile * kTile;  // [kTile, d] unnormalized output, then kTile max + kTile sum
    float* top = acc + kTile * d;
    float* total = top + kTile;
    std::fill(acc, acc + kTile * d, 0.0f);
    std::fill(top, top + kTile, kMasked);
    const float* qrows = qp + (b * s.seq + q0) * q_stride + h * d;
    const int32_t* row_seg = seg + b * s.seq;
    for (int64_t j = 0; j <= i; ++j) {
      const int relation = spans.relation(b, i, j, tiles);
      if (relation == 0) continue;
      const int64_t k0 = j * kTile;
      const int nk = static_cast<int>(std::min<int64_t>(kTile, s.seq - k0));
      const float* keys_t = keys_t_all.data() + ((b * s.kv_heads + kvh) * tiles + j) * d * kTile;
      gemm(nq, kTile, static_cast<int>(d), qrows, q_stride, keys_t, kTile, scores, kTile, false);
      if (relation == 2) mask_tile(scores, nq, nk, q0, k0, row_seg);
      for (int r = 0; r < nq; ++r) {  // scores unscaled here; top in scaled units
        float* row = scores + r * kTile;
        for (int c = nk; c < kTile; ++c) row[c] = kMasked;
        v8 most = load(row);
        for (int c = 8; c < kTile; c += 8) most = most > load(row + c) ? most : load(row + c);
        const float best = std::max(top[r], max_lanes(most) * scale);
        const float rescale = std::exp(top[r] - best);
        v8 sum{};
        for (int c = 0; c < kTile; c += 8) {
          v8 p = exp_nonpositive(load(row + c) * splat(scale) - splat(best));
          store(row + c, p);
          sum += p;
        }
        total[r] = total[r] * rescale + sum_lanes(sum);
        top[r] = best;
        float* arow = acc + r * d;
        for (int c = 0; c < d; c += 8) store(arow + c, load(arow + c) * splat(rescale));
      }
      const float* vrows = vp + (b * s.seq + k0) * k_stride + kvh * d;
      gemm(nq, static_cast<int>(d), nk, scores, kTile, vrows, k_stride, acc, d, true);
    }
    for (int r = 0; r < nq; ++r) {
      const float inv = 1.0f / total[r];
      float* orow = op + (b * s.seq + q0 + r) * q_stride + h * d;
      for (int c = 0; c < d; c += 8) store(orow + c, load(acc + r * d + c) * splat(inv));
      lp[(b * s.heads + h) * s.seq + q0 + r] = top[r] + std::log(total[r]);
    }
  });
  return ffi::Error::Success();
}

ffi::Error backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                    ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> segments,
                    ffi::Buffer<ffi::F32> out, ffi::Buffer<ffi::F32> lse,
                    ffi::Buffer<ffi::F32> d_out, float scale, ffi::ResultBuffer<ffi::F32> d_q,
                    ffi::ResultBuffer<ffi::F32> d_k, ffi::ResultBuffer<ffi::F32> d_v) {
  auto qd = q.dimensions(), kd = k.dimensions();
  Shape s{qd[0], qd[1], qd[2], kd[2], qd[3]};
  if (auto e = check(s, "causal_attention_backward"); e.failure()) return e;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const float *opp = out.typed_data(), *lp = lse.typed_data(), *gp = d_out.typed_data();
  const int32_t* seg = segments.typed_data();
  float *dqp = d_q->typed_data(), *dkp = d_k->typed_data(), *dvp = d_v->typed_data();
  const int64_t tiles = s.tiles(), d = s.dim, g = s.groups();
  const long q_stride = s.heads * d, k_stride = s.kv_heads * d;
  TileSegments spans(seg, s);

  parallel_for(pool, s.batch * s.kv_heads, [&](int64_t unit) {
    const int64_t kvh = unit % s.kv_heads, b = unit / s.kv_heads;
    const int32_t* row_seg = seg + b * s.seq;
    // softmax's backward needs, per query, sum over keys of weights * d_weights = d_out . out
    std::vector<float> rowdot(g * s.seq);
    for (int64_t gi = 0; gi < g; ++gi) {
      const int64_t h = kvh * g + gi;
      for (int64_t t = 0; t < s.seq; ++t) {
        const float* o = opp + (b * s.seq + t) * q_stride + h * d;
        const float* go = gp + (b * s.seq + t) * q_stride + h * d;
        v8 sum{};
        for (int c = 0; c < d; c += 8) sum += load(o + c) * load(go + c);
        rowdot[gi * s.seq + t] = sum_lanes(sum);
        std::fill(dqp + (b * s.seq + t) * q_stride + h * d, dqp + (b * s.seq + t) * q_stride + (h + 1) * d, 0.0f);
      }
    }
    std::vector<float> buffers(2 * kTile * kTile + 4 * kTile * d);
    float* weights = buffers.data();          // [kTile q, kTile k]
    float* d_scores = weights + kTile * kTile;  // [kTile q, kTile k]
    float* keys_t = d_scores + kTile * kTile;  // [d, kTile]
    float* values_t = keys_t + kTile * d;      // [d, kTile]
    float* dk_acc = values_t + kTile * d;      // [kTile, d]
    float* dv_acc = dk_acc + kTile * d;        // [kTile, d]
    for (int64_t j = 0; j < tiles; ++j) {
      const int64_t k0 = j * kTile;
      const int nk = static_cast<int>(std::min<int64_t>(kTile, s.seq - k0));
      const float* krows = kp + (b * s.seq + k0) * k_stride + kvh * d;
      const float* vrows = vp + (b * s.seq + k0) * k_stride + kvh * d;
      pack_transposed(krows, k_stride, nk, d, keys_t);
      pack_transposed(vrows, k_stride, nk, d, values_t);
      std::fill(dk_acc, dk_acc + 2 * kTile * d, 0.0f);
      for (int64_t gi = 0; gi < g; ++gi) {
        const int64_t h = kvh * g + gi;
        for (int64_t i = j; i < tiles; ++i) {
          const int relation = spans.relation(b, i, j, tiles);
          if (relation == 0) continue;
          const int64_t q0 = i * kTile;
          const int nq = static_cast<int>(std::min<int64_t>(kTile, s.seq - q0));
          const float* qrows = qp + (b * s.seq + q0) * q_stride + h * d;
          const float* grows = gp + (b * s.seq + q0) * q_stride + h * d;
          gemm(nq, kTile, static_cast<int>(d), qrows, q_stride, keys_t, kTile, weights, kTile, false);
          if (relation == 2) mask_tile(weights, nq, nk, q0, k0, row_seg);
          const float* row_lse = lp + (b * s.heads + h) * s.seq + q0;
          for (int r = 0; r < nq; ++r) {
            float* row = weights + r * kTile;
            for (int c = nk; c < kTile; ++c) row[c] = kMasked;
            const v8 lse_r = splat(row_lse[r]);
            for (int c = 0; c < kTile; c += 8) store(row + c, exp_nonpositive(load(row + c) * splat(scale) - lse_r));
          }
          gemm(nq, kTile, static_cast<int>(d), grows, q_stride, values_t, kTile, d_scores, kTile, false);
          const float* row_dot = rowdot.data() + gi * s.seq + q0;
          for (int r = 0; r < nq; ++r)
            for (int c = 0; c < kTile; c += 8) {
              float* ds = d_scores + r * kTile + c;
              store(ds, load(weights + r * kTile + c) * (load(ds) - splat(row_dot[r])) * splat(scale));
            }
          gemm<true>(nk, static_cast<int>(d), nq, weights, kTile, grows, q_stride, dv_acc, d, true);
          gemm<true>(nk, static_cast<int>(d), nq, d_scores, kTile, qrows, q_stride, dk_acc, d, true);
          float* dq_rows = dqp + (b * s.seq + q0) * q_stride + h * d;
          gemm(nq, static_cast<int>(d), nk, d_scores, kTile, krows, k_stride, dq_rows, q_stride, true);
        }
      }
      for (int r = 0; r < nk; ++r) {
        std::memcpy(dkp + (b * s.seq + k0 + r) * k_stride + kvh * d, dk_acc + r * d, d * sizeof(float));
        std::memcpy(dvp + (b * s.seq + k0 + r) * k_stride + kvh * d, dv_acc + r * d, d * sizeof(float));
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewCausalAttentionForward, forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewCausalAttentionBackward, backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
