// A chain of d20's four per-layer GEMVs run by SMs in two roles (scripts/bench_two_role_chain.py compiles
// this with NVRTC; the constants in capitals come in as -D defines).
//
// Clusters of CS CTAs, one per SM. Rank 0 of a cluster is its *syncer*, ranks 1..CS-1 are *streamers*.
// A streamer owns a contiguous share of every GEMV's rows. Its producer warp streams those rows, band by band
// (RB rows = RB x K bf16, one bulk copy each), into a shared-memory ring of NSLOT slots, at most D bands in
// flight: HBM needs only ~5 MB in flight on an H100, and every byte beyond that is queue that the grid's
// barrier polls and activation loads wait in (CHANGELOG_GB10.md, session 24). Its RB consumer warps wait
// for the phase's input x, which the syncer writes into their shared memory, reduce one row each, and store
// the products into the syncer's shared memory (distributed shared memory, never through L2).
// The syncer writes its cluster's outputs to global memory, meets the other syncers at a flag barrier, loads
// the next input and hands it to its streamers. The sync chain thus runs on SMs with no stream of their own.
//
// GEMV g of a layer reads the first K outputs of GEMV g - 1 (act[g]) and writes act[(g + 1) % 4], scaled by
// 1/32: the same chain as scripts/bench_gemv_ring.py. `mode` 1: streamers stream and reduce with x = 0 and no
// syncer takes part (the throttled stream alone); 2: the sync chain alone (no weights, zeros for products).

#define N0 3840
#define N1 1280
#define N2 5120
#define N3 5120
#define NTOT (N0 + N1 + N2 + N3)
#define AW 5120
#define K 1280
#define RB 8
#define BAND_BYTES (RB * K * 2)
#define NWARPS (RB + 1)
#define XBYTES (K * 4)
#define YMAX 5120

typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ u32 cluster_id() {
    u32 r;
    asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
    return r;
}

__device__ __forceinline__ u32 num_clusters() {
    u32 r;
    asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
    return r;
}

__device__ __forceinline__ u32 remote(u32 addr, u32 rank) {  // this address in CTA `rank`'s shared memory
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ void bar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void bar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void bar_arrive_remote(u32 rbar) {  // release at cluster scope: prior stores first
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(rbar) : "memory");
}

__device__ __forceinline__ void bar_wait(u32 bar, u32 parity) {  // local arrivals (and the bulk copies)
    asm volatile(
        "{\n\t.reg .pred p;\n"
        "W_%=:\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t@!p bra W_%=;\n}"
        ::"r"(bar), "r"(parity) : "memory");
}

__device__ __forceinline__ void bar_wait_cluster(u32 bar, u32 parity) {  // arrivals from other CTAs
    asm volatile(
        "{\n\t.reg .pred p;\n"
        "W_%=:\n\tmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n\t@!p bra W_%=;\n}"
        ::"r"(bar), "r"(parity) : "memory");
}

__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

__device__ __forceinline__ int rows_n(int g) { return g == 0 ? N0 : g == 1 ? N1 : g == 2 ? N2 : N3; }
__device__ __forceinline__ int rows_off(int g) { return g == 0 ? 0 : g == 1 ? N0 : g == 2 ? N0 + N1 : N0 + N1 + N2; }

__device__ void produce(const unsigned short* w, int L, int s, int S, u32 ring, u32 full, u32 empty) {
    long b = 0;
    for (int l = 0; l < L; ++l)
        for (int g = 0; g < 4; ++g) {
            int n = rows_n(g), r0 = s * n / S, r1 = (s + 1) * n / S;
            for (int r = r0; r < r1; r += RB, ++b) {
                u32 slot = b % NSLOT;
                if (b >= NSLOT) bar_wait(empty + 8 * slot, ((b / NSLOT) - 1) & 1);
                if (b >= D) bar_wait(full + 8 * ((b - D) % NSLOT), ((b - D) / NSLOT) & 1);  // the throttle
                int nr = min(RB, r1 - r);
                const unsigned short* src = w + ((long)l * NTOT + rows_off(g) + r) * K;
                bulk_load(ring + slot * BAND_BYTES, src, nr * K * 2, full + 8 * slot);
            }
        }
}

__device__ __forceinline__ float row_partial(const char* ringp, u32 slot, int warp, int lane, const float* x) {
    const uint4* row = (const uint4*)(ringp + slot * BAND_BYTES + warp * K * 2);
    float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // four chains: the FMAs do not wait on one another
#pragma unroll
    for (int i = 0; i < 5; ++i) {
        uint4 v = row[lane + 32 * i];
        u32 u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            a[j] += __uint_as_float(u[j] << 16) * x[8 * i + 2 * j];
            a[j] += __uint_as_float(u[j] & 0xffff0000u) * x[8 * i + 2 * j + 1];
        }
    }
    return (a[0] + a[1]) + (a[2] + a[3]);
}

// MODE 2: the sync chain alone (no weights: consumers send zeros at once, the producer idles).
__device__ void consume(int L, int s, int S, int c0, int mode, const char* ringp, const float* xbuf, u32 full,
                        u32 empty, u32 ybuf_syncer, u32 ydone_syncer, u32 xfull) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    long b = 0;
    int p = 0;
    for (int l = 0; l < L; ++l)
        for (int g = 0; g < 4; ++g, ++p) {
            float x[40];
            if (mode != 1) bar_wait_cluster(xfull, p & 1);
#pragma unroll
            for (int i = 0; i < 5; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) x[8 * i + j] = mode == 0 ? xbuf[8 * (lane + 32 * i) + j] : 0.0f;
            int n = rows_n(g), r0 = s * n / S, r1 = (s + 1) * n / S, cr0 = c0 * n / S;
            // GROUP bands at a time: their rows' reductions interleave (a band alone is a latency chain)
            for (int r = r0; r < r1; r += GROUP * RB) {
                float acc[GROUP];
#pragma unroll
                for (int q = 0; q < GROUP; ++q) {
                    acc[q] = 0.0f;
                    if (mode != 2 && r + q * RB < r1) {
                        u32 slot = (b + q) % NSLOT;
                        bar_wait(full + 8 * slot, ((b + q) / NSLOT) & 1);
                        if (r + q * RB + warp < r1) acc[q] = row_partial(ringp, slot, warp, lane, x);
                    }
                }
#pragma unroll
                for (int o = 16; o > 0; o >>= 1)
#pragma unroll
                    for (int q = 0; q < GROUP; ++q) acc[q] += __shfl_xor_sync(0xffffffffu, acc[q], o);
                __syncwarp();
                if (lane == 0) {
#pragma unroll
                    for (int q = 0; q < GROUP; ++q) {
                        int row = r + q * RB + warp;
                        if (mode != 1 && row < r1) {
                            u32 dst = ybuf_syncer + 4 * (row - cr0);
                            asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(dst), "f"(acc[q] * 0.03125f)
                                         : "memory");
                        }
                        if (mode != 2 && r + q * RB < r1) bar_arrive(empty + 8 * ((b + q) % NSLOT));
                    }
                }
                int nb = min(GROUP, (r1 - r + RB - 1) / RB);
                b += nb;
            }
            if (lane == 0 && mode != 1) bar_arrive_remote(ydone_syncer);
        }
}

__device__ void sync_role(float* act, u64* flags, u64 base, int L, int S, int c0, int CS, float* xbuf,
                          const float* ybuf, u32 ydone) {
    int C = num_clusters(), c = cluster_id(), t = threadIdx.x;
    int p = 0;
    for (int i = t; i < K; i += blockDim.x) xbuf[i] = __ldcg(act + i);  // the chain's input
    for (int l = 0; l < L; ++l)
        for (int g = 0; g < 4; ++g, ++p) {
            __syncthreads();
            for (int i = t; i < (CS - 1) * K / 4; i += blockDim.x) {  // x to every streamer of the cluster
                float4 v = ((const float4*)xbuf)[i % (K / 4)];
                u32 dst = remote(smem_addr(xbuf) + 16 * (i % (K / 4)), 1 + i / (K / 4));
                asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};"
                             ::"r"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
            }
            __syncthreads();
            if (t < CS - 1) bar_arrive_remote(remote(smem_addr(xbuf) + XBYTES, 1 + t));  // xfull of rank t + 1
            bar_wait_cluster(ydone, p & 1);
            int n = rows_n(g), cr0 = c0 * n / S, cr1 = (c0 + CS - 1) * n / S;
            float* out = act + ((g + 1) % 4) * AW;
            for (int r = cr0 + t; r < cr1; r += blockDim.x) __stcg(out + r, ybuf[r - cr0]);
            if (l == L - 1 && g == 3) break;
            __syncthreads();
            if (t == 0) {
                __threadfence();
                asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(flags + c), "l"(base + p + 1) : "memory");
            }
            if (t < C) {
                u64 seen;
                do {
                    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(seen) : "l"(flags + t) : "memory");
                } while (seen < base + p + 1);  // flags only grow: no reset between launches
            }
            __syncthreads();
            const float* src = act + ((g + 1) % 4) * AW;
            for (int i = t; i < K; i += blockDim.x) xbuf[i] = __ldcg(src + i);
        }
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32, 1)
two_role_chain(const unsigned short* w, float* act, u64* flags, u64 base, int L, int mode) {
    extern __shared__ __align__(128) char smem[];
    char* ringp = smem;
    float* xbuf = (float*)(smem + NSLOT * BAND_BYTES);  // K floats, then the xfull barrier (8 bytes)
    float* ybuf = (float*)(smem + NSLOT * BAND_BYTES + XBYTES + 128);
    u32 xfull = smem_addr(xbuf) + XBYTES;
    u32 bars = smem_addr(ybuf) + YMAX * 4;  // full[NSLOT], empty[NSLOT], ydone
    u32 full = bars, empty = bars + 8 * NSLOT, ydone = bars + 16 * NSLOT;
    int CS = CLUSTER, rank = cluster_rank(), c = cluster_id(), C = num_clusters();
    int S = C * (CS - 1), c0 = c * (CS - 1);
    if (threadIdx.x == 0) {
        for (int i = 0; i < NSLOT; ++i) {
            bar_init(full + 8 * i, 1);
            bar_init(empty + 8 * i, RB);
        }
        bar_init(xfull, 1);
        bar_init(ydone, RB * (CS - 1));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    cluster_sync();  // every barrier of the cluster exists before anyone arrives on it
    u32 ybuf_syncer = remote(smem_addr(ybuf), 0), ydone_syncer = remote(ydone, 0);
    if (rank == 0) {
        if (mode != 1) sync_role(act, flags, base, L, S, c0, CS, xbuf, ybuf, ydone);
    } else {
        int s = c0 + rank - 1;
        if (threadIdx.x / 32 == RB) {
            if (threadIdx.x % 32 == 0 && mode != 2) produce(w, L, s, S, smem_addr(ringp), full, empty);
        } else {
            consume(L, s, S, c0, mode, ringp, xbuf, full, empty, ybuf_syncer, ydone_syncer, xfull);
        }
    }
    __syncthreads();
    cluster_sync();  // no CTA leaves while another may still write its shared memory
}
