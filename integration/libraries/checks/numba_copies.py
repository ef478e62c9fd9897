# numba-cuda's device arrays and copies on streams: copy_to_host on a stream
# returns a buffer numba reads at once (the copy into pageable memory must be
# complete at return), pinned buffers, and device-to-device copies.
import numpy as np
from numba import cuda

s = cuda.stream()
a = np.arange(1 << 20, dtype=np.float64)
d = cuda.to_device(a, stream=s)
assert np.array_equal(d.copy_to_host(stream=s), a), "stream copy_to_host"
e = cuda.device_array_like(a, stream=s)
e.copy_to_device(d, stream=s)
assert np.array_equal(e.copy_to_host(stream=s), a), "device to device"
p = cuda.pinned_array(a.shape, dtype=a.dtype)
d.copy_to_host(p, stream=s)
s.synchronize()
assert np.array_equal(p, a), "pinned copy after synchronize"
free, total = cuda.current_context().get_memory_info()
assert 0 < free <= total, (free, total)
print("ok: numba device arrays, stream copies, pinned memory, memory info")
