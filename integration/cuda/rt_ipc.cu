// CUDA IPC between two processes through rgpu: the parent exports an
// allocation, a child process (this program again, spawned with --child)
// opens the handle, checks and changes the bytes with a copy and a kernel,
// and the parent sees the change. Then the memory outlives its exporter: the
// parent frees an allocation the child holds open and allocates again, and
// the child's bytes must be intact; the freed allocation's handle opens
// nothing more. Forged, foreign and misused handles get errors, never memory.
// With RGPU_IPC_FOREIGN_TOKEN set (another lease's token on the same GPU), a
// child run on that token must be refused the handle: IPC stays in one lease.
// Part 3, events: an interprocess event recorded in one process orders the
// other's stream (cudaStreamWaitEvent) and cudaEventSynchronize, both ways.
#include <cuda_runtime.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <string>
#include <vector>
#include "check.h"

extern char **environ;

__global__ void invert(unsigned char *p, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) p[i] = (unsigned char)~p[i];
}

static const size_t N = 1 << 20;

// Spins long enough (tens of milliseconds on the sim) that a wait which does
// not wait would be seen, then writes v.
__global__ void spin_then_set(int *p, int v, unsigned iters) {
    volatile unsigned x = 0;
    for (unsigned i = 0; i < iters; i++) x = x + i;
    *p = v + (int)(x & 0);
}

__global__ void copy_int(const int *from, int *to) { *to = *from; }

static const unsigned SPIN = 200000;

template <typename H> static void to_hex(const H &h, char *out) {
    const unsigned char *b = (const unsigned char *)&h;
    for (size_t i = 0; i < sizeof h; i++) sprintf(out + 2 * i, "%02x", b[i]);
}

template <typename H = cudaIpcMemHandle_t> static H from_hex(const char *s) {
    H h;
    unsigned char *b = (unsigned char *)&h;
    EXPECT(strlen(s) == 2 * sizeof h, "a handle of %zu hex digits", strlen(s));
    for (size_t i = 0; i < sizeof h; i++) sscanf(s + 2 * i, "%2hhx", &b[i]);
    return h;
}

static const char *arg_str(int argc, char **argv, const char *name) {
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0) return argv[i + 1];
    return nullptr;
}

static pid_t spawn(char **argv0, std::vector<const char *> args, char **env = environ) {
    args.insert(args.begin(), argv0[0]);
    args.push_back(nullptr);
    pid_t pid;
    int e = posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, (char *const *)args.data(), env);
    EXPECT(e == 0, "posix_spawn: %s", strerror(e));
    return pid;
}

static void wait_ok(pid_t pid, const char *what) {
    int status = 0;
    EXPECT(waitpid(pid, &status, 0) == pid, "waitpid");
    EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0, "%s: child exited with status %d", what, status);
}

// The child of part 1: open, check, invert by copy and by kernel, misuse, close.
static int child_open(const char *hex) {
    cudaIpcMemHandle_t h = from_hex(hex);
    void *p = nullptr;
    CHECK(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
    std::vector<unsigned char> buf(N);
    CHECK(cudaMemcpy(buf.data(), p, N, cudaMemcpyDeviceToHost));
    long long bad = check_pattern(buf.data(), N, 1);
    EXPECT(bad < 0, "the exporter's bytes at byte %lld", bad);
    ok("child: opened the handle and read the exporter's bytes");

    void *again = nullptr;
    CHECK(cudaIpcOpenMemHandle(&again, h, cudaIpcMemLazyEnablePeerAccess));
    EXPECT(again == p, "the same pointer for a second open (%p, %p)", again, p);
    CHECK(cudaIpcCloseMemHandle(again));
    ok("child: a second open gives the same pointer, closed once");

    // First half inverted by a kernel, second half by host copies.
    invert<<<(N / 2 + 255) / 256, 256>>>((unsigned char *)p, N / 2);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    for (size_t i = N / 2; i < N; i++) buf[i] = (unsigned char)~buf[i];
    CHECK(cudaMemcpy((char *)p + N / 2, buf.data() + N / 2, N / 2, cudaMemcpyHostToDevice));
    ok("child: inverted the bytes with a kernel and a copy");

    cudaError_t e = cudaFree(p);
    EXPECT(e != cudaSuccess, "cudaFree of opened memory fails");
    cudaGetLastError();
    cudaIpcMemHandle_t forged = h;
    ((unsigned char *)&forged)[40] ^= 0x5a;
    void *q = nullptr;
    e = cudaIpcOpenMemHandle(&q, forged, cudaIpcMemLazyEnablePeerAccess);
    EXPECT(e != cudaSuccess, "a handle with a changed secret opens nothing");
    cudaGetLastError();
    cudaIpcMemHandle_t junk;
    memset(&junk, 0x42, sizeof junk);
    e = cudaIpcOpenMemHandle(&q, junk, cudaIpcMemLazyEnablePeerAccess);
    EXPECT(e != cudaSuccess, "bytes that are no handle open nothing");
    cudaGetLastError();
    ok("child: cudaFree of opened memory, a forged and a foreign handle all fail (%s)", cudaGetErrorName(e));

    CHECK(cudaIpcCloseMemHandle(p));
    e = cudaIpcCloseMemHandle(p);
    EXPECT(e != cudaSuccess, "a second close of a handle opened once more fails");
    cudaGetLastError();
    ok("child: closed");
    return test_end();
}

// The child of part 2: open, tell the parent, wait while it frees and reuses
// memory, then check the bytes it holds; the freed allocation's handle is gone.
static int child_hold(const char *hex, int to_parent, int from_parent) {
    cudaIpcMemHandle_t h = from_hex(hex);
    void *p = nullptr;
    CHECK(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
    char c = 'o';
    EXPECT(write(to_parent, &c, 1) == 1, "told the parent");
    EXPECT(read(from_parent, &c, 1) == 1 && c == 'f', "the parent freed its allocation");
    std::vector<unsigned char> buf(N);
    CHECK(cudaMemcpy(buf.data(), p, N, cudaMemcpyDeviceToHost));
    long long bad = check_pattern(buf.data(), N, 2);
    EXPECT(bad < 0, "bytes held open after the exporter freed them, at byte %lld", bad);
    ok("child: the bytes it holds survived the exporter's free and new allocations");
    void *q = nullptr;
    cudaError_t e = cudaIpcOpenMemHandle(&q, h, cudaIpcMemLazyEnablePeerAccess);
    if (e == cudaSuccess) {
        // Opened before in this process: CUDA counts it; the memory is still this one.
        EXPECT(q == p, "a reopen in the holding process gives its pointer");
        CHECK(cudaIpcCloseMemHandle(q));
    }
    cudaGetLastError();
    CHECK(cudaIpcCloseMemHandle(p));
    ok("child: closed");
    return test_end();
}

// The child run on another lease's token: the handle must open nothing.
static int child_foreign(const char *hex) {
    cudaIpcMemHandle_t h = from_hex(hex);
    void *p = nullptr;
    cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    EXPECT(e != cudaSuccess, "another lease's process opened the handle (at %p)", p);
    ok("foreign child: another lease's handle is refused (%s)", cudaGetErrorName(e));
    return test_end();
}

// The child of part 3: opens the event and the memory; its kernel's end,
// recorded in the event, must order the parent's stream; then it waits in
// cudaEventSynchronize for the parent's record.
static int child_event(const char *evhex, const char *memhex, int to_parent, int from_parent) {
    cudaEvent_t ev;
    CHECK(cudaIpcOpenEventHandle(&ev, from_hex<cudaIpcEventHandle_t>(evhex)));
    int *p = nullptr;
    CHECK(cudaIpcOpenMemHandle((void **)&p, from_hex(memhex), cudaIpcMemLazyEnablePeerAccess));
    ok("child: opened the event and the memory");
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    spin_then_set<<<1, 1, 0, s>>>(p, 42, SPIN);
    CHECK(cudaGetLastError());
    CHECK(cudaEventRecord(ev, s));
    char c = 'r';
    EXPECT(write(to_parent, &c, 1) == 1, "told the parent");
    EXPECT(read(from_parent, &c, 1) == 1 && c == 'q', "the parent recorded the event");
    CHECK(cudaEventSynchronize(ev));
    CHECK(cudaEventQuery(ev));
    int got[2] = {0, 0};
    CHECK(cudaMemcpy(got, p, sizeof got, cudaMemcpyDeviceToHost));
    EXPECT(got[1] == 43, "after the parent's record the parent's kernel had written 43, read %d", got[1]);
    ok("child: cudaEventSynchronize waited for the parent's record");
    float ms = 0;
    cudaError_t e = cudaEventElapsedTime(&ms, ev, ev);
    EXPECT(e != cudaSuccess, "an interprocess event is not timed");
    cudaGetLastError();
    CHECK(cudaEventDestroy(ev));
    CHECK(cudaStreamDestroy(s));
    CHECK(cudaIpcCloseMemHandle(p));
    return test_end();
}

// The child run on another lease's token, for part 3: the event handle must open nothing.
static int child_foreign_event(const char *hex) {
    cudaEvent_t ev;
    cudaError_t e = cudaIpcOpenEventHandle(&ev, from_hex<cudaIpcEventHandle_t>(hex));
    EXPECT(e != cudaSuccess, "another lease's process opened the event handle");
    ok("foreign child: another lease's event handle is refused (%s)", cudaGetErrorName(e));
    return test_end();
}

// This process's environment with RGPU_TOKEN replaced by `token`.
static std::vector<char *> env_with_token(const char *token, std::string &slot) {
    std::vector<char *> env;
    for (char **e = environ; *e; e++)
        if (strncmp(*e, "RGPU_TOKEN=", 11) != 0) env.push_back(*e);
    slot = std::string("RGPU_TOKEN=") + token;
    env.push_back((char *)slot.c_str());
    env.push_back(nullptr);
    return env;
}

int main(int argc, char **argv) {
    if (const char *hex = arg_str(argc, argv, "--foreign")) {
        test_begin("rt_ipc foreign");
        return child_foreign(hex);
    }
    if (const char *hex = arg_str(argc, argv, "--child")) {
        test_begin("rt_ipc child");
        return child_open(hex);
    }
    if (const char *hex = arg_str(argc, argv, "--foreign-event")) {
        test_begin("rt_ipc foreign event");
        return child_foreign_event(hex);
    }
    if (const char *hex = arg_str(argc, argv, "--event")) {
        test_begin("rt_ipc event child");
        return child_event(hex, arg_str(argc, argv, "--memory"), (int)arg_ll(argc, argv, "--to", -1),
                           (int)arg_ll(argc, argv, "--from", -1));
    }
    if (const char *hex = arg_str(argc, argv, "--hold")) {
        test_begin("rt_ipc holder");
        return child_hold(hex, (int)arg_ll(argc, argv, "--to", -1), (int)arg_ll(argc, argv, "--from", -1));
    }
    test_begin("rt_ipc");
    std::vector<unsigned char> h(N), back(N);
    fill_pattern(h.data(), N, 1);
    unsigned char *d = nullptr;
    CHECK(cudaMalloc(&d, N));
    CHECK(cudaMemcpy(d, h.data(), N, cudaMemcpyHostToDevice));

    cudaIpcMemHandle_t handle, again, inner;
    CHECK(cudaIpcGetMemHandle(&handle, d));
    CHECK(cudaIpcGetMemHandle(&again, d));
    CHECK(cudaIpcGetMemHandle(&inner, d + 4096));
    EXPECT(memcmp(&handle, &again, sizeof handle) == 0, "the same handle each time");
    EXPECT(memcmp(&handle, &inner, sizeof handle) == 0, "an address inside names the whole allocation");
    ok("exported an allocation");

    void *self = nullptr;
    cudaError_t e = cudaIpcOpenMemHandle(&self, handle, cudaIpcMemLazyEnablePeerAccess);
    EXPECT(e != cudaSuccess, "the exporting process cannot open its own handle");
    cudaGetLastError();
    ok("opening in the exporting process fails (%s)", cudaGetErrorName(e));

    char hex[2 * sizeof(cudaIpcMemHandle_t) + 1];
    to_hex(handle, hex);
    wait_ok(spawn(argv, {"--child", hex}), "opener");
    CHECK(cudaMemcpy(back.data(), d, N, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < N; i++)
        EXPECT(back[i] == (unsigned char)~h[i], "the child's change at byte %zu (%02x, not %02x)", i, back[i], (unsigned char)~h[i]);
    ok("the exporter sees what the other process wrote");

    if (const char *other = getenv("RGPU_IPC_FOREIGN_TOKEN")) {
        std::string slot;
        std::vector<char *> env = env_with_token(other, slot);
        wait_ok(spawn(argv, {"--foreign", hex}, env.data()), "foreign opener");
        CHECK(cudaMemcpy(back.data(), d, N, cudaMemcpyDeviceToHost));
        EXPECT(back[0] == (unsigned char)~h[0], "the memory is unchanged");
        ok("a process of another lease cannot open the handle");
    }

    // Part 2: an allocation freed while another process holds it open.
    unsigned char *e2 = nullptr;
    CHECK(cudaMalloc(&e2, N));
    fill_pattern(h.data(), N, 2);
    CHECK(cudaMemcpy(e2, h.data(), N, cudaMemcpyHostToDevice));
    cudaIpcMemHandle_t held;
    CHECK(cudaIpcGetMemHandle(&held, e2));
    to_hex(held, hex);
    int up[2], down[2];
    EXPECT(pipe(up) == 0 && pipe(down) == 0, "pipes");
    char to[16], from[16];
    snprintf(to, sizeof to, "%d", up[1]);
    snprintf(from, sizeof from, "%d", down[0]);
    pid_t holder = spawn(argv, {"--hold", hex, "--to", to, "--from", from});
    char c = 0;
    EXPECT(read(up[0], &c, 1) == 1 && c == 'o', "the holder opened the handle");
    CHECK(cudaFree(e2));
    std::vector<unsigned char *> fresh(4);
    fill_pattern(h.data(), N, 3);
    for (auto &f : fresh) {
        CHECK(cudaMalloc(&f, N));
        EXPECT(f != e2, "memory another process holds is not allocated again");
        CHECK(cudaMemcpy(f, h.data(), N, cudaMemcpyHostToDevice));
    }
    c = 'f';
    EXPECT(write(down[1], &c, 1) == 1, "told the holder");
    wait_ok(holder, "holder");
    ok("freed while held: the holder kept its bytes");
    for (auto f : fresh) CHECK(cudaFree(f));

    // Part 3: an interprocess event.
    cudaEvent_t ev, timed, wrong;
    e = cudaEventCreateWithFlags(&wrong, cudaEventInterprocess);
    EXPECT(e == cudaErrorInvalidValue, "an interprocess event must not be timed (%s)", cudaGetErrorName(e));
    cudaGetLastError();
    CHECK(cudaEventCreate(&timed));
    cudaIpcEventHandle_t eh, eh2;
    e = cudaIpcGetEventHandle(&eh, timed);
    EXPECT(e != cudaSuccess, "an event not made interprocess was exported");
    cudaGetLastError();
    CHECK(cudaEventCreateWithFlags(&ev, cudaEventInterprocess | cudaEventDisableTiming));
    CHECK(cudaIpcGetEventHandle(&eh, ev));
    CHECK(cudaIpcGetEventHandle(&eh2, ev));
    EXPECT(memcmp(&eh, &eh2, sizeof eh) == 0, "the same event handle each time");
    cudaEvent_t own;
    e = cudaIpcOpenEventHandle(&own, eh);
    EXPECT(e != cudaSuccess, "the exporting process cannot open its own event handle");
    cudaGetLastError();
    ok("exported an interprocess event (misuse refused: %s)", cudaGetErrorName(e));
    int *flag = nullptr, *out = nullptr;
    CHECK(cudaMalloc(&flag, 2 * sizeof(int)));
    CHECK(cudaMalloc(&out, sizeof(int)));
    CHECK(cudaMemset(flag, 0, 2 * sizeof(int)));
    cudaIpcMemHandle_t fh;
    CHECK(cudaIpcGetMemHandle(&fh, flag));
    char evhex[2 * sizeof(cudaIpcEventHandle_t) + 1];
    to_hex(eh, evhex);
    to_hex(fh, hex);
    EXPECT(pipe(up) == 0 && pipe(down) == 0, "pipes");
    snprintf(to, sizeof to, "%d", up[1]);
    snprintf(from, sizeof from, "%d", down[0]);
    pid_t waiter = spawn(argv, {"--event", evhex, "--memory", hex, "--to", to, "--from", from});
    EXPECT(read(up[0], &c, 1) == 1 && c == 'r', "the child recorded the event");
    cudaStream_t ps;
    CHECK(cudaStreamCreateWithFlags(&ps, cudaStreamNonBlocking));
    CHECK(cudaStreamWaitEvent(ps, ev, 0));
    copy_int<<<1, 1, 0, ps>>>(flag, out);
    CHECK(cudaGetLastError());
    CHECK(cudaStreamSynchronize(ps));
    int got = 0;
    CHECK(cudaMemcpy(&got, out, sizeof got, cudaMemcpyDeviceToHost));
    EXPECT(got == 42, "this stream waited for the child's record: read %d, not 42", got);
    ok("cudaStreamWaitEvent waited for the other process's record");
    spin_then_set<<<1, 1, 0, ps>>>(flag + 1, 43, SPIN);
    CHECK(cudaGetLastError());
    CHECK(cudaEventRecord(ev, ps));
    c = 'q';
    EXPECT(write(down[1], &c, 1) == 1, "told the child");
    wait_ok(waiter, "event child");
    if (const char *other = getenv("RGPU_IPC_FOREIGN_TOKEN")) {
        std::string slot;
        std::vector<char *> env = env_with_token(other, slot);
        wait_ok(spawn(argv, {"--foreign-event", evhex}, env.data()), "foreign event opener");
        ok("a process of another lease cannot open the event handle");
    }
    CHECK(cudaEventDestroy(ev));
    CHECK(cudaEventDestroy(timed));
    CHECK(cudaStreamDestroy(ps));
    CHECK(cudaFree(out));
    CHECK(cudaFree(flag));
    CHECK(cudaFree(d));
    return test_end();
}
