//! How a kernel fails: a fault at one thread, and the launch error that names where. Its own
//! module because both the interpreter and device printf (which reads memory) report faults.

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    IllegalAddress { addr: u64, space: &'static str },
    Misaligned { addr: u64 },
    Timeout,
    Trap,
    /// A device `assert` failed (`__assertfail`).
    Assert { message: String, file: String, line: u32, function: String },
    Unsupported(String),
    /// Another block failed first; this one stopped.
    Aborted,
    /// The caller's cancel flag was raised (the session ended): the launch stopped.
    Cancelled,
}

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("kernel {kernel}: {fault:?} in block ({},{},{}) thread ({},{},{}) at PTX line {line}", block[0], block[1], block[2], thread[0], thread[1], thread[2])]
pub struct ExecError {
    pub kernel: String,
    pub block: [u32; 3],
    pub thread: [u32; 3],
    pub line: u32,
    pub fault: Fault,
}
