//! A module image as `moduleLoad` reads it (`server/src/command/module.rs`):
//! a link bundle is linked first, then the image (fatbin, cubin, PTX text)
//! is described by `module::read_image_for` for a compute capability 9.0
//! device (the sim's default), and the sim decodes its kernels as its
//! `module_load` does, globals at made-up addresses.
//!
//! Input: the image bytes.

use rgpu_server::backend::sim::kernels;
use rgpu_server::backend::GlobalInfo;
use rgpu_server::module;

/// The sim's default architecture (`--sim-compute-capability 9.0`).
const ARCH: u32 = 90;
/// What the server's input budget lets a load inflate
/// (`--max-buffered-input` is 1 GiB by default; a fuzz run gets less, to
/// stay under libFuzzer's memory limit): `moduleLoad` refuses an image whose
/// compressed entries announce more before it reads any.
const INFLATE_BUDGET: u64 = 256 << 20;

pub fn run(data: &[u8]) {
    crate::on_session_stack(|| load(data));
}

fn load(data: &[u8]) {
    let unpacked = module::fatbin::parse_fatbin(data).map_or(0, |es| {
        es.iter()
            .fold(0u64, |n, e| n.saturating_add(e.unpacked_len()))
    });
    if unpacked > INFLATE_BUDGET {
        return;
    }
    let linked;
    let image = if data.starts_with(rgpu_protocol::bundle::MAGIC) {
        match module::link_bundle(data, ARCH) {
            Ok(l) => {
                linked = l;
                &linked[..]
            }
            Err(_) => return,
        }
    } else {
        data
    };
    let Ok(parsed) = module::read_image_for(image, ARCH) else {
        return;
    };
    let mut next = 0x7f00_0000_0000u64;
    let globals: Vec<GlobalInfo> = parsed
        .globals
        .iter()
        .map(|g| {
            let ptr = next;
            next = next.saturating_add(g.size.min(1 << 40)).saturating_add(256) & !255;
            GlobalInfo {
                name: g.name.clone(),
                ptr,
                size: g.size,
                managed: g.managed,
            }
        })
        .collect();
    if let Ok(decoded) = kernels::decode(&parsed, &globals) {
        assert_eq!(
            decoded.len(),
            parsed.kernels.len(),
            "one decode result per kernel"
        );
    }
}
