@0xb8c1a3f2e4d56a71;
# Control plane of rgpu: sessions and device inventory, on capnp-rpc.
# Nothing per-call hot travels here; see data.capnp for the data plane.

interface GpuServer {
  # First call on a new connection: both sides check they speak the same
  # protocol version before anything else is exchanged.
  hello @0 (clientVersion :UInt32, clientName :Text)
        -> (serverVersion :UInt32, serverName :Text, backend :Text);

  # The devices this server exports, in ordinal order.
  listDevices @1 () -> (devices :List(DeviceInfo));

  # Opens a session. The returned id and key admit exactly one data-plane
  # connection to the same server; the session lives as long as that
  # connection (or until `attachTimeoutMs` passes without one).
  # `token` is reserved for the broker's lease tokens (empty today).
  openSession @2 (token :Data, clientName :Text)
        -> (sessionId :UInt64, key :Data, attachTimeoutMs :UInt32);

  # Memory each device holds now, as the caller may see it (NVML's memory
  # info, `rgpu smi`): with a lease token, the lease's devices, its memory
  # limit as the total and its own sessions' allocations as used; without
  # one, on a server that admits sessions without tokens, whole devices.
  # A pooled server refuses a caller without a valid token.
  deviceStatus @3 (token :Data) -> (devices :List(DeviceStatus));
}

struct DeviceStatus {
  ordinal @0 :UInt32;
  totalMem @1 :UInt64;        # the lease's limit where it has one
  usedMem @2 :UInt64;         # client allocations now
}

struct DeviceInfo {
  ordinal @0 :UInt32;
  name @1 :Text;
  uuid @2 :Data;              # 16 bytes, stable for the device's lifetime
  totalMem @3 :UInt64;
  pciDomain @4 :Int32;
  pciBus @5 :Int32;
  pciDevice @6 :Int32;
  # Every CUdevice_attribute the server can answer, as (id, value) pairs;
  # the client answers cuDeviceGetAttribute from this list without a round trip.
  attributes @7 :List(Attribute);
}

struct Attribute {
  id @0 :UInt32;
  value @1 :Int32;
}
