// An experiment, not built into kernjax: HeadsKernel's work for one fixed set of parts, pasted into
// a copy of csrc/dense.cu by experiments/heads_variants.py (its L* variants), which fills in its
// three placeholders: blocks an SM; cosf and sinf, or one sincosf; and whether each warp computes
// the row's frequencies itself, with no barrier. Same arithmetic, same order as
// HeadStep; measured in experiments/results/2026-12-03-h200-heads5/ (L6: 0.0540 ms at 8192 rows
// against HeadsKernel's 0.0615, the same bytes).

// kF: 4 bits a part (bit 0: a norm weight, 1: rope, 2: dst, 3: the state), parts 0..2 from the
// low bits; each part's flags known at compile time, its fields read at fixed offsets.
template <unsigned kP>
__device__ __forceinline__ void LeanStep(const Job& j, const Part& p, uint4 v, int head, int sub,
                                         long long row, long long slot, uint4 cs, uint4 sn) {
  if (kP & 1) {
    float x[8];
    const float ss = SumSquares<16>(v, x);
    v = Scale(x, rsqrtf(__fadd_rn(__fmul_rn(ss, 1.f / kD), j.eps)), reinterpret_cast<const uint4*>(p.w)[sub]);
  }
  if (kP & 2) {
    const uint4 o = Shfl(v, 8);
    auto* x = reinterpret_cast<B2*>(&v);
    const auto *y = reinterpret_cast<const B2*>(&o), *c = reinterpret_cast<const B2*>(&cs),
               *s = reinterpret_cast<const B2*>(&sn);
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = __hadd2_rn(__hmul2_rn(x[i], c[i]), __hmul2_rn(y[i], s[i]));
  }
  const long long at = head * kD + sub * 8;
  if (kP & 4) __stwb(reinterpret_cast<uint4*>(p.dst + row * p.dst_stride + at), v);
  if ((kP & 8) && slot >= 0)
    __stwb(reinterpret_cast<uint4*>(j.state + (slot * 2 + p.half) * j.kv_heads * kD + at), v);
}

template <unsigned kF>
__global__ void __launch_bounds__(32 * kWarps, LEAN_BLOCKS) HeadsLean(Job j) {
  constexpr unsigned k0 = kF & 15, k1 = kF >> 4 & 15, k2 = kF >> 8 & 15;
  const int row = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sub = lane % 16, pair = lane / 16;
  __shared__ __align__(16) __nv_bfloat16 cos_s[64], sin_s[64];
  long long slot = -1;
  if ((k0 | k1 | k2) & 8) {
    long long s = j.slots[row];
    s += s < 0 ? j.state_rows : 0;
    slot = s >= 0 && s < j.state_rows ? s : -1;
  }
  const int e0 = j.part[0].heads / 2, e1 = e0 + (k1 ? j.part[1].heads / 2 : 0),
            e2 = e1 + (k2 ? j.part[2].heads / 2 : 0);
  uint4 v[kPer];
#pragma unroll
  for (int b = 0; b < kPer; ++b) {
    const int g = warp + b * kWarps;
    const int t = g < e0 ? 0 : g < e1 ? 1 : 2, h = 2 * (g - (t == 0 ? 0 : t == 1 ? e0 : e1)) + pair;
    const __nv_bfloat16* src = t == 0 ? j.part[0].src : t == 1 ? j.part[1].src : j.part[2].src;
    const long long stride = t == 0 ? j.part[0].src_stride : t == 1 ? j.part[1].src_stride : j.part[2].src_stride;
    const long long col = t == 0 ? j.part[0].src_col : t == 1 ? j.part[1].src_col : j.part[2].src_col;
    if (g < e2) v[b] = *reinterpret_cast<const uint4*>(src + row * stride + col + h * kD + sub * 8);
  }
  uint4 cs{}, sn{};
  if ((k0 | k1 | k2) & 2) {
#if LEAN_WARP  // each warp its own frequencies, no barrier: lane l the pair 2l, 2l + 1
    const float pos = float(j.positions[row]);
    float s0, c0, s1, c1;
    sincosf(__fmul_rn(pos, j.inv_freq[2 * lane]), &s0, &c0);
    sincosf(__fmul_rn(pos, j.inv_freq[2 * lane + 1]), &s1, &c1);
    const B2 cp = __floats2bfloat162_rn(c0, c1), sp = __floats2bfloat162_rn(s0, s1);
    const unsigned cu = reinterpret_cast<const unsigned&>(cp), su = reinterpret_cast<const unsigned&>(sp);
    const int from = (sub % 8) * 4;
    cs = make_uint4(__shfl_sync(~0u, cu, from), __shfl_sync(~0u, cu, from + 1),
                    __shfl_sync(~0u, cu, from + 2), __shfl_sync(~0u, cu, from + 3));
    sn = make_uint4(__shfl_sync(~0u, su, from), __shfl_sync(~0u, su, from + 1),
                    __shfl_sync(~0u, su, from + 2), __shfl_sync(~0u, su, from + 3));
#else
    if (threadIdx.x < 64) {
      const float a = __fmul_rn(float(j.positions[row]), j.inv_freq[threadIdx.x]);
      LEAN_SINCOS
    }
    __syncthreads();
    cs = reinterpret_cast<const uint4*>(cos_s)[sub % 8];
    sn = reinterpret_cast<const uint4*>(sin_s)[sub % 8];
#endif
    if (sub < 8) sn.x ^= 0x80008000u, sn.y ^= 0x80008000u, sn.z ^= 0x80008000u, sn.w ^= 0x80008000u;
  }
#pragma unroll
  for (int b = 0; b < kPer; ++b) {
    const int g = warp + b * kWarps;
    if (g < e0) LeanStep<k0>(j, j.part[0], v[b], 2 * g + pair, sub, row, slot, cs, sn);
    else if (k1 && g < e1) LeanStep<k1>(j, j.part[1], v[b], 2 * (g - e0) + pair, sub, row, slot, cs, sn);
    else if (k2 && g < e2) LeanStep<k2>(j, j.part[2], v[b], 2 * (g - e1) + pair, sub, row, slot, cs, sn);
  }
}

