# PyTorch through rgpu on the sim: everything that runs without PyTorch's own kernels, which
# its wheels carry only as SASS (the sim executes PTX). Device properties, memory info, the
# caching allocator (also with expandable segments, a separate process), pinned memory, copies
# both ways, streams, events, CUDA graph capture of copies and memsets, and a kernel launch
# that must fail with a clear error instead of computing anything.
#
#   python torch_basics.py CC        (CC: the compute capability the server reports, e.g. 9.0)
import os
import subprocess
import sys

import torch

cc = tuple(int(v) for v in sys.argv[1].split("."))
expandable = len(sys.argv) > 2 and sys.argv[2] == "expandable"
MiB = 1 << 20


def properties():
    assert torch.cuda.is_available()
    assert torch.cuda.device_count() == 1, torch.cuda.device_count()
    p = torch.cuda.get_device_properties(0)
    assert (p.major, p.minor) == cc, (p.major, p.minor)
    free, total = torch.cuda.mem_get_info()
    assert total == p.total_memory and 0 < free <= total, (free, total, p.total_memory)
    return f"{p.name}, {total // MiB} MiB"


def allocator():
    before = torch.cuda.mem_get_info()[0]
    ts = [torch.empty(n * MiB, dtype=torch.uint8, device="cuda") for n in (1, 3, 20, 64)]
    assert torch.cuda.memory_allocated() >= 88 * MiB, torch.cuda.memory_allocated()
    assert torch.cuda.mem_get_info()[0] <= before - 88 * MiB, "allocations not seen by the device"
    ptrs = {t.data_ptr() for t in ts}
    assert len(ptrs) == 4
    del ts
    assert torch.cuda.memory_allocated() == 0
    reserved = torch.cuda.memory_reserved()
    assert reserved >= 88 * MiB, reserved
    t = torch.empty(20 * MiB, dtype=torch.uint8, device="cuda")  # served from the cache
    assert torch.cuda.memory_reserved() == reserved
    del t
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == 0, torch.cuda.memory_reserved()
    return f"reserved {reserved // MiB} MiB, returned on empty_cache"


def copies():
    n = 1 << 20
    host = torch.arange(n, dtype=torch.float32)
    pinned = host.pin_memory()
    assert pinned.is_pinned()
    d = pinned.to("cuda", non_blocking=True)
    d2 = host.to("cuda")                      # pageable source
    back = torch.empty(n, dtype=torch.float32).pin_memory()
    back.copy_(d, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, host)
    assert torch.equal(d2.cpu(), host)
    e = torch.empty_like(d)
    e.copy_(d)                                # device to device
    assert torch.equal(e.cpu(), host)
    z = torch.zeros(n, device="cuda")         # a memset
    assert torch.count_nonzero(z.cpu()) == 0
    return "pinned/pageable host to device, device to host, device to device, memset"


def streams_events():
    s = torch.cuda.Stream()
    host = torch.arange(1 << 18, dtype=torch.int64).pin_memory()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(s):
        start.record()
        d = host.to("cuda", non_blocking=True)
        out = torch.empty_like(host).pin_memory()
        out.copy_(d, non_blocking=True)
        end.record()
    end.synchronize()
    assert end.query() and s.query()
    assert start.elapsed_time(end) >= 0
    assert torch.equal(out, host)
    torch.cuda.current_stream().wait_stream(s)
    return f"stream, events, elapsed {start.elapsed_time(end):.3f} ms"


def graph_capture():
    n = 1 << 16
    src = torch.empty(n, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    cleared = torch.empty(n, dtype=torch.int32, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            dst.copy_(src)
            cleared.zero_()
    for k in range(3):
        host = torch.arange(n, dtype=torch.float32) * (k + 1)
        src.copy_(host)
        cleared.copy_(torch.ones(n, dtype=torch.int32))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), host), k
        assert torch.count_nonzero(cleared.cpu()) == 0, k
    return "captured copy + memset replayed 3 times"


def expandable_segments():
    if expandable:
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        assert "expandable_segments:True" in conf, conf
        a = torch.empty(30 * MiB, dtype=torch.uint8, device="cuda")
        b = torch.empty(50 * MiB, dtype=torch.uint8, device="cuda")
        host = (torch.arange(50 * MiB, dtype=torch.int64) % 251).to(torch.uint8)
        b.copy_(host)
        assert torch.equal(b.cpu(), host)
        del a, b
        torch.cuda.empty_cache()
        return "expandable segments"
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    r = subprocess.run([sys.executable, __file__, sys.argv[1], "expandable"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return "allocation, copies and release in a process with expandable_segments:True"


def kernel_refused():
    try:
        y = torch.ones(16, device="cuda") + 1   # a fill kernel, then an add kernel
        torch.cuda.synchronize()
    except (torch.AcceleratorError, RuntimeError) as e:
        msg = str(e)
        assert "not supported" in msg or "no kernel image" in msg, msg
        return f"PyTorch's SASS-only kernel refused: {msg.splitlines()[0]}"
    raise AssertionError(f"a SASS-only kernel ran on the sim and gave {y.cpu()}")


checks = [properties, allocator, copies, streams_events, graph_capture, kernel_refused]
if expandable:
    checks = [expandable_segments]
else:
    checks.insert(4, expandable_segments)
failed = 0
for check in checks:
    try:
        print(f"  {check.__name__}: {check()}")
    except Exception as e:  # report every part, then fail
        failed += 1
        print(f"  {check.__name__}: FAILED: {type(e).__name__}: {e}")
if failed:
    sys.exit(f"{failed} of {len(checks)} PyTorch checks failed")
print(f"ok: PyTorch {torch.__version__} ({len(checks)} checks)")
