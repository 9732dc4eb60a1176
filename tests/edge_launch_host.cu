// Which kernel instance and grid each launcher of csrc/kernels/edge_terms.cu
// picks, on the CPU: the file is included here and nvcc's launch entry points
// are wrapped at link time (-Xlinker --wrap=__cudaGetKernel
// --wrap=__cudaLaunchKernel, and --wrap=cudaLaunchKernel for toolkits whose
// stubs call it), so that nothing reaches a GPU and each launch names its
// kernel. tests/test_edge_terms.py states the choice each shape must get
// (32-bit indices only where the flat index fits, 16-byte rows only where
// aligned) and compares. stdout: a first line of the tuning constants the
// choice depends on, then a line a launch:
//   <launcher> <E> <N> <H> <F> <aligned 0/1> <kernel> <index bits> <V or K> <flag> <grid>
#include "edge_terms.cu"

#include <cstdio>
#include <map>
#include <string>

using namespace gt_fused3s;

namespace {
const void* g_kernel = nullptr;
unsigned g_grid = 0;
}  // namespace

extern "C" cudaError_t __wrap___cudaGetKernel(cudaKernel_t* out, const void* func) {
    *out = reinterpret_cast<cudaKernel_t>(const_cast<void*>(func));   // the handle names the kernel
    return cudaSuccess;
}
extern "C" cudaError_t __wrap___cudaLaunchKernel(cudaKernel_t kernel, dim3 grid, dim3, void**, size_t, cudaStream_t) {
    g_kernel = reinterpret_cast<const void*>(kernel);
    g_grid = grid.x;
    return cudaSuccess;
}
extern "C" cudaError_t __wrap_cudaLaunchKernel(const void* func, dim3 grid, dim3, void**, size_t, cudaStream_t) {
    g_kernel = func;
    g_grid = grid.x;
    return cudaSuccess;
}

int main() {
    // every instance: "<kernel> <index bits> <V or K> <flag>"
    std::map<const void*, std::string> name;
    auto add = [&](const void* f, const char* s) { name[f] = s; };
    add(reinterpret_cast<const void*>(edge_dot_kernel<1, false, uint32_t>), "dot 32 1 0");
    add(reinterpret_cast<const void*>(edge_dot_kernel<1, true, uint32_t>), "dot 32 1 1");
    add(reinterpret_cast<const void*>(edge_dot_kernel<1, false, int64_t>), "dot 64 1 0");
    add(reinterpret_cast<const void*>(edge_dot_kernel<1, true, int64_t>), "dot 64 1 1");
    add(reinterpret_cast<const void*>(edge_dot_kernel<kDotHeads, false, uint32_t>), "dot 32 4 0");
    add(reinterpret_cast<const void*>(edge_dot_kernel<kDotHeads, true, uint32_t>), "dot 32 4 1");
    add(reinterpret_cast<const void*>(edge_dot_kernel<kDotHeads, false, int64_t>), "dot 64 4 0");
    add(reinterpret_cast<const void*>(edge_dot_kernel<kDotHeads, true, int64_t>), "dot 64 4 1");
    add(reinterpret_cast<const void*>(edge_rows_kernel<uint32_t, 1>), "rows 32 1 0");
    add(reinterpret_cast<const void*>(edge_rows_kernel<uint32_t, 4>), "rows 32 4 0");
    add(reinterpret_cast<const void*>(edge_rows_kernel<int64_t, 1>), "rows 64 1 0");
    add(reinterpret_cast<const void*>(edge_rows_kernel<int64_t, 4>), "rows 64 4 0");
    add(reinterpret_cast<const void*>(edge_probs_kernel<uint32_t>), "probs 32 1 0");
    add(reinterpret_cast<const void*>(edge_probs_kernel<int64_t>), "probs 64 1 0");
    add(reinterpret_cast<const void*>(edge_scatter_kernel<uint32_t, 1, kSplit>), "scatter 32 1 0");
    add(reinterpret_cast<const void*>(edge_scatter_kernel<uint32_t, 4, kSplit>), "scatter 32 4 0");
    add(reinterpret_cast<const void*>(edge_scatter_kernel<int64_t, 1, kSplit>), "scatter 64 1 0");
    add(reinterpret_cast<const void*>(edge_scatter_kernel<int64_t, 4, kSplit>), "scatter 64 4 0");
    add(reinterpret_cast<const void*>(edge_scatter_kernel<uint32_t, 1, kSparseSplit>), "scatter 32 1 1");
    add(reinterpret_cast<const void*>(edge_scatter_kernel<uint32_t, 4, kSparseSplit>), "scatter 32 4 1");
    add(reinterpret_cast<const void*>(edge_scatter_kernel<int64_t, 1, kSparseSplit>), "scatter 64 1 1");
    add(reinterpret_cast<const void*>(edge_scatter_kernel<int64_t, 4, kSparseSplit>), "scatter 64 4 1");

    std::printf("constants threads %d max_blocks %lld dot_heads %d dot_group_edges %lld heads_per_thread %d "
                "split %d sparse_split %d sparse_degree %lld max_hub_blocks %lld\n", kThreads,
                static_cast<long long>(kMaxBlocks), kDotHeads, static_cast<long long>(kDotGroupEdges), kHeadsPerThread,
                kSplit, kSparseSplit, static_cast<long long>(kSparseDegree), static_cast<long long>(kMaxHubBlocks));
    // pointers are never dereferenced: 16-byte aligned ones, and one 4 bytes off
    float* al = reinterpret_cast<float*>(uintptr_t(1) << 20);
    float* off = reinterpret_cast<float*>((uintptr_t(1) << 20) + 4);
    const int64_t* ix = reinterpret_cast<const int64_t*>(uintptr_t(1) << 21);
    auto report = [&](const char* launcher, const EdgeTermsShape& s, int aligned) {
        const auto it = name.find(g_kernel);
        std::printf("%s %lld %lld %d %d %d %s %u\n", launcher, static_cast<long long>(s.num_edges),
                    static_cast<long long>(s.num_nodes), s.heads, s.features, aligned,
                    g_kernel == nullptr ? "none 0 0 0" : (it == name.end() ? "unknown 0 0 0" : it->second.c_str()),
                    g_grid);
        g_kernel = nullptr;
        g_grid = 0;
    };
    for (int64_t E : {int64_t(0), int64_t(7), (int64_t(1) << 19) - 1, int64_t(1) << 19, int64_t(1) << 28,
                      int64_t(3) << 30}) {
        for (int64_t N : {int64_t(5), int64_t(1) << 20, int64_t(1) << 26, int64_t(3) << 30}) {
            for (int H : {1, 3, 4, 8, 8192}) {
                for (int F : {1, 16, 18}) {
                    for (int aligned = 0; aligned < 2; ++aligned) {
                        float* p = aligned ? al : off;
                        EdgeTermsShape s{};
                        s.num_edges = E;
                        s.num_nodes = N;
                        s.heads = H;
                        s.features = F;
                        run_edge_dot(p, al, ix, al, s, nullptr);
                        report("edge_dot", s, aligned);
                        run_edge_rows(al, p, nullptr, nullptr, ix, al, s, nullptr);
                        report("edge_rows", s, aligned);
                        run_edge_rows(al, al, al, p, ix, al, s, nullptr);
                        report("edge_rows2", s, aligned);
                        run_edge_probs(al, nullptr, al, ix, 1.f, al, s, nullptr);
                        report("edge_probs", s, aligned);
                        run_edge_scatter(al, p, ix, ix, al, s, nullptr);
                        report("edge_scatter", s, aligned);
                    }
                }
            }
        }
    }
    return 0;
}
