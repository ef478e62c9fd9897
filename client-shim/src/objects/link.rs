//! JIT link states (cuLink*). Code is compiled on the server, not here, so a link of a single
//! image is that image: cuLinkComplete hands it back, and cuModuleLoadData loads it as it would
//! the image itself (PTX runs on the sim, any image on a GPU). Linking several images together
//! (resolving extern symbols across them) is not offered yet.

use std::sync::Mutex;

#[derive(Default)]
pub struct LinkState {
    /// The images added, each as cuModuleLoadData takes it (PTX NUL-terminated).
    pub inputs: Mutex<Vec<Vec<u8>>>,
    /// What cuLinkComplete returned: it must live until cuLinkDestroy.
    pub output: Mutex<Option<Vec<u8>>>,
}
