@0xd7e2a8b4c1f09e35;
# Data plane of rgpu: one framed stream per session.
#
# Each frame is a fixed header (see src/frame.rs), one capnp message
# (a Request from the client, a Reply from the server), then `bulkLen` raw
# bytes. Bulk bytes (copy payloads, kernel parameter buffers, module images)
# never travel inside the capnp message.
#
# Requests whose header has the WANTS_REPLY flag are answered by exactly one
# Reply with the same sequence number; the others (asynchronous CUDA calls)
# are never answered: their errors are kept by the server and returned in
# `deferredError` of the next Reply, as CUDA reports asynchronous errors at
# the next synchronising call.
#
# Handles of streams, events and modules are minted by the client, so that
# creating them never waits for the network; 0 is the legacy default stream.

struct Request {
  union {
    memAlloc @0 :MemAlloc;
    memFree @1 :MemFree;
    memGetInfo @2 :Device;
    memcpyHtoD @3 :MemcpyHtoD;     # bulk: the bytes
    memcpyDtoH @4 :MemcpyDtoH;     # reply bulk: the bytes
    memcpyDtoD @5 :MemcpyDtoD;
    memset @6 :Memset;
    streamCreate @7 :StreamCreate;
    streamDestroy @8 :Handle;
    streamSynchronize @9 :Handle;
    streamQuery @10 :Handle;
    streamWaitEvent @11 :StreamWaitEvent;
    eventCreate @12 :EventCreate;
    eventDestroy @13 :Handle;
    eventRecord @14 :EventRecord;
    eventSynchronize @15 :Handle;
    eventQuery @16 :Handle;
    eventElapsedTime @17 :EventPair;
    ctxSynchronize @18 :Device;
    moduleLoad @19 :ModuleLoad;    # bulk: the image
    moduleUnload @20 :Handle;
    launchKernel @21 :LaunchKernel; # bulk: the packed parameter buffer
    ping @22 :Void;
    # Virtual memory management (cuMemCreate, cuMemMap, ...): physical
    # allocations by client-minted handle, mapped into reserved ranges.
    memCreate @23 :MemCreate;
    memRelease @24 :Handle;
    memAddressReserve @25 :MemAddressReserve;  # reply: memAlloc, the range's start
    memAddressFree @26 :MemRange;
    memMap @27 :MemMap;
    memUnmap @28 :MemRange;
    memSetAccess @29 :MemSetAccess;
    graphExecCreate @30 :GraphExecCreate; # bulk: the kernel nodes' parameter buffers, in op order
    graphExecDestroy @31 :Handle;
    graphLaunch @32 :GraphLaunch;   # bulk: host-to-device bytes; reply bulk: device-to-host bytes
    # Sent once a client has destroyed or reset a context and released
    # what it held: a session holding nothing more is as new, so a device
    # assert no longer fails its calls (CUDA: the context must be destroyed).
    ctxReset @33 :Device;
    # IPC between processes of one client host (cuIpcGetMemHandle,
    # cuIpcOpenMemHandle, cuIpcCloseMemHandle): a session exports one of its
    # allocations, another session of the same lease on this server opens it.
    ipcExport @34 :MemFree;        # reply: ipcHandle
    ipcOpen @35 :IpcOpen;          # reply: ipcOpened, the allocation's start and size
    ipcClose @36 :MemFree;
    # IPC of events (cuIpcGetEventHandle, cuIpcOpenEventHandle): an
    # interprocess event exported, and opened under the opener's new handle
    # as the same event (a record in either session is seen by both).
    ipcEventExport @37 :Handle;    # reply: ipcHandle
    ipcEventOpen @38 :IpcEventOpen;
  }
}

struct Reply {
  # A CUresult: 0 for success.
  result @0 :UInt32;
  # The first error of an asynchronous request since the last Reply, 0 if none.
  deferredError @1 :UInt32;
  union {
    none @2 :Void;
    memAlloc @3 :UInt64;           # device pointer (memAlloc, memAddressReserve)
    memGetInfo @4 :MemInfo;
    eventElapsedTime @5 :Float32;  # milliseconds
    moduleLoad @6 :ModuleLoaded;
    ipcHandle @8 :IpcHandle;
    ipcOpened @9 :MemRange;
  }
  # Text kernels printed (device printf) since the previous reply, for the
  # client to write to its stdout; empty when none.
  output @7 :Data;
}

struct Device { device @0 :UInt32; }
struct Handle { handle @0 :UInt64; }

struct MemAlloc {
  device @0 :UInt32;
  size @1 :UInt64;
}
struct MemFree { ptr @0 :UInt64; }
struct MemInfo { free @0 :UInt64; total @1 :UInt64; }

struct MemcpyHtoD {
  dst @0 :UInt64;
  stream @1 :UInt64;
}
struct MemcpyDtoH {
  src @0 :UInt64;
  size @1 :UInt64;
  stream @2 :UInt64;
}
struct MemcpyDtoD {
  dst @0 :UInt64;
  src @1 :UInt64;
  size @2 :UInt64;
  stream @3 :UInt64;
}
struct Memset {
  dst @0 :UInt64;
  value @1 :UInt32;
  elementSize @2 :UInt8;           # 1, 2 or 4 (cuMemsetD8/D16/D32)
  count @3 :UInt64;                # elements
  pitch @4 :UInt64;                # 0 for 1-D; else bytes between rows
  rows @5 :UInt64;                 # 2-D only: `count` elements per row
  stream @6 :UInt64;
}

struct StreamCreate {
  handle @0 :UInt64;
  device @1 :UInt32;
  flags @2 :UInt32;
  priority @3 :Int32;
}
struct StreamWaitEvent {
  stream @0 :UInt64;
  event @1 :UInt64;
  flags @2 :UInt32;
}
struct EventCreate {
  handle @0 :UInt64;
  device @1 :UInt32;
  flags @2 :UInt32;
}
struct EventRecord {
  event @0 :UInt64;
  stream @1 :UInt64;
}
struct EventPair {
  start @0 :UInt64;
  end @1 :UInt64;
}

struct ModuleLoad {
  handle @0 :UInt64;
  device @1 :UInt32;
}
struct ModuleLoaded {
  functions @0 :List(FunctionInfo);
  globals @1 :List(GlobalInfo);
  # Why kernels of this module cannot run here, if they cannot (e.g. the
  # sim backend got a SASS-only image); empty when they can.
  launchNote @2 :Text;
}
struct FunctionInfo {
  name @0 :Text;
  # Offsets and sizes of the kernel's parameters in the kernelParams layout.
  params @1 :List(ParamInfo);
  maxThreadsPerBlock @2 :Int32;
  sharedSizeBytes @3 :Int32;
  constSizeBytes @4 :Int32;
  localSizeBytes @5 :Int32;
  numRegs @6 :Int32;
  ptxVersion @7 :Int32;
  binaryVersion @8 :Int32;
  # Why this kernel cannot run on the server, if it cannot; the client
  # then refuses its launches at once, where the program sees the error.
  launchNote @9 :Text;
}
struct ParamInfo {
  offset @0 :UInt32;
  size @1 :UInt32;
}
struct GlobalInfo {
  name @0 :Text;
  ptr @1 :UInt64;
  size @2 :UInt64;
  # A `__managed__` variable (`.attribute(.managed)`): the client keeps a host
  # copy at `ptr` coherent with it, as with managed memory.
  managed @3 :Bool;
}

struct LaunchKernel {
  module @0 :UInt64;
  function @1 :UInt32;             # index into ModuleLoaded.functions
  gridX @2 :UInt32;
  gridY @3 :UInt32;
  gridZ @4 :UInt32;
  blockX @5 :UInt32;
  blockY @6 :UInt32;
  blockZ @7 :UInt32;
  sharedMemBytes @8 :UInt32;
  stream @9 :UInt64;
  cooperative @10 :Bool;           # cuLaunchCooperativeKernel: every block resident at once
}

struct MemCreate {
  handle @0 :UInt64;               # minted by the client
  device @1 :UInt32;
  size @2 :UInt64;                 # a multiple of the granularity
}
struct MemAddressReserve {
  size @0 :UInt64;
  alignment @1 :UInt64;            # 0: the granularity
  addr @2 :UInt64;                 # a hint; 0 for none
}
# An exported allocation: the export's id and the secret that proves a
# holder of the handle was given it (ids are guessable, secrets are not).
struct IpcHandle {
  id @0 :UInt64;
  secret @1 :Data;                 # 16 bytes
}
struct IpcOpen {
  id @0 :UInt64;
  secret @1 :Data;
}
struct IpcEventOpen {
  handle @0 :UInt64;               # the opener's new event handle
  id @1 :UInt64;
  secret @2 :Data;
}

struct MemRange {
  ptr @0 :UInt64;
  size @1 :UInt64;
}
struct MemMap {
  ptr @0 :UInt64;
  size @1 :UInt64;
  offset @2 :UInt64;               # into the physical allocation
  handle @3 :UInt64;
}
struct MemSetAccess {
  ptr @0 :UInt64;
  size @1 :UInt64;
  device @2 :UInt32;
  flags @3 :UInt32;                # CUmemAccess_flags
}
# An instantiated graph (one segment of it between host nodes), replayed on a
# stream by each graphLaunch: its operations in a topological order of the
# graph. Sending it again under the same handle replaces it (exec updates).
struct GraphExecCreate {
  handle @0 :UInt64;
  device @1 :UInt32;
  ops @2 :List(GraphOp);
}
struct GraphOp {
  union {
    # Its parameter buffer is the next bytes of the request's bulk, as
    # many as the function takes.
    kernel @0 :LaunchKernel;       # stream ignored
    # The bytes come with each launch (the host memory is read at launch).
    memcpyHtoD @1 :GraphCopy;      # src unused
    # The bytes go back in the launch's reply, in op order.
    memcpyDtoH @2 :GraphCopy;      # dst unused
    memcpyDtoD @3 :GraphCopy;
    memset @4 :Memset;             # stream ignored
    eventRecord @5 :UInt64;
    eventWait @6 :UInt64;
  }
}
struct GraphCopy {
  dst @0 :UInt64;
  src @1 :UInt64;
  size @2 :UInt64;
}
struct GraphLaunch {
  exec @0 :UInt64;
  stream @1 :UInt64;
}
