# cupy.partition and argpartition on long rows, whose kernels are warp-synchronous (ballots and
# shuffles between lanes that diverged): on the sim the lanes of a cold path laid out after the
# join used to arrive late and the k-th element came out wrong while every call succeeded
# (both arrays below did, in one row of a hundred). argpartition's kernel is warp-synchronous
# with no `.sync` at all between its steps: lanes with no work in a loop laid out after the
# main loop's latch ran on into the next round before the others had finished (every row of
# the 9 x 256 case came out unpartitioned) until the sim reconverged divided lanes at the
# branch's post-dominator, as a GPU does. A k-th past 1,023 takes CuPy's sort.
import cupy as cp
import numpy as np
from cupy import testing

rng = np.random.default_rng(7)
cases = [
    ("CuPy's test array", testing.shaped_random((100, 20_000), np, np.float64), 3),
    ("normal", rng.standard_normal((100, 20_000)), 3),
    ("normal", rng.standard_normal((3, 4_097)), 2_000),
    ("CuPy's 9 x 256 array", testing.shaped_random((9, 256), np, np.float64, 10000), 20),
]
for name, a, kth in cases:
    n = a.shape[-1]
    want = np.sort(a, axis=-1)[:, kth]
    got = cp.partition(cp.asarray(a), kth, axis=-1).get()
    bad = np.flatnonzero(got[:, kth] != want)
    assert bad.size == 0, f"partition of {name}, n={n} kth={kth}: rows {bad[:5]} wrong ({got[bad[0], kth]} != {want[bad[0]]})"
    assert (got[:, :kth] <= want[:, None]).all() and (got[:, kth + 1:] >= want[:, None]).all(), f"{name} n={n}: not partitioned"
    idx = cp.argpartition(cp.asarray(a), kth, axis=-1).get()
    assert np.array_equal(np.take_along_axis(a, idx, -1)[:, kth], want), f"argpartition of {name}, n={n} kth={kth}"
print("ok: cupy partition/argpartition, 100 rows of 20,000, 9 of 256, and a k-th that sorts")
