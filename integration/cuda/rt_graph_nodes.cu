// Graphs built node by node with the runtime API, and their nodes changed: in the graph
// (which an instantiated graph must not see), in an instantiated graph
// (cudaGraphExec*NodeSetParams, cudaGraphNodeSetEnabled), through the generic node API
// (cudaGraphAddNode, cudaGraphNodeGetParams/SetParams, cudaGraphExecNodeSetParams), and
// in clones (cudaGraphNodeFindInClone). Every change is checked by what a launch then does,
// and every refused change by the launch after it doing what it did before.
#include <cuda_runtime.h>
#include <vector>
#include "check.h"

__global__ void add_k(int *p, int v, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] += v;
}

struct HostLog {
    int calls;
    int last;
};
static void CUDART_CB host_a(void *p) {
    HostLog *l = (HostLog *)p;
    l->calls++;
    l->last = 1;
}
static void CUDART_CB host_b(void *p) {
    HostLog *l = (HostLog *)p;
    l->calls++;
    l->last = 2;
}

static const int N = 4096;
static const size_t BYTES = N * sizeof(int);

// out[i] == in[i] + add for every i.
static void expect_plus(const std::vector<int> &out, const std::vector<int> &in, int add, const char *what) {
    for (int i = 0; i < N; i++)
        EXPECT(out[i] == in[i] + add, "%s: element %d is %d, expected %d", what, i, out[i], in[i] + add);
}

static void expect_all(const std::vector<int> &v, int want, const char *what) {
    for (int i = 0; i < N; i++) EXPECT(v[i] == want, "%s: element %d is %d, expected %d", what, i, v[i], want);
}

static void launch(cudaGraphExec_t e, cudaStream_t s) {
    CHECK(cudaGraphLaunch(e, s));
    CHECK(cudaStreamSynchronize(s));
}

// cudaGraphNodeParams has no default constructor (a union with dim3 in it).
union NodeParams {
    cudaGraphNodeParams p;
    NodeParams() { memset((void *)this, 0, sizeof *this); }
};

static void reset(cudaGraphNodeParams &p, cudaGraphNodeType t) {
    memset((void *)&p, 0, sizeof p);
    p.type = t;
}

// A one-row byte memset of `width` bytes at `dst`.
static void memset_params(cudaGraphNodeParams &p, void *dst, unsigned value, size_t width) {
    reset(p, cudaGraphNodeTypeMemset);
    p.memset.dst = dst;
    p.memset.value = value;
    p.memset.elementSize = 1;
    p.memset.width = width;
    p.memset.height = 1;
}

static cudaError_t add_node(cudaGraphNode_t *n, cudaGraph_t g, const cudaGraphNode_t *deps, size_t nd, cudaGraphNodeParams *p) {
#if CUDART_VERSION >= 13000
    return cudaGraphAddNode(n, g, deps, nullptr, nd, p);
#else
    return cudaGraphAddNode(n, g, deps, nd, p);
#endif
}

int main() {
    test_begin("rt_graph_nodes");
    std::vector<int> in(N), in2(N), out_a(N), out_b(N);
    for (int i = 0; i < N; i++) {
        in[i] = 3 * i + 1;
        in2[i] = 7 * i - 5;
    }
    int *d = nullptr, *d2 = nullptr;
    CHECK(cudaMalloc((void **)&d, BYTES));
    CHECK(cudaMalloc((void **)&d2, BYTES));
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));

    // ---- upload, add 10, download, host callback ----
    cudaGraph_t g;
    CHECK(cudaGraphCreate(&g, 0));
    cudaGraphNode_t up, k, down, host;
    CHECK(cudaGraphAddMemcpyNode1D(&up, g, nullptr, 0, d, in.data(), BYTES, cudaMemcpyHostToDevice));
    int n = N, v = 10;
    void *args[] = {&d, &v, &n};
    cudaKernelNodeParams kp = {};
    kp.func = (void *)add_k;
    kp.gridDim = dim3((N + 255) / 256);
    kp.blockDim = dim3(256);
    kp.kernelParams = args;
    CHECK(cudaGraphAddKernelNode(&k, g, &up, 1, &kp));
    CHECK(cudaGraphAddMemcpyNode1D(&down, g, &k, 1, out_a.data(), d, BYTES, cudaMemcpyDeviceToHost));
    HostLog log_a = {0, 0}, log_b = {0, 0};
    cudaHostNodeParams hp = {host_a, &log_a};
    CHECK(cudaGraphAddHostNode(&host, g, &down, 1, &hp));

    cudaMemcpy3DParms mp = {};
    CHECK(cudaGraphMemcpyNodeGetParams(up, &mp));
    EXPECT(mp.srcPtr.ptr == in.data() && mp.dstPtr.ptr == d && mp.extent.width == BYTES && mp.extent.height == 1 &&
               mp.extent.depth == 1,
           "memcpy node parameters read back as src %p dst %p extent %zux%zux%zu", mp.srcPtr.ptr, mp.dstPtr.ptr,
           mp.extent.width, mp.extent.height, mp.extent.depth);
    cudaHostNodeParams hp2 = {};
    CHECK(cudaGraphHostNodeGetParams(host, &hp2));
    EXPECT(hp2.fn == host_a && hp2.userData == &log_a, "host node parameters read back wrong");
    CHECK_ERR(cudaGraphMemcpyNodeGetParams(k, &mp), cudaErrorInvalidValue);
    CHECK_ERR(cudaGraphHostNodeGetParams(up, &hp2), cudaErrorInvalidValue);
    cudaMemsetParams msp = {};
    CHECK_ERR(cudaGraphMemsetNodeGetParams(down, &msp), cudaErrorInvalidValue);
    ok("node parameters read back; another kind's are refused");

    cudaGraphExec_t e;
    CHECK(cudaGraphInstantiate(&e, g, 0));
    launch(e, s);
    expect_plus(out_a, in, 10, "first launch");
    EXPECT(log_a.calls == 1 && log_a.last == 1, "host node ran %d times", log_a.calls);
    ok("a graph of memcpy, kernel, memcpy and host nodes runs in order");

    // ---- the graph changes; the exec made from it does not ----
    CHECK(cudaGraphMemcpyNodeSetParams1D(down, out_b.data(), d, BYTES, cudaMemcpyDeviceToHost));
    cudaHostNodeParams hpb = {host_b, &log_b};
    CHECK(cudaGraphHostNodeSetParams(host, &hpb));
    std::fill(out_a.begin(), out_a.end(), -1);
    std::fill(out_b.begin(), out_b.end(), -1);
    launch(e, s);
    expect_plus(out_a, in, 10, "exec after its graph changed");
    expect_all(out_b, -1, "buffer only the changed graph names");
    EXPECT(log_a.calls == 2 && log_b.calls == 0, "host calls %d/%d after the graph changed", log_a.calls, log_b.calls);
    cudaGraphExec_t e2;
    CHECK(cudaGraphInstantiate(&e2, g, 0));
    launch(e2, s);
    expect_plus(out_b, in, 10, "exec of the changed graph");
    EXPECT(log_b.calls == 1 && log_b.last == 2 && log_a.calls == 2, "the changed host node ran %d times", log_b.calls);
    ok("a node changed in its graph reaches new execs only");

    // ---- the exec changes; the graph does not ----
    CHECK(cudaGraphExecMemcpyNodeSetParams1D(e, up, d, in2.data(), BYTES, cudaMemcpyHostToDevice));
    CHECK(cudaGraphExecHostNodeSetParams(e, host, &hpb));
    std::fill(out_a.begin(), out_a.end(), -1);
    launch(e, s);
    expect_plus(out_a, in2, 10, "exec with a new source");
    EXPECT(log_b.calls == 2 && log_a.calls == 2, "host calls %d/%d after the exec changed", log_a.calls, log_b.calls);
    CHECK(cudaGraphMemcpyNodeGetParams(up, &mp));
    EXPECT(mp.srcPtr.ptr == in.data(), "the graph's node changed with its exec's");
    ok("cudaGraphExecMemcpyNodeSetParams1D and cudaGraphExecHostNodeSetParams change the exec only");

    // ---- refused exec changes leave the exec as it was ----
    CHECK_ERR(cudaGraphExecMemcpyNodeSetParams1D(e, up, d, in.data(), BYTES + 4, cudaMemcpyHostToDevice),
              cudaErrorInvalidValue);
    CHECK_ERR(cudaGraphExecMemcpyNodeSetParams1D(e, up, d + 1, in.data(), BYTES, cudaMemcpyHostToDevice),
              cudaErrorInvalidValue);
    CHECK_ERR(cudaGraphExecMemcpyNodeSetParams1D(e, up, d, in.data(), 0, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
    CHECK_ERR(cudaGraphExecMemcpyNodeSetParams1D(e, k, d, in.data(), BYTES, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
    // A host span that wraps the address space: read at launch, it would fault.
    const void *wraps = (const void *)(~(uintptr_t)0 - 15);
    CHECK_ERR(cudaGraphExecMemcpyNodeSetParams1D(e, up, d, wraps, BYTES, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
    CHECK_ERR(cudaGraphExecMemcpyNodeSetParams1D(e, up, d, wraps, BYTES, cudaMemcpyDefault), cudaErrorInvalidValue);
    cudaGraphNode_t wrapped;
    CHECK_ERR(cudaGraphAddMemcpyNode1D(&wrapped, g, nullptr, 0, d, wraps, BYTES, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
    cudaHostNodeParams hnull = {nullptr, &log_a};
    CHECK_ERR(cudaGraphExecHostNodeSetParams(e, host, &hnull), cudaErrorInvalidValue);
    cudaGraph_t other;
    cudaGraphNode_t stranger;
    CHECK(cudaGraphCreate(&other, 0));
    CHECK(cudaGraphAddEmptyNode(&stranger, other, nullptr, 0));
    CHECK_ERR(cudaGraphExecHostNodeSetParams(e, stranger, &hpb), cudaErrorInvalidValue);
    std::fill(out_a.begin(), out_a.end(), -1);
    launch(e, s);
    expect_plus(out_a, in2, 10, "exec after refused changes");
    EXPECT(log_b.calls == 3, "host node after refused changes ran %d times in all", log_b.calls);
    ok("out-of-bounds, wrapping, empty, wrong-kind and foreign-node changes are refused and change nothing");

    // ---- memset nodes ----
    cudaGraph_t gm;
    CHECK(cudaGraphCreate(&gm, 0));
    cudaGraphNode_t ms, back;
    cudaMemsetParams mset = {};
    mset.dst = d2;
    mset.value = 0x11111111;
    mset.elementSize = 4;
    mset.width = N;
    mset.height = 1;
    CHECK(cudaGraphAddMemsetNode(&ms, gm, nullptr, 0, &mset));
    CHECK(cudaGraphAddMemcpyNode1D(&back, gm, &ms, 1, out_b.data(), d2, BYTES, cudaMemcpyDeviceToHost));
    cudaGraphExec_t em;
    CHECK(cudaGraphInstantiate(&em, gm, 0));
    launch(em, s);
    expect_all(out_b, 0x11111111, "memset node");
    cudaMemsetParams half = mset;
    half.value = 0x22222222;
    half.width = N / 2;
    CHECK(cudaGraphExecMemsetNodeSetParams(em, ms, &half));
    launch(em, s);
    for (int i = 0; i < N; i++) {
        int want = i < N / 2 ? 0x22222222 : 0x11111111;
        EXPECT(out_b[i] == want, "after the memset node changed, element %d is %#x, expected %#x", i, out_b[i], want);
    }
    cudaMemsetParams bad = mset;
    bad.elementSize = 3;
    CHECK_ERR(cudaGraphExecMemsetNodeSetParams(em, ms, &bad), cudaErrorInvalidValue);
    bad = mset;
    bad.width = N + 1;
    CHECK_ERR(cudaGraphExecMemsetNodeSetParams(em, ms, &bad), cudaErrorInvalidValue);
    CHECK(cudaGraphMemsetNodeGetParams(ms, &msp));
    EXPECT(msp.value == 0x11111111 && msp.width == (size_t)N && msp.elementSize == 4,
           "the graph's memset node reads back value %#x width %zu", msp.value, msp.width);
    CHECK(cudaMemset(d2, 0, BYTES));
    launch(em, s);
    for (int i = 0; i < N; i++)
        EXPECT(out_b[i] == (i < N / 2 ? 0x22222222 : 0), "after refused memset changes, element %d is %#x", i, out_b[i]);
    ok("cudaGraphExecMemsetNodeSetParams changes the exec; bad element sizes and widths are refused");

    // ---- nodes disabled and enabled in an exec ----
    unsigned enabled = 7;
    CHECK(cudaGraphNodeGetEnabled(e, k, &enabled));
    EXPECT(enabled == 1, "a kernel node reads as enabled %u", enabled);
    CHECK(cudaGraphNodeSetEnabled(e, k, 0));
    CHECK(cudaGraphNodeGetEnabled(e, k, &enabled));
    EXPECT(enabled == 0, "a disabled kernel node reads as enabled %u", enabled);
    std::fill(out_a.begin(), out_a.end(), -1);
    launch(e, s);
    expect_plus(out_a, in2, 0, "exec with its kernel node disabled");
    CHECK(cudaGraphNodeSetEnabled(e, k, 1));
    launch(e, s);
    expect_plus(out_a, in2, 10, "exec with its kernel node enabled again");
    CHECK_ERR(cudaGraphNodeSetEnabled(e, host, 0), cudaErrorInvalidValue);
    CHECK_ERR(cudaGraphNodeSetEnabled(e, stranger, 0), cudaErrorInvalidValue);
    CHECK(cudaGraphNodeSetEnabled(em, ms, 0));
    CHECK(cudaMemset(d2, 0x7f, BYTES));
    launch(em, s);
    expect_all(out_b, 0x7f7f7f7f, "exec with its memset node disabled");
    ok("cudaGraphNodeSetEnabled skips kernel and memset nodes, and brings them back");

    // ---- event nodes ----
    cudaEvent_t ev1, ev2, ev3;
    CHECK(cudaEventCreate(&ev1));
    CHECK(cudaEventCreate(&ev2));
    CHECK(cudaEventCreateWithFlags(&ev3, cudaEventDisableTiming));
    cudaGraph_t ge;
    CHECK(cudaGraphCreate(&ge, 0));
    cudaGraphNode_t rec, kk, wait;
    CHECK(cudaGraphAddEventRecordNode(&rec, ge, nullptr, 0, ev1));
    int *dp = d;
    void *kargs[] = {&dp, &v, &n};
    kp.kernelParams = kargs;
    CHECK(cudaGraphAddKernelNode(&kk, ge, &rec, 1, &kp));
    CHECK(cudaGraphAddEventWaitNode(&wait, ge, &kk, 1, ev3));
    cudaEvent_t got = nullptr;
    CHECK(cudaGraphEventRecordNodeGetEvent(rec, &got));
    EXPECT(got == ev1, "record node's event reads back as %p, not %p", (void *)got, (void *)ev1);
    CHECK(cudaGraphEventWaitNodeGetEvent(wait, &got));
    EXPECT(got == ev3, "wait node's event reads back as %p, not %p", (void *)got, (void *)ev3);
    CHECK_ERR(cudaGraphEventRecordNodeGetEvent(wait, &got), cudaErrorInvalidValue);
    CHECK(cudaGraphEventRecordNodeSetEvent(rec, ev2));
    CHECK(cudaGraphEventRecordNodeGetEvent(rec, &got));
    EXPECT(got == ev2, "record node's event after SetEvent reads back as %p", (void *)got);
    CHECK(cudaGraphEventWaitNodeSetEvent(wait, ev1));
    CHECK(cudaGraphEventWaitNodeGetEvent(wait, &got));
    EXPECT(got == ev1, "wait node's event after SetEvent reads back as %p", (void *)got);
    CHECK_ERR(cudaGraphEventRecordNodeSetEvent(kk, ev1), cudaErrorInvalidValue);
    cudaGraphExec_t ee;
    CHECK(cudaGraphInstantiate(&ee, ge, 0));
    // ev1 and ev2 have never been recorded: a graph recording ev2 makes ev2 complete.
    CHECK(cudaEventRecord(ev1, s));
    launch(ee, s);
    CHECK(cudaEventQuery(ev2));
    float ms_between = -1;
    CHECK(cudaEventElapsedTime(&ms_between, ev1, ev2));
    EXPECT(ms_between >= 0, "time from ev1 to the graph's ev2 is %f ms", ms_between);
    // The exec's record node now records ev1 instead: ev1 is recorded after ev2 is.
    CHECK(cudaGraphExecEventRecordNodeSetEvent(ee, rec, ev1));
    CHECK(cudaGraphExecEventWaitNodeSetEvent(ee, wait, ev3));
    CHECK(cudaEventRecord(ev2, s));
    launch(ee, s);
    CHECK(cudaEventElapsedTime(&ms_between, ev2, ev1));
    EXPECT(ms_between >= 0, "time from ev2 to the exec's ev1 is %f ms", ms_between);
    CHECK_ERR(cudaGraphExecEventRecordNodeSetEvent(ee, kk, ev1), cudaErrorInvalidValue);
    ok("event record and wait nodes: read back, set in the graph and in the exec, recorded in order");

    // ---- the generic node API ----
    cudaGraph_t gg;
    CHECK(cudaGraphCreate(&gg, 0));
    NodeParams hold_p;
    cudaGraphNodeParams &p = hold_p.p;
    memset_params(p, d2, 0x5a, BYTES);
    cudaGraphNode_t gms, gk, gback, ghost;
    CHECK(add_node(&gms, gg, nullptr, 0, &p));
    reset(p, cudaGraphNodeTypeKernel);
    int *dp2 = d2, v2 = 1;
    void *gargs[] = {&dp2, &v2, &n};
    p.kernel.func = (void *)add_k;
    p.kernel.gridDim = dim3((N + 255) / 256);
    p.kernel.blockDim = dim3(256);
    p.kernel.kernelParams = gargs;
    CHECK(add_node(&gk, gg, &gms, 1, &p));
    reset(p, cudaGraphNodeTypeMemcpy);
    p.memcpy.copyParams.srcPtr = make_cudaPitchedPtr(d2, BYTES, BYTES, 1);
    p.memcpy.copyParams.dstPtr = make_cudaPitchedPtr(out_b.data(), BYTES, BYTES, 1);
    p.memcpy.copyParams.extent = make_cudaExtent(BYTES, 1, 1);
    p.memcpy.copyParams.kind = cudaMemcpyDeviceToHost;
    CHECK(add_node(&gback, gg, &gk, 1, &p));
    HostLog log_c = {0, 0};
    reset(p, cudaGraphNodeTypeHost);
    p.host.fn = host_a;
    p.host.userData = &log_c;
    CHECK(add_node(&ghost, gg, &gback, 1, &p));
    cudaGraphNodeType t;
    CHECK(cudaGraphNodeGetType(gk, &t));
    EXPECT(t == cudaGraphNodeTypeKernel, "a kernel node added generically has type %d", (int)t);
    cudaGraphExec_t eg;
    CHECK(cudaGraphInstantiate(&eg, gg, 0));
    launch(eg, s);
    expect_all(out_b, 0x5a5a5a5b, "generic memset, kernel, memcpy");
    EXPECT(log_c.calls == 1, "generic host node ran %d times", log_c.calls);

#if CUDART_VERSION >= 13000
    NodeParams hold_q;
    cudaGraphNodeParams &q = hold_q.p;
    reset(q, cudaGraphNodeTypeMemset);
    CHECK(cudaGraphNodeGetParams(gms, &q));
    EXPECT(q.type == cudaGraphNodeTypeMemset && q.memset.value == 0x5a && q.memset.width == BYTES,
           "generic memset node reads back type %d value %#x width %zu", (int)q.type, q.memset.value, q.memset.width);
    reset(q, cudaGraphNodeTypeHost);
    CHECK(cudaGraphNodeGetParams(ghost, &q));
    EXPECT(q.type == cudaGraphNodeTypeHost && q.host.fn == host_a && q.host.userData == &log_c,
           "generic host node reads back wrong");
#endif
    memset_params(p, d2, 0x01, BYTES);
    CHECK(cudaGraphExecNodeSetParams(eg, gms, &p));
    launch(eg, s);
    expect_all(out_b, 0x01010102, "exec after cudaGraphExecNodeSetParams");
    p.type = cudaGraphNodeTypeHost;
    CHECK_ERR(cudaGraphExecNodeSetParams(eg, gms, &p), cudaErrorInvalidValue);
    memset_params(p, d2, 0x02, BYTES + 1);
    CHECK_ERR(cudaGraphNodeSetParams(gms, &p), cudaErrorInvalidValue);
    p.memset.width = BYTES;
    CHECK(cudaGraphNodeSetParams(gms, &p));
    reset(p, cudaGraphNodeTypeMemset);
    p.reserved0[1] = 1;
    cudaGraphNode_t never;
    CHECK_ERR(add_node(&never, gg, nullptr, 0, &p), cudaErrorInvalidValue);
    reset(p, (cudaGraphNodeType)0x7fff);
    CHECK_ERR(add_node(&never, gg, nullptr, 0, &p), cudaErrorInvalidValue);
    reset(p, cudaGraphNodeTypeConditional);
    CHECK_ERR(add_node(&never, gg, nullptr, 0, &p), cudaErrorNotSupported);
    launch(eg, s);
    expect_all(out_b, 0x01010102, "exec after its graph's node changed");
    cudaGraphExec_t eg2;
    CHECK(cudaGraphInstantiate(&eg2, gg, 0));
    launch(eg2, s);
    expect_all(out_b, 0x02020203, "new exec of the changed graph");
    ok("cudaGraphAddNode, cudaGraphNodeGetParams/SetParams and cudaGraphExecNodeSetParams");

    // ---- clones ----
    cudaGraph_t gc;
    CHECK(cudaGraphClone(&gc, gg));
    cudaGraphNode_t cms = nullptr, cghost = nullptr;
    CHECK(cudaGraphNodeFindInClone(&cms, gms, gc));
    CHECK(cudaGraphNodeFindInClone(&cghost, ghost, gc));
    EXPECT(cms != gms && cms != nullptr, "the clone's node is the original's");
    CHECK(cudaGraphNodeGetType(cms, &t));
    EXPECT(t == cudaGraphNodeTypeMemset, "the clone's memset node has type %d", (int)t);
    CHECK_ERR(cudaGraphNodeFindInClone(&cms, gms, gg), cudaErrorInvalidValue);
    CHECK_ERR(cudaGraphNodeFindInClone(&cms, stranger, gc), cudaErrorInvalidValue);
    CHECK(cudaGraphNodeFindInClone(&cms, gms, gc));
    mset.dst = d2;
    mset.value = 0x03;
    mset.elementSize = 1;
    mset.width = BYTES;
    mset.height = 1;
    CHECK(cudaGraphMemsetNodeSetParams(cms, &mset));
    cudaHostNodeParams hpc = {host_b, &log_c};
    CHECK(cudaGraphHostNodeSetParams(cghost, &hpc));
    cudaGraphExec_t ec;
    CHECK(cudaGraphInstantiate(&ec, gc, 0));
    launch(ec, s);
    expect_all(out_b, 0x03030304, "exec of the clone whose node changed");
    EXPECT(log_c.calls == 5 && log_c.last == 2, "clone's changed host node: %d calls, last %d", log_c.calls, log_c.last);
    CHECK(cudaGraphMemsetNodeGetParams(gms, &msp));
    EXPECT(msp.value == 0x02, "the original's memset node changed with its clone's: %#x", msp.value);
    ok("cudaGraphNodeFindInClone finds each node's copy; changing it leaves the original alone");

    // ---- upload and flags ----
    cudaGraphExec_t ef;
    CHECK(cudaGraphInstantiateWithFlags(&ef, gg, cudaGraphInstantiateFlagAutoFreeOnLaunch));
    unsigned long long flags = 99;
    CHECK(cudaGraphExecGetFlags(ef, &flags));
    EXPECT(flags == cudaGraphInstantiateFlagAutoFreeOnLaunch, "exec flags read back as %llu", flags);
    CHECK(cudaGraphExecGetFlags(e, &flags));
    EXPECT(flags == 0, "exec flags read back as %llu", flags);
    CHECK(cudaGraphUpload(ef, s));
    launch(ef, s);
    expect_all(out_b, 0x02020203, "uploaded exec");
    ok("cudaGraphExecGetFlags and cudaGraphUpload");

    for (cudaGraphExec_t x : {e, e2, em, ee, eg, eg2, ec, ef}) CHECK(cudaGraphExecDestroy(x));
    for (cudaGraph_t x : {g, gm, ge, gg, gc, other}) CHECK(cudaGraphDestroy(x));
    CHECK(cudaEventDestroy(ev1));
    CHECK(cudaEventDestroy(ev2));
    CHECK(cudaEventDestroy(ev3));
    CHECK(cudaStreamDestroy(s));
    CHECK(cudaFree(d));
    CHECK(cudaFree(d2));
    return test_end();
}
