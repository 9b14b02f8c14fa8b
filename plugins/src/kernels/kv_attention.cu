// PEagleKVAttention: attention of a few new rows per request over that request's paged KV cache,
// causal by absolute position, writing the new K/V rows in place first.
//
// Shapes (docs/EXPORT.md): q [B, S, H*d]; k, v [B, S, KV*d]; positions [B, S] (-1 = padding);
// block_tables [B, M] (-1 = no block); k_cache, v_cache [NB, bs, KV, d] (NB = blocks + 1, the last
// block is the trash block); out [B, S, H*d]. Position p of request b lives in block
// block_tables[b, p / bs] at offset p % bs.
//
// Three launches on one stream:
//   1. kvWriteKernel     every row's k/v -> cache[block, offset, kv_head] (padding rows, positions past
//                        the table and entries -1 -> (trash, 0); FP8 caches store value / scale).
//                        All writes land before any read.
//   2. attnMmaKernel     flash-decoding over the context. Block = (16 query rows, one KV chunk,
//                        one (request, kv head)). The 16 rows are (s, head-in-group) pairs that share
//                        the kv head, so each K/V tile is loaded once for all of them (GQA). Four
//                        warps take 16 keys each of every 64-key tile staged in shared memory; each
//                        warp runs QK^T and PV on tensor cores (mma.sync m16n8k16, fp32 accumulate)
//                        with an online softmax in registers; the warps are merged at the end.
//                        Long contexts are split into chunks over blockIdx.y so an 8k context fills
//                        the GPU; blocks whose chunk starts past their rows' last position exit.
//                        Each 64-key tile looks its keys' blocks up in the table once (shared memory).
//   3. attnReduceKernel  merges the per-chunk partial results (o, log-sum-exp) of each row
//                        (only when the context was split).
// attnSimpleKernel (one block per query row, CUDA cores) serves fp32 activations, other head sizes,
// and is a second implementation to check the fast one against (PEAGLE_ATTN_FORCE_SIMPLE).
//
// Row (b, s) at position p sees the keys at positions 0..min(p, M*bs - 1) of its request, found
// through its block table; a padding row (p = -1) sees key 0 only, as the reference does, so its
// output is finite. Keys whose table entry is -1 (or out of range) are masked: the runtime never
// leaves such an entry inside a row's visible range (the reference would read the trash block
// there); a row that sees no key at all returns zeros.
#include "common.cuh"

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace peagle
{
namespace
{

constexpr float kLog2e = 1.4426950408889634f;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kTileRows = 16;                    // query rows per block: one m16 MMA tile
constexpr int kWarpKeys = 16;                    // keys per warp per tile: two n8 MMA tiles
constexpr int kTileKeys = kWarps * kWarpKeys;    // keys staged in shared memory per iteration
constexpr int kPad = 8;                          // 16-bit elements of row padding (conflict-free fragments)

constexpr int kMinChunk = 256;                   // keys per split, at least
constexpr int kMaxSplits = 64;
constexpr int kTargetBlocks = 1024;              // enough blocks to fill an H200 / B200 several times
constexpr size_t kWorkspaceBudget = size_t(64) << 20;

constexpr int kSimpleMaxDimsPerThread = 4;       // simple path: head_dim <= 4 * kThreads

struct AttnParams
{
    void const* q;
    void const* k;
    void const* v;
    int64_t const* positions;
    int64_t const* tables; // [B, M] block tables
    void* kCache;
    void* vCache;
    void* out;
    float* partO;   // [splits, B*S*H, D]
    float* partLse; // [splits, B*S*H]   (log2 domain)
    int32_t B, S, H, KV, G, D;
    int32_t NB;      // cache blocks, the trash block (NB - 1) included
    int32_t BS;      // positions per block
    int32_t M;       // table entries per request
    int32_t maxKeys; // M * BS: positions a table can address
    int32_t splits, chunk;
    float scale;  // softmax scale
    float kScale; // FP8 dequantization scales (1 for 16/32-bit caches)
    float vScale;
};

// Element offset of (position, kv head) of request b in the caches [NB, BS, KV, D], or -1 when the
// position has no block (entry -1 or out of range). `pos` must be in [0, maxKeys).
__device__ __forceinline__ int64_t keyRow(AttnParams const& p, int32_t b, int32_t pos, int32_t head)
{
    int64_t const block = p.tables[static_cast<int64_t>(b) * p.M + pos / p.BS];
    if (block < 0 || block >= p.NB)
        return -1;
    return ((block * p.BS + pos % p.BS) * p.KV + head) * static_cast<int64_t>(p.D);
}

// Last key position a row at `pos` sees (a padding row: key 0), capped by what the table addresses.
__device__ __forceinline__ int32_t lastKey(int64_t pos, int32_t maxKeys)
{
    return pos < 0 ? 0 : (pos >= maxKeys ? maxKeys - 1 : static_cast<int32_t>(pos));
}

// ------------------------------------------------------------------------------------------------
// 1. in-place K/V write
// ------------------------------------------------------------------------------------------------

template <typename TA, typename TC>
__global__ void __launch_bounds__(kThreads) kvWriteKernel(AttnParams p)
{
    int64_t const bs = blockIdx.x; // b * S + s
    int32_t const b = static_cast<int32_t>(bs / p.S);
    int64_t const pos = p.positions[bs];
    // (block, offset) of this row; padding rows, positions past the table and entries -1 -> (trash, 0)
    int64_t base = -1;
    if (pos >= 0 && pos < p.maxKeys)
        base = keyRow(p, b, static_cast<int32_t>(pos), 0);
    if (base < 0)
        base = static_cast<int64_t>(p.NB - 1) * p.BS * p.KV * p.D;
    int32_t const width = p.KV * p.D;
    TA const* k = static_cast<TA const*>(p.k) + bs * width;
    TA const* v = static_cast<TA const*>(p.v) + bs * width;
    TC* kc = static_cast<TC*>(p.kCache);
    TC* vc = static_cast<TC*>(p.vCache);
    for (int32_t e = threadIdx.x; e < width; e += blockDim.x)
    {
        int64_t const dst = base + e; // [KV, D] of one position are contiguous
        float kv = toFloat(k[e]), vv = toFloat(v[e]);
        if constexpr (IsFp8<TC>::value)
        {
            kv = kv / p.kScale; // stored = value / scale (saturating conversion)
            vv = vv / p.vScale;
        }
        kc[dst] = fromFloat<TC>(kv);
        vc[dst] = fromFloat<TC>(vv);
    }
}

// ------------------------------------------------------------------------------------------------
// 2. tensor-core flash-decoding kernel
// ------------------------------------------------------------------------------------------------

template <typename T>
struct Mma;

template <>
struct Mma<__half>
{
    // D (16x8 f32) += A (16x16 f16, row) * B (16x8 f16, col)
    static __device__ __forceinline__ void run(float (&d)[4], uint32_t const (&a)[4], uint32_t b0, uint32_t b1)
    {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }

    static __device__ __forceinline__ uint16_t bits(float x)
    {
        return __half_as_ushort(__float2half_rn(x));
    }
};

template <>
struct Mma<__nv_bfloat16>
{
    static __device__ __forceinline__ void run(float (&d)[4], uint32_t const (&a)[4], uint32_t b0, uint32_t b1)
    {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }

    static __device__ __forceinline__ uint16_t bits(float x)
    {
        return __bfloat16_as_ushort(__float2bfloat16_rn(x));
    }
};

// Two 16-bit values as one MMA register: `lo` (lower k / column index) in the low half.
__device__ __forceinline__ uint32_t pack(uint16_t lo, uint16_t hi)
{
    return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

__device__ __forceinline__ uint32_t load32(uint16_t const* p)
{
    return *reinterpret_cast<uint32_t const*>(p);
}

// Stage the keys of one tile into shared memory as T bit patterns: key r of the tile is the cache
// row at element offset rows[r] (-1: a key past kvEnd or without a block, staged as zeros: it is
// masked, and zeros keep 0 * V finite).
template <typename T, typename TC, int D>
__device__ __forceinline__ void loadKvTile(uint16_t (*sK)[D + kPad], uint16_t (*sV)[D + kPad],
    TC const* __restrict__ kBase, TC const* __restrict__ vBase, int64_t const* rows)
{
    if constexpr (IsFp8<TC>::value)
    {
        constexpr int kChunks = D / 16; // 16 fp8 values per 16-byte load
        for (int e = threadIdx.x; e < kTileKeys * kChunks; e += kThreads)
        {
            int const r = e / kChunks, c = (e % kChunks) * 16;
            int64_t const row = rows[r];
            uint4 kRaw = make_uint4(0, 0, 0, 0), vRaw = make_uint4(0, 0, 0, 0);
            if (row >= 0)
            {
                kRaw = __ldg(reinterpret_cast<uint4 const*>(kBase + row + c));
                vRaw = __ldg(reinterpret_cast<uint4 const*>(vBase + row + c));
            }
            uint8_t const* kb = reinterpret_cast<uint8_t const*>(&kRaw);
            uint8_t const* vb = reinterpret_cast<uint8_t const*>(&vRaw);
            alignas(16) uint16_t kh[16], vh[16];
#pragma unroll
            for (int i = 0; i < 16; ++i)
            {
                __nv_fp8_e4m3 fk, fv;
                fk.__x = kb[i];
                fv.__x = vb[i];
                kh[i] = Mma<T>::bits(static_cast<float>(fk)); // exact: every e4m3 value fits f16 / bf16
                vh[i] = Mma<T>::bits(static_cast<float>(fv));
            }
            *reinterpret_cast<uint4*>(&sK[r][c]) = *reinterpret_cast<uint4 const*>(&kh[0]);
            *reinterpret_cast<uint4*>(&sK[r][c + 8]) = *reinterpret_cast<uint4 const*>(&kh[8]);
            *reinterpret_cast<uint4*>(&sV[r][c]) = *reinterpret_cast<uint4 const*>(&vh[0]);
            *reinterpret_cast<uint4*>(&sV[r][c + 8]) = *reinterpret_cast<uint4 const*>(&vh[8]);
        }
    }
    else
    {
        constexpr int kChunks = D / 8; // 8 16-bit values per 16-byte load
        for (int e = threadIdx.x; e < kTileKeys * kChunks; e += kThreads)
        {
            int const r = e / kChunks, c = (e % kChunks) * 8;
            int64_t const row = rows[r];
            uint4 kRaw = make_uint4(0, 0, 0, 0), vRaw = make_uint4(0, 0, 0, 0);
            if (row >= 0)
            {
                kRaw = __ldg(reinterpret_cast<uint4 const*>(kBase + row + c));
                vRaw = __ldg(reinterpret_cast<uint4 const*>(vBase + row + c));
            }
            *reinterpret_cast<uint4*>(&sK[r][c]) = kRaw;
            *reinterpret_cast<uint4*>(&sV[r][c]) = vRaw;
        }
    }
}

// grid: x = tile of 16 query rows of one kv head, y = KV chunk (split), z = b * KV + kv head
template <typename T, typename TC, int D>
__global__ void __launch_bounds__(kThreads) attnMmaKernel(AttnParams p)
{
    static_assert(D % 16 == 0 && D >= 16 && D <= 128, "head_dim must be 16, 32, 48, ..., 128");
    constexpr int kStride = D + kPad;
    static_assert(kWarps * kTileRows * D * sizeof(float) + 2 * kWarps * kTileRows * sizeof(float)
            <= sizeof(uint16_t) * 2 * kTileKeys * kStride,
        "the warp-merge buffer must fit in the K/V tile buffer");

    __shared__ __align__(16) uint16_t sQ[kTileRows][kStride];
    __shared__ __align__(16) uint16_t sKV[2][kTileKeys][kStride];
    __shared__ int32_t sPos[kTileRows];
    __shared__ int64_t sRows[kTileKeys]; // cache offsets of the current tile's keys (-1: masked)

    int32_t const rowTile = blockIdx.x;
    int32_t const split = blockIdx.y;
    int32_t const b = blockIdx.z / p.KV;
    int32_t const g = blockIdx.z % p.KV;
    int32_t const R = p.S * p.G; // query rows of this (request, kv head): r = s * G + head-in-group
    int32_t const row0 = rowTile * kTileRows;

    if (threadIdx.x < kTileRows)
    {
        int32_t const r = row0 + threadIdx.x;
        int32_t pos = -1; // rows past R see nothing
        if (r < R)
            pos = lastKey(p.positions[static_cast<int64_t>(b) * p.S + r / p.G], p.maxKeys);
        sPos[threadIdx.x] = pos;
    }
    __syncthreads();

    int32_t kvLen = 0; // keys any row of this tile can see (>= 1: the tile holds a row r < R)
#pragma unroll
    for (int i = 0; i < kTileRows; ++i)
        kvLen = max(kvLen, sPos[i] + 1);
    int32_t const kvBegin = split * p.chunk;
    int32_t const kvEnd = min(kvBegin + p.chunk, kvLen);
    if (kvBegin >= kvEnd)
        return; // a chunk past every row of the tile (never chunk 0): the reducer skips it

    // ---- Q tile -> shared -> A fragments (registers) -------------------------------------------
    T const* q = static_cast<T const*>(p.q);
    for (int e = threadIdx.x; e < kTileRows * (D / 8); e += kThreads)
    {
        int const r = e / (D / 8), c = (e % (D / 8)) * 8;
        int32_t const row = row0 + r;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (row < R)
        {
            int32_t const h = g * p.G + row % p.G;
            val = __ldg(reinterpret_cast<uint4 const*>(
                q + ((static_cast<int64_t>(b) * p.S + row / p.G) * p.H + h) * D + c));
        }
        *reinterpret_cast<uint4*>(&sQ[r][c]) = val;
    }
    __syncthreads();

    int const warp = threadIdx.x / kWarpSize;
    int const lane = threadIdx.x % kWarpSize;
    int const gr = lane >> 2; // MMA "groupID": fragment rows gr and gr + 8
    int const tq = lane & 3;  // MMA "threadID_in_group": fragment columns 2*tq, 2*tq + 1

    uint32_t qf[D / 16][4];
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
    {
        qf[ks][0] = load32(&sQ[gr][ks * 16 + 2 * tq]);
        qf[ks][1] = load32(&sQ[gr + 8][ks * 16 + 2 * tq]);
        qf[ks][2] = load32(&sQ[gr][ks * 16 + 8 + 2 * tq]);
        qf[ks][3] = load32(&sQ[gr + 8][ks * 16 + 8 + 2 * tq]);
    }
    int32_t const pos0 = sPos[gr], pos1 = sPos[gr + 8];

    float o[D / 8][4];
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn)
        o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY; // running max (log2 domain) of rows gr, gr + 8
    float l0 = 0.f, l1 = 0.f;             // running sums (this lane's columns only)
    float const scoreScale = p.scale * p.kScale * kLog2e;

    TC const* kBase = static_cast<TC const*>(p.kCache);
    TC const* vBase = static_cast<TC const*>(p.vCache);
    uint16_t(*sK)[kStride] = sKV[0];
    uint16_t(*sV)[kStride] = sKV[1];

    for (int32_t t0 = kvBegin; t0 < kvEnd; t0 += kTileKeys)
    {
        __syncthreads(); // every warp is done with the previous tile (and its sRows)
        if (threadIdx.x < kTileKeys)
        {
            int32_t const key = t0 + threadIdx.x;
            sRows[threadIdx.x] = key < kvEnd ? keyRow(p, b, key, g) : -1;
        }
        __syncthreads();
        loadKvTile<T, TC, D>(sK, sV, kBase, vBase, sRows);
        __syncthreads();

        int32_t const key0 = t0 + warp * kWarpKeys;
        if (key0 >= kvEnd)
            continue; // warp-uniform

        // S = Q K^T for 16 rows x 16 keys (two n8 tiles)
        float s[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
        {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
            uint16_t const* kRow = &sK[warp * kWarpKeys + nt * 8 + gr][0];
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks)
                Mma<T>::run(s[nt], qf[ks], load32(kRow + ks * 16 + 2 * tq), load32(kRow + ks * 16 + 8 + 2 * tq));
        }

        // causal mask by absolute position (keys without a block masked too), scale into the log2 domain
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
            {
                int32_t const key = key0 + nt * 8 + 2 * tq + (e & 1);
                int32_t const pos = e < 2 ? pos0 : pos1;
                bool const visible = key <= pos && key < kvEnd && sRows[key - t0] >= 0;
                s[nt][e] = visible ? s[nt][e] * scoreScale : -INFINITY;
            }

        // online softmax: the 4 lanes of a group hold the 16 columns of a row
        float mx0 = fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1]));
        float mx1 = fmaxf(fmaxf(s[0][2], s[0][3]), fmaxf(s[1][2], s[1][3]));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        float const new0 = fmaxf(m0, mx0), new1 = fmaxf(m1, mx1);
        float const base0 = new0 == -INFINITY ? 0.f : new0; // a row with nothing visible yet
        float const base1 = new1 == -INFINITY ? 0.f : new1;
        float const alpha0 = exp2f(m0 - base0), alpha1 = exp2f(m1 - base1); // 0 while m == -inf
        m0 = new0;
        m1 = new1;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
        {
            s[nt][0] = exp2f(s[nt][0] - base0);
            s[nt][1] = exp2f(s[nt][1] - base0);
            s[nt][2] = exp2f(s[nt][2] - base1);
            s[nt][3] = exp2f(s[nt][3] - base1);
        }
        l0 = l0 * alpha0 + (s[0][0] + s[0][1] + s[1][0] + s[1][1]);
        l1 = l1 * alpha1 + (s[0][2] + s[0][3] + s[1][2] + s[1][3]);
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn)
        {
            o[dn][0] *= alpha0;
            o[dn][1] *= alpha0;
            o[dn][2] *= alpha1;
            o[dn][3] *= alpha1;
        }

        // O += P V: the S accumulators of the two n8 tiles are exactly the A fragment of P (16x16)
        uint32_t const pa[4] = {pack(Mma<T>::bits(s[0][0]), Mma<T>::bits(s[0][1])),
            pack(Mma<T>::bits(s[0][2]), Mma<T>::bits(s[0][3])), pack(Mma<T>::bits(s[1][0]), Mma<T>::bits(s[1][1])),
            pack(Mma<T>::bits(s[1][2]), Mma<T>::bits(s[1][3]))};
        int const k0 = warp * kWarpKeys + 2 * tq; // this lane's first key row of the B fragment
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn)
        {
            int const col = dn * 8 + gr;
            uint32_t const b0 = pack(sV[k0][col], sV[k0 + 1][col]);
            uint32_t const b1 = pack(sV[k0 + 8][col], sV[k0 + 9][col]);
            Mma<T>::run(o[dn], pa, b0, b1);
        }
    }

    // ---- merge the 4 warps (each saw a different quarter of the keys) --------------------------
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    __syncthreads(); // the K/V tile buffer becomes the merge buffer
    float* sO = reinterpret_cast<float*>(&sKV[0][0][0]); // [kWarps][kTileRows][D]
    float* sM = sO + kWarps * kTileRows * D;             // [kWarps][kTileRows]
    float* sL = sM + kWarps * kTileRows;                 // [kWarps][kTileRows]
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn)
    {
        int const col = dn * 8 + 2 * tq;
        float* r0 = sO + (warp * kTileRows + gr) * D + col;
        float* r1 = sO + (warp * kTileRows + gr + 8) * D + col;
        r0[0] = o[dn][0];
        r0[1] = o[dn][1];
        r1[0] = o[dn][2];
        r1[1] = o[dn][3];
    }
    if (tq == 0)
    {
        sM[warp * kTileRows + gr] = m0;
        sM[warp * kTileRows + gr + 8] = m1;
        sL[warp * kTileRows + gr] = l0;
        sL[warp * kTileRows + gr + 8] = l1;
    }
    __syncthreads();

    int64_t const rowsTotal = static_cast<int64_t>(p.B) * p.S * p.H;
    for (int e = threadIdx.x; e < kTileRows * D; e += kThreads)
    {
        int const r = e / D, c = e % D;
        int32_t const row = row0 + r;
        if (row >= R)
            continue;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < kWarps; ++w)
            M = fmaxf(M, sM[w * kTileRows + r]);
        float L = 0.f, acc = 0.f;
        if (M != -INFINITY)
        {
#pragma unroll
            for (int w = 0; w < kWarps; ++w)
            {
                float const wt = exp2f(sM[w * kTileRows + r] - M);
                L += wt * sL[w * kTileRows + r];
                acc += wt * sO[(w * kTileRows + r) * D + c];
            }
        }
        float const val = L > 0.f ? acc / L * p.vScale : 0.f;
        int32_t const h = g * p.G + row % p.G;
        int64_t const outRow = (static_cast<int64_t>(b) * p.S + row / p.G) * p.H + h;
        if (p.splits == 1)
            static_cast<T*>(p.out)[outRow * D + c] = fromFloat<T>(val);
        else
        {
            p.partO[(split * rowsTotal + outRow) * D + c] = val;
            if (c == 0)
                p.partLse[split * rowsTotal + outRow] = L > 0.f ? M + log2f(L) : -INFINITY;
        }
    }
}

// ------------------------------------------------------------------------------------------------
// 3. split-K reduction: one warp per (b, s, h) output row
// ------------------------------------------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(kThreads) attnReduceKernel(AttnParams p)
{
    int64_t const rowsTotal = static_cast<int64_t>(p.B) * p.S * p.H;
    int64_t const row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
    int const lane = threadIdx.x % kWarpSize;
    if (row >= rowsTotal)
        return;
    int64_t const bs = row / p.H;
    T* out = static_cast<T*>(p.out) + row * p.D;
    // chunks 0..n-1 cover this row's keys (its last key's chunk is n-1; the attention kernel ran all
    // of them for this row's tile); a chunk whose keys all lack a block holds lse = -inf
    int32_t const pos = lastKey(p.positions[bs], p.maxKeys);
    int32_t const n = min(p.splits, pos / p.chunk + 1);
    float M = -INFINITY;
    for (int i = 0; i < n; ++i)
        M = fmaxf(M, p.partLse[i * rowsTotal + row]);
    if (M == -INFINITY) // no visible key at all
    {
        for (int c = lane; c < p.D; c += kWarpSize)
            out[c] = fromFloat<T>(0.f);
        return;
    }
    float W = 0.f;
    for (int i = 0; i < n; ++i)
        W += exp2f(p.partLse[i * rowsTotal + row] - M);
    for (int c = lane; c < p.D; c += kWarpSize)
    {
        float acc = 0.f;
        for (int i = 0; i < n; ++i)
            acc += exp2f(p.partLse[i * rowsTotal + row] - M) * p.partO[(i * rowsTotal + row) * p.D + c];
        out[c] = fromFloat<T>(acc / W);
    }
}

// ------------------------------------------------------------------------------------------------
// simple path: one block per query row (any head_dim <= 512, fp32 activations too)
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ float blockMax(float x, float* red)
{
    x = warpMax(x);
    if (threadIdx.x % kWarpSize == 0)
        red[threadIdx.x / kWarpSize] = x;
    __syncthreads();
    float r = red[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w)
        r = fmaxf(r, red[w]);
    __syncthreads();
    return r;
}

__device__ __forceinline__ float blockSum(float x, float* red)
{
    x = warpSum(x);
    if (threadIdx.x % kWarpSize == 0)
        red[threadIdx.x / kWarpSize] = x;
    __syncthreads();
    float r = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w)
        r += red[w];
    __syncthreads();
    return r;
}

// grid: (H, S, B); dynamic shared memory: kThreads int64 + (D + kThreads + kWarps) floats
template <typename TA, typename TC>
__global__ void __launch_bounds__(kThreads) attnSimpleKernel(AttnParams p)
{
    extern __shared__ __align__(16) unsigned char smemRaw[];
    int64_t* sRow = reinterpret_cast<int64_t*>(smemRaw); // [kThreads] cache offsets of the tile's keys
    float* sq = reinterpret_cast<float*>(sRow + kThreads); // [D]
    float* sp = sq + p.D;                                  // [kThreads] probabilities of the current key tile
    float* red = sp + kThreads;                            // [kWarps]

    int32_t const h = blockIdx.x, s = blockIdx.y, b = blockIdx.z;
    int64_t const bs = static_cast<int64_t>(b) * p.S + s;
    TA* out = static_cast<TA*>(p.out) + (bs * p.H + h) * p.D;
    int32_t const g = h / p.G;
    int32_t const pos = lastKey(p.positions[bs], p.maxKeys);
    TA const* q = static_cast<TA const*>(p.q) + (bs * p.H + h) * p.D;
    for (int c = threadIdx.x; c < p.D; c += blockDim.x)
        sq[c] = toFloat(q[c]);
    __syncthreads();

    TC const* kc = static_cast<TC const*>(p.kCache);
    TC const* vc = static_cast<TC const*>(p.vCache);
    float const qkScale = p.scale * p.kScale;
    float acc[kSimpleMaxDimsPerThread] = {};
    float m = -INFINITY, l = 0.f;
    for (int32_t k0 = 0; k0 <= pos; k0 += kThreads)
    {
        int32_t const j = k0 + threadIdx.x;
        int64_t const row = j <= pos ? keyRow(p, b, j, g) : -1; // -1: past the row, or no block
        float sj = -INFINITY;
        if (row >= 0)
        {
            TC const* kr = kc + row;
            float dot = 0.f;
            for (int c = 0; c < p.D; ++c)
                dot += sq[c] * toFloat(kr[c]);
            sj = dot * qkScale;
        }
        sRow[threadIdx.x] = row;
        float const mNew = fmaxf(m, blockMax(sj, red));
        float const base = mNew == -INFINITY ? 0.f : mNew; // nothing visible yet: keep exp finite
        float const alpha = expf(m - base);                // 0 while m == -inf
        float const pj = row >= 0 ? expf(sj - base) : 0.f;
        sp[threadIdx.x] = pj;
        l = l * alpha + blockSum(pj, red); // blockSum's barrier also publishes sp and sRow
        m = mNew;
        int32_t const nk = min(kThreads, pos - k0 + 1);
#pragma unroll
        for (int i = 0; i < kSimpleMaxDimsPerThread; ++i)
        {
            int const c = threadIdx.x + i * kThreads;
            if (c < p.D)
            {
                float a = acc[i] * alpha;
                for (int jj = 0; jj < nk; ++jj)
                {
                    int64_t const r = sRow[jj];
                    if (r >= 0)
                        a += sp[jj] * toFloat(vc[r + c]);
                }
                acc[i] = a;
            }
        }
        __syncthreads(); // sp and sRow are rewritten by the next tile
    }
#pragma unroll
    for (int i = 0; i < kSimpleMaxDimsPerThread; ++i)
    {
        int const c = threadIdx.x + i * kThreads;
        if (c < p.D)
            out[c] = fromFloat<TA>(l > 0.f ? acc[i] / l * p.vScale : 0.f);
    }
}

// ------------------------------------------------------------------------------------------------
// host side
// ------------------------------------------------------------------------------------------------

int32_t maxSplits(int32_t maxKeys)
{
    int64_t const s = ceilDiv(maxKeys, kMinChunk);
    return static_cast<int32_t>(s < 1 ? 1 : (s > kMaxSplits ? kMaxSplits : s));
}

size_t perSplitBytes(int64_t batch, int64_t rows, int64_t heads, int64_t headDim)
{
    return static_cast<size_t>(batch * rows * heads * (headDim + 1)) * sizeof(float);
}

// Split the key range [0, M * bs) into `splits` chunks of `chunk` keys (a multiple of kTileKeys).
void planSplits(AttnParams& p, size_t workspaceSize)
{
    int64_t const tiles = ceilDiv(static_cast<int64_t>(p.S) * p.G, kTileRows);
    int64_t const baseBlocks = tiles * p.B * p.KV;
    int64_t s = maxSplits(p.maxKeys);
    s = std::min<int64_t>(s, std::max<int64_t>(1, kTargetBlocks / baseBlocks));
    size_t const per = perSplitBytes(p.B, p.S, p.H, p.D);
    s = std::min<int64_t>(s, static_cast<int64_t>(std::min(workspaceSize, kWorkspaceBudget) / per));
    if (s < 2)
        s = 1;
    int64_t const chunk = roundUp(ceilDiv(p.maxKeys, s), kTileKeys);
    p.chunk = static_cast<int32_t>(chunk);
    p.splits = static_cast<int32_t>(ceilDiv(p.maxKeys, chunk));
}

template <typename T, typename TC>
cudaError_t launchMma(AttnParams p, void* workspace, size_t workspaceSize, cudaStream_t stream)
{
    planSplits(p, workspace != nullptr && isAligned(workspace, 16) ? workspaceSize : 0);
    int64_t const rowsTotal = static_cast<int64_t>(p.B) * p.S * p.H;
    if (p.splits > 1)
    {
        p.partO = static_cast<float*>(workspace);
        p.partLse = p.partO + p.splits * rowsTotal * p.D;
    }
    int64_t const tiles = ceilDiv(static_cast<int64_t>(p.S) * p.G, kTileRows);
    if (tiles > 0x7fffffff || static_cast<int64_t>(p.B) * p.KV > 65535)
        return cudaErrorInvalidValue;
    dim3 const grid(static_cast<unsigned>(tiles), p.splits, p.B * p.KV);
    switch (p.D)
    {
    case 16: attnMmaKernel<T, TC, 16><<<grid, kThreads, 0, stream>>>(p); break;
    case 32: attnMmaKernel<T, TC, 32><<<grid, kThreads, 0, stream>>>(p); break;
    case 64: attnMmaKernel<T, TC, 64><<<grid, kThreads, 0, stream>>>(p); break;
    case 128: attnMmaKernel<T, TC, 128><<<grid, kThreads, 0, stream>>>(p); break;
    default: return cudaErrorInvalidValue;
    }
    PEAGLE_RETURN_IF_LAUNCH_ERROR();
    if (p.splits > 1)
    {
        attnReduceKernel<T><<<static_cast<unsigned>(ceilDiv(rowsTotal, kWarps)), kThreads, 0, stream>>>(p);
        PEAGLE_RETURN_IF_LAUNCH_ERROR();
    }
    return cudaSuccess;
}

template <typename TA, typename TC>
cudaError_t launchAll(AttnParams const& p, bool fast, void* workspace, size_t workspaceSize, cudaStream_t stream)
{
    kvWriteKernel<TA, TC><<<static_cast<unsigned>(static_cast<int64_t>(p.B) * p.S), kThreads, 0, stream>>>(p);
    PEAGLE_RETURN_IF_LAUNCH_ERROR();
    if constexpr (!std::is_same<TA, float>::value)
    {
        if (fast)
            return launchMma<TA, TC>(p, workspace, workspaceSize, stream);
    }
    if (p.S > 65535 || p.B > 65535)
        return cudaErrorInvalidValue;
    size_t const smem = kThreads * sizeof(int64_t) + (p.D + kThreads + kWarps) * sizeof(float);
    attnSimpleKernel<TA, TC><<<dim3(p.H, p.S, p.B), kThreads, smem, stream>>>(p);
    PEAGLE_RETURN_IF_LAUNCH_ERROR();
    return cudaSuccess;
}

template <typename TA>
cudaError_t dispatchCache(
    AttnParams const& p, bool fp8, bool fast, void* workspace, size_t workspaceSize, cudaStream_t stream)
{
    if (fp8)
        return launchAll<TA, __nv_fp8_e4m3>(p, fast, workspace, workspaceSize, stream);
    return launchAll<TA, TA>(p, fast, workspace, workspaceSize, stream);
}

} // namespace
} // namespace peagle

extern "C" size_t peagle_kv_attention_workspace_size(
    int32_t max_batch, int32_t max_rows, int32_t num_heads, int32_t head_dim, int32_t max_keys)
{
    using namespace peagle;
    if (max_batch <= 0 || max_rows <= 0 || num_heads <= 0 || head_dim <= 0 || max_keys <= 0)
        return 0;
    size_t const per = perSplitBytes(max_batch, max_rows, num_heads, head_dim);
    size_t const bytes = static_cast<size_t>(maxSplits(max_keys)) * per;
    size_t const capped = std::min(bytes, (kWorkspaceBudget / per) * per);
    return capped >= 2 * per ? capped : 0;
}

extern "C" cudaError_t peagle_kv_attention(void const* q, void const* k, void const* v, int64_t const* positions,
    int64_t const* block_tables, void* k_cache, void* v_cache, void* out, int32_t batch, int32_t rows,
    int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t cache_blocks, int32_t block_size,
    int32_t max_blocks, float scale, float k_scale, float v_scale, peagle_dtype_t act_dtype,
    peagle_dtype_t cache_dtype, void* workspace, size_t workspace_size, int32_t flags, cudaStream_t stream)
{
    using namespace peagle;
    if (batch < 0 || rows < 1 || num_heads < 1 || num_kv_heads < 1 || num_heads % num_kv_heads != 0
        || head_dim < 8 || head_dim % 8 != 0 || head_dim > kSimpleMaxDimsPerThread * kThreads || cache_blocks < 1
        || block_size < 1 || max_blocks < 1 || static_cast<int64_t>(max_blocks) * block_size > 0x7fffffff)
        return cudaErrorInvalidValue;
    if (act_dtype != PEAGLE_F32 && act_dtype != PEAGLE_F16 && act_dtype != PEAGLE_BF16)
        return cudaErrorInvalidValue;
    bool const fp8 = cache_dtype == PEAGLE_FP8_E4M3;
    if (cache_dtype != act_dtype && !fp8)
        return cudaErrorInvalidValue;
    if (fp8 && !(k_scale > 0.f && v_scale > 0.f && std::isfinite(k_scale) && std::isfinite(v_scale)))
        return cudaErrorInvalidValue;
    if (batch == 0)
        return cudaSuccess;
    if (!q || !k || !v || !positions || !block_tables || !k_cache || !v_cache || !out)
        return cudaErrorInvalidValue;
    if (static_cast<int64_t>(batch) * rows > 0x7fffffff)
        return cudaErrorInvalidValue;

    AttnParams p{};
    p.q = q;
    p.k = k;
    p.v = v;
    p.positions = positions;
    p.tables = block_tables;
    p.kCache = k_cache;
    p.vCache = v_cache;
    p.out = out;
    p.B = batch;
    p.S = rows;
    p.H = num_heads;
    p.KV = num_kv_heads;
    p.G = num_heads / num_kv_heads;
    p.D = head_dim;
    p.NB = cache_blocks;
    p.BS = block_size;
    p.M = max_blocks;
    p.maxKeys = max_blocks * block_size;
    p.splits = 1;
    p.chunk = p.maxKeys;
    p.scale = scale > 0.f ? scale : 1.f / std::sqrt(static_cast<float>(head_dim));
    p.kScale = fp8 ? k_scale : 1.f;
    p.vScale = fp8 ? v_scale : 1.f;

    bool const fast = !(flags & PEAGLE_ATTN_FORCE_SIMPLE) && act_dtype != PEAGLE_F32
        && (head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128) && isAligned(q, 16)
        && isAligned(k_cache, 16) && isAligned(v_cache, 16);

    switch (act_dtype)
    {
    case PEAGLE_F32: return dispatchCache<float>(p, fp8, false, workspace, workspace_size, stream);
    case PEAGLE_F16: return dispatchCache<__half>(p, fp8, fast, workspace, workspace_size, stream);
    default: return dispatchCache<__nv_bfloat16>(p, fp8, fast, workspace, workspace_size, stream);
    }
}

extern "C" char const* peagle_error_string(cudaError_t err)
{
    return cudaGetErrorString(err);
}

extern "C" int32_t peagle_kernels_version(void)
{
    return 2; // 2: paged KV cache (block tables)
}
