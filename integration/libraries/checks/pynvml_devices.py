# pynvml through rgpu's libnvidia-ml.so.1: the leased devices, named and
# identified as CUDA (here CuPy) sees them; what rgpu cannot know is
# NVML_ERROR_NOT_SUPPORTED, never a made-up number. Memory info is asked of
# the server each time: an allocation shows in it, and so does this process
# in the device's process list.
import os
import sys
import pynvml
import cupy as cp

cc = tuple(int(x) for x in sys.argv[1].split("."))
pynvml.nvmlInit()
n = pynvml.nvmlDeviceGetCount()
assert n == cp.cuda.runtime.getDeviceCount() == 1, n
h = pynvml.nvmlDeviceGetHandleByIndex(0)
name = pynvml.nvmlDeviceGetName(h)
name = name.decode() if isinstance(name, bytes) else name
props = cp.cuda.runtime.getDeviceProperties(0)
assert name == props["name"].decode(), (name, props["name"])
uuid = pynvml.nvmlDeviceGetUUID(h)
uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
# CuPy's properties hold the UUID as a C string (cut at a zero byte): ask the driver API.
from cuda.bindings import driver
(err,) = driver.cuInit(0)
assert err == driver.CUresult.CUDA_SUCCESS, err
err, cu_uuid = driver.cuDeviceGetUuid(0)
assert err == driver.CUresult.CUDA_SUCCESS, err
cuda_uuid = bytes(cu_uuid.bytes).hex()
assert uuid.startswith("GPU-") and uuid[4:].replace("-", "") == cuda_uuid, (uuid, cuda_uuid)
assert pynvml.nvmlDeviceGetCudaComputeCapability(h) == cc
pci = pynvml.nvmlDeviceGetPciInfo(h)
bus = pci.busId.decode() if isinstance(pci.busId, bytes) else pci.busId
assert (pci.bus, pci.device) == (props["pciBusID"], props["pciDeviceID"]), (pci.bus, pci.device)
assert pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(uuid)) == 0
assert pynvml.nvmlDeviceGetMigMode(h) == [0, 0]
assert pynvml.nvmlSystemGetCudaDriverVersion() == 13050
m0 = pynvml.nvmlDeviceGetMemoryInfo(h)
assert m0.total == props["totalGlobalMem"], (m0.total, props["totalGlobalMem"])
assert m0.free + m0.used == m0.total, (m0.free, m0.used, m0.total)
held = cp.zeros(32 << 20, dtype=cp.uint8)
cp.cuda.runtime.deviceSynchronize()
m1 = pynvml.nvmlDeviceGetMemoryInfo(h)
assert m1.used >= m0.used + (32 << 20), (m0.used, m1.used)
assert m1.free + m1.used == m1.total == m0.total
procs = {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
assert procs.get(os.getpid(), 0) >= 32 << 20, ("this process holds 32 MiB", os.getpid(), procs)
assert sum(procs.values()) <= m1.used, (procs, m1.used)
assert pynvml.nvmlDeviceGetGraphicsRunningProcesses(h) == []
m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
assert (m2.total, m2.reserved, m2.used) == (m1.total, 0, m1.used), (m2.total, m2.reserved, m2.used, m1.used)
del held
try:
    pynvml.nvmlDeviceGetUtilizationRates(h)
    raise AssertionError("utilization answered, but rgpu cannot know it")
except pynvml.NVMLError_NotSupported:
    pass
pynvml.nvmlShutdown()
print(f"ok: pynvml lists {n} device: {name} {uuid} {bus}, compute capability {cc}, "
      f"memory used {m0.used >> 20} -> {m1.used >> 20} MiB of {m1.total >> 20} MiB, "
      f"processes {sorted(procs)} (this one {os.getpid()})")
