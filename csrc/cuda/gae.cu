// Masked GAE on CUDA as an associative scan over time, so a few long rows still fill the GPU.
//
// Going backwards in t, one token maps the state (L = running advantage, nv = next value) affinely:
//   L'  = c L + e nv + bl,   c = m*gamma*lam + (1-m),  e = m*gamma,  bl = m*(r - v)
//   nv' = a nv + bn,         a = 1 - m,                bn = m*v
// (the reference recurrence, masked tokens carrying both states). Such maps compose associatively.
// Each row is cut into segments of kThreads * items tokens; a block scans one segment (each thread
// composes its `items` tokens, then a block-wide exclusive scan). With several segments per row, a
// first pass stores each segment's composed map, a small pass turns them into each segment's incoming
// state, and the final pass applies them.
#include <cub/block/block_scan.cuh>

#include "cuda_kernels.h"

namespace megatron_rl::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMapFloats = 5;
constexpr int kStateFloats = 2;
// Below this many blocks a GPU has idle SMs: use 1 token per thread (more segments) instead of 4.
constexpr int64_t kBusyBlocks = 512;

struct Map {  // [L, nv] -> [c L + e nv + bl, a nv + bn]
  float c, e, a, bl, bn;
};
struct State {
  float L, nv;
};

__device__ __forceinline__ Map identity_map() { return {1.f, 0.f, 1.f, 0.f, 0.f}; }

// `first` then `then`, i.e. then(first(x)).
__device__ __forceinline__ Map compose(const Map& first, const Map& then) {
  return {then.c * first.c, then.c * first.e + then.e * first.a, then.a * first.a,
          then.c * first.bl + then.e * first.bn + then.bl, then.a * first.bn + then.bn};
}

__device__ __forceinline__ State apply(const Map& f, const State& s) {
  return {f.c * s.L + f.e * s.nv + f.bl, f.a * s.nv + f.bn};
}

struct ComposeInTimeOrder {  // scan order is backwards in t: earlier scan elements act first
  __device__ Map operator()(const Map& earlier, const Map& later) const { return compose(earlier, later); }
};

struct Plan {
  int items;         // tokens per thread
  int64_t segments;  // per row
};

Plan plan_for(int64_t batch, int64_t steps) {
  const int64_t long_segment = int64_t(kThreads) * 4;
  const int64_t segments = (steps + long_segment - 1) / long_segment;
  if (batch * segments >= kBusyBlocks) return {4, segments};
  return {1, (steps + kThreads - 1) / kThreads};
}

// One block = one (row, segment). kApply=false: store the segment's composed map.
// kApply=true: start from the segment's incoming state (zero for the last-in-time segment) and write.
template <int kItems, bool kApply>
__global__ void __launch_bounds__(kThreads) gae_segment_kernel(GaeArgs g, int64_t segments, Map* seg_maps,
                                                             const State* seg_states) {
  const int64_t row = blockIdx.x / segments;
  const int64_t seg = blockIdx.x % segments;
  const float gamma = static_cast<float>(g.gamma);
  const float gamma_lam = static_cast<float>(g.gamma * g.lam);
  // u counts tokens backwards from the end of the row: t = steps - 1 - u
  const int64_t u0 = (seg * kThreads + threadIdx.x) * kItems;
  const int64_t row_base = row * g.steps;

  Map token[kItems];
  float values[kItems];
  Map mine = identity_map();
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int64_t u = u0 + k;
    token[k] = identity_map();
    values[k] = 0.f;
    if (u < g.steps) {
      const int64_t i = row_base + (g.steps - 1 - u);
      const float m = g.mask[i], v = g.values[i], keep = 1.f - m;
      token[k] = {m * gamma_lam + keep, m * gamma, keep, m * (g.rewards[i] - v), m * v};
      values[k] = v;
    }
    mine = compose(mine, token[k]);
  }

  using Scan = cub::BlockScan<Map, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  Map before_me, segment_map;
  Scan(temp).ExclusiveScan(mine, before_me, identity_map(), ComposeInTimeOrder{}, segment_map);

  if constexpr (!kApply) {
    if (threadIdx.x == 0) seg_maps[row * segments + seg] = segment_map;
  } else {
    State s = seg_states ? seg_states[row * segments + seg] : State{0.f, 0.f};
    s = apply(before_me, s);
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int64_t u = u0 + k;
      if (u >= g.steps) break;
      s = apply(token[k], s);
      const int64_t i = row_base + (g.steps - 1 - u);
      g.advantages[i] = s.L;
      g.returns[i] = s.L + values[k];
    }
  }
}

// One thread per row: the state entering each segment, from the composed maps of the earlier ones.
__global__ void gae_segment_states_kernel(int64_t batch, int64_t segments, const Map* seg_maps, State* seg_states) {
  const int64_t row = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (row >= batch) return;
  State s{0.f, 0.f};
  for (int64_t seg = 0; seg < segments; ++seg) {
    seg_states[row * segments + seg] = s;
    s = apply(seg_maps[row * segments + seg], s);
  }
}

template <int kItems>
cudaError_t launch(const GaeArgs& g, int64_t segments, float* workspace, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(g.batch * segments));
  Map* maps = nullptr;
  State* states = nullptr;
  if (segments > 1) {
    maps = reinterpret_cast<Map*>(workspace);
    states = reinterpret_cast<State*>(workspace + g.batch * segments * kMapFloats);
    gae_segment_kernel<kItems, false><<<grid, kThreads, 0, stream>>>(g, segments, maps, nullptr);
    const int threads = 128;
    gae_segment_states_kernel<<<static_cast<unsigned>((g.batch + threads - 1) / threads), threads, 0, stream>>>(
        g.batch, segments, maps, states);
  }
  gae_segment_kernel<kItems, true><<<grid, kThreads, 0, stream>>>(g, segments, nullptr, states);
  return cudaGetLastError();
}

}  // namespace

int64_t masked_gae_workspace_floats(int64_t batch, int64_t steps) {
  const Plan p = plan_for(batch, steps);
  return p.segments > 1 ? batch * p.segments * (kMapFloats + kStateFloats) : 0;
}

cudaError_t masked_gae(const GaeArgs& g, float* workspace, cudaStream_t stream) {
  const Plan p = plan_for(g.batch, g.steps);
  return p.items == 4 ? launch<4>(g, p.segments, workspace, stream) : launch<1>(g, p.segments, workspace, stream);
}

}  // namespace megatron_rl::cuda
