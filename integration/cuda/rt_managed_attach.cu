// cudaStreamAttachMemAsync: managed memory attached to one stream or to the host,
// under the rule of devices without concurrent managed access (which rgpu
// reports): the host may write memory attached to an idle stream, or to the
// host, while other streams' kernels run, and those writes must reach the
// next kernel that may use the memory, and must not be overwritten by the
// device's copy at the next synchronisation. Refusals: flags, the NULL
// stream, part of an allocation, memory that is not managed.
#include <cuda_runtime.h>
#include "check.h"

const int N = 1000;

__global__ void scale(int *out, const int *in, int n, int k) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = in[i] * k;
}

__global__ void add(int *p, int n, int v) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] += v;
}

static void expect_all(const int *p, int want_mul, int want_add, const char *what) {
    for (int i = 0; i < N; i++)
        EXPECT(p[i] == i * want_mul + want_add, "%s: [%d] is %d, expected %d", what, i, p[i], i * want_mul + want_add);
}

int main() {
    test_begin("rt_managed_attach");
    cudaStream_t s, t;
    CHECK(cudaStreamCreate(&s));
    CHECK(cudaStreamCreate(&t));
    int *x, *y, *rx;
    // As CUDA's samples do: allocated attached to the host, then to a stream.
    CHECK(cudaMallocManaged(&x, N * sizeof(int), cudaMemAttachHost));
    CHECK(cudaMallocManaged(&y, N * sizeof(int)));
    CHECK(cudaMallocManaged(&rx, N * sizeof(int)));
    CHECK(cudaStreamAttachMemAsync(s, x, 0, cudaMemAttachSingle));
    CHECK(cudaStreamAttachMemAsync(s, rx));  // the default: this stream alone
    CHECK(cudaStreamSynchronize(s));
    ok("attached to one stream");

    // x belongs to s: the host writes it while t's kernel may run, and s's
    // kernel reads what the host wrote last.
    for (int i = 0; i < N; i++) x[i] = i;
    for (int i = 0; i < N; i++) y[i] = 1;
    add<<<4, 256, 0, t>>>(y, N, 5);
    CHECK(cudaGetLastError());
    for (int i = 0; i < N; i++) x[i] = 2 * i;
    scale<<<4, 256, 0, s>>>(rx, x, N, 3);
    CHECK(cudaGetLastError());
    CHECK(cudaStreamSynchronize(s));
    expect_all(rx, 6, 0, "s's kernel over the host's last writes to s's memory");
    CHECK(cudaStreamSynchronize(t));
    expect_all(y, 0, 6, "t's kernel");
    ok("memory of an idle stream written by the host while another stream runs reaches its stream's next kernel");

    // Attached to the host: written by the host while a kernel runs, the
    // writes survive the synchronisation.
    CHECK(cudaStreamAttachMemAsync(s, x, 0, cudaMemAttachHost));
    CHECK(cudaStreamSynchronize(s));
    add<<<4, 256, 0, s>>>(y, N, 1);
    CHECK(cudaGetLastError());
    for (int i = 0; i < N; i++) x[i] = i + 7;
    CHECK(cudaStreamSynchronize(s));
    expect_all(x, 1, 7, "host-attached memory written during a kernel, after the synchronisation");
    expect_all(y, 0, 7, "the kernel beside it");
    ok("memory attached to the host keeps the host's writes across a kernel and its synchronisation");

    // Attached globally again: any stream's kernel sees the host's data.
    CHECK(cudaStreamAttachMemAsync(t, x, N * sizeof(int), cudaMemAttachGlobal));  // the whole length: also accepted
    scale<<<4, 256, 0, t>>>(y, x, N, 2);
    CHECK(cudaGetLastError());
    CHECK(cudaStreamSynchronize(t));
    expect_all(y, 2, 14, "attached globally, read by t's kernel");
    ok("attached globally again");

    // Refused, changing nothing.
    int *dev;
    CHECK(cudaMalloc(&dev, 64));
    CHECK_ERR(cudaStreamAttachMemAsync(s, x, 0, 3), cudaErrorInvalidValue);
    CHECK_ERR(cudaStreamAttachMemAsync(s, x, 0, 0), cudaErrorInvalidValue);
    CHECK_ERR(cudaStreamAttachMemAsync(0, x, 0, cudaMemAttachSingle), cudaErrorInvalidValue);
    CHECK_ERR(cudaStreamAttachMemAsync(s, x, 4, cudaMemAttachSingle), cudaErrorInvalidValue);
    CHECK_ERR(cudaStreamAttachMemAsync(s, x + 1, 0, cudaMemAttachSingle), cudaErrorInvalidValue);
    CHECK_ERR(cudaStreamAttachMemAsync(s, dev, 0, cudaMemAttachSingle), cudaErrorInvalidValue);
    (void)cudaGetLastError();
    for (int i = 0; i < N; i++) x[i] = 3 * i;
    scale<<<4, 256, 0, t>>>(y, x, N, 1);
    CHECK(cudaGetLastError());
    CHECK(cudaStreamSynchronize(t));
    expect_all(y, 3, 0, "after the refusals x is still attached globally");
    ok("bad flags, the NULL stream alone, part of an allocation, an interior or plain device pointer: cudaErrorInvalidValue");

    // A stream destroyed gives its memory back to all streams.
    CHECK(cudaStreamAttachMemAsync(s, x));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaStreamDestroy(s));
    for (int i = 0; i < N; i++) x[i] = 9;
    scale<<<4, 256, 0, t>>>(y, x, N, 1);
    CHECK(cudaGetLastError());
    CHECK(cudaStreamSynchronize(t));
    expect_all(y, 0, 9, "memory of a destroyed stream, read by another");
    ok("memory attached to a destroyed stream is read by another stream's kernel");

    // Allocated attached to the host and never attached: kernels use it (as
    // programs written for GPUs with concurrent managed access do).
    int *z;
    CHECK(cudaMallocManaged(&z, N * sizeof(int), cudaMemAttachHost));
    for (int i = 0; i < N; i++) z[i] = i;
    add<<<4, 256, 0, t>>>(z, N, 4);
    CHECK(cudaGetLastError());
    CHECK(cudaStreamSynchronize(t));
    expect_all(z, 1, 4, "allocated for the host, used by a kernel");
    ok("memory allocated attached to the host and used by kernels without an attach");

    CHECK(cudaFree(z));
    CHECK(cudaFree(dev));
    CHECK(cudaFree(rx));
    CHECK(cudaFree(y));
    CHECK(cudaFree(x));
    CHECK(cudaStreamDestroy(t));
    return test_end();
}
