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
  # `token`: the broker's lease token (empty on a server without a broker).
  # A token bound to a client key (docs/security.md, "Bound tokens") needs
  # `nonce` from `challenge` on this connection (one use) and
  # proof = the client key's Ed25519 signature of binding::message(nonce,
  # this connection's TLS exporter value, token).
  openSession @2 (token :Data, clientName :Text, nonce :Data, proof :Data)
        -> (sessionId :UInt64, key :Data, attachTimeoutMs :UInt32);

  # Operator operations (docs/migration.md). Each needs a nonce from
  # `challenge` (one use, this connection only) and
  # proof = HMAC-SHA256(the server's admin key, auth::server_op_message(...)).
  challenge @3 () -> (nonce :Data);

  # Quiesces session `sessionId` (its queued work finished, at most
  # `quiesceMs`) and writes its state as `name` in the server's
  # --checkpoint-dir. With `leave`, the session is served here no more: its
  # client keeps trying to resume until it is restored.
  checkpoint @4 (sessionId :UInt64, name :Text, quiesceMs :UInt32, leave :Bool, nonce :Data, proof :Data)
        -> (bytes :UInt64, memoryBytes :UInt64, micros :UInt64);

  # Rebuilds the session saved as `name` in --checkpoint-dir; its client
  # resumes it with the id and key it had.
  restore @5 (name :Text, nonce :Data, proof :Data)
        -> (sessionId :UInt64, bytes :UInt64, memoryBytes :UInt64, micros :UInt64);

  # Memory each device holds now, as the caller may see it (NVML's memory
  # info, `rgpu smi`): with a lease token, the lease's devices, its memory
  # limit as the total and its own sessions' allocations as used; without
  # one, on a server that admits sessions without tokens, whole devices.
  # A pooled server refuses a caller without a valid token; a bound token
  # needs its proof, as for openSession.
  deviceStatus @6 (token :Data, nonce :Data, proof :Data) -> (devices :List(DeviceStatus));

  # Moves session `sessionId` to the GPU server at `target` (host:port, as
  # clients reach it) while its program runs: quiesced as for a checkpoint,
  # its state streamed server to server, rebuilt there; the client's next
  # resume here is redirected to `target`. On any failure the session goes
  # on here. Needs the same admin key on both servers. `pauseMicros`: from
  # the session held still to the target's rebuild done.
  # `precopyBytes`: device memory sent while the program ran;
  # `heldBytes`: device memory sent while it was held (what changed since).
  migrate @7 (sessionId :UInt64, target :Text, quiesceMs :UInt32, nonce :Data, proof :Data)
        -> (bytes :UInt64, memoryBytes :UInt64, micros :UInt64, pauseMicros :UInt64,
            precopyBytes :UInt64, heldBytes :UInt64);

  # The sessions this server serves now (an operator call, as above): what
  # `rgpu sessions` lists, and where `checkpoint` and `migrate` find ids.
  listSessions @8 (nonce :Data, proof :Data) -> (sessions :List(SessionInfo));

  # Marks device `device` failing (an operator call, as above), as a real
  # GPU fails: kind "ecc" (an uncorrectable ECC error) or "xid:N" (Xid
  # error N). The server reports the device unhealthy to its broker, which
  # places nothing more there and moves its leases elsewhere
  # (docs/migration.md "Evacuation of unhealthy devices"). Only the sim
  # backend takes injected faults; the cuda backend reports what the GPU
  # reports. `healthy`/`reason`: the device's health now.
  injectFault @9 (device :UInt32, kind :Text, nonce :Data, proof :Data) -> (healthy :Bool, reason :Text);
  # Clears an injected fault: the device is healthy again.
  clearFault @10 (device :UInt32, nonce :Data, proof :Data) -> (healthy :Bool, reason :Text);

  # After `rgpu restore` rebuilt a session on another server: session
  # `sessionId`, whose state left this server in a checkpoint (`leave`),
  # is forwarded to `target` (host:port, as clients reach it). Its client's
  # next resume here is redirected there, as after a live migration, and
  # the session ends here. Refused for a session still served here.
  forward @11 (sessionId :UInt64, target :Text, nonce :Data, proof :Data) -> ();

  # Up to `maxBytes` (at most 4 MiB) of snapshot `name` in --checkpoint-dir
  # from `offset` (an operator call, as above; the proof names the offset,
  # the snapshot and `maxBytes`): how a snapshot is copied off its server
  # (`rgpu checkpoint --save FILE`). `size`: the whole snapshot's. Fewer
  # bytes than asked only at its end. `nextNonce`: this connection's next
  # challenge, as `challenge` would answer (one call per piece, not two).
  readSnapshot @12 (name :Text, offset :UInt64, maxBytes :UInt32, nonce :Data, proof :Data)
        -> (data :Data, size :UInt64, nextNonce :Data);

  # Writes snapshot `name` into --checkpoint-dir in pieces of at most
  # 56 KiB (within the server's 64 KiB control-message bound), in order (an operator call, as above; the proof names the
  # offset, the snapshot, `last` and the SHA-256 of `data`): how a snapshot
  # saved elsewhere comes back (`rgpu restore --load FILE`). Offset 0
  # starts it afresh; each next piece starts where the last ended; `last`
  # syncs it and puts it in place under `name` (refused if a snapshot of
  # that name exists). A snapshot larger than the server's devices could
  # hold (their memory and a lease's modules) is refused.
  # `nextNonce` as for readSnapshot.
  writeSnapshot @13 (name :Text, offset :UInt64, data :Data, last :Bool, nonce :Data, proof :Data)
        -> (nextNonce :Data);

  # The snapshots in --checkpoint-dir that a suspension of broker lease
  # `lease` wrote (an operator call, as above; the proof names the lease as
  # its session), by name, at most 4096: what `rgpu checkpoint LEASE --to
  # FILE` copies off, and what `rgpu restore FILE` finds still there.
  listSuspended @14 (lease :UInt64, nonce :Data, proof :Data) -> (names :List(Text));
}

struct SessionInfo {
  id @0 :UInt64;
  client @1 :Text;            # the name the client gave at openSession
  lease @2 :UInt64;           # the broker lease it runs under (0: none)
  memory @3 :UInt64;          # device memory its allocations hold now
  kernels @4 :UInt64;
  bytesIn @5 :UInt64;         # data plane, from its client
  bytesOut @6 :UInt64;
}

struct DeviceStatus {
  ordinal @0 :UInt32;
  totalMem @1 :UInt64;        # the lease's limit where it has one
  usedMem @2 :UInt64;         # client allocations now
  # The client processes holding memory on the device now (of the lease,
  # where there is one), as NVML lists a GPU's processes.
  processes @3 :List(DeviceProcess);
  # The device's sensors and activity now, as NVML reads them: whole
  # device, not the lease's share (a GPU's temperature is the same for all
  # its tenants). Each reading says where it came from; a server that reads
  # none (or predates these fields) leaves every `source` at `none`.
  gpuUtilization @4 :Reading;     # percent of the last sample period (about 1 s) a kernel ran
  memoryUtilization @5 :Reading;  # percent of the last sample period device memory was read or written
  temperature @6 :Reading;        # degrees Celsius, the GPU die (NVML_TEMPERATURE_GPU)
  powerUsage @7 :Reading;         # milliwatts drawn by the board now
  powerLimit @8 :Reading;         # milliwatts, the enforced power limit
}

# One sensor reading of a device.
struct Reading {
  source @0 :ReadingSource;
  value @1 :UInt32;           # meaningful only when `source` is not `none`
}

enum ReadingSource {
  none @0;                    # not reported: the backend has no such reading (or the GPU does not support it)
  measured @1;                # observed now: NVML on the server's GPU, or the sim timing its own kernels
  simulated @2;               # a constant the sim reports in place of a sensor it does not have
}

struct DeviceProcess {
  pid @0 :UInt32;             # on its client host, as the client named itself at openSession
  usedMem @1 :UInt64;
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
