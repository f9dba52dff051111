// latent_attention: multi-head latent attention (DeepSeek's MLA, absorbed form) over its own paged cache of
// rows [NB, BS, C], one row a token that every head reads as key (C values) and value (its first R): the
// online softmax of attention.h, each row read once for a block of heads.

#include "latent_attention.h"

#include <tuple>

#include "attention.h"

namespace moe_serve {

// ---- multi-head latent attention (DeepSeek's MLA in the absorbed form: moe_serve/kernels/latent.py) -----
// Every query head attends to the same keys, one cache row of C values per token (the normed latent in its
// first R values, the rotated rope key after), and reads the row's first R values as its value: multi-query
// attention with key size C and value size R. A row is key and value at once, so it is not transposed as
// paged_attention's keys are: a score is one FMA chain along the row, and a pass over a key row serves up to
// LATENT_HEADS heads, which load the row once. A work item is a token and a block of its heads, so every key
// row is read from memory once per block of heads rather than once per head.
//
// Any block size: the keys go a block at a time, in runs of up to 16 within one block (a block of 12 is one
// run of 12, a block of 40 runs of 16, 16 and 8), so a run's rows are evenly spaced for Softmax::add16. The
// runs depend on the sequence's own keys only, and each (token, head) is one online softmax over them in key
// order, so a row's result is bitwise the same whatever else is in the batch and however the heads are
// blocked.

namespace {

#if defined(__AVX512F__)
constexpr int LATENT_HEADS = 8;  // 8 accumulators (8 zmm): as many FMA chains in flight as the FMA units take
#else
constexpr int LATENT_HEADS = 4;  // 4 accumulators of two ymm each: 8 chains, leaving registers for the row
#endif

// scores[h * 16 + c] = q_h . row_c over C values, for NH heads (q_h at q + h * C) and n <= 16 rows at
// rows + c * C: one FMA chain per (head, key) in the order of d, then one horizontal sum, whatever NH is.
template <int NH>
inline void latent_scores(const float* q, const float* rows, int64_t n, int64_t C, float* scores) {
  for (int64_t c = 0; c < n; ++c) {
    const float* r = rows + c * C;
    vf a[NH];
    for (int h = 0; h < NH; ++h) a[h] = vzero();
    int64_t d = 0;
    for (; d + 16 <= C; d += 16) {
      vf x = vload(r + d);
      for (int h = 0; h < NH; ++h) a[h] = vfmadd(vload(q + h * C + d), x, a[h]);
    }
    if (d < C) {
      mask16 m = tail_mask(C - d);
      vf x = vload_masked(m, r + d);
      for (int h = 0; h < NH; ++h) a[h] = vfmadd(vload_masked(m, q + h * C + d), x, a[h]);
    }
    for (int h = 0; h < NH; ++h) scores[h * 16 + c] = vreduce_add(a[h]);
  }
}

// The scores of nh heads: in passes of LATENT_HEADS heads, the rest in halving passes (H = 4 with AVX-512:
// one pass of 4).
inline void latent_scores_heads(const float* q, int64_t nh, const float* rows, int64_t n, int64_t C, float* scores) {
  int64_t h = 0;
  for (; h + LATENT_HEADS <= nh; h += LATENT_HEADS) latent_scores<LATENT_HEADS>(q + h * C, rows, n, C, scores + h * 16);
#if defined(__AVX512F__)
  if (h + 4 <= nh) { latent_scores<4>(q + h * C, rows, n, C, scores + h * 16); h += 4; }
#endif
  if (h + 2 <= nh) { latent_scores<2>(q + h * C, rows, n, C, scores + h * 16); h += 2; }
  if (h < nh) latent_scores<1>(q + h * C, rows, n, C, scores + h * 16);
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Heads per work item. A block of all of a token's heads reads its keys once, but a step of few tokens (one
// decode) must still reach every thread: the heads are split until there are about two items a thread, into
// blocks of no fewer than LATENT_HEADS heads (below that a pass over a row feeds too few FMA chains).
int64_t latent_head_block(int64_t T, int64_t H) {
  int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t blocks = std::clamp<int64_t>(ceil_div(2 * threads, std::max<int64_t>(T, 1)), 1, ceil_div(H, LATENT_HEADS));
  return ceil_div(H, blocks);
}

// The inputs' shapes and dtypes, and every block a query will read inside the table and the cache (a bad
// index would read outside the cache, not fail). Returns the keys the step reads in all (for small_work).
int64_t check_latent_inputs(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                            const at::Tensor& seq_ids, const at::Tensor& positions,
                            const at::Tensor& num_keys_of, int64_t rank) {
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu() && tables.device().is_cpu() && seq_ids.device().is_cpu() &&
                  positions.device().is_cpu() && num_keys_of.device().is_cpu(),
              "latent_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "latent_attention: q must be float32 [T, H, C], got ",
              q.scalar_type(), " ", q.sizes());
  TORCH_CHECK(cache.dim() == 3 && cache.scalar_type() == at::kFloat,
              "latent_attention: the cache must be float32 [NB, BS, C], got ", cache.scalar_type(), " ", cache.sizes());
  TORCH_CHECK(cache.is_contiguous(), "latent_attention: the cache must be contiguous");
  const int64_t T = q.size(0), C = cache.size(2), NB = cache.size(0), BS = cache.size(1);
  TORCH_CHECK(q.size(2) == C, "latent_attention: q's last dimension (", q.size(2), ") must be the cache rows' width (",
              C, ")");
  TORCH_CHECK(rank > 0 && rank < C, "latent_attention: the rank R must be in [1, C) (C = ", C, "), got ", rank);
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kInt, "latent_attention: block_tables must be int32 [S, W], got ",
              tables.scalar_type(), " ", tables.sizes());
  const int64_t S = tables.size(0), W = tables.size(1);
  for (const auto& [name, t, n] : {std::make_tuple("seq_ids", seq_ids, T), std::make_tuple("positions", positions, T),
                                   std::make_tuple("num_keys", num_keys_of, S)})
    TORCH_CHECK(t.dim() == 1 && t.size(0) == n && t.scalar_type() == at::kLong, "latent_attention: ", name,
                " must be int64 [", n, "], got ", t.scalar_type(), " ", t.sizes());
  auto sc = seq_ids.contiguous(), pc = positions.contiguous(), nc = num_keys_of.contiguous(), tc = tables.contiguous();
  const int64_t* sp = sc.data_ptr<int64_t>();
  const int64_t* pp = pc.data_ptr<int64_t>();
  const int64_t* np = nc.data_ptr<int64_t>();
  const int32_t* tp = tc.data_ptr<int32_t>();
  std::vector<int64_t> reach(S, 0);  // the keys each sequence's queries read, at most
  int64_t keys = 0;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "latent_attention: token ", t, "'s sequence ", sp[t], " is not in [0, ", S, ")");
    TORCH_CHECK(pp[t] >= 0, "latent_attention: token ", t, "'s position is negative (", pp[t], ")");
    int64_t n = std::max<int64_t>(0, std::min(pp[t] + 1, np[sp[t]]));
    reach[sp[t]] = std::max(reach[sp[t]], n);
    keys += n;
  }
  for (int64_t s = 0; s < S; ++s) {
    int64_t blocks = ceil_div(reach[s], BS);
    TORCH_CHECK(blocks <= W, "latent_attention: sequence ", s, " reads ", reach[s], " keys, ", blocks,
                " blocks, past its table's ", W);
    for (int64_t b = 0; b < blocks; ++b)
      TORCH_CHECK(tp[s * W + b] >= 0 && tp[s * W + b] < NB, "latent_attention: sequence ", s, "'s block ", b, " is ",
                  tp[s * W + b], ", not a block of the cache [0, ", NB, ")");
  }
  return keys;
}

}  // namespace

// q [T, H, C], cache [NB, BS, C], block_tables [S, W] int32, seq_ids, positions [T] and num_keys [S] int64
// -> [T, H, R]: each query's softmax(scale * q . row) over its sequence's keys 0..min(position, num_keys - 1),
// times the rows' first R values.
at::Tensor latent_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_ids, const at::Tensor& positions,
                            const at::Tensor& num_keys_of, int64_t rank, double scale) {
  const int64_t keys = check_latent_inputs(q, cache, block_tables, seq_ids, positions, num_keys_of, rank);
  auto qc = q.contiguous();
  auto tables = block_tables.contiguous();
  auto sc = seq_ids.contiguous(), pc = positions.contiguous(), nc = num_keys_of.contiguous();
  const int64_t T = qc.size(0), H = qc.size(1), C = qc.size(2), R = rank, BS = cache.size(1), W = tables.size(1);
  auto out = at::empty({T, H, R}, qc.options());
  const float* qp = qc.data_ptr<float>();
  const float* rowp = cache.data_ptr<float>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t* sp = sc.data_ptr<int64_t>();
  const int64_t* pp = pc.data_ptr<int64_t>();
  const int64_t* np = nc.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = (float)scale;
  const int64_t HB = latent_head_block(T, H), blocks = ceil_div(H, HB);
  auto body = [&](int64_t i0, int64_t i1) {
    std::vector<float> acc(HB * R), scores(HB * 16);
    std::vector<Softmax> sm(HB, Softmax{-INFINITY, 0.f, nullptr, R});
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / blocks, h0 = i % blocks * HB, nh = std::min(HB, H - h0), seq = sp[t];
      const int64_t num_keys = std::min(pp[t] + 1, np[seq]);
      const float* qh = qp + (t * H + h0) * C;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t h = 0; h < nh; ++h) sm[h] = Softmax{-INFINITY, 0.f, acc.data() + h * R, R};
      for (int64_t j = 0; j < num_keys;) {
        const int64_t off = j % BS, n = std::min({(int64_t)16, BS - off, num_keys - j});
        const float* rows = rowp + ((int64_t)tp[seq * W + j / BS] * BS + off) * C;
        latent_scores_heads(qh, nh, rows, n, C, scores.data());  // lanes past n: stale, masked out below
        for (int64_t h = 0; h < nh; ++h)
          sm[h].add16(vmul(vload(scores.data() + h * 16), vset1(fscale)), tail_mask(n), rows, C);
        j += n;
      }
      for (int64_t h = 0; h < nh; ++h) sm[h].finish(op + (t * H + h0 + h) * R);
    }
  };
  if (small_work(keys * H * C)) body(0, T * blocks);
  else at::parallel_for(0, T * blocks, 1, body);
  return out;
}

}  // namespace moe_serve
