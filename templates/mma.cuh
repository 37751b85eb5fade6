// Tensor-core building blocks shared by the mma.sync families (conv_igemm, conv_stem,
// conv_grouped): the
// m16n8k16 product with f32 accumulators and ldmatrix. Fragments are laid out as the PTX ISA's
// mma.m16n8k16 describes: A's register 0 holds row lane / 4, k 2 (lane % 4) and the next; 1 the
// row 8 further; 2 and 3 the same rows 8 k further. B's 0 and 1 hold k 2 (lane % 4) (+8), column
// lane / 4; C's 0 and 1 row lane / 4, columns 2 (lane % 4) and the next, 2 and 3 the row 8 further.

// C[16x8] += A[16x16] B[16x8]. Turing has only k = 8 for f16: the m16n8k16 fragments split
// into two m16n8k8 ones, A's registers {0, 1} and B's 0 holding k 0-7, A's {2, 3} and B's 1
// k 8-15, with the accumulators laid out alike.
template <typename U> struct kiln_mma;
template <> struct kiln_mma<kiln_f16> {
  static __device__ __forceinline__ void run(float (&c)[4], const unsigned (&a)[4],
                                             unsigned b0, unsigned b1) {
#ifdef KILN_HOST
    kiln_host_mma(c, a, b0, b1, kiln_host_f16_to_float);  // tests/host/cuda_host.h
#elif KILN_ARCH >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif KILN_ARCH >= 750
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(b0));
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[2]), "r"(a[3]), "r"(b1));
#endif
  }
};
template <> struct kiln_mma<kiln_bf16> {
  static __device__ __forceinline__ void run(float (&c)[4], const unsigned (&a)[4],
                                             unsigned b0, unsigned b1) {
#ifdef KILN_HOST
    kiln_host_mma(c, a, b0, b1, kiln_host_bf16_to_float);
#elif KILN_ARCH >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
  }
};
template <> struct kiln_mma<float> {
  static __device__ __forceinline__ void run(float (&)[4], const unsigned (&)[4], unsigned,
                                             unsigned) {}
};

// C[16x8] += A[16x8] B[8x8] in TF32 (sm_80 on), f32 accumulators. A's register 0 holds row
// lane / 4, k lane % 4; 1 the row 8 further; 2 and 3 the same rows 4 k further. B's 0 and 1
// hold k lane % 4 (+4), column lane / 4. C as for m16n8k16. The MMA reads the top 19 bits of
// each f32 word (sign, exponent, 10 mantissa bits).
__device__ __forceinline__ void kiln_mma_tf32(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                              unsigned b1) {
#ifdef KILN_HOST
  kiln_host_mma_tf32(c, a, b0, b1);  // tests/host/cuda_host.h
#elif KILN_ARCH >= 800
  // Not volatile: the compiler may move it among the fragment loads (its result is used).
  asm(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// The f32 word x as TF32 operands. PRODUCTS 1: x rounded to the nearest TF32 (ties away from
// zero) in hi; lo unused. PRODUCTS 3: hi is x truncated to TF32 and lo the rest, x - hi (exact
// in f32), rounded to TF32, so that hi + lo holds about 22 of x's 24 bits; truncating hi cannot
// overflow to infinity, as rounding the largest f32 values would.
template <int PRODUCTS>
__device__ __forceinline__ void kiln_tf32_split(unsigned x, unsigned& hi, unsigned& lo) {
  constexpr unsigned kMask = 0xffffe000u, kHalf = 0x1000u;  // the 13 bits TF32 drops
  const auto round = [](unsigned v) {
    return (v & 0x7f800000u) == 0x7f800000u ? v : (v + kHalf) & kMask;  // inf, NaN as they are
  };
  if (PRODUCTS == 1) {
    hi = round(x);
    lo = 0;
  } else {
    hi = x & kMask;
    lo = round(__float_as_uint(__uint_as_float(x) - __uint_as_float(hi)));
  }
}

// ldmatrix exists from sm_75 on, as tensor cores kiln uses do.
template <bool TRANS>
__device__ __forceinline__ void kiln_ldmatrix_x4(unsigned (&r)[4], const void* smem) {
#ifdef KILN_HOST
  kiln_host_ldmatrix<4, TRANS>(r, smem);
#elif KILN_ARCH >= 750
  const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
  if (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
#endif
}

// Two matrices: lanes 0-15 give the row addresses (the others' are not read).
template <bool TRANS>
__device__ __forceinline__ void kiln_ldmatrix_x2(unsigned (&r)[2], const void* smem) {
#ifdef KILN_HOST
  kiln_host_ldmatrix<2, TRANS>(r, smem);
#elif KILN_ARCH >= 750
  const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
  if (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(a));
#endif
}
