# cuBLAS through CuPy on the sim: its kernels are SASS only, so a matrix product must fail
# with cuBLAS's own error, never compute something else and never crash the process.
# cuBLASLt reads the driver's tools-context export table past its size; rgpu's shim once left
# other data there, and `dot` crashed the process about one run in four.
import cupy as cp
from cupy_backends.cuda.libs import cublas

for attempt in range(3):
    a = cp.arange(16, dtype=cp.float32).reshape(4, 4)
    try:
        r = a.dot(a)
        cp.cuda.runtime.deviceSynchronize()
    except cublas.CUBLASError as e:
        err = str(e)
        continue
    raise AssertionError(f"a SASS-only cuBLAS kernel ran on the sim and gave {r}")
print(f"ok: cuBLAS refused clearly: {err}")
