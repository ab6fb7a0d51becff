// CUDA sampler: one frame of every slot's generation state machine, in two launches (higgs_rt/sampling.py,
// `FrameSampler.__call__`, is the reference; its docstring states the rules).
//
//   pick    one block of 1024 threads per (codebook, slot). The codebook's logits go to shared memory; the
//           delay-pattern ramp forces BOS / EOS; a radix select of the top k (select_top; where it cannot, a
//           bitonic sort of the tempered scores, V <= 2048, padded with -inf) gives the top-k threshold and,
//           through a softmax and a block prefix sum in ascending order, the top-p threshold; Gumbel-max with
//           counter-based noise (the same 32-bit hash as the reference) picks a code; repetition-aware sampling
//           redraws from the raw logits; a done slot emits EOS.
//   update  one block of Q threads per slot: the RAS history ring, the frame of the first EOS, the done flag,
//           the frame counter, and the KV length of slots that were running.
// Same seed, same codes as the reference, up to summation order: the softmax denominators and the prefix sums
// are computed in a fixed tree order, not torch's, so a cumulative probability within about 1e-6 of 1 - top_p
// can fall on the other side of the threshold (a documented tie, see tests/test_sample_frame.py).
#include <cmath>

#include "../ops.h"
#include "common.cuh"

namespace higgs_rt {
namespace {

constexpr int kThreads = 1024;
constexpr int kSort = 2048;  // largest vocabulary: 2 entries per thread
constexpr uint32_t kMask32 = 0xffffffffu;

__device__ __forceinline__ uint32_t mix32(uint32_t x) {  // the reference's _mix32, in uint32 arithmetic
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x5BD1E995u;
  return x ^ (x >> 16);
}

// Gumbel noise of vocabulary entry `idx` given the per-(slot, frame, codebook, draw) hash h.
__device__ __forceinline__ float gumbel(uint32_t h, int idx) {
  const uint32_t bits = mix32(h + uint32_t(idx));
  const float u = (float(bits >> 8) + 0.5f) * (1.0f / 16777216.0f);
  return -logf(-logf(u));
}

__device__ __forceinline__ uint32_t noise_hash(int64_t seed, int64_t frame, int q, int draw) {
  const uint64_t s = uint64_t(seed);
  uint32_t h = mix32(mix32(uint32_t(s >> 32) & kMask32) ^ uint32_t(s & kMask32));
  h = mix32(h ^ uint32_t(uint64_t(frame) & kMask32));
  return mix32(h ^ uint32_t(q * 4 + draw));
}

// (value, index) argmax over the block: the largest value, the smallest index among equals (as torch.argmax).
struct ArgMax {
  float v;
  int i;
};

__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b) {
  return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
}

__device__ ArgMax block_argmax(ArgMax mine, ArgMax* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    ArgMax o{__shfl_xor_sync(0xffffffffu, mine.v, off), __shfl_xor_sync(0xffffffffu, mine.i, off)};
    mine = better(mine, o);
  }
  __syncthreads();
  if (lane == 0) scratch[warp] = mine;
  __syncthreads();
  ArgMax r = scratch[0];
  for (int w = 1; w < kThreads / 32; ++w) r = better(r, scratch[w]);
  return r;
}

__device__ float block_sum(float mine, float* scratch) {  // fixed tree order
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int off = 16; off > 0; off /= 2) mine += __shfl_xor_sync(0xffffffffu, mine, off);
  __syncthreads();
  if (lane == 0) scratch[warp] = mine;
  __syncthreads();
  float r = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) r += scratch[w];
  return r;
}

// Inclusive prefix sum of one value per thread, in thread order.
__device__ float block_scan(float mine, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float x = mine;
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    const float y = __shfl_up_sync(0xffffffffu, x, off);
    if (lane >= off) x += y;
  }
  __syncthreads();
  if (lane == 31) scratch[warp] = x;
  __syncthreads();
  float before = 0.f;
  for (int w = 0; w < warp; ++w) before += scratch[w];
  return before + x;
}

__device__ int block_count(bool mine, int* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int c = __popc(__ballot_sync(0xffffffffu, mine));
  __syncthreads();
  if (lane == 0) scratch[warp] = c;
  __syncthreads();
  int r = 0;
  for (int w = 0; w < kThreads / 32; ++w) r += scratch[w];
  return r;
}

// The top-k cut without the sort (the default; $HIGGS_RT_SAMPLER_SELECT=0 sorts always, for measuring): where
// top_k <= kSelectK and at most kSelectKeep scores reach the k-th largest, those survivors alone are ranked into
// `sorted`'s first places and every later place holds -inf. What follows reads only kth, the survivors and, below
// them, values under kth (which it maps to p = 0 and a -inf threshold either way): the same arithmetic on the same
// floats at the same places, so the same codes as after the full sort. H100, f949e68, the step against the sort
// in one call: b1 2.394 / 2.398 ms, b1 at 2000 positions 2.451 / 2.467, b8 at 500 2.635 / 2.645, b64 5.233 /
// 5.246; in the profiled b1 step pick 21.4 / 35.9 us, update 21.3 / 35.2 (both wait on the head through PDL).
constexpr int kSelectK = 64, kSelectKeep = 256;

// Order-preserving unsigned key of a float (-0 as +0): key(x) < key(y) iff x < y (no NaN).
__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t u = __float_as_uint(x == 0.f ? 0.f : x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The k-th largest of sorted[0, V) (1 <= k <= V) by a 4-pass radix select on order_key, 8 bits a pass: each pass
// counts the candidates' next byte, and warp 0 finds, from the top bin down, the bin holding the k-th.
__device__ uint32_t kth_largest_key(const float* sorted, int V, int k, unsigned* hist, unsigned* shared) {
  const int tid = threadIdx.x, lane = tid % 32;
  uint32_t key[kSort / kThreads];
#pragma unroll
  for (int j = 0; j < kSort / kThreads; ++j) {
    const int i = tid + j * kThreads;
    key[j] = i < V ? order_key(sorted[i]) : 0u;
  }
  uint32_t prefix = 0, mask = 0;
  int want = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    if (tid < 256) hist[tid] = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kSort / kThreads; ++j)
      if (tid + j * kThreads < V && (key[j] & mask) == prefix) atomicAdd(&hist[(key[j] >> shift) & 255u], 1u);
    __syncthreads();
    if (tid < 32) {  // lane l: bins 255 - 8 l down to 248 - 8 l
      unsigned mine = 0;
      for (int i = 0; i < 8; ++i) mine += hist[255 - 8 * lane - i];
      unsigned incl = mine;
#pragma unroll
      for (int off = 1; off < 32; off *= 2) {
        const unsigned y = __shfl_up_sync(kMask32, incl, off);
        if (lane >= off) incl += y;
      }
      const unsigned above = incl - mine;  // candidates in higher bins
      const bool here = above < unsigned(want) && incl >= unsigned(want);
      if (here) {
        unsigned acc = above;
        for (int i = 0; i < 8; ++i) {
          const int bin = 255 - 8 * lane - i;
          if (acc + hist[bin] >= unsigned(want)) {
            shared[0] = unsigned(bin);
            shared[1] = unsigned(want) - acc;
            break;
          }
          acc += hist[bin];
        }
      }
    }
    __syncthreads();
    prefix |= shared[0] << shift;
    mask |= 255u << shift;
    want = int(shared[1]);
    __syncthreads();  // shared[] is rewritten by the next pass
  }
  return prefix;
}

__device__ __forceinline__ float from_order_key(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// select_top's work: true where it ranked the survivors into `sorted` (else `sorted` is as before: sort it).
__device__ bool select_top(float* sorted, int V, int k, unsigned* hist, unsigned* shared, float* keep,
                           int* scratch_i) {
  const int tid = threadIdx.x;
  const float kth = from_order_key(kth_largest_key(sorted, V, k, hist, shared));
  if (kth == -INFINITY) return false;  // block-uniform: every score survives
  float v[kSort / kThreads];
  bool survives[kSort / kThreads];
  int total = 0;
#pragma unroll
  for (int j = 0; j < kSort / kThreads; ++j) {
    const int i = tid + j * kThreads;
    v[j] = i < V ? sorted[i] : -INFINITY;
    survives[j] = i < V && v[j] >= kth;
    total += block_count(survives[j], scratch_i);
  }
  if (total > kSelectKeep) return false;  // block-uniform
  if (tid == 0) shared[2] = 0;
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kSort / kThreads; ++j)
    if (survives[j]) keep[atomicAdd(&shared[2], 1u)] = v[j];
#pragma unroll
  for (int j = 0; j < kSort / kThreads; ++j) sorted[tid + j * kThreads] = -INFINITY;
  __syncthreads();
  if (tid < total) {  // rank among the survivors, descending (equal values are interchangeable)
    const float x = keep[tid];
    int rank = 0;
    for (int m = 0; m < total; ++m) rank += keep[m] > x || (keep[m] == x && m < tid);
    sorted[rank] = x;
  }
  __syncthreads();
  return true;
}

__global__ void __launch_bounds__(kThreads) pick_kernel(const SampleFrameArgs a, int select) {
  __shared__ float raw[kSort], sorted[kSort];
  __shared__ ArgMax scratch_am[kThreads / 32];
  __shared__ float scratch_f[kThreads / 32];
  __shared__ int scratch_i[kThreads / 32];
  const int q = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  const int V = int(a.V), bos = V - 2, eos = V - 1;
  const float kNegInf = -INFINITY;

  cuda::allow_next_grid();
  cuda::wait_for_previous_grid();
  const int64_t t = a.frame[b], eos_start = a.eos_start[b];
  const bool done = a.done[b];
  const bool force_bos = q >= t;
  const bool force_eos = (eos_start >= 0 && q < t - eos_start) || done;
  const float temperature = fmaxf(a.temperature[b], 1e-5f);

  // raw logits; masked scores (greedy pick); tempered scores to sort
  const float* logits = a.logits + (int64_t(b) * a.Q + q) * V;
  ArgMax greedy{kNegInf, V};
  for (int i = tid; i < kSort; i += kThreads) {
    float s = kNegInf;
    if (i < V) {
      const float r = __ldcg(logits + i);
      raw[i] = r;
      s = r;
      if (force_bos && i != bos) s = kNegInf;
      if (force_eos && i != eos) s = kNegInf;
      greedy = better(greedy, ArgMax{s, i});
      s = s / temperature;
    }
    sorted[i] = s;
  }
  greedy = block_argmax(greedy, scratch_am);  // syncs: `sorted` is complete

  const int64_t top_k = a.top_k[b];
  const int k = top_k > 0 ? int(top_k < V ? top_k : V) : V;
  __shared__ unsigned hist[256], select_shared[3];
  __shared__ float keep[kSelectKeep];
  const bool selected = select && k <= kSelectK && select_top(sorted, V, k, hist, select_shared, keep, scratch_i);
  // bitonic sort, descending
  for (int kk = 2; !selected && kk <= kSort; kk <<= 1) {
    for (int j = kk >> 1; j > 0; j >>= 1) {
      const int i = 2 * j * (tid / j) + tid % j, p = i + j;
      const bool descending = (i & kk) == 0;
      const float x = sorted[i], y = sorted[p];
      if (descending ? x < y : x > y) sorted[i] = y, sorted[p] = x;
      __syncthreads();
    }
  }
  const float kth = sorted[k - 1];

  // top-p over what top-k kept: ascending order a_i = sorted[V - 1 - i] (entries below kth are -inf)
  const float mx = sorted[0];
  float e[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = 2 * tid + h;  // ascending index
    const float v = i < V ? sorted[V - 1 - i] : kNegInf;
    e[h] = (v >= kth && v != kNegInf) ? expf(v - mx) : 0.f;
  }
  const float z = block_sum(e[0] + e[1], scratch_f);
  const float p0 = e[0] / z, p1 = e[1] / z;
  const float cum1 = block_scan(p0 + p1, scratch_f), cum0 = cum1 - p1;
  const float limit = 1.f - a.top_p[b];
  const int i0 = 2 * tid, i1 = i0 + 1;
  const int n_drop = block_count((i0 < V - 1 && cum0 <= limit), scratch_i) +
                     block_count((i1 < V - 1 && cum1 <= limit), scratch_i);
  const int ti = n_drop < V - 1 ? n_drop : V - 1;
  const float asc_t = sorted[V - 1 - ti];
  const float threshold = asc_t >= kth ? asc_t : kNegInf;

  const uint32_t h0 = noise_hash(a.seeds[b], t, q, 0);
  ArgMax sampled{kNegInf, V};
  for (int i = tid; i < V; i += kThreads) {
    float s = raw[i];
    if (force_bos && i != bos) s = kNegInf;
    if (force_eos && i != eos) s = kNegInf;
    s = s / temperature;
    if (s < kth || s < threshold) s = kNegInf;
    sampled = better(sampled, ArgMax{s + gumbel(h0, i), i});
  }
  sampled = block_argmax(sampled, scratch_am);
  int picked = a.greedy[b] ? greedy.i : sampled.i;

  if (a.window > 0) {  // repetition-aware sampling
    int repeats = 0;
    for (int w = 0; w < a.W; ++w) {
      const int64_t c = a.history[(int64_t(b) * a.W + w) * a.Q + q];
      repeats += c == picked && c != bos && c != eos;
    }
    if (a.ras_on[b] && repeats >= a.ras_max[b]) {  // block-uniform
      const uint32_t h1 = noise_hash(a.seeds[b], t, q, 1);
      ArgMax fresh{kNegInf, V};
      for (int i = tid; i < V; i += kThreads) fresh = better(fresh, ArgMax{raw[i] + gumbel(h1, i), i});
      picked = block_argmax(fresh, scratch_am).i;
    }
  }
  if (done) picked = eos;
  if (tid == 0) a.frames[int64_t(b) * a.Q + q] = picked;
}

__global__ void update_kernel(const SampleFrameArgs a) {
  const int b = blockIdx.x, q = threadIdx.x;
  const int64_t eos = a.V - 1;
  cuda::allow_next_grid();
  cuda::wait_for_previous_grid();
  const int64_t picked = __ldcg(a.frames + int64_t(b) * a.Q + q);
  const int64_t t = a.frame[b];
  if (a.window > 0) a.history[(int64_t(b) * a.W + t % a.window) * a.Q + q] = picked;
  const bool any_eos = __syncthreads_or(picked == eos);
  const bool all_eos = __syncthreads_and(picked == eos);
  if (q == 0) {
    if (a.eos_start[b] < 0 && any_eos) a.eos_start[b] = t;
    const bool was_done = a.done[b];
    if (!was_done) a.lengths[b] += 1;
    a.done[b] = was_done || all_eos;
    a.frame[b] = t + 1;
  }
}

}  // namespace

void sample_frame_cuda(const SampleFrameArgs& a, int device, void* stream) {
  if (a.B == 0 || a.Q == 0) return;
  if (a.V < 3 || a.V > kSort) throw std::invalid_argument("higgs_rt sample_frame: vocabulary must be 3 to 2048");
  if (a.Q > 1024 || a.B > 65535) throw std::invalid_argument("higgs_rt sample_frame: too many codebooks or slots");
  if (a.W < 1 || a.window < 0 || a.window > a.W) throw std::invalid_argument("higgs_rt sample_frame: bad RAS window");
  cuda::DeviceGuard guard(device);
  const cudaStream_t s = cuda::as_stream(stream);
  static const int select = cuda::env_int("HIGGS_RT_SAMPLER_SELECT", 1) == 0 ? 0 : 1;
  cuda::launch(pick_kernel, dim3(unsigned(a.Q), unsigned(a.B)), dim3(kThreads), 0, s, device, cuda::kPdlSampler,
               "sample_frame pick", a, select);
  cuda::launch(update_kernel, dim3(unsigned(a.B)), dim3(unsigned(a.Q)), 0, s, device, cuda::kPdlSampler, "sample_frame update", a);
}

}  // namespace higgs_rt
