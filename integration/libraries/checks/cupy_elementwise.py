# CuPy's elementwise kernels (compiled to PTX by NVRTC), creation, copies both
# ways, and a few ufuncs, checked against NumPy.
import cupy as cp
import numpy as np

x = np.arange(100_000, dtype=np.float32)
d = cp.asarray(x)
assert np.array_equal((d * 2 + 1).get(), x * 2 + 1), "affine"
assert np.allclose(cp.sqrt(d).get(), np.sqrt(x)), "sqrt"
assert np.array_equal(cp.zeros(1000, dtype=cp.int32).get(), np.zeros(1000, dtype=np.int32)), "zeros"
assert np.array_equal(cp.full((3, 5), 7, dtype=cp.int64).get(), np.full((3, 5), 7)), "full"
y = cp.arange(12, dtype=cp.float64).reshape(3, 4)
assert np.array_equal(y.T.copy().get(), np.arange(12.0).reshape(3, 4).T), "transpose copy"
assert np.array_equal(cp.where(d > 50_000, d, 0).get(), np.where(x > 50_000, x, 0)), "where"
print("ok: cupy elementwise, creation, copies, ufuncs")
