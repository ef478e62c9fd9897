//! An in-process model of the verbs operations the transport uses.
//!
//! A [`Fabric`] holds any number of endpoints in this process. Memory
//! regions are real memory (the model copies bytes between them exactly as
//! the NIC would DMA them), keys are checked against bounds and rights, and
//! every failure a real RC queue pair reports is reported the same way: a
//! bad rkey completes with `RemoteAccess` and moves the queue pair to the
//! error state, a SEND with no receive posted completes with
//! `RnrRetryExceeded`, a dead peer with `RetryExceeded`, and outstanding work
//! of a queue pair in the error state completes as `Flushed`.
//!
//! Knobs ([`ModelConfig`], [`Fabric::inject`]): completions can be held back
//! for a number of polls (a deterministic stand-in for wire delay), the next
//! work request can be made to fail with a chosen status, and an endpoint can
//! be killed (its process "dies"). Work executes when it is posted, so the
//! results are deterministic; only the visibility of completions is delayed.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::verbs::*;

/// Model settings.
#[derive(Debug, Clone, Copy)]
pub struct ModelConfig {
    /// A completion becomes visible this many `poll_cq` calls after it was
    /// produced (0: at once).
    pub delay_polls: u64,
    /// Path MTU reported by every endpoint.
    pub mtu: u32,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig { delay_polls: 0, mtu: 4096 }
    }
}

/// Counters, for tests that check what the transport did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelStats {
    pub registrations: u64,
    pub deregistrations: u64,
    pub sends: u64,
    pub writes: u64,
    pub reads: u64,
    pub recvs_posted: u64,
    pub arms: u64,
    pub waits: u64,
}

struct Mr {
    owner: u32,
    addr: u64,
    len: usize,
    access: Access,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum QpState {
    Init,
    Ready,
    Error,
    Dead,
}

struct Ep {
    state: QpState,
    peer: Option<u32>,
    recvs: VecDeque<(u64, Sge)>,
    /// (visible after this many polls, completion)
    cq: VecDeque<(u64, Completion)>,
    polls: u64,
    armed: bool,
    event: bool,
    fail_next: Option<WcStatus>,
    stats: ModelStats,
    /// Index into the fabric's P_Key table (the port's).
    pkey_index: u16,
}

struct State {
    cfg: ModelConfig,
    /// The P_Key table every endpoint's port has (host byte order).
    pkeys: Vec<u16>,
    eps: HashMap<u32, Ep>,
    mrs: HashMap<u32, Mr>,
    next_qpn: u32,
    next_key: u32,
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
}

/// A set of endpoints that can reach each other.
#[derive(Clone)]
pub struct Fabric {
    shared: Arc<Shared>,
}

/// What to do to an endpoint's next work request.
#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// The next work request posted on it completes with this status (and,
    /// if it is an error, moves its queue pair to the error state).
    FailNext(WcStatus),
    /// The endpoint's process dies: its queue pair is gone, the peer's
    /// next operation fails with `RetryExceeded`, and the peer's posted
    /// receives are flushed (as the connection manager's disconnect event
    /// or the TCP side channel would reveal).
    Kill,
}

impl Fabric {
    pub fn new(cfg: ModelConfig) -> Fabric {
        Fabric {
            shared: Arc::new(Shared {
                state: Mutex::new(State { cfg, pkeys: vec![0xffff], eps: HashMap::new(), mrs: HashMap::new(), next_qpn: 0x100, next_key: 0x1000 }),
                cv: Condvar::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking test thread must not wedge the others.
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new endpoint, not yet connected.
    pub fn endpoint(&self) -> ModelEndpoint {
        let mut s = self.lock();
        let qpn = s.next_qpn;
        s.next_qpn += 1;
        s.eps.insert(
            qpn,
            Ep {
                state: QpState::Init,
                peer: None,
                recvs: VecDeque::new(),
                cq: VecDeque::new(),
                polls: 0,
                armed: false,
                event: false,
                fail_next: None,
                stats: ModelStats::default(),
                pkey_index: 0,
            },
        );
        ModelEndpoint { fabric: self.clone(), qpn, mtu: s.cfg.mtu }
    }

    /// Two endpoints connected to each other.
    pub fn pair(&self) -> (ModelEndpoint, ModelEndpoint) {
        let (mut a, mut b) = (self.endpoint(), self.endpoint());
        let (ia, ib) = (a.local_info(), b.local_info());
        a.connect(&ib).expect("fresh model endpoints connect");
        b.connect(&ia).expect("fresh model endpoints connect");
        (a, b)
    }

    /// Sets the P_Key table of every port on the fabric (the default is
    /// `[0xffff]`, the default partition only).
    pub fn set_pkey_table(&self, table: Vec<u16>) {
        self.lock().pkeys = table;
    }

    /// The P_Key an endpoint's queue pair is in.
    pub fn pkey_of(&self, qpn: u32) -> Option<u16> {
        let s = self.lock();
        s.eps.get(&qpn).and_then(|e| s.pkeys.get(e.pkey_index as usize).copied())
    }

    pub fn inject(&self, qpn: u32, fault: Fault) {
        let mut s = self.lock();
        match fault {
            Fault::FailNext(st) => {
                if let Some(ep) = s.eps.get_mut(&qpn) {
                    ep.fail_next = Some(st);
                }
            }
            Fault::Kill => kill(&mut s, qpn),
        }
        drop(s);
        self.shared.cv.notify_all();
    }

    pub fn stats(&self, qpn: u32) -> ModelStats {
        self.lock().eps.get(&qpn).map(|e| e.stats).unwrap_or_default()
    }

    /// Registrations currently alive, for leak checks.
    pub fn live_registrations(&self) -> usize {
        self.lock().mrs.len()
    }

    pub fn set_delay_polls(&self, n: u64) {
        self.lock().cfg.delay_polls = n;
    }
}

fn kill(s: &mut State, qpn: u32) {
    let peer = match s.eps.get_mut(&qpn) {
        Some(ep) => {
            ep.state = QpState::Dead;
            ep.recvs.clear();
            ep.cq.clear();
            ep.peer
        }
        None => None,
    };
    s.mrs.retain(|_, m| m.owner != qpn);
    if let Some(p) = peer {
        to_error(s, p);
    }
}

/// Moves a queue pair to the error state and flushes its receives.
fn to_error(s: &mut State, qpn: u32) {
    let delay = s.cfg.delay_polls;
    if let Some(ep) = s.eps.get_mut(&qpn) {
        if ep.state == QpState::Dead || ep.state == QpState::Error {
            return;
        }
        ep.state = QpState::Error;
        let at = ep.polls + delay;
        while let Some((wr_id, _)) = ep.recvs.pop_front() {
            ep.cq.push_back((
                at,
                Completion { wr_id, status: WcStatus::Flushed, opcode: WcOpcode::Recv, byte_len: 0, imm: None },
            ));
        }
        ep.event = true;
    }
}

/// One model endpoint (queue pair + completion queue). Dropping it is a
/// clean close: the queue pair is destroyed and its registrations with it.
pub struct ModelEndpoint {
    fabric: Fabric,
    qpn: u32,
    mtu: u32,
}

impl ModelEndpoint {
    pub fn qpn(&self) -> u32 {
        self.qpn
    }
    pub fn fabric(&self) -> &Fabric {
        &self.fabric
    }
}

impl Drop for ModelEndpoint {
    fn drop(&mut self) {
        let mut s = self.fabric.lock();
        kill(&mut s, self.qpn);
        s.eps.remove(&self.qpn);
        drop(s);
        self.fabric.shared.cv.notify_all();
    }
}

/// Checks a local SGE against the owner's registrations.
fn check_local(s: &State, owner: u32, sge: &Sge, need: Access) -> bool {
    match s.mrs.get(&sge.lkey) {
        Some(m) => {
            m.owner == owner
                && m.access.contains(need)
                && sge.addr >= m.addr
                && sge.addr.saturating_add(sge.len as u64) <= m.addr + m.len as u64
        }
        None => false,
    }
}

fn check_remote(s: &State, owner: u32, rkey: u32, addr: u64, len: u32, need: Access) -> bool {
    match s.mrs.get(&rkey) {
        Some(m) => {
            m.owner == owner
                && m.access.contains(need)
                && addr >= m.addr
                && addr.saturating_add(len as u64) <= m.addr + m.len as u64
        }
        None => false,
    }
}

impl Verbs for ModelEndpoint {
    fn local_info(&self) -> EndpointInfo {
        let mut gid = [0u8; 16];
        gid[..4].copy_from_slice(&self.qpn.to_be_bytes());
        EndpointInfo { qpn: self.qpn, psn: self.qpn.wrapping_mul(2654435761) & 0xff_ffff, lid: 1, gid, mtu: self.mtu }
    }

    fn pkey_index(&self, pkey: u16) -> Result<u16, VerbsError> {
        let s = self.fabric.lock();
        find_pkey_index(&s.pkeys, pkey).ok_or(VerbsError::NoPkey { pkey, port: 1 })
    }

    fn set_pkey_index(&mut self, index: u16) -> Result<(), VerbsError> {
        let mut s = self.fabric.lock();
        if index as usize >= s.pkeys.len() {
            return Err(VerbsError::Invalid { op: "modify_qp(INIT)", msg: format!("P_Key index {index} out of range") });
        }
        let ep = s.eps.get_mut(&self.qpn).ok_or(VerbsError::QpError)?;
        if ep.state != QpState::Init {
            return Err(VerbsError::Invalid { op: "modify_qp(INIT)", msg: "queue pair already connected".into() });
        }
        ep.pkey_index = index;
        Ok(())
    }

    fn connect(&mut self, remote: &EndpointInfo) -> Result<(), VerbsError> {
        let mut s = self.fabric.lock();
        if !s.eps.contains_key(&remote.qpn) {
            return Err(VerbsError::op("modify_qp(RTR)", format!("no queue pair {:#x} on the fabric", remote.qpn)));
        }
        let ep = s.eps.get_mut(&self.qpn).ok_or(VerbsError::QpError)?;
        if ep.state != QpState::Init {
            return Err(VerbsError::Invalid { op: "modify_qp(RTR)", msg: "queue pair already connected".into() });
        }
        ep.peer = Some(remote.qpn);
        ep.state = QpState::Ready;
        Ok(())
    }

    unsafe fn reg_mr(&mut self, addr: *mut u8, len: usize, access: Access) -> Result<MemoryRegion, VerbsError> {
        if addr.is_null() || len == 0 {
            return Err(VerbsError::Invalid { op: "reg_mr", msg: "empty region".into() });
        }
        let mut s = self.fabric.lock();
        let key = s.next_key;
        s.next_key = s.next_key.wrapping_add(1);
        s.mrs.insert(key, Mr { owner: self.qpn, addr: addr as u64, len, access });
        if let Some(ep) = s.eps.get_mut(&self.qpn) {
            ep.stats.registrations += 1;
        }
        Ok(MemoryRegion { addr: addr as u64, len, lkey: key, rkey: key, handle: key as u64 })
    }

    fn dereg_mr(&mut self, mr: &MemoryRegion) -> Result<(), VerbsError> {
        let mut s = self.fabric.lock();
        match s.mrs.get(&mr.lkey) {
            Some(m) if m.owner == self.qpn => {
                s.mrs.remove(&mr.lkey);
                if let Some(ep) = s.eps.get_mut(&self.qpn) {
                    ep.stats.deregistrations += 1;
                }
                Ok(())
            }
            _ => Err(VerbsError::Invalid { op: "dereg_mr", msg: format!("unknown key {:#x}", mr.lkey) }),
        }
    }

    fn post_recv(&mut self, wr_id: u64, local: Sge) -> Result<(), VerbsError> {
        let mut s = self.fabric.lock();
        let delay = s.cfg.delay_polls;
        let ep = s.eps.get_mut(&self.qpn).ok_or(VerbsError::QpError)?;
        match ep.state {
            QpState::Dead => return Err(VerbsError::QpError),
            QpState::Error => {
                // A receive posted to a queue pair in the error state is
                // flushed at once.
                let at = ep.polls + delay;
                ep.cq.push_back((
                    at,
                    Completion { wr_id, status: WcStatus::Flushed, opcode: WcOpcode::Recv, byte_len: 0, imm: None },
                ));
                ep.event = true;
            }
            _ => {
                ep.recvs.push_back((wr_id, local));
                ep.stats.recvs_posted += 1;
            }
        }
        Ok(())
    }

    fn post_send(&mut self, wr_id: u64, wr: &WorkRequest) -> Result<(), VerbsError> {
        let mut s = self.fabric.lock();
        let status = execute(&mut s, self.qpn, wr_id, wr)?;
        let delay = s.cfg.delay_polls;
        let opcode = match wr {
            WorkRequest::Send { .. } => WcOpcode::Send,
            WorkRequest::WriteImm { .. } => WcOpcode::Write,
            WorkRequest::Read { .. } => WcOpcode::Read,
        };
        let byte_len = match wr {
            WorkRequest::Read { local, .. } => local.len,
            _ => 0,
        };
        if let Some(ep) = s.eps.get_mut(&self.qpn) {
            let at = ep.polls + delay;
            ep.cq.push_back((at, Completion { wr_id, status, opcode, byte_len, imm: None }));
            ep.event = true;
        }
        // The failed request's own completion comes first, then the
        // flushed receives, as on a real queue pair.
        if !status.is_ok() {
            to_error(&mut s, self.qpn);
        }
        drop(s);
        self.fabric.shared.cv.notify_all();
        Ok(())
    }

    fn poll_cq(&mut self, out: &mut [Completion]) -> Result<usize, VerbsError> {
        let mut s = self.fabric.lock();
        let ep = s.eps.get_mut(&self.qpn).ok_or(VerbsError::QpError)?;
        if ep.state == QpState::Dead {
            return Err(VerbsError::QpError);
        }
        ep.polls += 1;
        let mut n = 0;
        while n < out.len() {
            match ep.cq.front() {
                Some((at, c)) if *at <= ep.polls => {
                    out[n] = *c;
                    ep.cq.pop_front();
                    n += 1;
                }
                _ => break,
            }
        }
        Ok(n)
    }

    fn arm_cq(&mut self) -> Result<(), VerbsError> {
        let mut s = self.fabric.lock();
        let ep = s.eps.get_mut(&self.qpn).ok_or(VerbsError::QpError)?;
        ep.armed = true;
        ep.event = false;
        ep.stats.arms += 1;
        Ok(())
    }

    fn wait_cq(&mut self, timeout: Duration) -> Result<bool, VerbsError> {
        let deadline = Instant::now() + timeout;
        let mut s = self.fabric.lock();
        if let Some(ep) = s.eps.get_mut(&self.qpn) {
            ep.stats.waits += 1;
        }
        loop {
            let ep = s.eps.get_mut(&self.qpn).ok_or(VerbsError::QpError)?;
            if ep.state == QpState::Dead {
                return Err(VerbsError::QpError);
            }
            // Delayed completions count as arrived: the delay is measured
            // in polls, and the waiter will poll next.
            if ep.armed && (ep.event || !ep.cq.is_empty()) {
                ep.armed = false;
                ep.event = false;
                return Ok(true);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            s = self.fabric.shared.cv.wait_timeout(s, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    fn disconnect(&mut self) {
        let mut s = self.fabric.lock();
        let peer = s.eps.get(&self.qpn).and_then(|e| e.peer);
        to_error(&mut s, self.qpn);
        if let Some(p) = peer {
            to_error(&mut s, p);
        }
        drop(s);
        self.fabric.shared.cv.notify_all();
    }
}

/// Runs one send-queue work request; returns its completion status.
fn execute(s: &mut State, me: u32, wr_id: u64, wr: &WorkRequest) -> Result<WcStatus, VerbsError> {
    let delay = s.cfg.delay_polls;
    let (state, peer, fail) = {
        let ep = s.eps.get_mut(&me).ok_or(VerbsError::QpError)?;
        (ep.state, ep.peer, ep.fail_next.take())
    };
    match state {
        QpState::Dead => return Err(VerbsError::QpError),
        QpState::Init => return Err(VerbsError::Invalid { op: "post_send", msg: "queue pair not connected".into() }),
        QpState::Error => return Ok(WcStatus::Flushed),
        QpState::Ready => {}
    }
    if let Some(st) = fail {
        return Ok(st);
    }
    let _ = wr_id;
    let peer = match peer {
        Some(p) if s.eps.get(&p).map(|e| e.state) == Some(QpState::Ready) => p,
        // The peer is gone or broken: an RC sender sees its retries run out.
        _ => return Ok(WcStatus::RetryExceeded),
    };
    // Ports drop packets of another partition (or between two limited
    // members): to the sender that is a peer that never answers.
    let key = |q: u32| s.eps.get(&q).and_then(|e| s.pkeys.get(e.pkey_index as usize).copied()).unwrap_or(0);
    let (mine, theirs) = (key(me), key(peer));
    if mine & PKEY_PARTITION != theirs & PKEY_PARTITION || (mine | theirs) & !PKEY_PARTITION == 0 {
        return Ok(WcStatus::RetryExceeded);
    }
    match *wr {
        WorkRequest::Send { local } => {
            if !check_local(s, me, &local, Access(0)) {
                return Ok(WcStatus::LocalProtection);
            }
            let pep = s.eps.get_mut(&peer).ok_or(VerbsError::QpError)?;
            let Some((rid, rsge)) = pep.recvs.pop_front() else {
                to_error(s, peer);
                return Ok(WcStatus::RnrRetryExceeded);
            };
            if rsge.len < local.len {
                let at = pep.polls + delay;
                pep.cq.push_back((
                    at,
                    Completion { wr_id: rid, status: WcStatus::LocalLength, opcode: WcOpcode::Recv, byte_len: 0, imm: None },
                ));
                to_error(s, peer);
                return Ok(WcStatus::RemoteInvalidRequest);
            }
            if !check_local(s, peer, &rsge, Access::LOCAL_WRITE) {
                to_error(s, peer);
                return Ok(WcStatus::RemoteInvalidRequest);
            }
            // SAFETY: both ranges lie inside live registrations, whose
            // owners promised (reg_mr's contract) to keep them allocated.
            unsafe { std::ptr::copy(local.addr as *const u8, rsge.addr as *mut u8, local.len as usize) };
            let pep = s.eps.get_mut(&peer).ok_or(VerbsError::QpError)?;
            let at = pep.polls + delay;
            pep.cq.push_back((
                at,
                Completion { wr_id: rid, status: WcStatus::Success, opcode: WcOpcode::Recv, byte_len: local.len, imm: None },
            ));
            pep.event = true;
            if let Some(ep) = s.eps.get_mut(&me) {
                ep.stats.sends += 1;
            }
        }
        WorkRequest::WriteImm { local, remote_addr, rkey, imm } => {
            if !check_local(s, me, &local, Access(0)) {
                return Ok(WcStatus::LocalProtection);
            }
            if !check_remote(s, peer, rkey, remote_addr, local.len, Access::REMOTE_WRITE) {
                to_error(s, peer);
                return Ok(WcStatus::RemoteAccess);
            }
            let pep = s.eps.get_mut(&peer).ok_or(VerbsError::QpError)?;
            let Some((rid, _)) = pep.recvs.pop_front() else {
                to_error(s, peer);
                return Ok(WcStatus::RnrRetryExceeded);
            };
            // SAFETY: as above.
            unsafe { std::ptr::copy(local.addr as *const u8, remote_addr as *mut u8, local.len as usize) };
            let at = pep.polls + delay;
            pep.cq.push_back((
                at,
                Completion { wr_id: rid, status: WcStatus::Success, opcode: WcOpcode::RecvImm, byte_len: local.len, imm: Some(imm) },
            ));
            pep.event = true;
            if let Some(ep) = s.eps.get_mut(&me) {
                ep.stats.writes += 1;
            }
        }
        WorkRequest::Read { local, remote_addr, rkey } => {
            if !check_local(s, me, &local, Access::LOCAL_WRITE) {
                return Ok(WcStatus::LocalProtection);
            }
            if !check_remote(s, peer, rkey, remote_addr, local.len, Access::REMOTE_READ) {
                to_error(s, peer);
                return Ok(WcStatus::RemoteAccess);
            }
            // SAFETY: as above.
            unsafe { std::ptr::copy(remote_addr as *const u8, local.addr as *mut u8, local.len as usize) };
            if let Some(ep) = s.eps.get_mut(&me) {
                ep.stats.reads += 1;
            }
        }
    }
    Ok(WcStatus::Success)
}

/// A [`VerbsProvider`] over a model fabric, for end-to-end tests of the
/// set-up exchange.
pub struct ModelProvider(pub Fabric);

impl VerbsProvider for ModelProvider {
    fn describe(&self) -> String {
        "in-process verbs model".into()
    }
    fn open(&self) -> Result<Box<dyn Verbs>, VerbsError> {
        Ok(Box::new(self.0.endpoint()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(ep: &mut ModelEndpoint, buf: &mut [u8], a: Access) -> MemoryRegion {
        unsafe { ep.reg_mr(buf.as_mut_ptr(), buf.len(), a) }.unwrap()
    }

    fn poll1(ep: &mut ModelEndpoint) -> Completion {
        let mut c = [Completion::EMPTY; 1];
        for _ in 0..100 {
            if ep.poll_cq(&mut c).unwrap() == 1 {
                return c[0];
            }
        }
        panic!("no completion");
    }

    #[test]
    fn send_lands_in_posted_receive() {
        let f = Fabric::new(ModelConfig::default());
        let (mut a, mut b) = f.pair();
        let mut src = *b"hello";
        let mut dst = [0u8; 8];
        let ms = reg(&mut a, &mut src, Access(0));
        let md = reg(&mut b, &mut dst, Access::LOCAL_WRITE);
        b.post_recv(7, md.sge(md.addr, 8)).unwrap();
        a.post_send(1, &WorkRequest::Send { local: ms.sge(ms.addr, 5) }).unwrap();
        assert_eq!(poll1(&mut a).status, WcStatus::Success);
        let c = poll1(&mut b);
        assert_eq!((c.wr_id, c.opcode, c.byte_len), (7, WcOpcode::Recv, 5));
        assert_eq!(&dst[..5], b"hello");
    }

    #[test]
    fn bad_rkey_is_a_remote_access_error_and_breaks_the_qp() {
        let f = Fabric::new(ModelConfig::default());
        let (mut a, mut b) = f.pair();
        let mut src = [1u8; 64];
        let mut dst = [0u8; 64];
        let ms = reg(&mut a, &mut src, Access::LOCAL_WRITE);
        let md = reg(&mut b, &mut dst, Access::REMOTE_READ);
        // Read with the right key but beyond the region, then a wrong key.
        a.post_send(1, &WorkRequest::Read { local: ms.sge(ms.addr, 64), remote_addr: md.addr + 1, rkey: md.rkey })
            .unwrap();
        assert_eq!(poll1(&mut a).status, WcStatus::RemoteAccess);
        a.post_send(2, &WorkRequest::Read { local: ms.sge(ms.addr, 8), remote_addr: md.addr, rkey: md.rkey }).unwrap();
        assert_eq!(poll1(&mut a).status, WcStatus::Flushed, "queue pair is in the error state");
        assert_eq!(dst, [0u8; 64]);
        // Writing without REMOTE_WRITE rights is refused too.
        let (mut c, mut d) = f.pair();
        let mut s2 = [5u8; 8];
        let m2 = reg(&mut c, &mut s2, Access(0));
        let mut d2 = [0u8; 8];
        let md2 = reg(&mut d, &mut d2, Access::REMOTE_READ);
        d.post_recv(1, Sge { addr: 0, len: 0, lkey: 0 }).unwrap();
        c.post_send(1, &WorkRequest::WriteImm { local: m2.sge(m2.addr, 8), remote_addr: md2.addr, rkey: md2.rkey, imm: 0 })
            .unwrap();
        assert_eq!(poll1(&mut c).status, WcStatus::RemoteAccess);
        assert_eq!(d2, [0u8; 8]);
    }

    #[test]
    fn send_without_receive_is_rnr_and_dead_peer_is_retry_exceeded() {
        let f = Fabric::new(ModelConfig::default());
        let (mut a, b) = f.pair();
        let mut src = [0u8; 4];
        let ms = reg(&mut a, &mut src, Access(0));
        a.post_send(1, &WorkRequest::Send { local: ms.sge(ms.addr, 4) }).unwrap();
        assert_eq!(poll1(&mut a).status, WcStatus::RnrRetryExceeded);
        let (mut c, d) = f.pair();
        drop((b, d));
        let mut s2 = [0u8; 4];
        let m2 = reg(&mut c, &mut s2, Access(0));
        c.post_send(1, &WorkRequest::Send { local: m2.sge(m2.addr, 4) }).unwrap();
        assert_eq!(poll1(&mut c).status, WcStatus::Flushed, "peer death moved ours to error");
    }

    #[test]
    fn completions_wait_the_configured_polls() {
        let f = Fabric::new(ModelConfig { delay_polls: 3, ..Default::default() });
        let (mut a, _b) = f.pair();
        let mut src = [0u8; 4];
        let ms = reg(&mut a, &mut src, Access::LOCAL_WRITE);
        let _ = ms;
        a.post_send(1, &WorkRequest::Read { local: ms.sge(ms.addr, 4), remote_addr: 0, rkey: 0 }).unwrap();
        let mut c = [Completion::EMPTY; 4];
        assert_eq!(a.poll_cq(&mut c).unwrap(), 0);
        assert_eq!(a.poll_cq(&mut c).unwrap(), 0);
        assert_eq!(a.poll_cq(&mut c).unwrap(), 1);
        a.arm_cq().unwrap();
        assert!(!a.wait_cq(Duration::from_millis(1)).unwrap());
    }
}
