# CUDA IPC as Python programs use it: a CuPy array's memory handed to a
# process started with multiprocessing ("spawn", as CUDA requires), which opens
# the handle, changes the array with a CuPy kernel and closes it; the parent
# sees the change. Both processes reach the sim server through rgpu.
import multiprocessing as mp

import cupy as cp
import numpy as np

N = 1 << 18


def child(handle, q):
    try:
        ptr = cp.cuda.runtime.ipcOpenMemHandle(handle)
        mem = cp.cuda.UnownedMemory(ptr, N * 4, owner=None)
        a = cp.ndarray((N,), dtype=cp.float32, memptr=cp.cuda.MemoryPointer(mem, 0))
        ok = bool(cp.all(a == cp.arange(N, dtype=cp.float32)))
        a *= 3
        cp.cuda.runtime.deviceSynchronize()
        cp.cuda.runtime.ipcCloseMemHandle(ptr)
        q.put(("ok" if ok else "the child read wrong bytes", None))
    except Exception as e:  # reported to the parent, which fails
        q.put(("error", repr(e)))


if __name__ == "__main__":
    a = cp.arange(N, dtype=cp.float32)
    handle = cp.cuda.runtime.ipcGetMemHandle(a.data.ptr)
    assert len(handle) == 64, len(handle)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(handle, q))
    p.start()
    what, err = q.get(timeout=300)
    p.join(timeout=60)
    assert what == "ok", f"{what}: {err}"
    assert p.exitcode == 0, p.exitcode
    assert np.array_equal(a.get(), np.arange(N, dtype=np.float32) * 3), "the child's change"
    try:
        cp.cuda.runtime.ipcOpenMemHandle(handle)
        raise AssertionError("the exporting process opened its own handle")
    except cp.cuda.runtime.CUDARuntimeError:
        pass
    print("ok: cupy IPC: a spawned process opened the array, changed it with a kernel, closed it")
