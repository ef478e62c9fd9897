// Device code for drv_vmm: built with `nvcc -fatbin` (and `-ptx`) by the harness and embedded
// in drv_vmm as byte arrays (generated header drv_vmm_images.h).

// p[i] = base + i for i < n.
extern "C" __global__ void iota(unsigned *p, unsigned base, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = base + i;
}

// p[i] += add for i < n (reads and writes).
extern "C" __global__ void add(unsigned *p, unsigned add, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] += add;
}
