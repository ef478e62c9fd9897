# pynvml through rgpu's libnvidia-ml.so.1: the leased devices, named and
# identified as CUDA (here CuPy) sees them; what rgpu cannot know is
# NVML_ERROR_NOT_SUPPORTED, never a made-up number. Memory info is asked of
# the server each time: an allocation shows in it, and so does this process
# in the device's process list. Utilization is measured by the server; the
# sim's temperature and power are its constants.
import os
import sys
import time
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
# Peak clocks are CUDA's clock rates; what the device does now is not known to the client.
for clock, attr in ((pynvml.NVML_CLOCK_SM, driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CLOCK_RATE),
                    (pynvml.NVML_CLOCK_MEM, driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)):
    err, khz = driver.cuDeviceGetAttribute(attr, 0)
    assert err == driver.CUresult.CUDA_SUCCESS and khz > 0, (err, khz)
    assert pynvml.nvmlDeviceGetMaxClockInfo(h, clock) == khz // 1000, (clock, khz)
for query in (lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM), lambda: pynvml.nvmlDeviceGetFanSpeed(h),
              lambda: pynvml.nvmlDeviceGetPerformanceState(h), lambda: pynvml.nvmlDeviceGetEccMode(h)):
    try:
        query()
        raise AssertionError("a query rgpu cannot answer answered")
    except pynvml.NVMLError_NotSupported:
        pass
m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
assert (m2.total, m2.reserved, m2.used) == (m1.total, 0, m1.used), (m2.total, m2.reserved, m2.used, m1.used)
del held
# The sim's sensors are constants it reports as simulated (its name says "sim"): a plausible
# die temperature, a draw under the board's limit.
assert "sim" in name, name
temp = pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
assert 20 <= temp <= 95, temp
power, limit = pynvml.nvmlDeviceGetPowerUsage(h), pynvml.nvmlDeviceGetEnforcedPowerLimit(h)
assert 0 < power < limit, (power, limit)
try:
    pynvml.nvmlDeviceGetTemperature(h, 1)
    raise AssertionError("a sensor NVML does not have was answered")
except pynvml.NVMLError_InvalidArgument:
    pass
# GPU utilization is measured: the share of the last second during which a kernel ran. A kernel
# that runs past a second shows it busy; a second after it ends, idle. Its length is found by
# trying (the sim's speed depends on the host).
spin = cp.RawKernel(r"""
extern "C" __global__ void spin(unsigned int n, unsigned int* out) {
    unsigned int acc = 0;
    for (unsigned int i = 0; i < n; ++i) acc += i ^ (acc >> 3);
    out[0] = acc;
}""", "spin")
out = cp.zeros(1, dtype=cp.uint32)
iters, busy = 1 << 16, None
for _ in range(8):
    done = cp.cuda.Event()
    t0 = time.monotonic()
    spin((1,), (1,), (cp.uint32(iters), out))
    done.record()
    while not done.done:
        time.sleep(0.1)
        u = pynvml.nvmlDeviceGetUtilizationRates(h)
        # Only a reading taken after a second of running, with the kernel still running, counts.
        if time.monotonic() - t0 > 1.2 and not done.done:
            busy = u
            break
    done.synchronize()
    if busy is not None:
        break
    took = max(time.monotonic() - t0, 0.01)
    iters = min(int(iters * 3.0 / took), 0xFFFFFFFF)
assert busy is not None, "no kernel ran past a second"
assert busy.gpu >= 80, ("a kernel ran the whole last second", busy.gpu)
assert busy.memory == 0, ("the sim does not measure memory utilization", busy.memory)
time.sleep(1.2)
idle = pynvml.nvmlDeviceGetUtilizationRates(h)
assert idle.gpu == 0, ("no kernel in the last second", idle.gpu)
pynvml.nvmlShutdown()
print(f"ok: pynvml lists {n} device: {name} {uuid} {bus}, compute capability {cc}, "
      f"memory used {m0.used >> 20} -> {m1.used >> 20} MiB of {m1.total >> 20} MiB, "
      f"processes {sorted(procs)} (this one {os.getpid()}), utilization {busy.gpu}% busy, "
      f"{idle.gpu}% idle, {temp} C and {power / 1000:.0f} / {limit / 1000:.0f} W (simulated)")
