// Device code for drv_module's linker test, part 1 of 2 (built with `nvcc -ptx -rdc=true`):
// a kernel calling a function and reading a variable that drv_link_lib.cu defines, and a
// module-local helper whose name the other part uses too.
extern __device__ int scale(int v);
extern __device__ int offset;

static __device__ __noinline__ int helper(int v) { return v + 1; }

extern "C" __global__ void linked_fill(int *out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = helper(scale(i)) + offset;
}
