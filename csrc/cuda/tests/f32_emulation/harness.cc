// Runs the float32 kernels under host emulation (emu_cuda.h, emu_ptx.h) against a float64 reference; see run.py.
#include "emu_cuda.h"
#include <cstdio>
#include <random>
#include <string>
#include <functional>

namespace jax_flash::cuda::f32 { alignas(16) float smem[64000]; }
#include "cuda/f32/forward_kernel.h"
#include "cuda/f32/backward_kernels.h"
#include "cuda/f32/tf32_forward_kernel.h"
#include "cuda/f32/tf32_backward_kernels.h"
#include "cuda/f32/dbias_kernel.h"
#include "cuda/sm80/backward_row_kernels.h"

using namespace jax_flash;
constexpr int kGuard = 64;
constexpr float kSentinel = 12345.0f;

struct Buf {  // float buffer with guard zones
  std::vector<float> data; size_t n;
  explicit Buf(size_t n_, float fill = NAN) : data(n_ + 2 * kGuard, kSentinel), n(n_) {
    std::fill(data.begin() + kGuard, data.begin() + kGuard + n, fill);
  }
  float* p() { return data.data() + kGuard; }
  float& operator[](size_t i) { return data[kGuard + i]; }
  bool guards_ok() const {
    for (int i = 0; i < kGuard; ++i) if (data[i] != kSentinel || data[kGuard + n + i] != kSentinel) return false;
    return true;
  }
};

// Dense operands: `bias` / `mask` name the axes of [batch, head, query, key] they have ("bhqk": full shape;
// "qk": [1, 1, Sq, Sk]; "" none); the others broadcast with stride 0.
struct Dense {
  std::string bias, mask; float dropout = 0; bool deterministic = false;
};

struct Case {
  std::string name; int B, Sq, Sk, Hq, Hkv, d; bool causal = false; int wl = -1, wr = -1; float softcap = 0;
  bool alibi = false; std::vector<int> q_lens, kv_lens; bool segments = false; bool unaligned = false;
  Dense dense = {}; int packed_heads = 1;  // GQA packing: Sq rows hold Sq / packed_heads positions
  int kv_chunks = 1;  // split-KV: batch row b holds key chunk b % kv_chunks of its sequence
};

// Strides of an operand with the axes in `axes` (others broadcast); returns its element count.
size_t dense_strides(const Case& c, const std::string& axes, BroadcastStrides* s) {
  auto has = [&](char a) { return axes.find(a) != std::string::npos; };
  int64_t n = 1;
  s->key = has('k') ? n : 0; n *= has('k') ? c.Sk : 1;
  s->query = has('q') ? n : 0; n *= has('q') ? c.Sq : 1;
  s->head = has('h') ? n : 0; n *= has('h') ? c.Hq : 1;
  s->batch = has('b') ? n : 0; n *= has('b') ? c.B : 1;
  s->outer = n;
  return size_t(n);
}

template <int D>
int run_case(const Case& c, bool tf32) {
  std::mt19937 rng(c.Sq * 31 + c.d);
  std::normal_distribution<float> nd;
  const size_t nq = size_t(c.B) * c.Sq * c.Hq * c.d, nk = size_t(c.B) * c.Sk * c.Hkv * c.d;
  Buf q(nq), k(nk), v(nk), o(nq), lse(size_t(c.B) * c.Hq * c.Sq), d_o(nq), dq(nq), dk(nk), dv(nk),
      sd(size_t(c.B) * c.Hq * c.Sq), dlse(size_t(c.B) * c.Hq * c.Sq, 0.0f);
  for (size_t i = 0; i < nq; ++i) { q[i] = nd(rng); d_o[i] = nd(rng); }
  for (size_t i = 0; i < nk; ++i) { k[i] = nd(rng); v[i] = nd(rng); }
  std::vector<float> slopes(c.B * c.Hq);
  for (auto& s : slopes) s = 0.05f + 0.3f * std::uniform_real_distribution<float>()(rng);
  std::vector<int32_t> qlen(c.q_lens.begin(), c.q_lens.end()), kvlen(c.kv_lens.begin(), c.kv_lens.end());
  std::vector<int32_t> qseg(c.B * c.Sq), kvseg(c.B * c.Sk);
  for (int b = 0; b < c.B; ++b) {
    for (int i = 0; i < c.Sq; ++i) qseg[b * c.Sq + i] = (3 * i) / c.Sq;
    for (int j = 0; j < c.Sk; ++j) kvseg[b * c.Sk + j] = (3 * j) / c.Sk;
  }
  const Dense& dn = c.dense;
  BroadcastStrides bias_s, mask_s;
  const size_t n_bias = dn.bias.empty() ? 0 : dense_strides(c, dn.bias, &bias_s);
  const size_t n_mask = dn.mask.empty() ? 0 : dense_strides(c, dn.mask, &mask_s);
  Buf bias(n_bias), dbias(n_bias);
  for (size_t i = 0; i < n_bias; ++i) bias[i] = 0.7f * nd(rng);
  std::vector<uint8_t> maskv(n_mask);
  for (size_t i = 0; i < n_mask; ++i) maskv[i] = std::uniform_real_distribution<float>()(rng) < 0.75f;
  if (dn.mask.find('q') != std::string::npos && dn.mask.find('k') != std::string::npos)  // a few all-false rows
    for (int i = 3; i < c.Sq; i += 7)
      for (size_t e = 0; e < n_mask; ++e)
        if ((e / mask_s.query) % c.Sq == size_t(i)) maskv[e] = 0;
  // A nonzero lse cotangent with dense operands: otherwise the dbias of a key-broadcast bias is exactly 0
  // (softmax is shift-invariant) and only rounding noise would be compared.
  if (!dn.bias.empty() || !dn.mask.empty() || dn.dropout > 0)
    for (size_t i = 0; i < dlse.n; ++i) dlse[i] = 0.5f * nd(rng);
  std::vector<uint32_t> seeds(2 * c.B);
  for (auto& s : seeds) s = rng();
  AttentionBackwardParams p;
  p.batch = c.B; p.seqlen_q = c.Sq; p.seqlen_k = c.Sk; p.heads_q = c.Hq; p.heads_kv = c.Hkv; p.head_dim = c.d;
  p.element_type = ElementType::kFloat32;
  p.q = q.p(); p.k = k.p(); p.v = v.p(); p.o = o.p(); p.lse = lse.p();
  p.alibi_slopes = c.alibi ? slopes.data() : nullptr;
  p.q_seqlens = qlen.empty() ? nullptr : qlen.data();
  p.kv_seqlens = kvlen.empty() ? nullptr : kvlen.data();
  p.q_segment_ids = c.segments ? qseg.data() : nullptr;
  p.kv_segment_ids = c.segments ? kvseg.data() : nullptr;
  p.softmax_scale = 1.0f / std::sqrt(float(c.d)); p.softcap = c.softcap; p.causal = c.causal;
  p.window_left = c.wl; p.window_right = c.wr; p.allow_tf32 = tf32;
  while ((1 << p.position_shift) < c.packed_heads) ++p.position_shift;
  p.kv_chunks = c.kv_chunks;
  p.d_o = d_o.p(); p.d_lse = dlse.p(); p.dq = dq.p(); p.dk = dk.p(); p.dv = dv.p(); p.softmax_d = sd.p();
  p.inner_batch = c.B; p.outer_batch = 1;
  if (n_bias) { p.bias = bias.p(); p.bias_strides = bias_s; p.dbias = dbias.p(); }
  if (n_mask) { p.mask = reinterpret_cast<const bool*>(maskv.data()); p.mask_strides = mask_s; }
  p.dropout_rate = dn.dropout; p.dropout_seeds = dn.dropout > 0 ? seeds.data() : nullptr;
  p.deterministic = dn.deterministic;
  using namespace jax_flash::cuda;
  const bool transforms = f32::needs_general_variant(p);
  const DbiasPlan plan = plan_dbias(p);
  for (size_t i = 0; i < n_bias; ++i) dbias[i] = 0.0f;  // the dispatcher zero-fills dbias
  const bool vectorized = c.d % 4 == 0 && !c.unaligned;

  // Forward.
  if (tf32) {
    using G = f32::Tf32ForwardGeometry<D>;
    unsigned grid = ceil_div(c.Sq, G::kBlockM) * c.Hq * c.B;
    emu_launch(grid, G::kThreads, f32::smem, G::kBytes / 4, [&] {
      if (transforms) f32::tf32_forward_kernel<D, true>(p, vectorized); else f32::tf32_forward_kernel<D, false>(p, vectorized);
    });
  } else {
    unsigned grid = ceil_div(c.Sq, 64) * c.Hq * c.B;
    emu_launch(grid, 256, f32::smem, f32::ForwardSmem<D>::kBytes / 4, [&] {
      if (transforms) f32::forward_kernel<D, true>(p, vectorized); else f32::forward_kernel<D, false>(p, vectorized);
    });
  }
  // Backward. Packed and chunked calls are forward-only (AttentionParams::position_shift, kv_chunks): the backward
  // kernels compile without those layouts, so their cases check o and lse alone.
  const bool forward_only = c.packed_heads > 1 || c.kv_chunks > 1;
  int zeroing_fails = 0;
  if (!forward_only) {
    emu_launch(static_cast<unsigned>(sm80::softmax_d_blocks<float>(p)), sm80::kRowKernelWarps * 32, f32::smem, 0,
               [&] { sm80::softmax_d_kernel<float>(p); });
    if (c.d % 4 == 0 && !tf32) {  // the sm90 fused dQ's pre-pass zeroes its workspace (zero_dq_accum_of_row)
      Buf accum(size_t(dq_workspace_elements(c.B, c.Sq, c.Hq, c.d)));  // NaN: every float must be written
      float* const saved = p.dq_accum;
      p.dq_accum = accum.p();
      emu_launch(static_cast<unsigned>(sm80::softmax_d_blocks<float>(p)), sm80::kRowKernelWarps * 32, f32::smem, 0,
                 [&] { sm80::softmax_d_rows<float, /*kZeroDqAccum=*/true>(p); });
      p.dq_accum = saved;
      size_t unzeroed = 0;
      for (size_t i = 0; i < accum.n; ++i) unzeroed += accum[i] != 0.0f;
      if (unzeroed != 0 || !accum.guards_ok()) {
        std::printf("  %s: dq_accum zeroing left %zu of %zu floats, guards %s\n", c.name.c_str(), unzeroed, accum.n,
                    accum.guards_ok() ? "intact" : "overwritten");
        zeroing_fails = 1;
      }
    }
    if (tf32 && D <= 128) {
      if constexpr (D <= 128) {
        using G = f32::Tf32BackwardGeometry<D>;
        emu_launch(ceil_div(c.Sk, 64) * c.Hkv * c.B, G::kThreads, f32::smem, G::kBytes / 4, [&] {
          if (transforms) f32::tf32_dkdv_kernel<D, true>(p, vectorized); else f32::tf32_dkdv_kernel<D, false>(p, vectorized);
        });
        emu_launch(ceil_div(c.Sq, 64) * c.Hq * c.B, G::kThreads, f32::smem, G::kBytes / 4, [&] {
          if (transforms) f32::tf32_dq_kernel<D, true>(p, vectorized, plan.dq_mode); else f32::tf32_dq_kernel<D, false>(p, vectorized, plan.dq_mode);
        });
      }
    } else {
      emu_launch(ceil_div(c.Sk, 64) * c.Hkv * c.B, 256, f32::smem, f32::DkdvGeometry<D>::kBytes / 4, [&] {
        if (transforms) f32::dkdv_kernel<D, true>(p, vectorized); else f32::dkdv_kernel<D, false>(p, vectorized);
      });
      emu_launch(ceil_div(c.Sq, 64) * c.Hq * c.B, 256, f32::smem, f32::DqSmem<D>::kBytes / 4, [&] {
        if (transforms) f32::dq_kernel<D, true>(p, vectorized, plan.dq_mode); else f32::dq_kernel<D, false>(p, vectorized, plan.dq_mode);
      });
    }

    if (plan.separate_kernel) {
      const DbiasGrid grid = make_dbias_grid(p, plan.broadcast, 64, 64);
      emu_launch(unsigned(grid.blocks(p)), 256, f32::smem, f32::DbiasSmem<D>::kBytes / 4,
                 [&] { f32::dbias_kernel<D>(p, vectorized, grid); });
    }
  }

  // float64 reference.
  std::vector<double> ro(nq, 0), rlse(lse.n), rdq(nq, 0), rdk(nk, 0), rdv(nk, 0), rdbias(n_bias, 0);
  const uint32_t threshold = dropout_threshold(dn.dropout);
  const double keep_scale = 1.0 / (1.0 - double(dn.dropout));
  const int group = c.Hq / c.Hkv;
  auto Q = [&](int b, int i, int h, int x) { return double(q[((size_t(b) * c.Sq + i) * c.Hq + h) * c.d + x]); };
  auto DO = [&](int b, int i, int h, int x) { return double(d_o[((size_t(b) * c.Sq + i) * c.Hq + h) * c.d + x]); };
  auto KI = [&](int b, int j, int h, int x) { return ((size_t(b) * c.Sk + j) * c.Hkv + h) * c.d + x; };
  for (int b = 0; b < c.B; ++b)
    for (int h = 0; h < c.Hq; ++h) {
      const SliceMask m = make_slice_mask(static_cast<const AttentionParams&>(p), b, h);  // the forward's masks
      const int hk = h / group;
      for (int i = 0; i < c.Sq; ++i) {
        std::vector<double> s(c.Sk, -INFINITY), grad(c.Sk, 0), P(c.Sk, 0);
        double mx = -INFINITY;
        for (int j = 0; j < c.Sk; ++j) {
          if (!m.visible(i, j)) continue;
          double dot = 0; for (int x = 0; x < c.d; ++x) dot += Q(b, i, h, x) * k[KI(b, j, hk, x)];
          double sc = dot * p.softmax_scale, g = p.softmax_scale;
          if (c.softcap > 0) { double t = std::tanh(sc / c.softcap); sc = c.softcap * t; g *= 1 - t * t; }
          if (c.alibi) { long dist = long(i) + long(m.diagonal_shift) - j; sc -= m.alibi_slope * double(std::labs(dist)); }
          sc += m.bias_at(i, j);
          s[j] = sc; grad[j] = g; mx = std::max(mx, sc);
        }
        const size_t li = (size_t(b) * c.Hq + h) * c.Sq + i;
        if (mx == -INFINITY) { rlse[li] = -INFINITY; continue; }
        double sum = 0; for (int j = 0; j < c.Sk; ++j) if (s[j] > -INFINITY) { P[j] = std::exp(s[j] - mx); sum += P[j]; }
        rlse[li] = mx + std::log(sum);
        for (int j = 0; j < c.Sk; ++j) P[j] /= sum;
        // Dropout factor of each probability: the same Philox keep bits as the kernels (common/philox.h).
        std::vector<double> F(c.Sk, 1.0);
        if (dn.dropout > 0)
          for (int j = 0; j < c.Sk; ++j)
            F[j] = dropout_keeps(seeds.data() + 2 * b, threshold, h, i, j) ? keep_scale : 0.0;
        std::vector<double> orow(c.d, 0);
        for (int j = 0; j < c.Sk; ++j) if (P[j] > 0) for (int x = 0; x < c.d; ++x) orow[x] += P[j] * F[j] * v[KI(b, j, hk, x)];
        double Dd = 0; for (int x = 0; x < c.d; ++x) { ro[((size_t(b) * c.Sq + i) * c.Hq + h) * c.d + x] = orow[x]; Dd += orow[x] * DO(b, i, h, x); }
        Dd -= dlse[li];
        for (int j = 0; j < c.Sk; ++j) {
          if (P[j] == 0) continue;
          double dp = 0; for (int x = 0; x < c.d; ++x) dp += DO(b, i, h, x) * v[KI(b, j, hk, x)];
          const double dsb = P[j] * (F[j] * dp - Dd);  // d loss / d biased score
          const double ds = dsb * grad[j];
          if (n_bias) rdbias[(m.bias - bias.p()) + i * bias_s.query + j * bias_s.key] += dsb;
          for (int x = 0; x < c.d; ++x) {
            rdq[((size_t(b) * c.Sq + i) * c.Hq + h) * c.d + x] += ds * k[KI(b, j, hk, x)];
            rdk[KI(b, j, hk, x)] += ds * Q(b, i, h, x);
            rdv[KI(b, j, hk, x)] += P[j] * F[j] * DO(b, i, h, x);
          }
        }
      }
    }
  auto rel = [&](Buf& x, const std::vector<double>& r, const char* name) {
    double err = 0, mag = 0; bool bad = false;
    for (size_t i = 0; i < x.n; ++i) {
      if (std::isinf(r[i])) { if (x[i] != r[i]) bad = true; continue; }
      if (!std::isfinite(x[i])) { bad = true; continue; }
      err = std::max(err, std::fabs(x[i] - r[i])); mag = std::max(mag, std::fabs(r[i]));
    }
    // Inputs are O(1); a gradient that is zero in theory (one visible key) is rounding noise of dP - D, terms of
    // size ~sqrt(head_dim), hence the floor of 1 under the magnitude (tests/test_cuda.py uses the same).
    const double e = err / std::max(mag, 1.0);
    const double tol = tf32 ? 5e-3 : 1e-5;
    const bool ok = !bad && e <= tol && x.guards_ok();
    std::printf("  %-4s rel %.2e%s%s\n", name, e, bad ? " NONFINITE/INF MISMATCH" : "", x.guards_ok() ? "" : " GUARD OVERWRITTEN");
    return ok ? 0 : 1;
  };
  std::printf("%s [%s, D=%d]\n", c.name.c_str(), tf32 ? "tf32" : "exact", D);
  int fails = rel(o, ro, "o") + rel(lse, rlse, "lse") + zeroing_fails;
  if (!forward_only) {
    fails += rel(dq, rdq, "dq") + rel(dk, rdk, "dk") + rel(dv, rdv, "dv");
    if (n_bias) fails += rel(dbias, rdbias, "db");
  }
  // Rows that see no key (e.g. an all-false mask row): o exactly 0 (and lse -inf, checked above).
  int empty_rows = 0, bad_rows = 0;
  for (int b = 0; b < c.B; ++b)
    for (int h = 0; h < c.Hq; ++h)
      for (int i = 0; i < c.Sq; ++i) {
        if (rlse[(size_t(b) * c.Hq + h) * c.Sq + i] != -INFINITY) continue;
        ++empty_rows;
        for (int x = 0; x < c.d; ++x) if (o[((size_t(b) * c.Sq + i) * c.Hq + h) * c.d + x] != 0.0f) { ++bad_rows; break; }
      }
  if (empty_rows) std::printf("  rows that see no key: %d, with o != 0: %d\n", empty_rows, bad_rows);
  fails += bad_rows != 0;
  return fails;
}

int main() {
  std::vector<std::pair<Case, int>> cases = {
    {{"mha causal 130", 2, 130, 130, 4, 2, 64, true}, 64},
    {{"window softcap alibi 70x200", 1, 70, 200, 2, 1, 40, false, 5, 3, 2.0f, true}, 64},
    {{"seqlens segments d=7", 2, 17, 33, 2, 2, 7, false, -1, -1, 0, false, {10, 17}, {33, 5}, true}, 64},
    {{"mqa d=100 65x65 causal alibi", 1, 65, 65, 3, 1, 100, true, -1, -1, 0, true}, 128},
    {{"empty q rows 1x1", 1, 1, 1, 1, 1, 32, false, -1, -1, 0, false, {0}, {1}}, 64},
    {{"gqa 1x1", 2, 1, 1, 4, 2, 64, false}, 64},
    {{"gqa4 causal 300x40 (rows see nothing)", 1, 300, 40, 4, 1, 64, true}, 64},
    {{"window 40/10 200x150 unaligned-path", 1, 200, 150, 2, 2, 64, false, 40, 10, 0, false, {}, {}, false, true}, 64},
    {{"left window causal 129x257 d=128 kvlens", 2, 129, 257, 2, 1, 128, true, 30, -1, 0, false, {129, 60}, {257, 100}}, 128},
    {{"d=32 softcap 50x90", 1, 50, 90, 2, 1, 32, false, -1, -1, 1.5f}, 32},
    {{"d=96 causal gqa 80x80", 1, 80, 80, 4, 2, 90, true}, 96},
    {{"d=192 window 70x70", 1, 70, 70, 2, 2, 192, false, 20, 20}, 192},
    {{"d=256 causal 66x100 segments", 1, 66, 100, 2, 1, 250, true, -1, -1, 0, false, {}, {}, true}, 256},
    // Bias, boolean mask, dropout and dbias (general variant).
    {{"full bias + full mask (empty rows) causal 70x90", 2, 70, 90, 2, 1, 64, true, -1, -1, 0, false, {}, {}, false,
      false, {"bhqk", "bhqk"}}, 64},
    {{"bias [1,H,Sq,Sk] atomic dbias, mask [1,1,Sq,Sk]", 2, 40, 70, 2, 2, 32, false, -1, -1, 0, false, {}, {}, false,
      false, {"hqk", "qk"}}, 32},
    {{"bias [B,1,1,Sk] deterministic dbias 130x70 gqa", 2, 130, 70, 2, 1, 32, false, -1, -1, 0, false, {}, {},
      false, false, {"bk", "", 0, true}}, 32},
    {{"bias [1,H,Sq,1] deterministic, softcap, dropout 0.25, kvlens", 2, 70, 66, 2, 1, 40, false, -1, -1, 2.0f,
      false, {}, {60, 66}, false, false, {"hq", "", 0.25f, true}}, 64},
    {{"dropout 0.3 alibi window mask [B,1,Sq,Sk] unaligned", 1, 67, 80, 2, 1, 36, false, 30, 20, 0, true, {}, {},
      false, true, {"", "bqk", 0.3f}}, 64},
    {{"d=128 dropout 0.2 + bias [B,H,1,Sk] atomic, seqlens", 2, 65, 70, 2, 2, 128, true, -1, -1, 0, false,
      {65, 30}, {70, 40}, false, false, {"bhk", "", 0.2f}}, 128},
    // GQA packing (AttentionParams::position_shift): rows of 4 heads per position; the reference reads the same
    // SliceMask, whose position map the Python tests check against unpacked calls.
    {{"packed 4 heads causal 35 positions x 60, seqlens", 2, 140, 60, 1, 1, 64, true, -1, -1, 0, false, {140, 48},
      {60, 21}, false, false, {}, 4}, 64},
    {{"packed 8 heads window 9/0 segments 17 positions x 40", 1, 136, 40, 2, 1, 40, false, 9, 0, 0, false, {}, {},
      true, false, {"", "bk"}, 8}, 64},
    // Split-KV (AttentionParams::kv_chunks): 2 sequences of 150 and 90 keys x 3 chunks of 50 keys, kv lengths counted
    // from each chunk's first key (the last chunk of the second sequence empty), bottom-right causal and ALiBi across
    // chunk boundaries.
    {{"3 key chunks causal alibi 7x50, kvlens", 6, 7, 50, 2, 1, 64, true, -1, -1, 0, true, {}, {150, 100, 50, 90, 40,
      -10}, false, false, {}, 1, 3}, 64},
    {{"packed 4 heads x 2 key chunks window 20/0", 4, 24, 64, 1, 1, 32, false, 20, 0, 0, false, {}, {128, 64, 128, 64},
      false, false, {}, 4, 2}, 32},
  };
  int fails = 0;
  for (auto& [c, D] : cases)
    for (bool tf32 : {false, true}) {
      switch (D) {
        case 32: fails += run_case<32>(c, tf32); break;
        case 64: fails += run_case<64>(c, tf32); break;
        case 96: fails += run_case<96>(c, tf32); break;
        case 128: fails += run_case<128>(c, tf32); break;
        case 192: fails += run_case<192>(c, tf32); break;
        default: fails += run_case<256>(c, tf32); break;
      }
    }
  std::printf("%s (%d failures)\n", fails ? "FAILED" : "ALL OK", fails);
  return fails != 0;
}
