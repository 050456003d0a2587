// Fused CPU kernels for the model's elementwise work (relaytrain/model/cpu_kernels.py says why).
//
// Every kernel reads its inputs once and writes its outputs once, vectorised with ATen's own
// Vectorized<float> (the same exp torch's kernels use), and splits its work over torch's
// intra-op threads. Results never depend on the thread count: each row (or element) is
// computed by one thread in a fixed order, and the one sum over rows (RMSNorm's weight
// gradient) adds fixed blocks of rows, then the blocks in order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>

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

}  // namespace

TORCH_LIBRARY(relaytrain_cpu, m) {
  m.def("rms_norm_fwd(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rms_norm_bwd(Tensor grad, Tensor x, Tensor r, Tensor weight) -> (Tensor, Tensor)");
  m.def("swiglu_fwd(Tensor gate, Tensor up) -> Tensor");
  m.def("swiglu_bwd(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, bool inverse) -> Tensor");
  m.def("logsumexp_rows(Tensor logits) -> Tensor");
  m.def("softmax_scale_(Tensor(a!) logits, Tensor lse, Tensor scale) -> ()");
}

TORCH_LIBRARY_IMPL(relaytrain_cpu, CPU, m) {
  m.impl("rms_norm_fwd", rms_norm_fwd);
  m.impl("rms_norm_bwd", rms_norm_bwd);
  m.impl("swiglu_fwd", swiglu_fwd);
  m.impl("swiglu_bwd", swiglu_bwd);
  m.impl("rope", rope);
  m.impl("logsumexp_rows", logsumexp_rows);
  m.impl("softmax_scale_", softmax_scale_);
}
