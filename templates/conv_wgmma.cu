// Convolution on Hopper's tensor cores (sm_90a), channels last, one group: an implicit GEMM whose
// operand tiles the tensor memory accelerator copies into shared memory (im2col boxes of the
// activations, tiled boxes of the weight or the cotangent) and whose products wgmma.mma_async
// takes straight from there, accumulating in f32 registers.
//   PASS 0 forward:         C[pixel, cout] = sum over (tap, cin)  im2col(input)  * weight
//   PASS 1 backward-data:   C[pixel, cin]  = sum over (tap, cout) im2col(cotangent) * weight
//                           (stride 1: the forward of the cotangent with the kernel turned round)
//   PASS 2 backward-weight: C[cout, (tap, cin)] = sum over pixels cotangent^T * im2col(input)
//   PASS 3 backward-weight with C turned round: C[(tap, cin), cout] = im2col(input)^T *
//                           cotangent, so that cout is the n side, which may be 320 wide (where
//                           320 output channels would fill 83% of three 128-row tiles); its
//                           f32 sums always go to the partials, stored in the weight's layout
// A block is three warpgroups: the first issues the copies (one thread), the other two each
// multiply half of the BM-row tile (64 or 128 rows). STAGES buffers of both operands, each with
// a "full" barrier (the copy engine's bytes arrived) and an "empty" one (both consumers'
// products that read it are done), let the copies run ahead of the products. Blocks are persistent: each
// walks the tile schedule with a grid stride, so a tile's stores overlap the next tile's copies.
// Backward-data at stride s runs one launch per stride phase: the input pixels f, f + s, ...
// along each dim, which a stride-1 problem over the cotangent with that phase's taps gives
// (a phase no tap reaches writes zeros). Backward-weight splits its pixels over tiles and writes f32 partial sums per split, which
// reduce_cols.cu adds up in a fixed order.
//
// Shared-memory layouts, all 128-byte swizzled as the copy engine writes them:
//   K-major (rows of 64 k elements, 128 bytes): A of forward and backward-data, B of forward.
//   MN-major (64-wide chunks of rows or columns, 64 k rows each): A of backward-weight, B of
//   backward-data and backward-weight.
// BN above 256 (PASS 3's 320) is one wgmma of n = 256 and one of n = BN - 256 per k step.
// f32 (KILN_ALLOW_TF32) runs as TF32 products: a k step is still one 128-byte row, now of 32
// elements, and four wgmma of k = 8. TF32's shared-memory operands must be K-major, so
// backward-data's B is the weight turned round, (cin, taps, cout), and backward-weight (PASS 3
// only) takes B from the cotangent turned round, (cout, pixels), both copied by the host, and A
// from registers: each thread loads its fragments of the MN-major im2col chunks (two boxes of
// 32 channels each) from shared memory.
{{> prelude}}
{{> tma}}
{{> cluster}}

typedef {{dtype}} T;
constexpr int PASS = {{PASS}};
constexpr int BM = {{BM}}, BN = {{BN}}, STAGES = {{STAGES}}, SPATIAL = {{SPATIAL}};
constexpr int CLUSTER = {{CLUSTER}};
static_assert(CLUSTER == 1 || CLUSTER == 2, "blocks alone or in pairs");
// A k step is one 128-byte swizzled row of each operand: 64 16-bit elements or 32 f32.
constexpr int BK = 128 / (int)sizeof(T);
constexpr bool TF32 = sizeof(T) == 4;
static_assert(!TF32 || PASS != 2, "TF32 backward-weight runs turned round (PASS 3)");
// Backward-weight, either way round: k runs over pixels; one operand is the cotangent's
// (pixel, cout) boxes, the other the input's im2col chunks (64 channels of one tap each).
constexpr bool WGRAD = PASS >= 2, SWAP = PASS == 3;
// Each consumer warpgroup multiplies SLICES slices of 64 rows (BM = 128 or 256).
constexpr int SLICES = BM / 128;
constexpr int A_MN = WGRAD, B_MN = PASS != 0 && !TF32;
// A from registers: TF32's backward-weight.
constexpr bool A_REGS = TF32 && WGRAD;
constexpr int A_BYTES = BM * 128, B_BYTES = BN * 128, CHUNK = 64 * 128;
constexpr int THREADS = 384;
// Shared memory each consumer warp stages its 16-bit stores through: 16 rows of 64 columns (none
// for PASS 3, whose partials go straight from the registers). f32 rows leave from the registers
// too (a quad's pairs of columns are whole 32-byte sectors); the room stays, to keep the layout
// the host computes one for every dtype.
constexpr int EPILOGUE_WARP_BYTES = SWAP ? 0 : 16 * 64 * 2;

// Mirrors ops::conv::hopper::Problem (repr(C)).
struct kiln_wg_problem {
  int rows, cols;             // valid rows of C; valid columns of a column block (per tap for PASS 2)
  int m_tiles, n_tiles, splits, k_per_split, k_iters;
  int cblocks;                // 64-channel blocks of the reduced channels (PASS 0, 1)
  int col_blocks;             // PASS 2: 64-channel chunks of one tap's columns
  int batch, pix[3];          // the pixel space the tiles walk: (batch, d, h, w)
  int stride[3], lower[3];    // a pixel's first activation coordinate: pos * stride + lower
  int taps_per_dim[3], tap_step[3], taps;  // the launch's taps; tap t's offset is t * tap_step
  int kernel[3];              // the weight's taps per dim
  int weight_first[3], weight_step[3];     // the weight's tap for tap t: first + t * step
  int out_pix[3], out_first[3], out_step[3];  // PASS 1: pixel i writes out_first + i * out_step
  long long ldc;              // elements between rows of C
  long long split_elems;      // PASS 2: elements of one split's partial sums
};

// --- wgmma -----------------------------------------------------------------------------------

// A shared-memory matrix descriptor for a 128-byte swizzled tile at `addr` (1024-aligned atoms):
// `lead` bytes between 64-element chunks along MN (MN-major) and 1024 between groups of 8 rows.
__device__ __forceinline__ unsigned long long kiln_wg_desc(unsigned addr, unsigned lead) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(lead >> 4) << 16) |
         ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void kiln_wg_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void kiln_wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N> __device__ __forceinline__ void kiln_wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// The instruction's k and types, and its transpose operands (%a, %b): 16-bit operands may be
// MN-major; TF32's are K-major, with no such operands.
#define KILN_WG_IS_{{dtype_name}} 1
#ifdef KILN_WG_IS_f32
#define KILN_WG_KIND "k8.f32.tf32.tf32"
#define KILN_WG_TRANS(a, b) ""
#else
#define KILN_WG_KIND "k16.f32.{{dtype_name}}.{{dtype_name}}"
#define KILN_WG_TRANS(a, b) ", %" #a ", %" #b
#endif
// A from shared memory (a descriptor), or for TF32's backward-weight from registers (four .b32
// a thread: `ra`), whose operands follow the others so that no index moves.
#if defined(KILN_WG_IS_f32) && {{PASS}} >= 2
#define KILN_WG_A(desc, r0, r1, r2, r3) "{%" #r0 ", %" #r1 ", %" #r2 ", %" #r3 "}"
#else
#define KILN_WG_A(desc, r0, r1, r2, r3) "%" #desc
#endif

// d (64 x N per warpgroup, f32: N / 2 a thread) += A (64 x 128 bytes / 4) * B (128 bytes / 4
// x N); d = A * B when !accumulate. `ra` is A when it comes from registers (KILN_WG_A).
template <int N>
__device__ __forceinline__ void kiln_wgmma(float* d, unsigned long long desc_a,
                                           unsigned long long desc_b, int accumulate,
                                           const unsigned (&ra)[4]) {
  static_assert(N == 64 || N == 128 || N == 192 || N == 256, "wgmma widths kiln issues");
  if constexpr (N == 64) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64" KILN_WG_KIND " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        KILN_WG_A(32, 37, 38, 39, 40) ", %33, p, 1, 1" KILN_WG_TRANS(35, 36) ";\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
          "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
          "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(A_MN), "n"(B_MN), "r"(ra[0]),
          "r"(ra[1]), "r"(ra[2]), "r"(ra[3]));
  } else if constexpr (N == 128) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128" KILN_WG_KIND " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
        "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "
        "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        KILN_WG_A(64, 69, 70, 71, 72) ", %65, p, 1, 1" KILN_WG_TRANS(67, 68) ";\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
          "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
          "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),
          "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
          "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),
          "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]),
          "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(A_MN), "n"(B_MN), "r"(ra[0]),
          "r"(ra[1]), "r"(ra[2]), "r"(ra[3]));
  } else if constexpr (N == 192) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192" KILN_WG_KIND " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
        "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "
        "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "
        "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, "
        "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, "
        "%92, %93, %94, %95}, "
        KILN_WG_A(96, 101, 102, 103, 104) ", %97, p, 1, 1" KILN_WG_TRANS(99, 100) ";\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
          "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
          "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),
          "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
          "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),
          "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]),
          "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]),
          "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]),
          "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]),
          "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]),
          "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(A_MN), "n"(B_MN), "r"(ra[0]),
          "r"(ra[1]), "r"(ra[2]), "r"(ra[3]));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256" KILN_WG_KIND " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
        "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "
        "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, "
        "%70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, "
        "%87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, "
        "%104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, "
        "%118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        KILN_WG_A(128, 133, 134, 135, 136) ", %129, p, 1, 1" KILN_WG_TRANS(131, 132) ";\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
          "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
          "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),
          "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
          "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),
          "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]),
          "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]),
          "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]),
          "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]),
          "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]),
          "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
          "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
          "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
          "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
          "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(A_MN), "n"(B_MN), "r"(ra[0]),
          "r"(ra[1]), "r"(ra[2]), "r"(ra[3]));
  }
}

// --- copies ----------------------------------------------------------------------------------

// Each copy below lands in this block's shared memory, or with a nonzero `mask` (CLUSTER > 1)
// at the same offset in every block of the cluster the mask names, completing on each one's
// barrier at `bar`'s offset.

// An im2col box: the pixels from (n, d, h, w) on (stride, wrapping as the map's window says), each
// at its tap offset, the map's channels (one 128-byte row) from c.
__device__ __forceinline__ void kiln_im2col_load(void* smem, const kiln_tensor_map* map, int c,
                                                 int n, const int (&pos)[3], const int (&off)[3],
                                                 unsigned long long* bar, unsigned short mask) {
  unsigned dst = kiln_smem_addr(smem), b = kiln_smem_addr(bar);
  unsigned short ow = off[2], oh = off[1], od = off[0];
  if constexpr (SPATIAL == 1) {
    if (CLUSTER > 1 && mask)
      asm volatile(
          "cp.async.bulk.tensor.3d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes"
          ".multicast::cluster [%0], [%1, {%2, %3, %4}], [%5], {%6}, %7;"
          ::"r"(dst), "l"(map), "r"(c), "r"(pos[2]), "r"(n), "r"(b), "h"(ow), "h"(mask)
          : "memory");
    else
      asm volatile(
          "cp.async.bulk.tensor.3d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes"
          " [%0], [%1, {%2, %3, %4}], [%5], {%6};"
          ::"r"(dst), "l"(map), "r"(c), "r"(pos[2]), "r"(n), "r"(b), "h"(ow)
          : "memory");
  } else if constexpr (SPATIAL == 2) {
    if (CLUSTER > 1 && mask)
      asm volatile(
          "cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes"
          ".multicast::cluster [%0], [%1, {%2, %3, %4, %5}], [%6], {%7, %8}, %9;"
          ::"r"(dst), "l"(map), "r"(c), "r"(pos[2]), "r"(pos[1]), "r"(n), "r"(b), "h"(ow),
            "h"(oh), "h"(mask)
          : "memory");
    else
      asm volatile(
          "cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes"
          " [%0], [%1, {%2, %3, %4, %5}], [%6], {%7, %8};"
          ::"r"(dst), "l"(map), "r"(c), "r"(pos[2]), "r"(pos[1]), "r"(n), "r"(b), "h"(ow), "h"(oh)
          : "memory");
  } else {
    if (CLUSTER > 1 && mask)
      asm volatile(
          "cp.async.bulk.tensor.5d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes"
          ".multicast::cluster [%0], [%1, {%2, %3, %4, %5, %6}], [%7], {%8, %9, %10}, %11;"
          ::"r"(dst), "l"(map), "r"(c), "r"(pos[2]), "r"(pos[1]), "r"(pos[0]), "r"(n), "r"(b),
            "h"(ow), "h"(oh), "h"(od), "h"(mask)
          : "memory");
    else
      asm volatile(
          "cp.async.bulk.tensor.5d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes"
          " [%0], [%1, {%2, %3, %4, %5, %6}], [%7], {%8, %9, %10};"
          ::"r"(dst), "l"(map), "r"(c), "r"(pos[2]), "r"(pos[1]), "r"(pos[0]), "r"(n), "r"(b),
            "h"(ow), "h"(oh), "h"(od)
          : "memory");
  }
}

// A tiled box of a 2-D map at (x innermost, y).
__device__ __forceinline__ void kiln_wg_load_2d(void* smem, const kiln_tensor_map* map, int x,
                                                int y, unsigned long long* bar,
                                                unsigned short mask) {
  if (CLUSTER > 1 && mask)
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;"
        ::"r"(kiln_smem_addr(smem)), "l"(map), "r"(x), "r"(y), "r"(kiln_smem_addr(bar)), "h"(mask)
        : "memory");
  else
    kiln_tma_load_2d(smem, map, x, y, bar);
}

// A tiled box of a 3-D map at (x innermost, y, z).
__device__ __forceinline__ void kiln_wg_load_3d(void* smem, const kiln_tensor_map* map, int x,
                                                int y, int z, unsigned long long* bar,
                                                unsigned short mask) {
  if (CLUSTER > 1 && mask)
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
        ".multicast::cluster [%0], [%1, {%2, %3, %4}], [%5], %6;"
        ::"r"(kiln_smem_addr(smem)), "l"(map), "r"(x), "r"(y), "r"(z), "r"(kiln_smem_addr(bar)),
          "h"(mask)
        : "memory");
  else
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4}], [%5];"
        ::"r"(kiln_smem_addr(smem)), "l"(map), "r"(x), "r"(y), "r"(z), "r"(kiln_smem_addr(bar))
        : "memory");
}

// --- the stage barriers ------------------------------------------------------------------------

// A consumer warp is done with the stage of `bar`: it arrives on that "empty" barrier in every
// block of the cluster, since every block's copies may write into this one's stage. The arrive
// keeps its default semantics (release at CTA scope): the stage's readers are this warp's
// wgmma, already waited for, and a cluster-scope release would wait for every memory access
// the thread has in flight.
__device__ __forceinline__ void kiln_wg_release(unsigned long long* bar) {
  if constexpr (CLUSTER == 1) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(kiln_smem_addr(bar)) : "memory");
  } else {
#pragma unroll
    for (int r = 0; r < CLUSTER; ++r)
      asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(kiln_cluster_map(bar, r))
                   : "memory");
  }
}

// Every thread of every block of the cluster: barriers initialised before are visible to the
// cluster after (at the start), and no block leaves while the other may still write into its
// shared memory or arrive on its barriers (at the end). Not `.aligned`: the producer warp's
// threads reach it from different branches.
__device__ __forceinline__ void kiln_wg_cluster_barrier() {
  if constexpr (CLUSTER > 1)
    asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}

// --- the tile schedule -------------------------------------------------------------------------

// PASS 2's columns are 64-channel chunks of the taps laid end to end (chunk g: tap g / col_blocks,
// channels from 64 (g % col_blocks)), so a tile may span taps and a layer's taps waste no more
// than one partial tile between them.
struct kiln_wg_tile {
  int row0, col0, split;  // first row and column of C (PASS 2: chunk col0 / 64); the split
  int k0, k1;             // its k iterations
};

// The schedule's units: tiles, or with CLUSTER = 2 pairs of row tiles (an odd last row tile's
// pair is past the rows: it copies zeros, or rows it never stores, and stores nothing).
__device__ __forceinline__ int kiln_wg_units(const kiln_wg_problem& p) {
  return (p.m_tiles + CLUSTER - 1) / CLUSTER * p.n_tiles * p.splits;
}

// This block's tile of unit u (`rank`: its place in the cluster).
__device__ __forceinline__ kiln_wg_tile kiln_wg_decode(const kiln_wg_problem& p, int u,
                                                       int rank) {
  kiln_wg_tile r;
  const int m_units = (p.m_tiles + CLUSTER - 1) / CLUSTER;
  const int nt = u % p.n_tiles, rest = u / p.n_tiles;
  r.row0 = ((rest % m_units) * CLUSTER + rank) * BM;
  r.split = rest / m_units;
  r.col0 = nt * BN;
  r.k0 = r.split * p.k_per_split;
  r.k1 = min(r.k0 + p.k_per_split, p.k_iters);
  return r;
}

// A tap as digits per dim (outermost first), stepped without dividing.
__device__ __forceinline__ void kiln_wg_tap_digits(const kiln_wg_problem& p, int tap, int (&t)[3]) {
  t[2] = tap % p.taps_per_dim[2];
  t[1] = (tap / p.taps_per_dim[2]) % p.taps_per_dim[1];
  t[0] = tap / (p.taps_per_dim[2] * p.taps_per_dim[1]);
}

__device__ __forceinline__ void kiln_wg_next_tap(const kiln_wg_problem& p, int (&t)[3]) {
  if (++t[2] == p.taps_per_dim[2]) {
    t[2] = 0;
    if (++t[1] == p.taps_per_dim[1]) {
      t[1] = 0;
      ++t[0];
    }
  }
}

// Tap t's im2col offset per dim, and the weight's tap it multiplies.
__device__ __forceinline__ int kiln_wg_tap_at(const kiln_wg_problem& p, const int (&t)[3],
                                              int (&off)[3]) {
  int w = 0;
#pragma unroll
  for (int d = 0; d < 3; ++d) {
    off[d] = t[d] * p.tap_step[d];
    w = w * p.kernel[d] + p.weight_first[d] + t[d] * p.weight_step[d];
  }
  return w;
}

__device__ __forceinline__ int kiln_wg_tap(const kiln_wg_problem& p, int tap, int (&off)[3]) {
  int t[3];
  kiln_wg_tap_digits(p, tap, t);
  return kiln_wg_tap_at(p, t, off);
}

// A pixel of the walk as digits (batch, d, h, w), stepped forward without dividing per step.
struct kiln_wg_cursor {
  int n, i[3];
};

__device__ __forceinline__ kiln_wg_cursor kiln_wg_cursor_at(const kiln_wg_problem& p, int i) {
  kiln_wg_cursor c;
#pragma unroll
  for (int d = 2; d >= 0; --d) {
    c.i[d] = i % p.pix[d];
    i /= p.pix[d];
  }
  c.n = i;
  return c;
}

__device__ __forceinline__ void kiln_wg_cursor_add(const kiln_wg_problem& p, kiln_wg_cursor& c,
                                                   int step) {
  c.i[2] += step;
  if (c.i[2] < p.pix[2]) return;
  int carry = c.i[2] / p.pix[2];
  c.i[2] -= carry * p.pix[2];
#pragma unroll
  for (int d = 1; d >= 0; --d) {
    c.i[d] += carry;
    if (c.i[d] < p.pix[d]) return;
    carry = c.i[d] / p.pix[d];
    c.i[d] -= carry * p.pix[d];
  }
  c.n += carry;
}

// The first activation coordinate per dim of the cursor's pixel.
__device__ __forceinline__ void kiln_wg_position(const kiln_wg_problem& p, const kiln_wg_cursor& c,
                                                 int (&pos)[3]) {
#pragma unroll
  for (int d = 0; d < 3; ++d) pos[d] = c.i[d] * p.stride[d] + p.lower[d];
}

// PASS 1: the output row of row r of C (its phase's pixel r).
__device__ __forceinline__ long long kiln_wg_out_row(const kiln_wg_problem& p, int r) {
  long long row = 0;
  int pos[3];
#pragma unroll
  for (int d = 2; d >= 0; --d) {
    pos[d] = p.out_first[d] + (r % p.pix[d]) * p.out_step[d];
    r /= p.pix[d];
  }
  row = r;
#pragma unroll
  for (int d = 0; d < 3; ++d) row = row * p.out_pix[d] + pos[d];
  return row;
}

// Backward-weight's im2col chunk g: where its first channel lies in a row of the weight
// gradient (the weight's tap times cin, plus its first channel), and how many of its channels
// are real (none past the last tap).
__device__ __forceinline__ int kiln_wg_weight_chunk(const kiln_wg_problem& p, int g,
                                                    long long& col) {
  const int tap = g / p.col_blocks, c0 = (g % p.col_blocks) * 64;
  if (tap >= p.taps) {
    col = 0;
    return 0;
  }
  int unused[3];
  col = (long long)kiln_wg_tap(p, tap, unused) * p.cols + c0;
  return p.cols - c0;
}

// The output column of 64-column chunk `ch` of tile `tl`, and how many of its columns are real.
__device__ __forceinline__ int kiln_wg_chunk(const kiln_wg_problem& p, const kiln_wg_tile& tl,
                                             int ch, long long& col) {
  if (PASS != 2) {
    col = tl.col0 + 64 * ch;
    return p.cols - (tl.col0 + 64 * ch);
  }
  return kiln_wg_weight_chunk(p, tl.col0 / 64 + ch, col);
}

// Of `chunks` 64-wide chunks from `first`, how many start below `limit`: the real ones. Chunks
// wholly past C's last row or column are not copied at all (the copy engine's zero fill of a
// box outside the tensor costs about as much as a real copy): the products they would feed lie
// in C's rows or columns past the end, which are never stored, as a wgmma row of C depends only
// on its own row of A and a column only on its own column of B.
__device__ __forceinline__ int kiln_wg_real_chunks(int first, int limit, int chunks) {
  return max(0, min(chunks, (limit - first + 63) / 64));
}

// The producer: one thread walks the tile schedule and issues each k step's copies into the
// next stage, once the consumers (of every block of the cluster) are done with it. In a cluster
// block `rank` copies every CLUSTER-th of B's 64-column chunks into every block; A is its own.
__device__ __forceinline__ void kiln_wg_produce(const kiln_wg_problem& p,
                                                const kiln_tensor_map* amap,
                                                const kiln_tensor_map* bmap,
                                                unsigned char* a_stage, unsigned char* b_stage,
                                                unsigned long long* full,
                                                unsigned long long* empty, int rank) {
  const unsigned short all = CLUSTER > 1 ? (1u << CLUSTER) - 1 : 0;
  const int units = kiln_wg_units(p);
  int it = 0;
  for (int u = blockIdx.x / CLUSTER; u < units; u += gridDim.x / CLUSTER) {
    const kiln_wg_tile tl = kiln_wg_decode(p, u, rank);
    // PASS 0, 1: k runs over (tap, channel block) from the first; the tile's pixels are fixed.
    // PASS 2, 3: k runs over blocks of 64 pixels; the tile's chunks (taps, channels) are fixed.
    kiln_wg_cursor cur = kiln_wg_cursor_at(p, WGRAD ? tl.k0 * BK : tl.row0);
    int tap[3] = {0, 0, 0}, cb = 0;
    if (WGRAD) {
      const int g = (SWAP ? tl.row0 : tl.col0) / 64;
      kiln_wg_tap_digits(p, g / p.col_blocks, tap);
      cb = g % p.col_blocks;
    }
    // The real chunks of each operand (PASS 0, 1: A is one im2col box, always copied whole).
    // Backward-weight's im2col chunks end with the last tap; its cotangent chunks with cout.
    const int weight_chunks = p.taps * p.col_blocks;
    int a_chunks, b_chunks;
    if (!WGRAD) {
      a_chunks = BM / 64;
      b_chunks = kiln_wg_real_chunks(tl.col0, p.cols, BN / 64);
    } else if (!SWAP) {
      a_chunks = kiln_wg_real_chunks(tl.row0, p.rows, BM / 64);
      b_chunks = kiln_wg_real_chunks(tl.col0 / 64 * 64, weight_chunks * 64, BN / 64);
    } else {
      a_chunks = kiln_wg_real_chunks(tl.row0 / 64 * 64, weight_chunks * 64, BM / 64);
      b_chunks = kiln_wg_real_chunks(tl.col0, p.rows, BN / 64);
    }
    const unsigned stage_bytes = (a_chunks + b_chunks) * CHUNK;
    for (int k = tl.k0; k < tl.k1; ++k, ++it) {
      const int s = it % STAGES;
      unsigned char* a = a_stage + s * A_BYTES;
      unsigned char* b = b_stage + s * B_BYTES;
      kiln_mbarrier_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
      kiln_mbarrier_expect_bytes(&full[s], stage_bytes);
      int pos[3], off[3];
      kiln_wg_position(p, cur, pos);
      if (!WGRAD) {
        // A: the tile's pixels at this tap; B: the weight at this tap.
        const int wtap = kiln_wg_tap_at(p, tap, off), c = cb * BK;
        kiln_im2col_load(a, amap, c, cur.n, pos, off, &full[s], 0);
#pragma unroll
        for (int j = 0; j < BN / 64; ++j) {
          if (j >= b_chunks || j % CLUSTER != rank) continue;
          if (PASS == 0 || TF32) {
            // weight viewed as (cout, taps, cin), or turned round for TF32's backward-data:
            // 64 rows of n, BK channels of k each per chunk.
            kiln_wg_load_3d(b + j * CHUNK, bmap, c, wtap, tl.col0 + 64 * j, &full[s], all);
          } else {
            // (cout, taps, cin) again, now 64 cout rows (k) by 64 cin (n) per chunk.
            kiln_wg_load_3d(b + j * CHUNK, bmap, tl.col0 + 64 * j, wtap, c, &full[s], all);
          }
        }
        if (++cb == p.cblocks) {
          cb = 0;
          kiln_wg_next_tap(p, tap);
        }
      } else {
        // The cotangent's (pixel, cout) boxes and the input's im2col box of each chunk: A and B
        // of PASS 2, B and A of PASS 3.
        unsigned char* dy = SWAP ? b : a;
        unsigned char* x = SWAP ? a : b;
        constexpr int DY_CHUNKS = (SWAP ? BN : BM) / 64, X_CHUNKS = (SWAP ? BM : BN) / 64;
        const int cout0 = SWAP ? tl.col0 : tl.row0;
        const int dy_chunks = SWAP ? b_chunks : a_chunks;
        const int x_chunks = SWAP ? a_chunks : b_chunks;
#pragma unroll
        for (int j = 0; j < DY_CHUNKS; ++j) {
          if (j >= dy_chunks || (SWAP && j % CLUSTER != rank)) continue;
          if (TF32) {
            // The cotangent turned round, (cout, pixel): 64 cout rows of BK pixels (K-major).
            kiln_wg_load_2d(dy + j * CHUNK, amap, k * BK, cout0 + 64 * j, &full[s], all);
          } else {
            kiln_wg_load_2d(dy + j * CHUNK, amap, cout0 + 64 * j, k * BK, &full[s],
                            SWAP ? all : 0);
          }
        }
        int t[3] = {tap[0], tap[1], tap[2]}, c = cb;
#pragma unroll
        for (int j = 0; j < X_CHUNKS; ++j) {
          if (j > 0 && ++c == p.col_blocks) {
            c = 0;
            kiln_wg_next_tap(p, t);
          }
          if (j < x_chunks && (SWAP || j % CLUSTER == rank)) {
            kiln_wg_tap_at(p, t, off);
            // 64 channels: one box of 128-byte rows, or two of 32 f32 channels.
#pragma unroll
            for (int h = 0; h < (TF32 ? 2 : 1); ++h)
              kiln_im2col_load(x + j * CHUNK + h * (CHUNK / 2), bmap, c * 64 + h * 32, cur.n,
                               pos, off, &full[s], SWAP ? 0 : all);
          }
        }
        kiln_wg_cursor_add(p, cur, BK);
      }
    }
  }
}

// --- the kernel --------------------------------------------------------------------------------

// Blocks in pairs declare their cluster shape, which the launch then takes.
#if {{CLUSTER}} > 1
#define KILN_WG_CLUSTER_DIMS __cluster_dims__({{CLUSTER}}, 1, 1)
#else
#define KILN_WG_CLUSTER_DIMS
#endif

extern "C" __global__ void KILN_WG_CLUSTER_DIMS __launch_bounds__(THREADS, 1) {{kernel}}(
    const __grid_constant__ kiln_tensor_map amap, const __grid_constant__ kiln_tensor_map bmap,
    T* __restrict__ out, float* __restrict__ partial, const kiln_wg_problem p) {
  extern __shared__ unsigned char smem_raw[];
  // Swizzled tiles need 1024-byte alignment; the launch asks for 1 KiB of slack.
  unsigned char* smem = (unsigned char*)(((size_t)smem_raw + 1023) & ~(size_t)1023);
  unsigned char* a_stage = smem;
  unsigned char* b_stage = smem + STAGES * A_BYTES;
  unsigned char* epilogue = b_stage + STAGES * B_BYTES;
  unsigned long long* full = (unsigned long long*)(epilogue + 8 * EPILOGUE_WARP_BYTES);
  unsigned long long* empty = full + STAGES;

  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      kiln_mbarrier_init(&full[s], 1);
      // Each consumer warp of each block of the cluster arrives once.
      kiln_mbarrier_init(&empty[s], 8 * CLUSTER);
    }
  }
  __syncthreads();
  kiln_wg_cluster_barrier();
  const int rank = CLUSTER > 1 ? (int)kiln_cluster_rank() : 0;
  const int units = kiln_wg_units(p);

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) kiln_wg_produce(p, &amap, &bmap, a_stage, b_stage, full, empty, rank);
    kiln_wg_cluster_barrier();
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int cw = wg - 1;                       // this consumer's BM / 2 rows of the tile
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  float acc[SLICES][BN / 2];
  // A from registers (TF32 backward-weight): the byte offsets, within a 64-row chunk of A, of
  // this thread's fragment (rows warp * 16 + lane / 4, + 8; k lane % 4, + 4, in that order) at
  // the first k of a step: the chunk is two boxes of 32 channels (rows of A), each BK pixel rows
  // of 128 bytes whose 16-byte units the copy engine swizzled by the row.
  unsigned a_frag[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int ch = 16 * (warp % 2) + lane / 4 + 8 * (q & 1), kr = lane % 4 + 4 * (q >> 1);
    a_frag[q] = (warp / 2) * (CHUNK / 2) + kr * 128 + (((ch >> 2) ^ kr) << 4) + (ch & 3) * 4;
  }
  const unsigned no_regs[4] = {0, 0, 0, 0};
  int it = 0;
  for (int u = blockIdx.x / CLUSTER; u < units; u += gridDim.x / CLUSTER) {
    const kiln_wg_tile tl = kiln_wg_decode(p, u, rank);
    if (tl.k1 == tl.k0) {
      // Nothing to multiply (a stride phase no tap reaches): the tile is zeros.
#pragma unroll
      for (int sl = 0; sl < SLICES; ++sl)
#pragma unroll
        for (int j = 0; j < BN / 2; ++j) acc[sl][j] = 0.f;
    }
    for (int k = tl.k0; k < tl.k1 && A_REGS; ++k, ++it) {
      // TF32 backward-weight: A's fragments from shared memory into registers, which the
      // products read asynchronously: they stay untouched until the wait after them, and so
      // does the stage, released only then.
      const int s = it % STAGES;
      kiln_mbarrier_wait(&full[s], (it / STAGES) & 1);
      const unsigned char* as = a_stage + s * A_BYTES + cw * SLICES * CHUNK;
      const unsigned b = kiln_smem_addr(b_stage + s * B_BYTES);
      unsigned ra[SLICES][4][4];
#pragma unroll
      for (int sl = 0; sl < SLICES; ++sl)
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
          for (int q = 0; q < 4; ++q)
            ra[sl][kk][q] =
                *reinterpret_cast<const unsigned*>(as + sl * CHUNK + a_frag[q] + kk * 8 * 128);
      kiln_wg_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const unsigned db = b + kk * 32;
        const int accumulate = k > tl.k0 || kk > 0;
#pragma unroll
        for (int sl = 0; sl < SLICES; ++sl) {
          if constexpr (BN <= 256) {
            kiln_wgmma<BN>(acc[sl], 0, kiln_wg_desc(db, CHUNK), accumulate, ra[sl][kk]);
          } else {
            constexpr int HI = BN > 256 ? 128 : 0;
            kiln_wgmma<256>(acc[sl], 0, kiln_wg_desc(db, CHUNK), accumulate, ra[sl][kk]);
            kiln_wgmma<BN - 256>(&acc[sl][HI], 0, kiln_wg_desc(db + 4 * CHUNK, CHUNK),
                                 accumulate, ra[sl][kk]);
          }
        }
      }
      kiln_wg_commit();
      kiln_wg_wait<0>();
      // The fragments live (in the same registers) until here.
#pragma unroll
      for (int sl = 0; sl < SLICES; ++sl)
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
          for (int q = 0; q < 4; ++q) asm volatile("" : "+r"(ra[sl][kk][q])::"memory");
      if (lane == 0) kiln_wg_release(&empty[s]);
    }
    for (int k = tl.k0; k < tl.k1 && !A_REGS; ++k, ++it) {
      const int s = it % STAGES;
      kiln_mbarrier_wait(&full[s], (it / STAGES) & 1);
      const unsigned a = kiln_smem_addr(a_stage + s * A_BYTES) + cw * SLICES * CHUNK;
      const unsigned b = kiln_smem_addr(b_stage + s * B_BYTES);
      kiln_wg_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        // A wgmma's k (16 16-bit elements, 8 f32) is 32 bytes along a K-major row; MN-major,
        // 16 rows of 128 bytes.
        const unsigned da = A_MN ? a + kk * 2048 : a + kk * 32;
        const unsigned db = B_MN ? b + kk * 2048 : b + kk * 32;
        const int accumulate = k > tl.k0 || kk > 0;
#pragma unroll
        for (int sl = 0; sl < SLICES; ++sl) {
          const unsigned long long desc_a = kiln_wg_desc(da + sl * CHUNK, CHUNK);
          if constexpr (BN <= 256) {
            kiln_wgmma<BN>(acc[sl], desc_a, kiln_wg_desc(db, CHUNK), accumulate, no_regs);
          } else {
            // Columns 256 on: B's chunks 4 on, accumulators 128 on. (The index is written so
            // that the branch the other tiles discard still indexes within their arrays.)
            constexpr int HI = BN > 256 ? 128 : 0;
            kiln_wgmma<256>(acc[sl], desc_a, kiln_wg_desc(db, CHUNK), accumulate, no_regs);
            kiln_wgmma<BN - 256>(&acc[sl][HI], desc_a, kiln_wg_desc(db + 4 * CHUNK, CHUNK),
                                 accumulate, no_regs);
          }
        }
      }
      kiln_wg_commit();
      // The products of the previous iteration are done: its buffers may be refilled.
      kiln_wg_wait<1>();
      if (k > tl.k0 && lane == 0) kiln_wg_release(&empty[(it + STAGES - 1) % STAGES]);
    }
    kiln_wg_wait<0>();
    if (!A_REGS && tl.k1 > tl.k0 && lane == 0)
      kiln_wg_release(&empty[(it + STAGES - 1) % STAGES]);

    // Thread (warp, lane) holds rows warp * 16 + lane / 4 (+ 8) of each slice and column pairs
    // 8 j + 2 (lane % 4).
    if constexpr (SWAP) {
      // f32 partials in the weight gradient's layout [split][cout][tap][cin]: a row of C is a
      // (tap, channel) of the weight, a column an output channel. One store of the warp writes
      // 8 consecutive channels of each of 4 columns.
      const int c0 = tl.col0 + 2 * (lane % 4);
#pragma unroll
      for (int sh = 0; sh < 2 * SLICES; ++sh) {
        const int sl = sh / 2, half = sh % 2;
        const int r = tl.row0 + (cw * SLICES + sl) * 64 + warp * 16 + lane / 4 + 8 * half;
        long long at;
        if (r % 64 >= kiln_wg_weight_chunk(p, r / 64, at)) continue;
        float* row = partial + tl.split * p.split_elems + at + r % 64;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int c = c0 + 8 * j + e;
            if (c < p.rows) row[(long long)c * p.ldc] = acc[sl][4 * j + 2 * half + e];
          }
      }
      continue;
    }
    if (TF32 || (PASS == 2 && p.splits > 1)) {
      // f32 straight from the registers (pairs of columns): TF32's output, or a split
      // backward-weight's partials.
      float* dst = TF32 ? reinterpret_cast<float*>(out) : partial + tl.split * p.split_elems;
      const int c0 = 2 * (lane % 4);
#pragma unroll
      for (int ch = 0; ch < BN / 64; ++ch) {
        long long col;
        const int limit = kiln_wg_chunk(p, tl, ch, col);
#pragma unroll
        for (int sh = 0; sh < 2 * SLICES; ++sh) {
          const int sl = sh / 2, half = sh % 2;
          const int r = tl.row0 + (cw * SLICES + sl) * 64 + warp * 16 + lane / 4 + 8 * half;
          if (r >= p.rows) continue;
          float* row = dst + (PASS == 1 ? kiln_wg_out_row(p, r) : r) * p.ldc + col;
#pragma unroll
          for (int jj = 0; jj < 8; ++jj) {
            const int c = 8 * jj + c0, j = 8 * ch + jj;
            if (c >= limit) continue;  // columns come in even counts (channels % 8 == 0)
            *reinterpret_cast<float2*>(row + c) =
                make_float2(acc[sl][4 * j + 2 * half], acc[sl][4 * j + 2 * half + 1]);
          }
        }
      }
      continue;
    }
    // Through shared memory, so that each row leaves as whole 128-byte pieces: the warp puts
    // its 16 rows x 64 columns of a slice in its 2 KiB (16-byte units of a row XOR-swizzled by
    // the row, so that neither side conflicts on banks), then each quarter of the warp stores
    // one row's 128 bytes with 16-byte stores.
    unsigned char* stage = epilogue + (cw * 4 + warp) * EPILOGUE_WARP_BYTES;
#pragma unroll
    for (int sl = 0; sl < SLICES; ++sl) {
      // The output offsets of the four rows this lane stores.
      long long base[4];
      bool valid[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int r = tl.row0 + (cw * SLICES + sl) * 64 + warp * 16 + 4 * q + lane / 8;
        valid[q] = r < p.rows;
        base[q] = (PASS == 1 ? kiln_wg_out_row(p, valid[q] ? r : 0) : r) * p.ldc;
      }
#pragma unroll
      for (int ch = 0; ch < BN / 64; ++ch) {
        long long col;
        const int limit = kiln_wg_chunk(p, tl, ch, col);
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int row = lane / 4 + 8 * half, j = 8 * ch + jj;
            kiln_vec<T, 2> v;
            v.v[0] = kiln_from_float<T>(acc[sl][4 * j + 2 * half]);
            v.v[1] = kiln_from_float<T>(acc[sl][4 * j + 2 * half + 1]);
            *reinterpret_cast<kiln_vec<T, 2>*>(stage + row * 128 + ((jj ^ (row & 7)) * 16) +
                                               4 * (lane % 4)) = v;
          }
        }
        __syncwarp();
        const int unit = lane % 8, c = 8 * unit;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int row = 4 * q + lane / 8;
          const uint4 v =
              *reinterpret_cast<const uint4*>(stage + row * 128 + ((unit ^ (row & 7)) * 16));
          if (valid[q] && c < limit) *reinterpret_cast<uint4*>(out + base[q] + col + c) = v;
        }
        __syncwarp();
      }
    }
  }
  kiln_wg_cluster_barrier();
}
