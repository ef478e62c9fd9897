# CuPy's reductions and scans through CUB (CuPy's default). CuPy's CUB fatbin
# carries SASS and compute_120 PTX only: on a 12.0 sim the results must be
# right; on a 9.0 sim (only the sm_90 SASS would run, which the sim cannot)
# the call must fail. A wrong number is never acceptable.
import sys
import cupy as cp

expect = sys.argv[1]  # "right" or "error"
x = cp.ones(1000, dtype=cp.float32)
try:
    got = (float(x.sum()), float(x.mean()), float(cp.cumsum(x)[-1]))
except Exception as e:  # the clear failure
    assert expect == "error", f"CUB failed on a device that runs its PTX: {e}"
    print(f"ok: cupy CUB refused clearly: {type(e).__name__}")
    sys.exit(0)
assert expect == "right", f"CUB ran on a device that cannot run its code, giving {got}"
assert got == (1000.0, 1.0, 1000.0), f"wrong CUB results {got}"
print(f"ok: cupy CUB sum/mean/cumsum {got}")
