// Fused CPU kernels for the model's elementwise work and its sliding-window attention
// (relaytrain/model/cpu_kernels.py says why).
//
// Every elementwise kernel reads its inputs once and writes its outputs once, vectorised with
// ATen's own Vectorized<float> (the same exp torch's kernels use), and splits its work over
// torch's intra-op threads. Results never depend on the thread count: each row (or element) is
// computed by one thread in a fixed order, the one sum over rows (RMSNorm's weight gradient)
// adds fixed blocks of rows, then the blocks in order, and attention's sums over keys and
// queries are each one (batch, kv head) task's, in order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();
constexpr int64_t kRowBlock = 32;     // rows per block of RMSNorm's weight-gradient sum
constexpr int64_t kGrain = 1 << 15;   // elements per task of the elementwise kernels

void check(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              "relaytrain_cpu: ", name, " must be a contiguous fp32 CPU tensor");
}

// Sum of squares of one row: vector lanes, then the tail, in a fixed order.
float sum_squares(const float* x, int64_t d) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + kW <= d; i += kW) {
    Vec v = Vec::loadu(x + i);
    acc = acc + v * v;
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < d; ++i) s += x[i] * x[i];
  return s;
}

// y = w * (x * r), r = 1 / sqrt(mean(x^2) + eps), per row of x [rows, d]; r is returned
// for the backward.
std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x, const at::Tensor& w,
                                                double eps) {
  check(x, "x");
  check(w, "weight");
  const int64_t d = x.size(-1), rows = x.numel() / d;
  TORCH_CHECK(w.numel() == d, "relaytrain_cpu: weight of ", w.numel(), " for rows of ", d);
  at::Tensor y = at::empty_like(x), r = at::empty({rows}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *yp = y.data_ptr<float>(), *rp = r.data_ptr<float>();
  const float feps = static_cast<float>(eps), fd = static_cast<float>(d);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* xr = xp + row * d;
      float* yr = yp + row * d;
      const float rr = 1.f / std::sqrt(sum_squares(xr, d) / fd + feps);
      rp[row] = rr;
      const Vec rv(rr);
      int64_t i = 0;
      for (; i + kW <= d; i += kW) (Vec::loadu(wp + i) * (Vec::loadu(xr + i) * rv)).store(yr + i);
      for (; i < d; ++i) yr[i] = wp[i] * (xr[i] * rr);
    }
  });
  return {y, r};
}

// With x_hat = x r and gw = g w:  dx = r (gw - x_hat mean(gw x_hat)),  dw = sum_rows g x_hat.
std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& g, const at::Tensor& x,
                                                const at::Tensor& r, const at::Tensor& w) {
  check(g, "grad");
  check(x, "x");
  check(r, "r");
  check(w, "weight");
  const int64_t d = x.size(-1), rows = x.numel() / d;
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  at::Tensor dx = at::empty_like(x), partial = at::empty({blocks, d}, x.options());
  const float *gp = g.data_ptr<float>(), *xp = x.data_ptr<float>(), *rp = r.data_ptr<float>(),
              *wp = w.data_ptr<float>();
  float *dxp = dx.data_ptr<float>(), *pp = partial.data_ptr<float>();
  const float fd = static_cast<float>(d);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* part = pp + b * d;
      std::fill(part, part + d, 0.f);
      for (int64_t row = b * kRowBlock; row < std::min(rows, (b + 1) * kRowBlock); ++row) {
        const float *gr = gp + row * d, *xr = xp + row * d;
        float* dxr = dxp + row * d;
        const float rr = rp[row];
        const Vec rv(rr);
        Vec acc(0.f);
        int64_t i = 0;
        for (; i + kW <= d; i += kW) {
          Vec gx = Vec::loadu(gr + i) * (Vec::loadu(xr + i) * rv);
          (Vec::loadu(part + i) + gx).store(part + i);
          acc = acc + gx * Vec::loadu(wp + i);
        }
        float m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& c) { return a + c; }, acc);
        for (int64_t j = i; j < d; ++j) {
          const float gx = gr[j] * (xr[j] * rr);
          part[j] += gx;
          m += gx * wp[j];
        }
        m /= fd;
        const Vec mv(m);
        i = 0;
        for (; i + kW <= d; i += kW) {
          Vec xh = Vec::loadu(xr + i) * rv;
          ((Vec::loadu(gr + i) * Vec::loadu(wp + i) - xh * mv) * rv).store(dxr + i);
        }
        for (; i < d; ++i) dxr[i] = (gr[i] * wp[i] - (xr[i] * rr) * m) * rr;
      }
    }
  });
  at::Tensor dw = at::empty({d}, x.options());
  float* dwp = dw.data_ptr<float>();
  std::copy(pp, pp + d, dwp);
  for (int64_t b = 1; b < blocks; ++b) {
    const float* part = pp + b * d;
    int64_t i = 0;
    for (; i + kW <= d; i += kW) (Vec::loadu(dwp + i) + Vec::loadu(part + i)).store(dwp + i);
    for (; i < d; ++i) dwp[i] += part[i];
  }
  return {dx, dw};
}

// silu(g) * u, with silu(g) = g / (1 + exp(-g)) as torch's kernel computes it.
at::Tensor swiglu_fwd(const at::Tensor& g, const at::Tensor& u) {
  check(g, "gate");
  check(u, "up");
  TORCH_CHECK(g.sizes() == u.sizes(), "relaytrain_cpu: gate and up differ in shape");
  at::Tensor out = at::empty_like(g);
  const float *gp = g.data_ptr<float>(), *up = u.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t n = g.numel();
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    const Vec one(1.f);
    int64_t i = begin;
    for (; i + kW <= end; i += kW) {
      Vec x = Vec::loadu(gp + i);
      ((x / (one + x.neg().exp())) * Vec::loadu(up + i)).store(op + i);
    }
    if (i < end) {
      const int64_t k = end - i;
      Vec x = Vec::loadu(gp + i, k);
      ((x / (one + x.neg().exp())) * Vec::loadu(up + i, k)).store(op + i, k);
    }
  });
  return out;
}

// du = grad silu(g);  dg = (grad u) s (1 + g (1 - s)), s = sigmoid(g): torch's silu_backward.
std::tuple<at::Tensor, at::Tensor> swiglu_bwd(const at::Tensor& grad, const at::Tensor& g,
                                              const at::Tensor& u) {
  check(grad, "grad");
  check(g, "gate");
  check(u, "up");
  at::Tensor dg = at::empty_like(g), du = at::empty_like(u);
  const float *qp = grad.data_ptr<float>(), *gp = g.data_ptr<float>(), *up = u.data_ptr<float>();
  float *dgp = dg.data_ptr<float>(), *dup = du.data_ptr<float>();
  const int64_t n = g.numel();
  auto body = [&](int64_t i, int64_t k) {
    const Vec one(1.f);
    Vec x = Vec::loadu(gp + i, k), q = Vec::loadu(qp + i, k);
    Vec e = one + x.neg().exp();
    (q * (x / e)).store(dup + i, k);
    Vec s = one / e;
    ((q * Vec::loadu(up + i, k)) * s * at::vec::fmadd(x, one - s, one)).store(dgp + i, k);
  };
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + kW <= end; i += kW) body(i, kW);
    if (i < end) body(i, end - i);
  });
  return {dg, du};
}

// Rotate-half RoPE of x [B, H, T, hd] (any strides, the last dimension dense) by position t,
// written half by half as torch's ops in `_RopeFunction` round it: forward
// [x1 c1 - x2 s1, x2 c2 + x1 s2], and the transposed rotation for the backward
// (`inverse`) [x1 c1 + x2 s2, x2 c2 - x1 s1]. The result has x's layout.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                bool inverse) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 4 &&
                  x.stride(3) == 1,
              "relaytrain_cpu: rope's x must be a fp32 CPU tensor [B, H, T, hd], last dim dense");
  check(cos, "cos");
  check(sin, "sin");
  const int64_t nb = x.size(0), nh = x.size(1), nt = x.size(2), hd = x.size(3), half = hd / 2;
  TORCH_CHECK(cos.numel() == nt * hd && sin.numel() == nt * hd,
              "relaytrain_cpu: rope tables must be [T, hd]");
  at::Tensor out = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), xs2 = x.stride(2);
  const int64_t os0 = out.stride(0), os1 = out.stride(1), os2 = out.stride(2);
  at::parallel_for(0, nb * nh * nt, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = row % nt, h = (row / nt) % nh, b = row / (nt * nh);
      const float* xr = xp + b * xs0 + h * xs1 + t * xs2;
      float* orow = op + b * os0 + h * os1 + t * os2;
      const float *c = cp + t * hd, *s = sp + t * hd;
      auto pair = [&](int64_t i, int64_t k) {
        Vec x1 = Vec::loadu(xr + i, k), x2 = Vec::loadu(xr + half + i, k);
        Vec c1 = Vec::loadu(c + i, k), c2 = Vec::loadu(c + half + i, k);
        if (inverse) {
          (x1 * c1 + x2 * Vec::loadu(s + half + i, k)).store(orow + i, k);
          (x2 * c2 - x1 * Vec::loadu(s + i, k)).store(orow + half + i, k);
        } else {
          (x1 * c1 - x2 * Vec::loadu(s + i, k)).store(orow + i, k);
          (x2 * c2 + x1 * Vec::loadu(s + half + i, k)).store(orow + half + i, k);
        }
      };
      int64_t i = 0;
      for (; i + kW <= half; i += kW) pair(i, kW);
      if (i < half) pair(i, half - i);
    }
  });
  return out;
}

// The LM head's softmax, per row of fp32 logits x [rows, V]: `logsumexp` returns each row's
// max + log(sum(exp(x - max))) (one read); `softmax_scale_` overwrites x with
// exp(x - lse) * scale (one read, one write): the cross-entropy's logit gradient before its
// one-hot term, where torch's log_softmax, exp_ and mul_ take three passes that each write.
at::Tensor logsumexp_rows(const at::Tensor& x) {
  check(x, "logits");
  TORCH_CHECK(x.dim() == 2, "relaytrain_cpu: logits must be [rows, V]");
  const int64_t rows = x.size(0), v = x.size(1);
  at::Tensor lse = at::empty({rows}, x.options());
  const float* xp = x.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* xr = xp + row * v;
      const float mx = at::vec::reduce_all<float>(
          [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, xr, v);
      const Vec mv(mx);
      Vec acc(0.f);
      int64_t i = 0;
      for (; i + kW <= v; i += kW) acc = acc + (Vec::loadu(xr + i) - mv).exp();
      float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
      if (i < v) {
        Vec tail = (Vec::loadu(xr + i, v - i) - mv).exp();
        float buf[kW];
        tail.store(buf, v - i);
        for (int64_t j = 0; j < v - i; ++j) s += buf[j];
      }
      lp[row] = mx + std::log(s);
    }
  });
  return lse;
}

void softmax_scale_(at::Tensor& x, const at::Tensor& lse, const at::Tensor& scale) {
  check(x, "logits");
  check(lse, "lse");
  check(scale, "scale");
  const int64_t rows = x.size(0), v = x.size(1);
  float* xp = x.data_ptr<float>();
  const float *lp = lse.data_ptr<float>(), *sp = scale.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      float* xr = xp + row * v;
      const Vec lv(lp[row]), sv(sp[row]);
      int64_t i = 0;
      for (; i + kW <= v; i += kW) ((Vec::loadu(xr + i) - lv).exp() * sv).store(xr + i);
      if (i < v) ((Vec::loadu(xr + i, v - i) - lv).exp() * sv).store(xr + i, v - i);
    }
  });
}

// Sliding-window attention: each query against only the keys in its window.

constexpr int64_t kQueries = 32;  // queries per chunk of the backward's key-gradient pass
constexpr int64_t kG = 4;         // vectors accumulated side by side: independent FMA chains

struct Strided {  // a [B, H, T, D] fp32 tensor's data and strides (D dense)
  float* p;
  int64_t sb, sh, st;
  explicit Strided(const at::Tensor& t)
      : p(t.data_ptr<float>()), sb(t.stride(0)), sh(t.stride(1)), st(t.stride(2)) {}
  float* row(int64_t b, int64_t h, int64_t t) const { return p + b * sb + h * sh + t * st; }
};

void check_attention(const at::Tensor& t, const char* name, int64_t d) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 4 &&
                  t.stride(3) == 1 && t.size(3) == d,
              "relaytrain_cpu: attention's ", name,
              " must be a fp32 CPU tensor [B, H, T, hd], last dim dense");
}

// [B, H, T, D] with the memory of [B, T, H, D]: the layout attention's input projections give
// and its output projection takes without a copy.
at::Tensor empty_bthd(int64_t b, int64_t h, int64_t t, int64_t d, const at::Tensor& like) {
  return at::empty({b, t, h, d}, like.options()).permute({0, 2, 1, 3});
}

// One head's T rows of x, transposed into xt [D][ld] (ld >= T + kG kW, zero past T: a score
// pass reads whole vectors).
void transpose_head(const Strided& x, int64_t b, int64_t h, int64_t nt, int64_t d, float* xt,
                    int64_t ld) {
  for (int64_t t = 0; t < nt; t += 16) {
    const int m = static_cast<int>(std::min<int64_t>(16, nt - t));
    for (int64_t c = 0; c < d; c += 16) {
      if (m == 16)
        at::vec::transpose_mxn<float, 16, 16>(x.row(b, h, t) + c, x.st, xt + c * ld + t, ld);
      else
        at::vec::transpose_mxn<float>(x.row(b, h, t) + c, x.st, xt + c * ld + t, ld, m, 16);
    }
  }
  for (int64_t c = 0; c < d; ++c) std::fill(xt + c * ld + nt, xt + (c + 1) * ld, 0.f);
}

// s[j] = scale (x . row j0 + j) for j < n, from the transposed rows xt; s[j] = -inf for
// n <= j < n rounded up to whole vectors.
void scores(const float* x, const float* xt, int64_t ld, int64_t j0, int64_t n, int64_t d,
            float scale, float* s) {
  for (int64_t j = 0; j < n; j += kG * kW) {
    Vec acc[2][kG];  // even and odd columns of x apart: twice the chains
    for (int64_t g = 0; g < kG; ++g) acc[0][g] = acc[1][g] = Vec(0.f);
    const float* col = xt + j0 + j;
    for (int64_t c = 0; c < d; c += 2) {
      for (int64_t h = 0; h < 2; ++h) {
        const Vec xc(x[c + h]);
        const float* r = col + (c + h) * ld;
        for (int64_t g = 0; g < kG; ++g)
          acc[h][g] = at::vec::fmadd(xc, Vec::loadu(r + g * kW), acc[h][g]);
      }
    }
    for (int64_t g = 0; g < kG && j + g * kW < n; ++g)
      ((acc[0][g] + acc[1][g]) * Vec(scale)).store(s + j + g * kW);
  }
  std::fill(s + n, s + (n + kW - 1) / kW * kW, -std::numeric_limits<float>::infinity());
}

// out[0..d) = scale sum_{j < n} w[j] row(j), rows of stride st from base.
void weighted_rows(const float* w, int64_t n, const float* base, int64_t st, int64_t d,
                   float scale, float* out) {
  for (int64_t c = 0; c < d; c += kG * kW) {
    Vec acc[2][kG];  // even and odd rows apart: twice the chains
    for (int64_t g = 0; g < kG; ++g) acc[0][g] = acc[1][g] = Vec(0.f);
    int64_t j = 0;
    for (; j + 1 < n; j += 2) {
      for (int64_t h = 0; h < 2; ++h) {
        const Vec wj(w[j + h]);
        const float* r = base + (j + h) * st + c;
        for (int64_t g = 0; g < kG; ++g)
          acc[h][g] = at::vec::fmadd(wj, Vec::loadu(r + g * kW), acc[h][g]);
      }
    }
    if (j < n) {
      const Vec wj(w[j]);
      const float* r = base + j * st + c;
      for (int64_t g = 0; g < kG; ++g)
        acc[0][g] = at::vec::fmadd(wj, Vec::loadu(r + g * kW), acc[0][g]);
    }
    for (int64_t g = 0; g < kG; ++g)
      ((acc[0][g] + acc[1][g]) * Vec(scale)).store(out + c + g * kW);
  }
}

float reduce_sum(Vec v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// Causal attention of q [B, H, T, D] over k, v [B, Hkv, T, D] (each kv head serving H / Hkv
// query heads) restricted to q - window < k <= q, scores scaled by `scale`. Returns the
// output [B, H, T, D] (memory [B, T, H, D]) and each row's log-sum-exp [B, H, T]. A task is
// one (batch, kv head): no result depends on the thread count.
std::tuple<at::Tensor, at::Tensor> window_attention_fwd(const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& v, int64_t window,
                                                        double scale) {
  const int64_t nb = q.size(0), nh = q.size(1), nt = q.size(2), d = q.size(3), nkv = k.size(1);
  check_attention(q, "q", d);
  check_attention(k, "k", d);
  check_attention(v, "v", d);
  // whole groups of kG vectors (kW <= 16 floats) and 16 x 16 transposes per head row
  TORCH_CHECK(d % 64 == 0 && nh % nkv == 0 && k.size(2) == nt && v.sizes() == k.sizes() &&
                  window > 0,
              "relaytrain_cpu: window attention takes q [B, H, T, hd], k and v [B, Hkv, T, hd] "
              "with H a multiple of Hkv, hd a multiple of 64 and a positive window");
  at::Tensor out = empty_bthd(nb, nh, nt, d, q), lse = at::empty({nb, nh, nt}, q.options());
  const Strided Q(q), K(k), V(v), O(out);
  float* lp = lse.data_ptr<float>();
  const int64_t rep = nh / nkv, ld = nt + kG * kW;
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, nb * nkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt(d * ld), s(ld);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / nkv, hk = task % nkv;
      transpose_head(K, b, hk, nt, d, kt.data(), ld);
      for (int64_t h = hk * rep; h < (hk + 1) * rep; ++h) {
        for (int64_t i = 0; i < nt; ++i) {
          const int64_t j0 = std::max<int64_t>(0, i - window + 1), n = i + 1 - j0;
          scores(Q.row(b, h, i), kt.data(), ld, j0, n, d, fscale, s.data());
          Vec mv(-std::numeric_limits<float>::infinity());
          for (int64_t j = 0; j < n; j += kW)
            mv = at::vec::maximum(mv, Vec::loadu(s.data() + j));
          const float m = at::vec::vec_reduce_all<float>(
              [](Vec& a, Vec& x) { return at::vec::maximum(a, x); }, mv);
          Vec sv(0.f);
          for (int64_t j = 0; j < n; j += kW) {
            Vec e = (Vec::loadu(s.data() + j) - Vec(m)).exp();
            e.store(s.data() + j);
            sv = sv + e;
          }
          const float sum = reduce_sum(sv);
          weighted_rows(s.data(), n, V.row(b, hk, j0), V.st, d, 1.f / sum, O.row(b, h, i));
          lp[(b * nh + h) * nt + i] = m + std::log(sum);
        }
      }
    }
  });
  return {out, lse};
}

// The backward of window_attention_fwd: dq [B, H, T, D] and dk, dv [B, Hkv, T, D] (memory
// [B, T, heads, D]). With p = exp(s - lse) the forward's softmax, dp = dO . v and
// ds = scale p (dp - dO . o): dq = sum_j ds k, dk = sum_i ds q, dv = sum_i p dO, each summed
// in a fixed order by the task of its (batch, kv head).
std::tuple<at::Tensor, at::Tensor, at::Tensor> window_attention_bwd(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, int64_t window, double scale) {
  const int64_t nb = q.size(0), nh = q.size(1), nt = q.size(2), d = q.size(3), nkv = k.size(1);
  check_attention(grad, "grad", d);
  check_attention(q, "q", d);
  check_attention(k, "k", d);
  check_attention(v, "v", d);
  check_attention(out, "out", d);
  TORCH_CHECK(lse.is_contiguous() && lse.numel() == nb * nh * nt, "relaytrain_cpu: lse");
  at::Tensor dq = empty_bthd(nb, nh, nt, d, q);
  at::Tensor dk = empty_bthd(nb, nkv, nt, d, k).zero_();
  at::Tensor dv = empty_bthd(nb, nkv, nt, d, v).zero_();
  const Strided G(grad), Q(q), K(k), V(v), O(out), DQ(dq), DK(dk), DV(dv);
  const float* lp = lse.data_ptr<float>();
  const int64_t rep = nh / nkv, ld = nt + kG * kW;
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, nb * nkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt(d * ld), vt(d * ld), p(kQueries * ld), ds(kQueries * ld), dp(ld);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / nkv, hk = task % nkv;
      transpose_head(K, b, hk, nt, d, kt.data(), ld);
      transpose_head(V, b, hk, nt, d, vt.data(), ld);
      for (int64_t h = hk * rep; h < (hk + 1) * rep; ++h) {
        for (int64_t s0 = 0; s0 < nt; s0 += kQueries) {
          const int64_t e = std::min(nt, s0 + kQueries);
          const int64_t f = std::max<int64_t>(0, s0 - window + 1);  // the chunk's first key
          for (int64_t i = s0; i < e; ++i) {  // row i - s0 of p and ds, column j - f for key j
            const int64_t j0 = std::max<int64_t>(0, i - window + 1), n = i + 1 - j0;
            float* pr = p.data() + (i - s0) * ld + (j0 - f);
            float* dsr = ds.data() + (i - s0) * ld + (j0 - f);
            const float *gi = G.row(b, h, i), *oi = O.row(b, h, i);
            scores(Q.row(b, h, i), kt.data(), ld, j0, n, d, fscale, dp.data());
            const Vec l(lp[(b * nh + h) * nt + i]);
            for (int64_t j = 0; j < n; j += kW)
              (Vec::loadu(dp.data() + j) - l).exp().store(pr + j);
            scores(gi, vt.data(), ld, j0, n, d, 1.f, dp.data());
            Vec dot(0.f);
            for (int64_t c = 0; c < d; c += kW)
              dot = at::vec::fmadd(Vec::loadu(gi + c), Vec::loadu(oi + c), dot);
            const Vec di(reduce_sum(dot));
            for (int64_t j = 0; j < n; j += kW)
              (Vec::loadu(pr + j) * (Vec::loadu(dp.data() + j) - di) * Vec(fscale))
                  .store(dsr + j);
            weighted_rows(dsr, n, K.row(b, hk, j0), K.st, d, 1.f, DQ.row(b, h, i));
          }
          for (int64_t j = f; j < e; ++j) {  // keys the chunk's queries see
            float *dkj = DK.row(b, hk, j), *dvj = DV.row(b, hk, j);
            const int64_t i0 = std::max(s0, j), i1 = std::min(e, j + window);
            for (int64_t c = 0; c < d; c += kG * kW) {
              Vec ak[kG], av[kG];
              for (int64_t g = 0; g < kG; ++g) {
                ak[g] = Vec::loadu(dkj + c + g * kW);
                av[g] = Vec::loadu(dvj + c + g * kW);
              }
              for (int64_t i = i0; i < i1; ++i) {
                const Vec dsij(ds[(i - s0) * ld + (j - f)]), pij(p[(i - s0) * ld + (j - f)]);
                const float *qi = Q.row(b, h, i) + c, *gi = G.row(b, h, i) + c;
                for (int64_t g = 0; g < kG; ++g) {
                  ak[g] = at::vec::fmadd(dsij, Vec::loadu(qi + g * kW), ak[g]);
                  av[g] = at::vec::fmadd(pij, Vec::loadu(gi + g * kW), av[g]);
                }
              }
              for (int64_t g = 0; g < kG; ++g) {
                ak[g].store(dkj + c + g * kW);
                av[g].store(dvj + c + g * kW);
              }
            }
          }
        }
      }
    }
  });
  return {dq, dk, dv};
}

// x + kMagic, for an integer-valued x with |x| < 2^51, holds x in its low bits: the integer is
// then read by a subtraction of bit patterns (vectorised, where a conversion is not on AVX2);
// for a non-integral x >= 0 the sum rounds x to the nearest integer, ties to even (kMagic is
// even), as torch's round does.
constexpr double kMagic = 6755399441055744.0;  // 1.5 * 2^52
constexpr int64_t kMagicBits = 0x4338000000000000;

inline int64_t rounded_bits(double x) {
  const double y = x + kMagic;
  int64_t bits;
  std::memcpy(&bits, &y, sizeof bits);
  return bits - kMagicBits;
}

// The double of an integer |v| < 2^51, exactly, by its bits: AVX2 has no vector conversion of
// int64 to double, and the loops below vectorise with this.
inline double exact_double(int64_t v) {
  const int64_t bits = v + kMagicBits;
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d - kMagic;
}

// 1.0 where c holds, else 0.0, by a bit mask: static_cast<double>(c) of a float comparison is a
// branch to the compiler (the comparison might trap), which kept the fold's loop scalar and
// mispredicted on every other value (10 ns a value); the mask vectorises.
inline double one_if(bool c) {
  const uint64_t bits = UINT64_C(0x3FF0000000000000) & -static_cast<uint64_t>(c);
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}

// Exact mode's fold of a micro-batch's gradient into packed fixed point (parallel/reduce.py
// says what the packing is and why): for each value with |g| < bound, its limbs
// hi = floor(g 2^30) and lo = round((g 2^30 - hi) 2^30) (to_limbs's float64 operations, one for
// one: no contraction, rounding half to even) added into acc as hi 2^shift + lo (assign: written
// over acc). Other values (NaN and infinities among them) are left for the two-limb fold: their
// slot takes nothing (assign: 0). Returns how many were left. One pass over g and acc. The
// bound is at most 2 (2^(3 - 2 bits(M))), so |hi| <= 2^31 and lo <= 2^30 read exactly.
int64_t fold_packed_(const at::Tensor& g, const at::Tensor& acc, int64_t shift, double bound,
                     bool assign) {
  check(g, "grad");
  TORCH_CHECK(acc.device().is_cpu() && acc.scalar_type() == at::kLong && acc.is_contiguous() &&
              acc.numel() == g.numel(), "relaytrain_cpu: acc must be a contiguous int64 CPU "
              "tensor of grad's size");
  TORCH_CHECK(shift > 0 && shift < 63 && bound <= 2.0, "relaytrain_cpu: shift ", shift,
              " or bound ", bound, " out of range");
  const float* gp = g.data_ptr<float>();
  int64_t* ap = acc.data_ptr<int64_t>();
  std::atomic<int64_t> left{0};
  at::parallel_for(0, g.numel(), kGrain, [&](int64_t begin, int64_t end) {
    const float* __restrict x = gp;  // locals the stores below cannot alias: vectorised
    int64_t* __restrict a = ap;
    const int64_t k = shift;
    const double b = bound;
    const uint64_t keep = assign ? 0 : ~uint64_t(0);  // a[i]'s bits, or none of them
    int64_t here = 0;
    for (int64_t i = begin; i < end; ++i) {  // no branch, no std::floor: vectorised
      const double d = x[i];
      const int64_t small = std::fabs(d) < b;  // NaN: 0
      const double s = d * 0x1p30;
      const double r = (s + kMagic) - kMagic;  // s rounded to an integer (|s| < 2^31)
      const double h = r - one_if(r > s);  // floor(s), exactly
      // In uint64 (wrapping, not undefined, for the values left out, which are masked off)
      const uint64_t v = (static_cast<uint64_t>(rounded_bits(h)) << k) +
                         static_cast<uint64_t>(rounded_bits((s - h) * 0x1p30));
      a[i] = static_cast<int64_t>((static_cast<uint64_t>(a[i]) & keep) +
                                  (v & -static_cast<uint64_t>(small)));
      here += 1 - small;
    }
    left += here;
  });
  return left.load();
}

// The float32 value of packed sums: hi = acc >> shift, lo = acc mod 2^shift, then from_limbs's
// float64 hi 2^-30 + lo 2^-60 rounded once more to float32, as from_limbs(...).float() does.
at::Tensor unpack_float(const at::Tensor& acc, int64_t shift) {
  TORCH_CHECK(acc.device().is_cpu() && acc.scalar_type() == at::kLong && acc.is_contiguous(),
              "relaytrain_cpu: acc must be a contiguous int64 CPU tensor");
  TORCH_CHECK(shift >= 12 && shift < 63, "relaytrain_cpu: shift ", shift, " out of range");
  at::Tensor out = at::empty(acc.sizes(), acc.options().dtype(at::kFloat));
  const int64_t* ap = acc.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const uint64_t mask = (uint64_t(1) << shift) - 1;
  // acc >> shift (arithmetic) as a logical shift, which AVX2 vectorises: acc + 2^63 shifted,
  // less 2^63 shifted. |hi| < 2^(63 - shift) reads exactly, and so does lo < 2^shift where
  // anything packs (shift <= 46: reduce.pack_bound; above, the sums are 0).
  const uint64_t sign = uint64_t(1) << 63, bias = sign >> shift;
  at::parallel_for(0, acc.numel(), kGrain, [&](int64_t begin, int64_t end) {
    const int64_t* __restrict a = ap;
    float* __restrict o = op;
    for (int64_t i = begin; i < end; ++i) {
      const uint64_t u = static_cast<uint64_t>(a[i]);
      const double hi = exact_double(static_cast<int64_t>(((u ^ sign) >> shift) - bias));
      o[i] = static_cast<float>(hi * 0x1p-30 + exact_double(static_cast<int64_t>(u & mask)) *
                                0x1p-60);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(relaytrain_cpu, m) {
  m.def("rms_norm_fwd(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rms_norm_bwd(Tensor grad, Tensor x, Tensor r, Tensor weight) -> (Tensor, Tensor)");
  m.def("swiglu_fwd(Tensor gate, Tensor up) -> Tensor");
  m.def("swiglu_bwd(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, bool inverse) -> Tensor");
  m.def("logsumexp_rows(Tensor logits) -> Tensor");
  m.def("softmax_scale_(Tensor(a!) logits, Tensor lse, Tensor scale) -> ()");
  m.def("window_attention_fwd(Tensor q, Tensor k, Tensor v, int window, float scale) "
        "-> (Tensor, Tensor)");
  m.def("window_attention_bwd(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, "
        "Tensor lse, int window, float scale) -> (Tensor, Tensor, Tensor)");
  m.def("fold_packed_(Tensor grad, Tensor(a!) acc, int shift, float bound, bool assign) -> int");
  m.def("unpack_float(Tensor acc, int shift) -> Tensor");
}

TORCH_LIBRARY_IMPL(relaytrain_cpu, CPU, m) {
  m.impl("rms_norm_fwd", rms_norm_fwd);
  m.impl("rms_norm_bwd", rms_norm_bwd);
  m.impl("swiglu_fwd", swiglu_fwd);
  m.impl("swiglu_bwd", swiglu_bwd);
  m.impl("rope", rope);
  m.impl("logsumexp_rows", logsumexp_rows);
  m.impl("softmax_scale_", softmax_scale_);
  m.impl("window_attention_fwd", window_attention_fwd);
  m.impl("window_attention_bwd", window_attention_bwd);
  m.impl("fold_packed_", fold_packed_);
  m.impl("unpack_float", unpack_float);
}
