// Device code for drv_module: built with `nvcc -fatbin` (and `-ptx`) by the
// harness and embedded in drv_module as byte arrays (generated header
// drv_module_images.h).
__device__ int table[256];
__device__ unsigned long long counter = 0x1122334455667788ull;
__constant__ float coef[4] = {0.5f, 1.5f, 2.5f, 3.5f};

extern "C" __global__ void fill(int *out, int value, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value + table[i % 256] + (int)coef[i % 4];
}

extern "C" __global__ void __launch_bounds__(64) bounded(float *x) {
    __shared__ float tile[512];
    tile[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    x[threadIdx.x] = tile[511 - threadIdx.x] + (float)counter;
}
