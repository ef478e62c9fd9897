//! The control plane (hello, devices, session), through `rgpu-control-client`, which rgpu's
//! NVML library shares.

pub use rgpu_control_client::{Hello, RemoteDevice};

use super::ClientError;

/// Says hello, lists the devices and opens a session on `addr`.
pub fn open(addr: &str, client_name: &str) -> Result<Hello, ClientError> {
    let hello = rgpu_control_client::open(addr, client_name, super::security::security(addr)?)?;
    // The lease's InfiniBand partition, for the data connection's RDMA set-up.
    super::transport_select::note_pkey(hello.session_id, hello.pkey);
    Ok(hello)
}
