// Host emulation of cvt.rna.tf32.f32, mma.m16n8k8 TF32 (PTX fragment layouts), ex2.approx.ftz and cp.async.
#pragma once
#include <cstdint>
#include <cmath>
#include <cstring>

inline uint32_t emu_to_tf32(float x) {
  uint32_t u; std::memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) == 0x7f800000u) return u;            // inf / nan
  u += 0x1000u;                                              // round to nearest, ties away (13 dropped bits)
  return u & 0xffffe000u;
}
inline float emu_tf32_value(uint32_t u) {  // the MMA reads only the top 19 bits
  u &= 0xffffe000u; float f; std::memcpy(&f, &u, 4); return f;
}
inline void emu_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint32_t* mine = &g_cta->frag[(w * 32 + lane) * 10];
  for (int i = 0; i < 4; ++i) mine[i] = a[i];
  mine[4] = b0; mine[5] = b1;
  for (int i = 0; i < 4; ++i) std::memcpy(&mine[6 + i], &c[i], 4);
  emu_warp_sync();
  float A[16][8], B[8][8], C[16][8];
  for (int l = 0; l < 32; ++l) {
    const uint32_t* f = &g_cta->frag[(w * 32 + l) * 10];
    const int g = l / 4, q = l % 4;
    A[g][q] = emu_tf32_value(f[0]); A[g + 8][q] = emu_tf32_value(f[1]);
    A[g][q + 4] = emu_tf32_value(f[2]); A[g + 8][q + 4] = emu_tf32_value(f[3]);
    B[q][g] = emu_tf32_value(f[4]); B[q + 4][g] = emu_tf32_value(f[5]);
    float cc[4]; for (int i = 0; i < 4; ++i) std::memcpy(&cc[i], &f[6 + i], 4);
    C[g][2 * q] = cc[0]; C[g][2 * q + 1] = cc[1]; C[g + 8][2 * q] = cc[2]; C[g + 8][2 * q + 1] = cc[3];
  }
  emu_warp_sync();
  const int g = lane / 4, q = lane % 4;
  const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * q, 2 * q + 1, 2 * q, 2 * q + 1};
  for (int e = 0; e < 4; ++e) {
    float acc = C[rows[e]][cols[e]];
    for (int k = 0; k < 8; ++k) acc += A[rows[e]][k] * B[k][cols[e]];
    c[e] = acc;
  }
}
inline float emu_exp2_approx(float x) {  // ex2.approx.ftz: denormal results flush to zero
  const float y = std::exp2(x);
  return std::fpclassify(y) == FP_SUBNORMAL ? 0.0f : y;
}
inline void emu_cp_async(void* smem, const void* gmem, bool fill) {
  if (fill) std::memcpy(smem, gmem, 16); else std::memset(smem, 0, 16);
}
