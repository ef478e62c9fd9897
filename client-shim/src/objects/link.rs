//! JIT link states (cuLink*). Code is compiled on the server, not here, so a link of a single
//! image is that image: cuLinkComplete hands it back, and cuModuleLoadData loads it as it would
//! the image itself (PTX runs on the sim, any image on a GPU). Several images come back as a
//! link bundle (`rgpu_protocol::bundle`) that the server links when it is loaded, where the
//! device is known (server/src/module/link.rs): link errors surface at that load.

use std::sync::Mutex;

#[derive(Default)]
pub struct LinkState {
    /// The images added with their `CUjitInputType`, each as cuModuleLoadData takes it (PTX
    /// NUL-terminated).
    pub inputs: Mutex<Vec<(u32, Vec<u8>)>>,
    /// What cuLinkComplete returned: it must live until cuLinkDestroy.
    pub output: Mutex<Option<Vec<u8>>>,
}
