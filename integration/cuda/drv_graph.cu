// A CUDA graph built by hand through the driver API: memset, kernel, memcpy,
// host and event nodes with dependencies; the graph's queries; a cycle
// refused at instantiation; an exec that keeps its graph as instantiated
// while the graph changes; a clone; a child graph; and a launch repeated
// with the results checked on the host. Kernels from drv_module_kernels.cu
// (`fill(out, value, n)`: out[i] = value + i % 4 on a fresh module).
#include <cuda.h>
#include <unistd.h>
#include "check.h"
#include "drv_module_images.h"  // module_fatbin[], module_fatbin_len, module_ptx[]
// cuda.h 13 maps the edge and dependency calls to their _v2 forms (edge data: null, default).

static const int N = 512;

struct Seen {
    const int *host;
    int value;
    int calls;
};

static void host_fn(void *p) {
    Seen *s = (Seen *)p;
    s->value = s->host[5];
    s->calls++;
}

static int destroyed = 0;
static void destroy_fn(void *p) { destroyed += *(int *)p; }

static CUDA_MEMCPY3D copy1d(CUmemorytype st, CUdeviceptr sd, const void *sh, CUmemorytype dt, CUdeviceptr dd, void *dh, size_t n) {
    CUDA_MEMCPY3D c;
    memset(&c, 0, sizeof c);
    c.srcMemoryType = st;
    c.srcDevice = sd;
    c.srcHost = sh;
    c.dstMemoryType = dt;
    c.dstDevice = dd;
    c.dstHost = dh;
    c.WidthInBytes = n;
    c.Height = 1;
    c.Depth = 1;
    return c;
}

static CUDA_KERNEL_NODE_PARAMS fill_params(CUfunction f, void **args) {
    CUDA_KERNEL_NODE_PARAMS k;
    memset(&k, 0, sizeof k);
    k.func = f;
    k.gridDimX = N / 128;
    k.gridDimY = k.gridDimZ = 1;
    k.blockDimX = 128;
    k.blockDimY = k.blockDimZ = 1;
    k.kernelParams = args;
    return k;
}

int main() {
    test_begin("drv_graph");
    CU_CHECK(cuInit(0));
    CUdevice dev;
    CU_CHECK(cuDeviceGet(&dev, 0));
    CUcontext ctx;
    CU_CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CU_CHECK(cuCtxSetCurrent(ctx));
    CUmodule m;
    CU_CHECK(cuModuleLoadData(&m, module_fatbin));
    CUfunction fill;
    CU_CHECK(cuModuleGetFunction(&fill, m, "fill"));
    CUstream s;
    CU_CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CUevent done;
    CU_CHECK(cuEventCreate(&done, CU_EVENT_DISABLE_TIMING));

    const size_t bytes = N * sizeof(int);
    CUdeviceptr d1, d2, d3;
    CU_CHECK(cuMemAlloc(&d1, bytes));
    CU_CHECK(cuMemAlloc(&d2, bytes));
    CU_CHECK(cuMemAlloc(&d3, bytes));
    int *h1 = (int *)malloc(bytes), *h2 = (int *)malloc(bytes), *h3 = (int *)malloc(bytes);

    CUgraph g;
    CU_CHECK(cuGraphCreate(&g, 0));
    // a: d1 = 7          b: d2 = fill(100)
    // c: d3 = d1 (after a)                  f: h2 = d2 (after b)
    // d: d1 = fill(200) (after c: it must read d1 first)   e: h3 = d3 (after c)
    // g: h1 = d1 (after d)   h: host reads h1 (after g)   r: record `done` (after h)
    CUgraphNode a, b, c, d, e, f, gn, h, r;
    CUDA_MEMSET_NODE_PARAMS ms;
    memset(&ms, 0, sizeof ms);
    ms.dst = d1;
    ms.value = 7;
    ms.elementSize = 4;
    ms.width = N;
    ms.height = 1;
    CU_CHECK(cuGraphAddMemsetNode(&a, g, nullptr, 0, &ms, ctx));
    int v = 100, n = N;
    void *args_b[] = {&d2, &v, &n};
    CUDA_KERNEL_NODE_PARAMS kb = fill_params(fill, args_b);
    CU_CHECK(cuGraphAddKernelNode(&b, g, nullptr, 0, &kb));
    v = -1;  // the node holds a copy of its arguments
    CUDA_MEMCPY3D cc = copy1d(CU_MEMORYTYPE_DEVICE, d1, nullptr, CU_MEMORYTYPE_DEVICE, d3, nullptr, bytes);
    CU_CHECK(cuGraphAddMemcpyNode(&c, g, &a, 1, &cc, ctx));
    int v200 = 200;
    void *args_d[] = {&d1, &v200, &n};
    CUDA_KERNEL_NODE_PARAMS kd = fill_params(fill, args_d);
    CU_CHECK(cuGraphAddKernelNode(&d, g, &c, 1, &kd));
    CUDA_MEMCPY3D ce = copy1d(CU_MEMORYTYPE_DEVICE, d3, nullptr, CU_MEMORYTYPE_HOST, 0, h3, bytes);
    CU_CHECK(cuGraphAddMemcpyNode(&e, g, &c, 1, &ce, ctx));
    CUDA_MEMCPY3D cf = copy1d(CU_MEMORYTYPE_DEVICE, d2, nullptr, CU_MEMORYTYPE_HOST, 0, h2, bytes);
    CU_CHECK(cuGraphAddMemcpyNode(&f, g, &b, 1, &cf, ctx));
    CUDA_MEMCPY3D cg = copy1d(CU_MEMORYTYPE_DEVICE, d1, nullptr, CU_MEMORYTYPE_HOST, 0, h1, bytes);
    CU_CHECK(cuGraphAddMemcpyNode(&gn, g, &d, 1, &cg, ctx));
    Seen seen = {h1, 0, 0};
    CUDA_HOST_NODE_PARAMS hp = {host_fn, &seen};
    CU_CHECK(cuGraphAddHostNode(&h, g, &gn, 1, &hp));
    CU_CHECK(cuGraphAddEventRecordNode(&r, g, &h, 1, done));
    ok("nine nodes added by hand");

    size_t count = 0;
    CU_CHECK(cuGraphGetNodes(g, nullptr, &count));
    EXPECT(count == 9, "%zu nodes", count);
    CUgraphNode roots[4];
    count = 4;
    CU_CHECK(cuGraphGetRootNodes(g, roots, &count));
    EXPECT(count == 2 && roots[0] == a && roots[1] == b && roots[2] == nullptr, "%zu roots", count);
    count = 0;
    CU_CHECK(cuGraphGetEdges(g, nullptr, nullptr, nullptr, &count));
    EXPECT(count == 7, "%zu edges", count);
    CUgraphNode list[4];
    count = 4;
    CU_CHECK(cuGraphNodeGetDependentNodes(c, list, nullptr, &count));
    EXPECT(count == 2 && list[0] == d && list[1] == e, "dependents of c: %zu", count);
    count = 4;
    CU_CHECK(cuGraphNodeGetDependencies(d, list, nullptr, &count));
    EXPECT(count == 1 && list[0] == c, "dependencies of d: %zu", count);
    CUgraphNodeType t;
    CU_CHECK(cuGraphNodeGetType(h, &t));
    EXPECT(t == CU_GRAPH_NODE_TYPE_HOST, "host node type %d", (int)t);
    CU_CHECK(cuGraphNodeGetType(a, &t));
    EXPECT(t == CU_GRAPH_NODE_TYPE_MEMSET, "memset node type %d", (int)t);
    CUDA_MEMSET_NODE_PARAMS got;
    CU_CHECK(cuGraphMemsetNodeGetParams(a, &got));
    EXPECT(got.dst == d1 && got.value == 7 && got.width == N, "memset params read back");
    CU_CHECK_ERR(cuGraphAddDependencies(g, &a, &c, nullptr, 1), CUDA_ERROR_INVALID_VALUE);
    ok("roots, edges, dependencies, dependents, node types and params; an edge twice is refused");

    // A cycle (r -> a) is refused at instantiation, naming a node on it.
    CU_CHECK(cuGraphAddDependencies(g, &r, &a, nullptr, 1));
    CUgraphExec x = nullptr;
    CUDA_GRAPH_INSTANTIATE_PARAMS ip;
    memset(&ip, 0, sizeof ip);
    CU_CHECK_ERR(cuGraphInstantiateWithParams(&x, g, &ip), CUDA_ERROR_INVALID_VALUE);
    EXPECT(ip.hErrNode_out != nullptr && ip.result_out == CUDA_GRAPH_INSTANTIATE_INVALID_STRUCTURE,
           "cycle: error node %p, result %d", (void *)ip.hErrNode_out, (int)ip.result_out);
    CU_CHECK(cuGraphRemoveDependencies(g, &r, &a, nullptr, 1));
    CU_CHECK_ERR(cuGraphRemoveDependencies(g, &r, &a, nullptr, 1), CUDA_ERROR_INVALID_VALUE);
    ok("a cycle fails cuGraphInstantiate with CUDA_ERROR_INVALID_VALUE and an error node");

    CU_CHECK(cuGraphInstantiateWithParams(&x, g, &ip));
    EXPECT(ip.result_out == CUDA_GRAPH_INSTANTIATE_SUCCESS, "result %d", (int)ip.result_out);
    for (int round = 0; round < 2; round++) {
        memset(h1, 0, bytes);
        memset(h2, 0, bytes);
        memset(h3, 0, bytes);
        CU_CHECK(cuGraphLaunch(x, s));
        CU_CHECK(cuStreamSynchronize(s));
        for (int i = 0; i < N; i++) {
            EXPECT(h3[i] == 7, "round %d: h3[%d] = %d (d1 before d overwrote it)", round, i, h3[i]);
            EXPECT(h2[i] == 100 + i % 4, "round %d: h2[%d] = %d", round, i, h2[i]);
            EXPECT(h1[i] == 200 + i % 4, "round %d: h1[%d] = %d", round, i, h1[i]);
        }
        EXPECT(seen.calls == round + 1 && seen.value == 201, "host node: %d calls, saw %d", seen.calls, seen.value);
        CU_CHECK(cuEventQuery(done));
    }
    ok("launched twice: every node ran in dependency order, the host node after its copy");

    // The graph changes; the exec keeps what it instantiated, a new one takes the change.
    int v300 = 300;
    void *args_300[] = {&d2, &v300, &n};
    CUDA_KERNEL_NODE_PARAMS k300 = fill_params(fill, args_300);
    CU_CHECK(cuGraphKernelNodeSetParams(b, &k300));
    CUgraph g2;
    CU_CHECK(cuGraphClone(&g2, g));
    CU_CHECK(cuGraphLaunch(x, s));
    CU_CHECK(cuStreamSynchronize(s));
    EXPECT(h2[1] == 101, "the exec ran the changed graph: h2[1] = %d", h2[1]);
    CUgraphExec x2;
    CU_CHECK(cuGraphInstantiateWithFlags(&x2, g2, 0));
    CU_CHECK(cuGraphLaunch(x2, s));
    CU_CHECK(cuStreamSynchronize(s));
    EXPECT(h2[1] == 301, "the clone's exec: h2[1] = %d", h2[1]);
    ok("an exec keeps the graph as instantiated; a clone of the changed graph computes 300");

    // The whole graph as a child of another, after a memset that the child's a repeats.
    CUgraph outer;
    CU_CHECK(cuGraphCreate(&outer, 0));
    CUgraphNode z, child;
    ms.dst = d2;
    ms.value = 0;
    CU_CHECK(cuGraphAddMemsetNode(&z, outer, nullptr, 0, &ms, ctx));
    CU_CHECK(cuGraphAddChildGraphNode(&child, outer, &z, 1, g2));
    CU_CHECK(cuGraphDestroy(g2));  // the node holds its own copy
    CUgraphExec x3;
    CU_CHECK(cuGraphInstantiateWithFlags(&x3, outer, 0));
    memset(h2, 0, bytes);
    CU_CHECK(cuGraphLaunch(x3, s));
    CU_CHECK(cuStreamSynchronize(s));
    EXPECT(h2[2] == 302 && seen.value == 201, "through a child graph: h2[2] = %d", h2[2]);
    ok("a child graph node runs its copy of the graph");

    // Capture into an existing graph, after one of its nodes.
    CUgraph gc;
    CU_CHECK(cuGraphCreate(&gc, 0));
    CUgraphNode m0;
    ms.dst = d3;
    ms.value = 0;
    CU_CHECK(cuGraphAddMemsetNode(&m0, gc, nullptr, 0, &ms, ctx));
    CU_CHECK(cuStreamBeginCaptureToGraph(s, gc, &m0, nullptr, 1, CU_STREAM_CAPTURE_MODE_GLOBAL));
    int v400 = 400;
    void *args_400[] = {&d3, &v400, &n};
    CU_CHECK(cuLaunchKernel(fill, N / 128, 1, 1, 128, 1, 1, 0, s, args_400, nullptr));
    CUgraph gout = nullptr;
    CU_CHECK(cuStreamEndCapture(s, &gout));
    EXPECT(gout == gc, "the capture returned another graph");
    count = 0;
    CU_CHECK(cuGraphGetEdges(gc, nullptr, nullptr, nullptr, &count));
    EXPECT(count == 1, "%zu edges after capturing into the graph", count);
    CUgraphExec x4;
    CU_CHECK(cuGraphInstantiateWithFlags(&x4, gc, 0));
    CU_CHECK(cuGraphLaunch(x4, s));
    CU_CHECK(cuMemcpyDtoH(h3, d3, bytes));
    EXPECT(h3[3] == 403, "captured into the graph: h3[3] = %d", h3[3]);
    CU_CHECK(cuGraphExecDestroy(x4));
    CU_CHECK(cuGraphDestroy(gc));
    ok("cuStreamBeginCaptureToGraph: captured work follows the graph's node");

    char path[] = "/tmp/drv_graph_dot_XXXXXX";
    int fd = mkstemp(path);
    EXPECT(fd >= 0, "mkstemp");
    close(fd);
    CU_CHECK(cuGraphDebugDotPrint(g, path, 0));
    FILE *dot = fopen(path, "r");
    EXPECT(dot != nullptr, "no DOT file");
    char text[8192] = {0};
    size_t got_bytes = fread(text, 1, sizeof text - 1, dot);
    fclose(dot);
    unlink(path);
    EXPECT(got_bytes > 0 && strstr(text, "digraph") && strstr(text, "->") && strstr(text, "kernel fill"),
           "DOT text: %s", text);
    ok("cuGraphDebugDotPrint writes the nodes and edges");

    // A user object whose only reference a graph takes over lives while the graph, its clone
    // and an exec of the clone do; its destructor runs once, when the last goes.
    {
        int one = 1;
        CUuserObject uo;
        CU_CHECK(cuUserObjectCreate(&uo, &one, destroy_fn, 1, CU_USER_OBJECT_NO_DESTRUCTOR_SYNC));
        CUgraph go, gcl;
        CU_CHECK(cuGraphCreate(&go, 0));
        CUgraphNode en;
        CU_CHECK(cuGraphAddEmptyNode(&en, go, nullptr, 0));
        CU_CHECK(cuGraphRetainUserObject(go, uo, 1, CU_GRAPH_USER_OBJECT_MOVE));
        CU_CHECK(cuGraphClone(&gcl, go));
        CU_CHECK(cuGraphDestroy(go));
        EXPECT(destroyed == 0, "destroyed with a clone still holding it");
        CUgraphExec xe;
        CU_CHECK(cuGraphInstantiateWithFlags(&xe, gcl, 0));
        CU_CHECK(cuGraphDestroy(gcl));
        EXPECT(destroyed == 0, "destroyed with an exec still holding it");
        CU_CHECK(cuGraphLaunch(xe, s));
        CU_CHECK(cuStreamSynchronize(s));
        CU_CHECK(cuGraphExecDestroy(xe));
        EXPECT(destroyed == 1, "destructor ran %d times", destroyed);
    }
    ok("user objects owned by a graph live through its clone and exec, destroyed once");

    CU_CHECK(cuGraphDestroyNode(r));
    count = 0;
    CU_CHECK(cuGraphGetNodes(g, nullptr, &count));
    EXPECT(count == 8, "%zu nodes after destroying one", count);
    CU_CHECK_ERR(cuGraphNodeGetType(r, &t), CUDA_ERROR_INVALID_HANDLE);
    ok("cuGraphDestroyNode");

    CU_CHECK(cuGraphExecDestroy(x));
    CU_CHECK(cuGraphExecDestroy(x2));
    CU_CHECK(cuGraphExecDestroy(x3));
    CU_CHECK_ERR(cuGraphLaunch(x, s), CUDA_ERROR_INVALID_HANDLE);
    CU_CHECK(cuGraphDestroy(outer));
    CU_CHECK(cuGraphDestroy(g));
    CU_CHECK(cuMemFree(d1));
    CU_CHECK(cuMemFree(d2));
    CU_CHECK(cuMemFree(d3));
    CU_CHECK(cuStreamDestroy(s));
    free(h1);
    free(h2);
    free(h3);
    return test_end();
}
