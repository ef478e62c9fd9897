//! Sizes of rgpu's data-plane frames, computed with the protocol's own
//! encoder, so that the raw-TCP baselines move exactly the bytes rgpu does.

use rgpu_protocol::frame::HEADER_LEN;
use rgpu_cuda_types::tag;
use rgpu_protocol::message::Encoder;

fn request(build: impl FnOnce(rgpu_protocol::data_capnp::request::Builder<'_>)) -> usize {
    let mut out = Vec::new();
    HEADER_LEN + Encoder::default().request(&mut out, build)
}

pub fn stream_query_request() -> usize {
    request(|r| r.init_stream_query().set_handle((tag::STREAM as u64) << tag::SHIFT | 1))
}

pub fn ctx_synchronize_request() -> usize {
    request(|r| r.init_ctx_synchronize().set_device(0))
}

pub fn empty_reply() -> usize {
    let mut out = Vec::new();
    HEADER_LEN + Encoder::default().reply(&mut out, |mut r| r.set_none(()))
}

/// A launch frame, parameter bytes included.
pub fn launch_request(param_bytes: usize) -> usize {
    param_bytes
        + request(|r| {
            let mut l = r.init_launch_kernel();
            l.set_module((tag::MODULE as u64) << tag::SHIFT | 1);
            l.set_grid_x(1);
            l.set_block_x(32);
        })
}

/// A host-to-device copy frame, payload included.
pub fn htod_request(bytes: usize) -> usize {
    bytes
        + request(|r| {
            let mut m = r.init_memcpy_hto_d();
            m.set_dst(0x7f00_0000_0000);
        })
}

/// A device-to-host request, and its reply with the payload.
pub fn dtoh_request() -> usize {
    request(|r| {
        let mut m = r.init_memcpy_dto_h();
        m.set_src(0x7f00_0000_0000);
        m.set_size(1 << 20);
    })
}
