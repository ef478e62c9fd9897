// Device code for drv_module's linker test, part 2 of 2 (built with `nvcc -ptx -rdc=true`).
__device__ int offset = 1000;

static __device__ __noinline__ int helper(int v) { return v * 3; }

__device__ int scale(int v) { return helper(v); }
