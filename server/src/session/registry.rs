//! Sessions known to the server: opened on the control plane and waiting
//! for their data connection (pending), or attached and being served
//! (active). Cold path: touched once per open, attach, resume and close.
//!
//! An active session whose connection broke is still active: its thread
//! waits out the reconnect grace for a resumed connection, which comes
//! through the session's [`Resume`] channel. A resume with the session's
//! key replaces the connection the session has, dead or not (the key is the
//! client's proof; a client that lost its connection may know before the
//! server does): the old socket is shut, so one connection at a time is
//! served. Closing a session drops its channel, which ends the wait at once.
//!
//! The same channel carries visits ([`Registry::visit`]): work done on the
//! session's thread while it is held still between requests (a checkpoint).
//! Its connection is cut to bring the thread there; the client resumes
//! afterwards as after any broken connection. A session rebuilt from a
//! snapshot is adopted ([`Registry::adopt`]): active, with no connection
//! until its client resumes.
//!
//! A session that moved to another server leaves a forwarding note
//! ([`Registry::forward`]): its key and where it went, so that its client's
//! resume here is answered with the new address. Notes are bounded in count
//! and time; a session adopted here again drops its note.
//!
//! While a visit runs, the session is *held*: a resume is not queued
//! behind the visit (its client would wait unanswered, spending its
//! reconnect time, for as long as a checkpoint takes) but answered "held,
//! try again" ([`ResumeError::Held`]); the listener waits a little for the
//! visit to end before it answers so, so short visits cost no extra try.
//!
//! A session checkpointed out of this server (`rgpu checkpoint` without
//! `--continue`) leaves a checkpoint note ([`Registry::park`]): its client's
//! resumes are answered "held" until the session is restored (here, or
//! elsewhere and forwarded), its lease ends, or [`PARK_FOR`] passes, so a
//! program paused between a checkpoint and its restore waits for it
//! (within its `RGPU_HOLD_TIMEOUT`) instead of giving up after its
//! reconnect time.
//!
//! A session whose lease was preempted leaves a suspension note
//! ([`Registry::suspend`]): its key and its lease, so that its client's
//! resume is answered "suspended, try again" until the session is restored
//! here (adopting it drops the note) or its lease ends (the note is
//! dropped with [`Registry::unsuspend_lease`]).

use std::collections::HashMap;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rgpu_protocol::SESSION_KEY_LEN;
use rgpu_transport::tcp::TcpTransport;

pub type SessionKey = [u8; SESSION_KEY_LEN];

#[derive(Default)]
pub struct Registry {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    pending: HashMap<u64, Pending>,
    active: HashMap<u64, Active>,
    moved: HashMap<u64, Moved>,
    /// Sessions of preempted leases, on disk here: id -> (key, lease).
    suspended: HashMap<u64, (SessionKey, u64)>,
    /// Sessions checkpointed out of here and not yet restored.
    parked: HashMap<u64, Parked>,
    /// Sessions being adopted in place of one still ending here: resumes
    /// wait in the new session's channel instead of finding no session.
    arriving: HashMap<u64, Arriving>,
    closing: bool,
}

struct Arriving {
    key: SessionKey,
    resume: mpsc::Sender<Wake>,
    socket: Option<TcpStream>,
}

/// Where a session that left went, for its client's next resume.
struct Moved {
    key: SessionKey,
    to: String,
    until: Instant,
}

/// A session checkpointed out of this server, for its client's resumes.
struct Parked {
    key: SessionKey,
    /// Its lease, when it had one: the note goes when the lease ends.
    lease: Option<u64>,
    until: Instant,
}

/// Most checkpoint notes kept (the oldest goes first).
pub const MAX_PARKED: usize = 4096;
/// How long a checkpoint note is kept: the client's longest wait for a held
/// session (its RGPU_HOLD_TIMEOUT, an hour by default) and more.
pub const PARK_FOR: Duration = Duration::from_secs(86_400);

/// Most forwarding notes kept (the oldest goes first).
pub const MAX_FORWARDS: usize = 4096;
/// How long a forwarding note is kept: longer than any client's
/// reconnect time (its RGPU_RECONNECT_TIMEOUT).
pub const FORWARD_FOR: Duration = Duration::from_secs(600);

struct Active {
    key: SessionKey,
    client_name: String,
    /// A handle on the session's current socket, to unblock its thread
    /// (none for a restored session not yet resumed).
    socket: Option<TcpStream>,
    resume: mpsc::Sender<Wake>,
    /// The session's ended flag, once it has one: closing raises it, which
    /// stops its work.
    ended: Option<Arc<AtomicBool>>,
    /// Visits handed to the session and not yet over: while any is, the
    /// session is held still and resumes are answered "held".
    visits: Arc<AtomicUsize>,
}

/// One visit not yet over; dropped when the visit ends, or with it unmade
/// (its session ended first).
struct VisitPending(Arc<AtomicUsize>);

impl Drop for VisitPending {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Active {
    fn close(&self) {
        if let Some(e) = &self.ended {
            e.store(true, Ordering::Relaxed);
        }
        if let Some(s) = &self.socket {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// What a session's thread is woken for while its connection is down.
pub enum Wake {
    Resume(Resume),
    Visit(Visit),
}

/// Work done on a session's thread between requests; it says whether the
/// session goes on being served here.
pub type Visit = Box<dyn FnOnce(super::Parts<'_>) -> super::After + Send>;

/// A client coming back to its session on a new connection.
pub struct Resume {
    /// The new connection, TLS and all when the server serves TLS.
    pub transport: TcpTransport,
    /// The last reply sequence number the client received.
    pub last_reply: u64,
    /// What the connection holds of the server's connection limits, kept
    /// while it is served.
    pub hold: Box<dyn std::any::Any + Send>,
}

struct Pending {
    key: SessionKey,
    client_name: String,
}

/// Why a data connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachError {
    /// No pending session has this id, or the key is wrong.
    Unknown,
    ShuttingDown,
}

/// Why a resume was not handed to its session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResumeError {
    Refused(AttachError),
    /// The session moved to this address (its key was right).
    Moved(String),
    /// The session's lease is suspended (its key was right): it comes back
    /// here when the lease resumes.
    Suspended,
    /// The session is held still for a visit (its key was right): it is
    /// served again once the visit ends.
    Held,
}

/// Most suspension notes kept: a preempted lease's sessions beyond this are
/// not suspended (the suspension fails and the lease runs on).
pub const MAX_SUSPENDED: usize = 4096;

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a new pending session with a fresh random id and key.
    pub fn open(&self, client_name: &str) -> std::io::Result<(u64, SessionKey)> {
        let mut key = [0u8; SESSION_KEY_LEN];
        getrandom::fill(&mut key).map_err(std::io::Error::other)?;
        let mut inner = self.lock();
        if inner.closing {
            return Err(std::io::Error::other("server is shutting down"));
        }
        loop {
            let mut idb = [0u8; 8];
            getrandom::fill(&mut idb).map_err(std::io::Error::other)?;
            let id = u64::from_le_bytes(idb);
            if id != 0 && !inner.pending.contains_key(&id) && !inner.active.contains_key(&id)
                && !inner.suspended.contains_key(&id)
                && !inner.parked.contains_key(&id)
            {
                inner.pending.insert(id, Pending { key, client_name: client_name.to_string() });
                return Ok((id, key));
            }
        }
    }

    /// Drops a session still pending (its attach time ran out); `true` if it was.
    pub fn expire(&self, id: u64) -> bool {
        self.lock().pending.remove(&id).is_some()
    }

    /// Claims pending session `id` with `key`: at most one data connection
    /// per session ever gets it (later ones come back with [`Registry::resume`]).
    /// Returns the client's name and where resumed connections arrive.
    /// `socket` is kept so that shutdown can close the connection.
    pub fn attach(&self, id: u64, key: &[u8], socket: TcpStream) -> Result<(String, mpsc::Receiver<Wake>), AttachError> {
        let mut inner = self.lock();
        if inner.closing {
            return Err(AttachError::ShuttingDown);
        }
        let ok = inner.pending.get(&id).is_some_and(|p| constant_time_eq(&p.key, key));
        if !ok {
            return Err(AttachError::Unknown);
        }
        let p = inner.pending.remove(&id).ok_or(AttachError::Unknown)?;
        let (tx, rx) = mpsc::channel();
        let client_name = p.client_name.clone();
        inner.active.insert(id, Active { key: p.key, client_name, socket: Some(socket), resume: tx, ended: None, visits: Default::default() });
        Ok((p.client_name, rx))
    }

    /// Gives active session `id` its ended flag, raised if it is closed.
    pub fn bind_ended(&self, id: u64, ended: Arc<AtomicBool>) {
        if let Some(a) = self.lock().active.get_mut(&id) {
            a.ended = Some(ended);
        }
    }

    /// Hands `resume` to active session `id` if `key` is its key; the
    /// connection it had is shut (dead or not: see the module's comment).
    /// `socket` is a handle on the new connection.
    /// A refused resume comes back, for the caller to answer on it.
    pub fn resume(&self, id: u64, key: &[u8], socket: TcpStream, resume: Resume) -> Result<(), (ResumeError, Resume)> {
        let mut inner = self.lock();
        if inner.closing {
            return Err((ResumeError::Refused(AttachError::ShuttingDown), resume));
        }
        // Before the active sessions: a session that moved may still be
        // ending here, and its client belongs at the new address.
        let now = Instant::now();
        if let Some(m) = inner.moved.get(&id).filter(|m| m.until > now && constant_time_eq(&m.key, key)) {
            return Err((ResumeError::Moved(m.to.clone()), resume));
        }
        if inner.suspended.get(&id).is_some_and(|(k, _)| constant_time_eq(k, key)) {
            return Err((ResumeError::Suspended, resume));
        }
        // Before the active sessions too: a session checkpointed out may
        // still be ending here, and its client waits for the restore.
        if inner.parked.get(&id).is_some_and(|p| p.until > now && constant_time_eq(&p.key, key)) {
            return Err((ResumeError::Held, resume));
        }
        // Before the active sessions too: the one active may be the one
        // ending, which the arriving one replaces.
        if let Some(a) = inner.arriving.get_mut(&id).filter(|a| constant_time_eq(&a.key, key)) {
            if let Err(mpsc::SendError(Wake::Resume(r))) = a.resume.send(Wake::Resume(resume)) {
                return Err((ResumeError::Refused(AttachError::Unknown), r));
            }
            if let Some(old) = a.socket.replace(socket) {
                let _ = old.shutdown(Shutdown::Both);
            }
            return Ok(());
        }
        let Some(a) = inner.active.get_mut(&id).filter(|a| constant_time_eq(&a.key, key)) else {
            return Err((ResumeError::Refused(AttachError::Unknown), resume));
        };
        if a.visits.load(Ordering::Acquire) > 0 {
            return Err((ResumeError::Held, resume));
        }
        if let Err(mpsc::SendError(w)) = a.resume.send(Wake::Resume(resume)) {
            // Its thread is gone: the resume comes back to be answered.
            return match w {
                Wake::Resume(r) => Err((ResumeError::Refused(AttachError::Unknown), r)),
                Wake::Visit(_) => Ok(()),
            };
        }
        if let Some(old) = a.socket.replace(socket) {
            let _ = old.shutdown(Shutdown::Both);
        }
        Ok(())
    }

    /// Hands `visit` to active session `id` and cuts its connection, so its
    /// thread makes the visit between requests; false if there is no such
    /// session (or its thread is gone).
    pub fn visit(&self, id: u64, visit: Visit) -> bool {
        let inner = self.lock();
        let Some(a) = inner.active.get(&id) else { return false };
        a.visits.fetch_add(1, Ordering::AcqRel);
        let pending = VisitPending(a.visits.clone());
        let visit: Visit = Box::new(move |p| {
            let after = visit(p);
            drop(pending);
            after
        });
        if a.resume.send(Wake::Visit(visit)).is_err() {
            return false;
        }
        if let Some(s) = &a.socket {
            let _ = s.shutdown(Shutdown::Both);
        }
        true
    }

    /// Notes that session `id` (key `key`) now lives at `to`: its client's
    /// resumes here are redirected there for [`FORWARD_FOR`].
    pub fn forward(&self, id: u64, key: SessionKey, to: &str) {
        let mut inner = self.lock();
        let now = Instant::now();
        inner.moved.retain(|_, m| m.until > now);
        if inner.moved.len() >= MAX_FORWARDS {
            if let Some(oldest) = inner.moved.iter().min_by_key(|(_, m)| m.until).map(|(id, _)| *id) {
                inner.moved.remove(&oldest);
            }
        }
        inner.moved.insert(id, Moved { key, to: to.to_string(), until: now + FORWARD_FOR });
        inner.parked.remove(&id);
    }

    /// Notes that session `id` (key `key`, of `lease` if leased) was
    /// checkpointed out of here: its client's resumes are told to wait for
    /// its restore, for [`PARK_FOR`] at most.
    pub fn park(&self, id: u64, key: SessionKey, lease: Option<u64>) {
        let mut inner = self.lock();
        let now = Instant::now();
        inner.parked.retain(|_, p| p.until > now);
        if inner.parked.len() >= MAX_PARKED && !inner.parked.contains_key(&id) {
            if let Some(oldest) = inner.parked.iter().min_by_key(|(_, p)| p.until).map(|(id, _)| *id) {
                inner.parked.remove(&oldest);
            }
        }
        inner.parked.insert(id, Parked { key, lease, until: now + PARK_FOR });
    }

    /// Drops the checkpoint notes of leases `listed` says ended: their
    /// clients are refused from now on rather than waiting for a restore
    /// that cannot come. Returns the sessions dropped.
    pub fn unpark_ended(&self, listed: impl Fn(u64) -> bool) -> Vec<u64> {
        let mut inner = self.lock();
        let ids: Vec<u64> = inner.parked.iter().filter(|(_, p)| p.lease.is_some_and(|l| !listed(l))).map(|(&id, _)| id).collect();
        for id in &ids {
            inner.parked.remove(id);
        }
        ids
    }

    /// Notes that session `id` (key `key`) of `lease` is suspended here, on
    /// disk: its client's resumes are told to wait. False when too many
    /// notes are kept already.
    pub fn suspend(&self, id: u64, key: SessionKey, lease: u64) -> bool {
        let mut inner = self.lock();
        if inner.suspended.len() >= MAX_SUSPENDED && !inner.suspended.contains_key(&id) {
            return false;
        }
        inner.suspended.insert(id, (key, lease));
        true
    }

    /// Drops the suspension notes of `lease` (it ended): its clients'
    /// resumes are refused from now on. Returns the sessions it had.
    pub fn unsuspend_lease(&self, lease: u64) -> Vec<u64> {
        let mut inner = self.lock();
        let ids: Vec<u64> = inner.suspended.iter().filter(|(_, (_, l))| *l == lease).map(|(&id, _)| id).collect();
        for id in &ids {
            inner.suspended.remove(id);
        }
        ids
    }

    /// The leases with suspension notes here.
    pub fn suspended_leases(&self) -> std::collections::BTreeSet<u64> {
        self.lock().suspended.values().map(|&(_, l)| l).collect()
    }

    /// Every active session's client process id, where its client named one.
    pub fn pids(&self) -> HashMap<u64, u32> {
        self.lock().active.iter().filter_map(|(&id, a)| Some((id, client_pid(&a.client_name)?))).collect()
    }

    /// Every active session's id and client name, by id.
    pub fn active(&self) -> Vec<(u64, String)> {
        let mut v: Vec<(u64, String)> = self.lock().active.iter().map(|(&id, a)| (id, a.client_name.clone())).collect();
        v.sort_by_key(|(id, _)| *id);
        v
    }

    /// Session `id`'s key and client name, if it is active.
    pub fn identity(&self, id: u64) -> Option<(SessionKey, String)> {
        self.lock().active.get(&id).map(|a| (a.key, a.client_name.clone()))
    }

    /// Registers a session rebuilt from a snapshot as active, without a
    /// connection: its client resumes it with `key`. A session with this id
    /// still here is refused, unless `replace` (its state left in the
    /// snapshot being restored) or it moved away (it is ending): it is
    /// closed, and its thread's end awaited (at most `wait`), so that
    /// thread's detach cannot drop the new one.
    pub fn adopt(
        &self,
        id: u64,
        key: SessionKey,
        client_name: &str,
        replace: bool,
        wait: std::time::Duration,
    ) -> Result<mpsc::Receiver<Wake>, AttachError> {
        let until = std::time::Instant::now() + wait;
        let (tx, rx) = mpsc::channel();
        // Set once the old session is being replaced: from then on, resumes
        // are queued for the new one (see `arriving`).
        let mut replacing = false;
        loop {
            let mut inner = self.lock();
            if inner.closing || inner.pending.contains_key(&id) {
                inner.arriving.remove(&id);
                return Err(if inner.closing { AttachError::ShuttingDown } else { AttachError::Unknown });
            }
            // A session that moved away and is ending here is replaced
            // too: it is coming back.
            let replace = replace || replacing || inner.moved.contains_key(&id);
            match inner.active.get(&id) {
                None => {
                    // Back here after moving away, or restored after a
                    // suspension: resumes are ours again.
                    inner.moved.remove(&id);
                    inner.suspended.remove(&id);
                    inner.parked.remove(&id);
                    let socket = inner.arriving.remove(&id).and_then(|a| a.socket);
                    let a = Active { key, client_name: client_name.to_string(), socket, resume: tx, ended: None, visits: Default::default() };
                    inner.active.insert(id, a);
                    return Ok(rx);
                }
                Some(old) if replace && std::time::Instant::now() < until => {
                    old.close();
                    if !replacing {
                        replacing = true;
                        inner.moved.remove(&id);
                        inner.parked.remove(&id);
                        inner.arriving.insert(id, Arriving { key, resume: tx.clone(), socket: None });
                    }
                }
                Some(_) => {
                    inner.arriving.remove(&id);
                    return Err(AttachError::Unknown);
                }
            }
            drop(inner);
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// Waits, up to `wait`, until no session that is leaving this server
    /// (moved away or suspended, its thread ending at once) is left. Such a session frees its device memory only as its
    /// thread ends, and a session arriving meanwhile (the same one coming
    /// straight back, as a migration there and back does) needs the same
    /// device addresses. `false`: one was still ending at the deadline.
    pub fn wait_for_leaving(&self, wait: std::time::Duration) -> bool {
        let until = Instant::now() + wait;
        loop {
            {
                let inner = self.lock();
                let leaving = |id: &u64| inner.active.contains_key(id);
                if !(inner.moved.keys().any(leaving) || inner.suspended.keys().any(leaving)) {
                    return true;
                }
            }
            if Instant::now() >= until {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// Forgets an active session (its thread is ending).
    pub fn detach(&self, id: u64) {
        self.lock().active.remove(&id);
    }

    /// Closes one session (its lease ended): a pending one is dropped, an
    /// active one's work is stopped and its connection shut, which ends its
    /// thread, in the reconnect grace or not. `true` if there was such a session.
    pub fn close(&self, id: u64) -> bool {
        let mut inner = self.lock();
        inner.parked.remove(&id);
        if inner.pending.remove(&id).is_some() {
            return true;
        }
        match inner.active.remove(&id) {
            Some(a) => {
                a.close();
                true
            }
            None => false,
        }
    }

    /// Refuses new sessions and closes every active one, which makes each
    /// session thread end and free what it held.
    pub fn close_all(&self) {
        let mut inner = self.lock();
        inner.closing = true;
        inner.pending.clear();
        inner.moved.clear();
        inner.suspended.clear();
        inner.parked.clear();
        inner.arriving.clear();
        for (_, a) in inner.active.drain() {
            a.close();
        }
    }

    pub fn counts(&self) -> (usize, usize) {
        let inner = self.lock();
        (inner.pending.len(), inner.active.len())
    }

    /// Sessions on disk here for their suspended leases.
    pub fn suspended_count(&self) -> usize {
        self.lock().suspended.len()
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resume_on_loopback() -> (TcpStream, Resume) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        let transport = TcpTransport::new(s).unwrap();
        (c, Resume { transport, last_reply: 0, hold: Box::new(()) })
    }

    #[test]
    fn a_moved_session_is_redirected_only_for_its_key_and_drops_its_note_when_back() {
        let r = Registry::default();
        let key = [5u8; SESSION_KEY_LEN];
        let rx = r.adopt(7, key, "c", false, Duration::ZERO).unwrap();
        r.forward(7, key, "gpu2:7767");
        // Still active here (its thread ending), yet the client belongs there.
        let (c, res) = resume_on_loopback();
        match r.resume(7, &key, c, res) {
            Err((ResumeError::Moved(to), _)) => assert_eq!(to, "gpu2:7767"),
            other => panic!("not redirected: {:?}", other.err().map(|e| e.0)),
        }
        // Without the key nothing is said of where it went.
        let (c, res) = resume_on_loopback();
        assert!(matches!(r.resume(7, &[6u8; SESSION_KEY_LEN], c, res), Err((ResumeError::Refused(AttachError::Unknown), _))));
        drop(rx);
        r.detach(7);
        // Migrated back: adopted here again, the note is dropped and
        // resumes reach the session.
        let rx = r.adopt(7, key, "c", false, Duration::ZERO).unwrap();
        let (c, res) = resume_on_loopback();
        assert!(r.resume(7, &key, c, res).is_ok());
        assert!(matches!(rx.try_recv(), Ok(Wake::Resume(_))));
    }

    #[test]
    fn an_arrival_waits_for_a_session_leaving_here_to_end() {
        let r = Arc::new(Registry::default());
        let key = [5u8; SESSION_KEY_LEN];
        assert!(r.wait_for_leaving(Duration::ZERO), "nothing is leaving");
        let _rx = r.adopt(7, key, "c", false, Duration::ZERO).unwrap();
        assert!(r.wait_for_leaving(Duration::ZERO), "a session served here is not leaving");
        r.forward(7, key, "gpu2:7767");
        // Moved away, its thread still ending: its memory is not yet free.
        let t = Instant::now();
        assert!(!r.wait_for_leaving(Duration::from_millis(50)));
        assert!(t.elapsed() >= Duration::from_millis(50));
        let ending = {
            let r = r.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                r.detach(7);
            })
        };
        let t = Instant::now();
        assert!(r.wait_for_leaving(Duration::from_secs(10)));
        assert!(t.elapsed() >= Duration::from_millis(90), "returned before the session ended");
        ending.join().unwrap();
        // A suspended session is leaving too.
        let _rx = r.adopt(8, key, "c", false, Duration::ZERO).unwrap();
        assert!(r.suspend(8, key, 0x11));
        assert!(!r.wait_for_leaving(Duration::ZERO));
        r.detach(8);
        assert!(r.wait_for_leaving(Duration::ZERO));
    }

    #[test]
    fn a_suspended_session_is_told_to_wait_until_restored_or_its_lease_ends() {
        let r = Registry::default();
        let key = [5u8; SESSION_KEY_LEN];
        let rx = r.adopt(7, key, "c", false, Duration::ZERO).unwrap();
        assert!(r.suspend(7, key, 0x11));
        assert_eq!(r.suspended_count(), 1);
        // Its thread is still ending: the client is told to wait, not
        // handed to the session that is going.
        let (c, res) = resume_on_loopback();
        assert!(matches!(r.resume(7, &key, c, res), Err((ResumeError::Suspended, _))));
        let (c, res) = resume_on_loopback();
        assert!(matches!(r.resume(7, &[6u8; SESSION_KEY_LEN], c, res), Err((ResumeError::Refused(AttachError::Unknown), _))),
            "without the key nothing is said of the session");
        drop(rx);
        r.detach(7);
        assert_eq!(r.suspended_leases().into_iter().collect::<Vec<_>>(), vec![0x11]);
        // Restored: resumes reach it again.
        let rx = r.adopt(7, key, "c", true, Duration::ZERO).unwrap();
        let (c, res) = resume_on_loopback();
        assert!(r.resume(7, &key, c, res).is_ok());
        assert!(matches!(rx.try_recv(), Ok(Wake::Resume(_))));
        assert!(r.suspended_leases().is_empty());
        // A lease that ends while suspended: its clients are refused.
        assert!(r.suspend(8, key, 0x12));
        assert_eq!(r.unsuspend_lease(0x12), vec![8]);
        let (c, res) = resume_on_loopback();
        assert!(matches!(r.resume(8, &key, c, res), Err((ResumeError::Refused(AttachError::Unknown), _))));
    }

    /// A resume while a visit (a checkpoint) holds the session is told to
    /// wait, not queued behind the visit, where its client would wait
    /// unanswered for as long as the visit takes.
    #[test]
    fn a_held_session_is_told_to_wait_until_its_visits_are_over() {
        let r = Registry::default();
        let key = [5u8; SESSION_KEY_LEN];
        let rx = r.adopt(7, key, "c", false, Duration::ZERO).unwrap();
        assert!(r.visit(7, Box::new(|_| crate::session::After::Serve)));
        assert!(r.visit(7, Box::new(|_| crate::session::After::Serve)));
        let (c, res) = resume_on_loopback();
        assert!(matches!(r.resume(7, &key, c, res), Err((ResumeError::Held, _))));
        let (c, res) = resume_on_loopback();
        assert!(matches!(r.resume(7, &[6u8; SESSION_KEY_LEN], c, res), Err((ResumeError::Refused(AttachError::Unknown), _))),
            "without the key nothing is said of the session");
        // One visit over (here dropped unmade, as when its session ends
        // first): the other still holds it.
        let Ok(Wake::Visit(first)) = rx.try_recv() else { panic!("no visit queued") };
        drop(first);
        let (c, res) = resume_on_loopback();
        assert!(matches!(r.resume(7, &key, c, res), Err((ResumeError::Held, _))));
        let Ok(Wake::Visit(second)) = rx.try_recv() else { panic!("no second visit queued") };
        drop(second);
        let (c, res) = resume_on_loopback();
        assert!(r.resume(7, &key, c, res).is_ok(), "a resume after the visits was not handed on");
        assert!(matches!(rx.try_recv(), Ok(Wake::Resume(_))));
        // A visit to a session whose thread is gone is refused and holds nothing.
        drop(rx);
        assert!(!r.visit(7, Box::new(|_| crate::session::After::Serve)));
        let (c, res) = resume_on_loopback();
        assert!(matches!(r.resume(7, &key, c, res), Err((ResumeError::Refused(AttachError::Unknown), _))));
    }

    /// A session checkpointed out keeps its client waiting for the restore,
    /// and only for it; a restore here, a forward elsewhere, its lease's
    /// end or a close each end the wait.
    #[test]
    fn a_checkpointed_out_session_is_waited_for_until_restored_forwarded_or_its_lease_ends() {
        let r = Registry::default();
        let key = [5u8; SESSION_KEY_LEN];
        let rx = r.adopt(7, key, "c", false, Duration::ZERO).unwrap();
        r.park(7, key, Some(0x11));
        // Its thread is still ending: the client is told to wait, not
        // handed to the session that left.
        let (c, res) = resume_on_loopback();
        assert!(matches!(r.resume(7, &key, c, res), Err((ResumeError::Held, _))));
        let (c, res) = resume_on_loopback();
        assert!(matches!(r.resume(7, &[6u8; SESSION_KEY_LEN], c, res), Err((ResumeError::Refused(AttachError::Unknown), _))),
            "without the key nothing is said of the session");
        drop(rx);
        r.detach(7);
        let (c, res) = resume_on_loopback();
        assert!(matches!(r.resume(7, &key, c, res), Err((ResumeError::Held, _))), "the wait outlives the session's thread");
        // Restored here: resumes reach it.
        let rx = r.adopt(7, key, "c", true, Duration::ZERO).unwrap();
        let (c, res) = resume_on_loopback();
        assert!(r.resume(7, &key, c, res).is_ok());
        assert!(matches!(rx.try_recv(), Ok(Wake::Resume(_))));
        drop(rx);
        r.detach(7);
        // Restored elsewhere: the client is sent there.
        r.park(7, key, Some(0x11));
        r.forward(7, key, "gpu2:7767");
        let (c, res) = resume_on_loopback();
        assert!(matches!(r.resume(7, &key, c, res), Err((ResumeError::Moved(_), _))));
        // Its lease ended: refused, not kept waiting for nothing. A note
        // of a listed lease, or of no lease, stays.
        r.park(8, key, Some(0x12));
        r.park(9, key, Some(0x13));
        r.park(10, key, None);
        assert_eq!(r.unpark_ended(|l| l == 0x13), vec![8]);
        for (id, held) in [(8, false), (9, true), (10, true)] {
            let (c, res) = resume_on_loopback();
            let got = r.resume(id, &key, c, res);
            assert_eq!(matches!(got, Err((ResumeError::Held, _))), held, "session {id}");
        }
        // Closed (its lease ended by the broker's word): refused.
        assert!(!r.close(9));
        let (c, res) = resume_on_loopback();
        assert!(matches!(r.resume(9, &key, c, res), Err((ResumeError::Refused(AttachError::Unknown), _))));
    }

    /// A restore in place of a session still ending here: a resume that
    /// comes while the old one ends reaches the new one (it used to find
    /// no session in between and be refused for good).
    #[test]
    fn a_resume_during_a_replacement_waits_for_the_new_session() {
        let r = Arc::new(Registry::default());
        let key = [5u8; SESSION_KEY_LEN];
        let _old = r.adopt(7, key, "c", false, Duration::ZERO).unwrap();
        let ended = Arc::new(AtomicBool::new(false));
        r.bind_ended(7, ended.clone());
        // The old session's thread: it sees its ended flag, takes a while
        // to free what it holds, then detaches.
        let (r2, e2) = (r.clone(), ended.clone());
        let old_thread = std::thread::spawn(move || {
            while !e2.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(5));
            }
            std::thread::sleep(Duration::from_millis(150));
            r2.detach(7);
        });
        let r3 = r.clone();
        let adopting = std::thread::spawn(move || r3.adopt(7, key, "c", true, Duration::from_secs(5)).unwrap());
        while !ended.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(5));
        }
        let (c, res) = resume_on_loopback();
        assert!(r.resume(7, &key, c, res).is_ok(), "a resume during the replacement was refused");
        old_thread.join().unwrap();
        let new = adopting.join().unwrap();
        assert!(matches!(new.try_recv(), Ok(Wake::Resume(_))), "the new session did not get the resume");
    }

    #[test]
    fn forwarding_notes_are_bounded() {
        let r = Registry::default();
        for id in 0..(MAX_FORWARDS as u64 + 10) {
            r.forward(id, [1; SESSION_KEY_LEN], "gpu2:7767");
        }
        assert_eq!(r.lock().moved.len(), MAX_FORWARDS);
    }

    #[test]
    fn checkpoint_notes_are_bounded_and_the_oldest_goes() {
        let r = Registry::default();
        for id in 1..=(MAX_PARKED as u64 + 10) {
            r.park(id, [1; SESSION_KEY_LEN], None);
        }
        let inner = r.lock();
        assert_eq!(inner.parked.len(), MAX_PARKED);
        assert!(!inner.parked.contains_key(&1) && inner.parked.contains_key(&(MAX_PARKED as u64 + 10)));
    }
}

/// The process id in a client name as rgpu's clients give it at openSession
/// (`python3 (pid 4242)`: the shim's and the NVML library's `client_name`).
/// Only reported back (NVML's process list), never trusted for anything.
pub fn client_pid(name: &str) -> Option<u32> {
    let inner = name.strip_suffix(')')?;
    let at = inner.rfind("(pid ")?;
    inner[at + 5..].parse().ok()
}

#[cfg(test)]
mod pid_tests {
    use super::client_pid;

    #[test]
    fn pids_come_from_the_clients_own_names() {
        assert_eq!(client_pid("python3 (pid 4242)"), Some(4242));
        assert_eq!(client_pid("a (pid 1) (pid 77)"), Some(77));
        assert_eq!(client_pid("python3"), None);
        assert_eq!(client_pid("x (pid -3)"), None);
        assert_eq!(client_pid("x (pid 99999999999)"), None);
        assert_eq!(client_pid(""), None);
    }
}
