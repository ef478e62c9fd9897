// CUDA graphs through stream capture: a captured sequence of copies, memsets
// and kernels replays with the data of each launch; work forked onto a second
// stream with events and joined back runs in the graph; exec updates and
// kernel node parameters change what a launch computes; host nodes run in
// order; calls that capture forbids fail and invalidate the capture, an
// unjoined fork fails cudaStreamEndCapture; relaxed mode allows them.
#include <cuda_runtime.h>
#include "check.h"

__global__ void scale(float *x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= a;
}

__global__ void add(float *y, const float *x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += x[i];
}

__global__ void fill(float *x, float v, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}

static const int N = 1024;

struct Seen {
    const float *host;
    float value;
    int calls;
};

static void CUDART_CB host_fn(void *p) {
    Seen *s = (Seen *)p;
    s->value = s->host[7];
    s->calls++;
}

static void CUDART_CB count_fn(void *p) { ++*(int *)p; }

static void captured_sequence(cudaStream_t s) {
    float *in = nullptr, *out = nullptr, *a = nullptr, *b = nullptr;
    in = (float *)malloc(N * sizeof(float));
    out = (float *)malloc(N * sizeof(float));
    CHECK(cudaMalloc(&a, N * sizeof(float)));
    CHECK(cudaMalloc(&b, N * sizeof(float)));

    cudaStreamCaptureStatus st;
    CHECK(cudaStreamIsCapturing(s, &st));
    EXPECT(st == cudaStreamCaptureStatusNone, "status %d before capture", (int)st);
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CHECK(cudaStreamIsCapturing(s, &st));
    EXPECT(st == cudaStreamCaptureStatusActive, "status %d during capture", (int)st);
    // b = 0; a = in; a *= 3; b += a (b == 3 in, as bytes 0 were set first); out = b
    CHECK(cudaMemsetAsync(b, 0, N * sizeof(float), s));
    CHECK(cudaMemcpyAsync(a, in, N * sizeof(float), cudaMemcpyHostToDevice, s));
    float k = 3.0f;
    int n = N;
    void *args[] = {&a, &k, &n};
    CHECK(cudaLaunchKernel((void *)scale, dim3(N / 256), dim3(256), args, 0, s));
    k = 100.0f;  // the node copied its parameters: changing them now changes nothing
    add<<<N / 256, 256, 0, s>>>(b, a, N);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpyAsync(out, b, N * sizeof(float), cudaMemcpyDeviceToHost, s));
    cudaGraph_t g = nullptr;
    CHECK(cudaStreamEndCapture(s, &g));
    EXPECT(g != nullptr, "no graph from cudaStreamEndCapture");
    CHECK(cudaStreamIsCapturing(s, &st));
    EXPECT(st == cudaStreamCaptureStatusNone, "status %d after capture", (int)st);
    size_t nodes = 0;
    CHECK(cudaGraphGetNodes(g, nullptr, &nodes));
    EXPECT(nodes == 5, "captured %zu nodes, expected 5", nodes);
    ok("capture: memset, HtoD, two kernels and DtoH became 5 nodes and did not run");

    cudaGraphExec_t x = nullptr;
    CHECK(cudaGraphInstantiate(&x, g, 0));
    for (int round = 1; round <= 3; round++) {
        for (int i = 0; i < N; i++) in[i] = (float)(i * round);
        memset(out, 0, N * sizeof(float));
        CHECK(cudaGraphLaunch(x, s));
        CHECK(cudaStreamSynchronize(s));
        for (int i = 0; i < N; i++) EXPECT(out[i] == 3.0f * i * round, "round %d: out[%d] = %f", round, i, out[i]);
    }
    ok("the instantiated graph replays three times with each launch's host data");

    // A second graph of the same shape with another scale: cudaGraphExecUpdate takes it.
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CHECK(cudaMemsetAsync(b, 0, N * sizeof(float), s));
    CHECK(cudaMemcpyAsync(a, in, N * sizeof(float), cudaMemcpyHostToDevice, s));
    scale<<<N / 256, 256, 0, s>>>(a, 5.0f, N);
    add<<<N / 256, 256, 0, s>>>(b, a, N);
    CHECK(cudaMemcpyAsync(out, b, N * sizeof(float), cudaMemcpyDeviceToHost, s));
    cudaGraph_t g2 = nullptr;
    CHECK(cudaStreamEndCapture(s, &g2));
    cudaGraphExecUpdateResultInfo info;
    CHECK(cudaGraphExecUpdate(x, g2, &info));
    EXPECT(info.result == cudaGraphExecUpdateSuccess, "update result %d", (int)info.result);
    for (int i = 0; i < N; i++) in[i] = 1.0f;
    CHECK(cudaGraphLaunch(x, s));
    CHECK(cudaStreamSynchronize(s));
    for (int i = 0; i < N; i++) EXPECT(out[i] == 5.0f, "after the update out[%d] = %f", i, out[i]);
    ok("cudaGraphExecUpdate: the launch scales by the new graph's 5");

    // The scale kernel node of the instantiated graph g, found by type, gets a new scale
    // on the exec only; it reads 3, as captured (the 100 written after the launch is not seen).
    cudaGraphNode_t list[8];
    size_t count = 8;
    CHECK(cudaGraphGetNodes(g, list, &count));
    cudaGraphNode_t scale_node = nullptr;
    for (size_t i = 0; i < count; i++) {
        cudaGraphNodeType t;
        CHECK(cudaGraphNodeGetType(list[i], &t));
        if (t != cudaGraphNodeTypeKernel) continue;
        cudaKernelNodeParams p;
        CHECK(cudaGraphKernelNodeGetParams(list[i], &p));
        if (p.func == (void *)scale) scale_node = list[i];
    }
    EXPECT(scale_node != nullptr, "no scale kernel node among %zu nodes", count);
    cudaKernelNodeParams p;
    CHECK(cudaGraphKernelNodeGetParams(scale_node, &p));
    EXPECT(*(float *)p.kernelParams[1] == 3.0f, "the node's scale reads %f", *(float *)p.kernelParams[1]);
    float seven = 7.0f;
    void *args7[] = {&a, &seven, &n};
    p.kernelParams = args7;
    CHECK(cudaGraphExecKernelNodeSetParams(x, scale_node, &p));
    CHECK(cudaGraphLaunch(x, s));
    CHECK(cudaStreamSynchronize(s));
    for (int i = 0; i < N; i++) EXPECT(out[i] == 7.0f, "after the node update out[%d] = %f", i, out[i]);
    ok("cudaGraphExecKernelNodeSetParams: the launch scales by 7");

    CHECK(cudaGraphExecDestroy(x));
    CHECK(cudaGraphDestroy(g));
    CHECK(cudaGraphDestroy(g2));
    CHECK(cudaFree(a));
    CHECK(cudaFree(b));
    free(in);
    free(out);
}

static void fork_join(cudaStream_t s1, cudaStream_t s2) {
    float *a = nullptr, *b = nullptr, *h = nullptr;
    CHECK(cudaMalloc(&a, N * sizeof(float)));
    CHECK(cudaMalloc(&b, N * sizeof(float)));
    CHECK(cudaMallocHost(&h, N * sizeof(float)));
    cudaEvent_t fork, join;
    CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));

    CHECK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
    fill<<<N / 256, 256, 0, s1>>>(a, 2.0f, N);
    CHECK(cudaEventRecord(fork, s1));
    CHECK(cudaStreamWaitEvent(s2, fork, 0));
    cudaStreamCaptureStatus st;
    unsigned long long id1 = 0, id2 = 0;
#if CUDART_VERSION >= 13000
    CHECK(cudaStreamGetCaptureInfo(s1, &st, &id1, nullptr, nullptr, nullptr, nullptr));
    CHECK(cudaStreamGetCaptureInfo(s2, &st, &id2, nullptr, nullptr, nullptr, nullptr));
#else
    CHECK(cudaStreamGetCaptureInfo(s1, &st, &id1, nullptr, nullptr, nullptr));
    CHECK(cudaStreamGetCaptureInfo(s2, &st, &id2, nullptr, nullptr, nullptr));
#endif
    EXPECT(st == cudaStreamCaptureStatusActive && id1 == id2 && id1 != 0,
           "the forked stream: status %d, capture %llu vs %llu", (int)st, id2, id1);
    fill<<<N / 256, 256, 0, s2>>>(b, 5.0f, N);   // on the fork
    scale<<<N / 256, 256, 0, s1>>>(a, 3.0f, N);  // meanwhile on the origin
    CHECK(cudaEventRecord(join, s2));
    CHECK(cudaStreamWaitEvent(s1, join, 0));
    add<<<N / 256, 256, 0, s1>>>(a, b, N);  // needs both branches
    CHECK(cudaMemcpyAsync(h, a, N * sizeof(float), cudaMemcpyDeviceToHost, s1));
    cudaGraph_t g = nullptr;
    CHECK(cudaStreamEndCapture(s1, &g));
    CHECK(cudaStreamIsCapturing(s2, &st));
    EXPECT(st == cudaStreamCaptureStatusNone, "the joined stream still captures (%d)", (int)st);
    size_t edges = 0;
#if CUDART_VERSION >= 13000
    CHECK(cudaGraphGetEdges(g, nullptr, nullptr, nullptr, &edges));
#else
    CHECK(cudaGraphGetEdges(g, nullptr, nullptr, &edges));
#endif
    EXPECT(edges == 5, "%zu edges, expected fill->fill, fill->scale, scale->add, fill->add, add->copy", edges);
    ok("fork/join capture across two streams: one capture id, the fork left capture with the origin");

    cudaGraphExec_t x = nullptr;
    CHECK(cudaGraphInstantiate(&x, g, 0));
    memset(h, 0, N * sizeof(float));
    CHECK(cudaGraphLaunch(x, s1));
    CHECK(cudaStreamSynchronize(s1));
    for (int i = 0; i < N; i++) EXPECT(h[i] == 11.0f, "h[%d] = %f, expected 2*3+5", i, h[i]);
    ok("the fork/join graph computes 2*3+5 into pinned memory");

    CHECK(cudaGraphExecDestroy(x));
    CHECK(cudaGraphDestroy(g));
    CHECK(cudaEventDestroy(fork));
    CHECK(cudaEventDestroy(join));
    CHECK(cudaFree(a));
    CHECK(cudaFree(b));
    CHECK(cudaFreeHost(h));
}

static void host_nodes(cudaStream_t s) {
    float *d = nullptr;
    float *h1 = (float *)malloc(N * sizeof(float));
    float *h2 = (float *)malloc(N * sizeof(float));
    CHECK(cudaMalloc(&d, N * sizeof(float)));
    Seen seen = {h1, 0, 0};
    int launched = 0;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    fill<<<N / 256, 256, 0, s>>>(d, 4.0f, N);
    CHECK(cudaMemcpyAsync(h1, d, N * sizeof(float), cudaMemcpyDeviceToHost, s));
    CHECK(cudaLaunchHostFunc(s, host_fn, &seen));
    fill<<<N / 256, 256, 0, s>>>(d, 9.0f, N);
    CHECK(cudaMemcpyAsync(h2, d, N * sizeof(float), cudaMemcpyDeviceToHost, s));
    CHECK(cudaLaunchHostFunc(s, count_fn, &launched));
    cudaGraph_t g = nullptr;
    CHECK(cudaStreamEndCapture(s, &g));
    EXPECT(seen.calls == 0 && launched == 0, "a captured host function ran during capture");
    cudaGraphExec_t x = nullptr;
    CHECK(cudaGraphInstantiateWithFlags(&x, g, 0));
    for (int k = 1; k <= 2; k++) {
        memset(h1, 0, N * sizeof(float));
        memset(h2, 0, N * sizeof(float));
        CHECK(cudaGraphLaunch(x, s));
        CHECK(cudaStreamSynchronize(s));
        EXPECT(seen.calls == k && launched == k, "launch %d: host nodes ran %d and %d times", k, seen.calls, launched);
        EXPECT(seen.value == 4.0f, "the host node saw %f, expected the copy before it (4)", seen.value);
        EXPECT(h2[N - 1] == 9.0f, "the copy after the host node read %f", h2[N - 1]);
    }
    ok("host nodes run once per launch, after the copy before them, before the work after them");
    CHECK(cudaGraphExecDestroy(x));
    CHECK(cudaGraphDestroy(g));
    CHECK(cudaFree(d));
    free(h1);
    free(h2);
}

static void update_dependencies(cudaStream_t s) {
    float *d = nullptr, h[N];
    CHECK(cudaMalloc(&d, N * sizeof(float)));
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
    fill<<<N / 256, 256, 0, s>>>(d, 1.0f, N);
    cudaStreamCaptureStatus st;
    cudaGraph_t cg = nullptr;
    const cudaGraphNode_t *deps = nullptr;
    size_t ndeps = 0;
#if CUDART_VERSION >= 13000
    CHECK(cudaStreamGetCaptureInfo(s, &st, nullptr, &cg, &deps, nullptr, &ndeps));
#else
    CHECK(cudaStreamGetCaptureInfo(s, &st, nullptr, &cg, &deps, &ndeps));
#endif
    EXPECT(st == cudaStreamCaptureStatusActive && cg != nullptr && ndeps == 1, "capture info: %d, %zu deps", (int)st, ndeps);
    // Added by hand after the captured fill, then made the stream's next dependency.
    cudaGraphNode_t m;
    cudaMemsetParams mp = {};
    mp.dst = d;
    mp.value = 0x40000000;  // 2.0f
    mp.elementSize = 4;
    mp.width = N;
    mp.height = 1;
    CHECK(cudaGraphAddMemsetNode(&m, cg, deps, ndeps, &mp));
#if CUDART_VERSION >= 13000
    CHECK(cudaStreamUpdateCaptureDependencies(s, &m, nullptr, 1, cudaStreamSetCaptureDependencies));
#else
    CHECK(cudaStreamUpdateCaptureDependencies(s, &m, 1, cudaStreamSetCaptureDependencies));
#endif
    scale<<<N / 256, 256, 0, s>>>(d, 3.0f, N);
    cudaGraph_t g = nullptr;
    CHECK(cudaStreamEndCapture(s, &g));
    EXPECT(g == cg, "the ended capture's graph is not the one cudaStreamGetCaptureInfo named");
    cudaGraphExec_t x = nullptr;
    CHECK(cudaGraphInstantiate(&x, g, 0));
    CHECK(cudaGraphLaunch(x, s));
    CHECK(cudaMemcpyAsync(h, d, sizeof h, cudaMemcpyDeviceToHost, s));
    CHECK(cudaStreamSynchronize(s));
    for (int i = 0; i < N; i++) EXPECT(h[i] == 6.0f, "h[%d] = %f, expected (memset 2) * 3", i, h[i]);
    ok("cudaStreamGetCaptureInfo + a node added by hand + cudaStreamUpdateCaptureDependencies");
    CHECK(cudaGraphExecDestroy(x));
    CHECK(cudaGraphDestroy(g));
    CHECK(cudaFree(d));
}

static void forbidden_calls(cudaStream_t s1, cudaStream_t s2) {
    float *d = nullptr, h[4];
    CHECK(cudaMalloc(&d, N * sizeof(float)));
    cudaGraph_t g = nullptr;

    CHECK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
    fill<<<1, 4, 0, s1>>>(d, 1.0f, 4);
    cudaError_t e = cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost);
    EXPECT(e == cudaErrorStreamCaptureUnsupported, "a synchronous cudaMemcpy in global capture: %s", cudaGetErrorName(e));
    cudaStreamCaptureStatus st;
    CHECK(cudaStreamIsCapturing(s1, &st));
    EXPECT(st == cudaStreamCaptureStatusInvalidated, "status %d after the forbidden call", (int)st);
    e = cudaStreamEndCapture(s1, &g);
    EXPECT(e == cudaErrorStreamCaptureInvalidated && g == nullptr, "end of an invalidated capture: %s", cudaGetErrorName(e));
    (void)cudaGetLastError();
    ok("a synchronous cudaMemcpy during global capture fails and invalidates the capture");

    CHECK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
    e = cudaStreamSynchronize(s1);
    EXPECT(e == cudaErrorStreamCaptureUnsupported, "cudaStreamSynchronize of a capturing stream: %s", cudaGetErrorName(e));
    e = cudaStreamEndCapture(s1, &g);
    EXPECT(e == cudaErrorStreamCaptureInvalidated, "end after cudaStreamSynchronize: %s", cudaGetErrorName(e));
    (void)cudaGetLastError();
    ok("cudaStreamSynchronize of a capturing stream fails and invalidates the capture");

    CHECK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
    float *p = nullptr;
    e = cudaMalloc(&p, 256);
    EXPECT(e == cudaErrorStreamCaptureUnsupported, "cudaMalloc in global capture: %s", cudaGetErrorName(e));
    e = cudaStreamEndCapture(s1, &g);
    EXPECT(e == cudaErrorStreamCaptureInvalidated, "end after cudaMalloc: %s", cudaGetErrorName(e));
    (void)cudaGetLastError();
    ok("cudaMalloc during global capture fails and invalidates the capture");

    // The thread's own relaxed mode allows it during a global capture.
    CHECK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    EXPECT(mode == cudaStreamCaptureModeGlobal, "the thread's mode was %d", (int)mode);
    CHECK(cudaMalloc(&p, 256));
    CHECK(cudaFree(p));
    CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    fill<<<1, 4, 0, s1>>>(d, 1.0f, 4);
    CHECK(cudaStreamEndCapture(s1, &g));
    CHECK(cudaGraphDestroy(g));
    // And a capture begun relaxed does not forbid it.
    CHECK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeRelaxed));
    CHECK(cudaMalloc(&p, 256));
    CHECK(cudaFree(p));
    CHECK(cudaStreamEndCapture(s1, &g));
    CHECK(cudaGraphDestroy(g));
    ok("relaxed mode (the thread's, or the capture's) allows cudaMalloc during capture");

    cudaEvent_t fork;
    CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    CHECK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
    fill<<<1, 4, 0, s1>>>(d, 1.0f, 4);
    CHECK(cudaEventRecord(fork, s1));
    CHECK(cudaStreamWaitEvent(s2, fork, 0));
    fill<<<1, 4, 0, s2>>>(d + 4, 1.0f, 4);
    e = cudaStreamEndCapture(s1, &g);
    EXPECT(e == cudaErrorStreamCaptureUnjoined && g == nullptr, "end with an unjoined fork: %s", cudaGetErrorName(e));
    (void)cudaGetLastError();
    CHECK(cudaStreamIsCapturing(s2, &st));
    EXPECT(st == cudaStreamCaptureStatusNone, "the fork still captures after the failed end (%d)", (int)st);
    ok("a fork not joined back fails cudaStreamEndCapture with cudaErrorStreamCaptureUnjoined");

    // An event recorded during a capture cannot be queried; waiting for an event recorded
    // outside it, without cudaEventWaitExternal, is invalid.
    CHECK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
    CHECK(cudaEventRecord(fork, s1));
    e = cudaEventQuery(fork);
    EXPECT(e == cudaErrorCapturedEvent, "cudaEventQuery of a captured event: %s", cudaGetErrorName(e));
    g = nullptr;
    (void)cudaStreamEndCapture(s1, &g);
    if (g) CHECK(cudaGraphDestroy(g));
    (void)cudaGetLastError();
    CHECK(cudaEventRecord(fork, s2));
    CHECK(cudaStreamSynchronize(s2));
    CHECK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
    e = cudaStreamWaitEvent(s1, fork, 0);
    EXPECT(e != cudaSuccess, "a capturing stream waited for an event recorded outside the capture");
    e = cudaStreamEndCapture(s1, &g);
    EXPECT(e == cudaErrorStreamCaptureInvalidated, "end after the isolation error: %s", cudaGetErrorName(e));
    (void)cudaGetLastError();
    ok("a captured event cannot be queried; an outside event cannot be waited for in capture");

    e = cudaStreamEndCapture(s1, &g);
    // cuda.h names INVALID_VALUE; drivers answer ILLEGAL_STATE: either says no capture.
    EXPECT(e == cudaErrorIllegalState || e == cudaErrorInvalidValue, "ending a capture that is not there: %s",
           cudaGetErrorName(e));
    (void)cudaGetLastError();
    e = cudaStreamBeginCapture(0, cudaStreamCaptureModeGlobal);
    EXPECT(e == cudaErrorStreamCaptureUnsupported, "capturing the legacy stream: %s", cudaGetErrorName(e));
    (void)cudaGetLastError();
    ok("ending no capture and capturing the legacy stream are refused");

    // Nothing of the failed captures ran or stays broken.
    CHECK(cudaMemset(d, 0, N * sizeof(float)));
    CHECK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
    EXPECT(h[0] == 0.0f, "d[0] = %f", h[0]);
    CHECK(cudaEventDestroy(fork));
    CHECK(cudaFree(d));
}

static void graph_memory(cudaStream_t s) {
    float h[N];
    float *t = nullptr, *o = nullptr;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CHECK(cudaMallocAsync(&t, N * sizeof(float), s));  // freed inside the graph
    CHECK(cudaMallocAsync(&o, N * sizeof(float), s));  // left to the program
    fill<<<N / 256, 256, 0, s>>>(t, 2.0f, N);
    CHECK(cudaMemsetAsync(o, 0, N * sizeof(float), s));
    add<<<N / 256, 256, 0, s>>>(o, t, N);
    CHECK(cudaFreeAsync(t, s));
    cudaGraph_t g = nullptr;
    CHECK(cudaStreamEndCapture(s, &g));
    cudaGraphNode_t list[16];
    size_t count = 16;
    CHECK(cudaGraphGetNodes(g, list, &count));
    int allocs = 0, frees = 0;
    for (size_t i = 0; i < count; i++) {
        cudaGraphNodeType t_;
        CHECK(cudaGraphNodeGetType(list[i], &t_));
        allocs += t_ == cudaGraphNodeTypeMemAlloc;
        frees += t_ == cudaGraphNodeTypeMemFree;
    }
    EXPECT(allocs == 2 && frees == 1, "%d allocation and %d free nodes", allocs, frees);
    cudaGraphExec_t x = nullptr;
    CHECK(cudaGraphInstantiateWithFlags(&x, g, 0));
    cudaGraphExec_t x2 = nullptr;
    cudaError_t e = cudaGraphInstantiateWithFlags(&x2, g, 0);
    EXPECT(e != cudaSuccess, "a second exec of a graph with memory nodes shares its memory");
    (void)cudaGetLastError();
    for (int k = 0; k < 2; k++) {
        CHECK(cudaGraphLaunch(x, s));
        CHECK(cudaStreamSynchronize(s));
        CHECK(cudaMemcpy(h, o, sizeof h, cudaMemcpyDeviceToHost));
        for (int i = 0; i < N; i++) EXPECT(h[i] == 2.0f, "launch %d: o[%d] = %f", k, i, h[i]);
        if (k == 0) {
            e = cudaGraphLaunch(x, s);
            EXPECT(e != cudaSuccess, "relaunched while the last launch's allocation was not freed");
            (void)cudaGetLastError();
            CHECK(cudaFreeAsync(o, s));
        }
    }
    CHECK(cudaFree(o));
    e = cudaFree(o);
    EXPECT(e != cudaSuccess, "graph memory freed twice");
    (void)cudaGetLastError();
    ok("cudaMallocAsync/cudaFreeAsync in capture: graph memory nodes, the output freed by the program between launches");
    // The last launch's output outlives the graph and its exec, as in CUDA.
    CHECK(cudaGraphLaunch(x, s));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaGraphExecDestroy(x));
    CHECK(cudaGraphDestroy(g));
    float *other = nullptr;
    CHECK(cudaMalloc(&other, N * sizeof(float)));
    CHECK(cudaMemset(other, 0, N * sizeof(float)));
    CHECK(cudaMemcpy(h, o, sizeof h, cudaMemcpyDeviceToHost));
    for (int i = 0; i < N; i++) EXPECT(h[i] == 2.0f, "after the graph's end o[%d] = %f", i, h[i]);
    CHECK(cudaFree(o));
    CHECK(cudaFree(other));
    ok("an allocation a launch left to the program outlives the graph and is freed by cudaFree");
}

int main() {
    test_begin("rt_graph");
    cudaStream_t s1, s2;
    CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    captured_sequence(s1);
    fork_join(s1, s2);
    host_nodes(s1);
    update_dependencies(s1);
    graph_memory(s1);
    forbidden_calls(s1, s2);
    CHECK(cudaStreamDestroy(s1));
    CHECK(cudaStreamDestroy(s2));
    return test_end();
}
