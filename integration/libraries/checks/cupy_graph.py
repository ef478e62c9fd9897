# CuPy's stream capture (cupy.cuda.Stream.begin_capture / end_capture, which
# use thread-local capture mode and cudaStreamGetCaptureInfo) around elementwise
# kernels and a device-to-device copy; the graph replays with new input data.
import cupy as cp
import numpy as np

n = 50_000
x = cp.arange(n, dtype=cp.float32)
y = cp.empty_like(x)
z = cp.empty_like(x)
s = cp.cuda.Stream(non_blocking=True)
with s:
    s.begin_capture()
    assert s.is_capturing(), "the stream does not say it captures"
    cp.multiply(x, 2, out=y)
    cp.add(y, 1, out=y)
    z[...] = y
    g = s.end_capture()
assert not s.is_capturing()
for k in range(3):
    x[...] = cp.arange(n, dtype=cp.float32) * (k + 1)
    cp.cuda.Device().synchronize()
    g.launch(stream=s)
    s.synchronize()
    want = np.arange(n, dtype=np.float32) * (k + 1) * 2 + 1
    assert np.array_equal(z.get(), want), f"launch {k}: wrong result"
print("ok: cupy stream capture, graph replayed 3 times with new data")
