@0xd3a4b5c6e7f80912;
# The GPU pool broker (rgpu-broker), on capnp-rpc. GPU servers register
# their devices and heartbeat; users lease GPUs (or fractions of one) and get
# a signed token that the GPU servers check before opening a session.
# Failures come back as capnp errors whose text starts with a bracketed kind,
# e.g. "[quota] tenant alice would use 5 GPUs, quota is 4".

# Who may call what: the bootstrap `Broker` answers `version` and
# `challenge` to anyone; everything else is reached through a capability
# that `login` (a tenant's credential) or `register` (a GPU server holding
# the broker's token key) returns once the caller proved itself over this
# connection's challenge. The proofs are bound to a nonce the broker drew
# for this connection and used once, so recorded bytes replayed on another
# connection, or to a restarted broker, prove nothing. The messages the
# proofs sign are built by `rgpu_protocol::auth`.

interface Broker {
  version @0 () -> (version :Text, protocol :UInt32);
  # A fresh random nonce for this connection: a `login` or `register` on
  # it proves over it and uses it up. A connection holds at most 64 unused
  # nonces (the oldest is dropped first), so registrations may be pipelined.
  challenge @1 () -> (nonce :Data);
  # A tenant's credential (see `rgpu credential issue`): role is "user",
  # "operator" or "admin"; serial is the credential's issue time (unix ms);
  # proof = HMAC-SHA256(secret, auth::login_message(nonce, tenant, role,
  # serial)) where secret = HMAC-SHA256(credential key, auth::credential_message(
  # tenant, role, serial)). Refused: a wrong proof, no challenge, a revoked serial.
  login @2 (nonce :Data, tenant :Text, role :Text, serial :UInt64, proof :Data) -> (session :Session);
  # (Re-)registers a GPU server and its inventory: proof =
  # HMAC-SHA256(token key, auth::register_message(nonce, server)), covering
  # every field of `server`.
  register @3 (server :ServerInfo, nonce :Data, proof :Data) -> (agent :ServerAgent, heartbeatMs :UInt32);
}

# A logged-in tenant. A user sees, renews and releases only its own
# tenant's leases; an operator also lists every lease, drains, undrains and
# reads the audit log; an admin also revokes credentials and releases any lease.
# Failures come back as capnp errors whose text starts with a bracketed kind
# ("[auth] ...", "[quota] ...", "[rate] ...").
interface Session {
  whoami @0 () -> (tenant :Text, role :Text, serial :UInt64);
  # `request.tenant` must be empty or the session's tenant.
  lease @1 (request :LeaseRequest) -> (lease :Lease);
  renew @2 (leaseId :UInt64, ttlMs :UInt64) -> (lease :Lease);
  release @3 (leaseId :UInt64) -> (released :Bool);
  # tenant: "" for all a role may see (a user: its own).
  listLeases @4 (tenant :Text) -> (leases :List(Lease));
  listServers @5 () -> (servers :List(ServerStatus));
  status @6 () -> (status :BrokerStatus);
  # deadlineMs: unix milliseconds after which remaining leases are revoked (0: none).
  # migrate: also move each lease there to another server by live
  # migration (docs/migration.md "Migration with a broker"); `moves` says,
  # per lease, the target chosen or why none fits (at most 256).
  drain @7 (serverId :Text, deadlineMs :UInt64, migrate :Bool) -> (server :ServerStatus, moves :List(MovePlan));
  undrain @8 (serverId :Text) -> (server :ServerStatus);
  # The newest `limit` records (at most 10000), oldest first; tenant "" for all.
  audit @9 (tenant :Text, limit :UInt32) -> (records :List(AuditRecord));
  # Refuses from now on every credential of `tenant` issued before
  # `beforeSerial` (at most now): what `rgpu credential rotate` does.
  revokeCredentials @10 (tenant :Text, beforeSerial :UInt64) -> (beforeSerial :UInt64);
  # Accounting: records of leases that ended at or after sinceMs, then the
  # live leases so far; a user sees its own tenant's only, an operator any
  # (tenant "" for all), newest last, at most `limit` (0: 1000).
  usage @11 (tenant :Text, sinceMs :UInt64, limit :UInt32) -> (records :List(UsageRecord));
  # The caller's own lease (an admin: any) written to its server's disk and
  # its GPUs freed (docs/migration.md "Preemption"); its program waits. It
  # stays suspended until `resume`. The lease comes back `suspending`; its
  # state turns `suspended` once the server has written it (or `active`
  # with `moveError` set if the server could not).
  suspend @12 (leaseId :UInt64) -> (lease :Lease);
  # Lets a lease suspended by `suspend` take its GPUs back: at once if they
  # are free and nothing of higher priority waits for them, else then.
  resume @13 (leaseId :UInt64) -> (lease :Lease);
  # An operator moves a lease by live migration to server `serverId` (""
  # for any that can take it), as a drain with migrate moves one; its
  # programs run on. The lease comes back with `movingTo` set; the move has
  # ended when `movingTo` is empty again: on the target, or where it was
  # with `moveError` set. Refused, saying why, for a lease that is not
  # active, is suspended or already moving, spans several servers, or that
  # no server (or not serverId) can take.
  moveLease @14 (leaseId :UInt64, serverId :Text) -> (lease :Lease);
}

# A registered GPU server, for as long as its connection lasts. Its
# inventory changes only by a new `register` with a fresh proof.
interface ServerAgent {
  # Every `heartbeatMs`; the reply lists the live leases on this server and
  # the generation floor: a lease with generation <= floor that is not in
  # the list has ended, and the server closes its sessions. known = false:
  # the broker forgot the server; register again. `usage`: what each lease
  # with sessions here used so far (cumulative); `total`: all sessions here
  # since the server started, leased or not. `load`: its data-plane
  # traffic since the last heartbeat (absent from an older server).
  # `moves` (at most 16): leases the broker asks this server to move to
  # another by live migration; the server answers each in a later
  # heartbeat's `moved` (at most 16). A lease in flight is listed for both
  # servers: here with its old generation, at the target with the move's.
  # `health` (at most one per GPU): GPUs whose health changed since the
  # last heartbeat the broker answered (empty: no change); registration
  # carries every GPU's. The broker places nothing on an unhealthy GPU and
  # moves the leases on it elsewhere (docs/migration.md "Evacuation of
  # unhealthy devices").
  heartbeat @0 (usage :List(Usage), total :Usage, load :LinkLoad, moved :List(MoveResult), health :List(GpuHealth)) -> (leases :List(LeaseRef), generationFloor :UInt64, known :Bool, moves :List(MoveOrder));
  # The server drains itself to stop (SIGTERM): no new grants; leases left
  # at deadlineMs are revoked; its next registration ends the drain.
  drainForShutdown @1 (deadlineMs :UInt64) -> (server :ServerStatus);
}

struct AuditRecord {
  timeMs @0 :UInt64;
  # Who: "tenant/role", or "server:ID", or "-" before any proof.
  actor @1 :Text;
  # The peer's address (host:port) as the broker saw it.
  peer @2 :Text;
  op @3 :Text;               # login, lease, renew, release, drain, undrain, register, revoke, ...
  target @4 :Text;           # a lease id, a server id, a tenant
  ok @5 :Bool;
  detail @6 :Text;           # why it was refused, or what was granted
}

struct ServerInfo {
  id @0 :Text;           # the address clients connect to (host:port)
  node @1 :Text;
  leaf @2 :Text;
  spine @3 :Text;
  partitions @4 :List(Text);
  gpus @5 :List(GpuInfo);
  transports @6 :List(Text);  # data-plane transports it serves: "tcp", and "rdma" when it can
  linkBandwidth @7 :UInt64;   # bytes/s its links carry each way (--link-bandwidth); 0: not said (unbounded)
}

struct GpuInfo {
  uuid @0 :Data;         # 16 bytes
  ordinal @1 :UInt32;
  model @2 :Text;
  memory @3 :UInt64;
  sms @4 :UInt32;
  healthy @5 :Bool;
  healthReason @6 :Text;  # why it is unhealthy (empty when healthy; at most 256 bytes kept)
}

# One GPU's health as its server observes it (server/src/health.rs).
struct GpuHealth {
  ordinal @0 :UInt32;
  healthy @1 :Bool;
  reason @2 :Text;            # why not (e.g. "uncorrectable ECC error"); empty when healthy
}

struct LeaseRequest {
  tenant @0 :Text;            # empty, or the logged-in tenant (it is taken from the credential)
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
  bandwidth @11 :UInt64;      # bytes/s each way on each of its servers' links (0: none asked)
  clientKey @12 :Data;        # empty, or the client's Ed25519 public key (32 bytes): the token is bound to it
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
  state @7 :Text;             # active | lost | suspending | suspended | resuming (preemption)
  token @8 :Data;
  grantedMs @9 :UInt64;
  priority @10 :Int32;
  usage @11 :Usage;           # summed over its servers' last reports
  bandwidth @12 :UInt64;      # bytes/s granted on each of its servers' links (0: none asked)
  movingTo @13 :Text;         # the server a drain moves it to now (empty: none)
  moveError @14 :Text;        # why its last move failed, or why it cannot leave an unhealthy GPU (empty: none)
}

# The accounting record of an ended lease (or, for a live one, so far:
# endedMs 0, why "live").
struct UsageRecord {
  lease @0 :UInt64;
  tenant @1 :Text;
  gpus @2 :UInt32;
  servers @3 :List(Text);
  memoryLimit @4 :UInt64;
  computeMilli @5 :UInt32;
  grantedMs @6 :UInt64;
  endedMs @7 :UInt64;
  why @8 :Text;               # released | expired | revoked | live
  reported @9 :Bool;          # false: no server reported use
  usage @10 :Usage;
}

# Metered use (server/src/metering.rs), cumulative.
struct Usage {
  lease @0 :UInt64;           # in a heartbeat's per-lease list; else 0
  kernels @1 :UInt64;
  kernelNs @2 :UInt64;        # device time of the kernels, when kernelTimed
  kernelTimed @3 :Bool;       # false: the backend cannot time kernels
  bytesIn @4 :UInt64;         # data plane, from clients
  bytesOut @5 :UInt64;
  memory @6 :UInt64;          # device memory held now
  memoryPeak @7 :UInt64;      # its high-water mark
}

# A server's data-plane traffic, bytes/s over the interval since its
# previous heartbeat, all transports together.
struct LinkLoad {
  bytesInPerS @0 :UInt64;     # from clients
  bytesOutPerS @1 :UInt64;
}

struct LeaseRef {
  id @0 :UInt64;
  generation @1 :UInt64;
  deadlineMs @2 :UInt64;
}

# A lease the broker asks its server to move, suspend or resume (see
# `heartbeat`).
struct MoveOrder {
  lease @0 :UInt64;
  generation @1 :UInt64;      # the lease's generation at the target (migrate), or its generation
  target @2 :Text;            # the target server's id (its address); empty unless migrate
  kind @3 :OrderKind;
}

enum OrderKind {
  migrate @0;                 # live-migrate every session of the lease to `target`
  suspend @1;                 # preemption: checkpoint every session of the lease to this server's disk and end it here
  resume @2;                  # restore the sessions a suspend wrote, and serve them again
}

# What a server did with a MoveOrder.
struct MoveResult {
  lease @0 :UInt64;
  ok @1 :Bool;                # migrate: every session runs at the target now; suspend: every one is on disk; resume: every one is served again
  reason @2 :Text;            # why not (at most 1024 bytes kept)
  kind @3 :OrderKind;         # the order this answers
}

# What a drain with migrate chose for one lease.
struct MovePlan {
  lease @0 :UInt64;
  target @1 :Text;            # empty: no server fits
  reason @2 :Text;            # why none fits
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
  usage @16 :Usage;           # its last heartbeat's total
  linkBandwidth @17 :UInt64;  # as registered (0: not said, unbounded)
  bandwidthGranted @18 :UInt64; # bytes/s its leases were granted, summed
  load @19 :LinkLoad;         # its last heartbeat's (absent: none reported)
  unhealthy @20 :List(GpuHealth); # its GPUs reported unhealthy, and why
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
