@0xd3a4b5c6e7f80912;
# The GPU pool broker (rgpu-broker), on capnp-rpc. GPU servers register
# their devices and heartbeat; users lease GPUs (or fractions of one) and get
# a signed token that the GPU servers check before opening a session.
# Failures come back as capnp errors whose text starts with a bracketed kind,
# e.g. "[quota] tenant alice would use 5 GPUs, quota is 4".

interface Broker {
  # --- GPU servers ---
  # (Re-)registers a server and its GPUs. `proof` is HMAC-SHA256 over
  # "rgpu-register:" ++ serverId under the broker key (empty without one).
  register @0 (server :ServerInfo, proof :Data) -> (heartbeatMs :UInt32);
  # Every `heartbeatMs`; the reply lists the live leases on this server and
  # the generation floor: a lease with generation <= floor that is not in
  # the list has ended, and the server closes its sessions.
  heartbeat @1 (serverId :Text, proof :Data) -> (leases :List(LeaseRef), generationFloor :UInt64, known :Bool);

  # --- users ---
  lease @2 (request :LeaseRequest) -> (lease :Lease);
  renew @3 (leaseId :UInt64, ttlMs :UInt64) -> (lease :Lease);
  release @4 (leaseId :UInt64) -> (released :Bool);
  listLeases @5 (tenant :Text) -> (leases :List(Lease));

  # --- operators ---
  listServers @6 () -> (servers :List(ServerStatus));
  # deadlineMs: unix milliseconds after which remaining leases are revoked (0: none).
  # forShutdown: the server drains itself to stop; its next registration
  # (when it is back) ends the drain.
  # drain and undrain need `auth` when the broker has a key: see AdminAuth.
  drain @7 (serverId :Text, deadlineMs :UInt64, forShutdown :Bool, auth :AdminAuth) -> (server :ServerStatus);
  undrain @8 (serverId :Text, auth :AdminAuth) -> (server :ServerStatus);
  status @9 () -> (status :BrokerStatus);
}

# An operator's credential for one request: HMAC-SHA256 under the broker's
# admin key (or its token key, which GPU servers hold) of
# "rgpu-admin:" ++ op ++ ":" ++ serverId ++ ":" ++ deadlineMs ++ ":" ++
# issuedMs (decimal; op "drain" or "undrain", deadlineMs 0 for undrain).
# The broker refuses one issued more than 5 minutes from its clock, or seen
# before.
struct AdminAuth {
  issuedMs @0 :UInt64;
  proof @1 :Data;
}

struct ServerInfo {
  id @0 :Text;           # the address clients connect to (host:port)
  node @1 :Text;
  leaf @2 :Text;
  spine @3 :Text;
  partitions @4 :List(Text);
  gpus @5 :List(GpuInfo);
  transports @6 :List(Text);  # data-plane transports it serves: "tcp", and "rdma" when it can
}

struct GpuInfo {
  uuid @0 :Data;         # 16 bytes
  ordinal @1 :UInt32;
  model @2 :Text;
  memory @3 :UInt64;
  sms @4 :UInt32;
  healthy @5 :Bool;
}

struct LeaseRequest {
  tenant @0 :Text;
  gpus @1 :UInt32;            # whole GPUs; 0 with memory/computeMilli: a fraction of one
  memory @2 :UInt64;          # bytes of one GPU (fractional lease)
  computeMilli @3 :UInt32;    # share of one GPU's compute, 1..1000 (fractional lease)
  models @4 :List(Text);      # allowed models (empty: any)
  scope @5 :Scope;            # keep the GPUs within one ...
  scopeRequired @6 :Bool;     # ... or fail (else: preferred)
  priority @7 :Int32;
  ttlMs @8 :UInt64;
  waitMs @9 :UInt64;          # how long to queue when it cannot be placed now
  key @10 :Text;              # idempotency key: a retry with the same key gets the same lease
}

enum Scope {
  any @0;
  node @1;
  leaf @2;
  spine @3;
}

struct LeasedGpu {
  server @0 :Text;
  uuid @1 :Data;
  ordinal @2 :UInt32;
  model @3 :Text;
  memory @4 :UInt64;
}

struct Lease {
  id @0 :UInt64;
  tenant @1 :Text;
  generation @2 :UInt64;
  gpus @3 :List(LeasedGpu);
  memoryLimit @4 :UInt64;     # 0: whole GPUs
  computeMilli @5 :UInt32;
  deadlineMs @6 :UInt64;      # unix ms
  state @7 :Text;             # active | lost
  token @8 :Data;
  grantedMs @9 :UInt64;
  priority @10 :Int32;
}

struct LeaseRef {
  id @0 :UInt64;
  generation @1 :UInt64;
  deadlineMs @2 :UInt64;
}

struct ServerStatus {
  id @0 :Text;
  node @1 :Text;
  leaf @2 :Text;
  spine @3 :Text;
  partitions @4 :List(Text);
  state @5 :Text;             # up | unreachable
  draining @6 :Bool;
  drainDeadlineMs @7 :UInt64;
  gpus @8 :UInt32;
  gpusFree @9 :UInt32;        # whole GPUs with nothing on them
  memory @10 :UInt64;
  memoryUsed @11 :UInt64;
  leases @12 :UInt32;
  lastHeartbeatMs @13 :UInt64;
  models @14 :List(Text);
  transports @15 :List(Text); # as the server registered them (empty: an older server, TCP)
}

struct BrokerStatus {
  servers @0 :UInt32;
  serversUp @1 :UInt32;
  gpus @2 :UInt32;
  gpusFree @3 :UInt32;
  leases @4 :UInt32;
  queued @5 :UInt32;
  generation @6 :UInt64;
  policy @7 :Text;
  dataDir @8 :Text;
  uptimeMs @9 :UInt64;
}
