// groupcoord custom all-reduce kernels, compiled at run time by NVRTC.
//
// No CUDA headers are included: half and bfloat16 conversions use PTX `cvt`
// instructions, so the source compiles with a bare NVRTC (no toolkit install).
//
// Every rank owns one IPC-shareable buffer: [Signal | staging | tmp]. A kernel
// gets a RankTable (in device memory) naming, for every rank p, p's Signal,
// the data p contributes (its staging area, or a registered input tensor) and
// p's tmp area. The signal protocol is described in docs/architecture.md and in
// device_comms/cuda/custom_allreduce/__init__.py.

#define GC_MAX_RANKS 8
#define GC_MAX_BLOCKS 64
#define GC_PHASES 3
#define GC_PHASE_START 0
#define GC_PHASE_MID 1
#define GC_PHASE_END 2

typedef unsigned int u32;
typedef unsigned long long u64;

struct Signal {
  // flags[phase][block][peer]: the epoch with which `peer`'s block reached
  // `phase`. Written only by that peer (remote stores), read only by the owner.
  u32 flags[GC_PHASES][GC_MAX_BLOCKS][GC_MAX_RANKS];
  // epoch[block]: how many calls this rank's block has started. Read and
  // written only by the owner, one kernel at a time (stream order).
  u32 epoch[GC_MAX_BLOCKS];
};

struct RankTable {
  Signal* sig[GC_MAX_RANKS];
  const void* data[GC_MAX_RANKS];
  void* tmp[GC_MAX_RANKS];
};

struct __align__(16) Pack {
  u32 w[4];
};

struct gc_f32 {};
struct gc_f16 {};
struct gc_bf16 {};

template <typename T> struct Traits;

template <> struct Traits<gc_f32> {
  static constexpr int kPer = 4;
  static __device__ __forceinline__ void add(float* acc, const Pack& p) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] += __uint_as_float(p.w[i]);
  }
  static __device__ __forceinline__ Pack pack(const float* acc) {
    Pack p;
#pragma unroll
    for (int i = 0; i < 4; ++i) p.w[i] = __float_as_uint(acc[i]);
    return p;
  }
};

__device__ __forceinline__ float f16_to_f32(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ unsigned short f32_to_f16(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ float bf16_to_f32(unsigned short h) {
  return __uint_as_float(((u32)h) << 16);
}
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

template <> struct Traits<gc_f16> {
  static constexpr int kPer = 8;
  static __device__ __forceinline__ void add(float* acc, const Pack& p) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc[2 * i] += f16_to_f32((unsigned short)(p.w[i] & 0xffffu));
      acc[2 * i + 1] += f16_to_f32((unsigned short)(p.w[i] >> 16));
    }
  }
  static __device__ __forceinline__ Pack pack(const float* acc) {
    Pack p;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      p.w[i] = (u32)f32_to_f16(acc[2 * i]) | ((u32)f32_to_f16(acc[2 * i + 1]) << 16);
    return p;
  }
};

template <> struct Traits<gc_bf16> {
  static constexpr int kPer = 8;
  static __device__ __forceinline__ void add(float* acc, const Pack& p) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc[2 * i] += bf16_to_f32((unsigned short)(p.w[i] & 0xffffu));
      acc[2 * i + 1] += bf16_to_f32((unsigned short)(p.w[i] >> 16));
    }
  }
  static __device__ __forceinline__ Pack pack(const float* acc) {
    Pack p;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      p.w[i] = (u32)f32_to_bf16(acc[2 * i]) | ((u32)f32_to_bf16(acc[2 * i + 1]) << 16);
    return p;
  }
};

__device__ __forceinline__ u64 now_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Release store / acquire load at system scope: the flag store publishes every
// write the block made before the preceding __syncthreads (release is
// cumulative), and the flag load makes the peer's published writes visible to
// the loads that follow the next __syncthreads.
__device__ __forceinline__ void store_release(u32* p, u32 v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 load_acquire(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Records the first failure in the host-visible error word: bit 31 set, the
// phase in bits 16-23, the rank that did not arrive in bits 8-15, the
// reporting rank in bits 0-7.
__device__ __forceinline__ void report_timeout(u32* err, int phase, int peer, int rank) {
  if (err != nullptr) {
    // A plain store: the word may live in mapped host memory, where device
    // atomics are not guaranteed. Racing reporters each leave a valid code.
    volatile u32* word = err;
    if (*word == 0u) *word = 0x80000000u | ((u32)phase << 16) | ((u32)peer << 8) | (u32)rank;
    __threadfence_system();
  }
}

// Block-level barrier across ranks for one phase of one call. Thread p < N
// announces this rank's arrival to peer p and waits for peer p's arrival.
// Returns false (in every thread of the block) if some peer did not arrive
// before the deadline.
template <int N>
__device__ __forceinline__ bool barrier(const RankTable* tab, int rank, int phase, u32 epoch,
                                        u64 deadline, u32* err) {
  bool ok = true;
  __syncthreads();
  if (threadIdx.x < N) {
    const int peer = threadIdx.x;
    store_release(&tab->sig[peer]->flags[phase][blockIdx.x][rank], epoch);
    const u32* mine = &tab->sig[rank]->flags[phase][blockIdx.x][peer];
    while (load_acquire(mine) != epoch) {
      if (now_ns() > deadline) {
        report_timeout(err, phase, peer, rank);
        ok = false;
        break;
      }
    }
  }
  return __syncthreads_and(ok) != 0;
}

// Advances this block's epoch (one kernel of a rank runs at a time).
__device__ __forceinline__ u32 next_epoch(const RankTable* tab, int rank) {
  __shared__ u32 epoch;
  if (threadIdx.x == 0) {
    Signal* self = tab->sig[rank];
    epoch = self->epoch[blockIdx.x] + 1;
    self->epoch[blockIdx.x] = epoch;
  }
  __syncthreads();
  return epoch;
}

template <typename T, int N>
__device__ __forceinline__ Pack reduce_at(const RankTable* tab, u64 i) {
  float acc[Traits<T>::kPer];
#pragma unroll
  for (int k = 0; k < Traits<T>::kPer; ++k) acc[k] = 0.0f;
#pragma unroll
  for (int p = 0; p < N; ++p) {  // fixed order: every rank adds identically
    const Pack v = reinterpret_cast<const Pack*>(tab->data[p])[i];
    Traits<T>::add(acc, v);
  }
  return Traits<T>::pack(acc);
}

// One shot: every rank reads every rank's data and reduces all of it.
template <typename T, int N>
__global__ void __launch_bounds__(512) gc_oneshot(const RankTable* __restrict__ tab,
                                                  Pack* __restrict__ out, u64 npacks, int rank,
                                                  u64 timeout_ns, u32* err) {
  const u32 epoch = next_epoch(tab, rank);
  const u64 deadline = now_ns() + timeout_ns;
  if (!barrier<N>(tab, rank, GC_PHASE_START, epoch, deadline, err)) return;
  const u64 stride = (u64)gridDim.x * blockDim.x;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < npacks; i += stride)
    out[i] = reduce_at<T, N>(tab, i);
  barrier<N>(tab, rank, GC_PHASE_END, epoch, deadline, err);
}

// Two shot: rank p reduces part p into its tmp area (reduce-scatter), then
// every rank copies every part from its owner's tmp area (all-gather). The
// part-to-thread mapping is the same on every rank, so block b's mid barrier
// covers exactly the tmp entries block b reads afterwards.
template <typename T, int N>
__global__ void __launch_bounds__(512) gc_twoshot(const RankTable* __restrict__ tab,
                                                  Pack* __restrict__ out, u64 npacks, int rank,
                                                  u64 timeout_ns, u32* err) {
  const u32 epoch = next_epoch(tab, rank);
  const u64 deadline = now_ns() + timeout_ns;
  const u64 part = npacks / N;
  const u64 stride = (u64)gridDim.x * blockDim.x;
  const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  if (!barrier<N>(tab, rank, GC_PHASE_START, epoch, deadline, err)) return;
  {
    const u64 start = part * rank;
    const u64 stop = rank == N - 1 ? npacks : start + part;
    Pack* mine = reinterpret_cast<Pack*>(tab->tmp[rank]);
    for (u64 i = start + first; i < stop; i += stride) mine[i - start] = reduce_at<T, N>(tab, i);
  }
  if (!barrier<N>(tab, rank, GC_PHASE_MID, epoch, deadline, err)) return;
#pragma unroll
  for (int p = 0; p < N; ++p) {
    const u64 start = part * p;
    const u64 stop = p == N - 1 ? npacks : start + part;
    const Pack* theirs = reinterpret_cast<const Pack*>(tab->tmp[p]);
    for (u64 i = start + first; i < stop; i += stride) out[i] = theirs[i - start];
  }
  barrier<N>(tab, rank, GC_PHASE_END, epoch, deadline, err);
}
