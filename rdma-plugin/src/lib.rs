//! rgpu's RDMA verbs plugin: libibverbs behind the C-ABI table of
//! `rgpu_transport::rdma::plugin`.
//!
//! The server and the shim never link libibverbs. They `dlopen` this library
//! when RDMA is requested or `auto`; on a host without rdma-core that fails
//! (libibverbs.so.1 is missing) and on one without a device
//! `device_count` says 0, and they carry on over TCP.
//!
//! One endpoint = one device context, protection domain, completion channel,
//! completion queue and RC queue pair. Everything is plain verbs: no
//! rdma_cm (the set-up exchange rides on rgpu's own TCP connection), no
//! extended verbs, so any provider (mlx5, efa with RC, rxe for soft-RoCE)
//! that does RC with RDMA WRITE-with-immediate and READ will do.
//!
//! Every entry point returns 0 or a negative errno and never unwinds: a
//! panic is caught and reported as -EIO.

use std::ffi::{c_char, c_int, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use rdma_sys::*;
use rgpu_transport::rdma::plugin::*;

/// The entry point: the versioned table.
#[no_mangle]
pub extern "C" fn rgpu_rdma_plugin_v1() -> *const VerbsVtable {
    &VTABLE
}

static VTABLE: VerbsVtable = VerbsVtable {
    abi_version: ABI_VERSION,
    size: std::mem::size_of::<VerbsVtable>() as u32,
    device_count,
    describe,
    open,
    close,
    local_info,
    connect,
    reg_mr,
    dereg_mr,
    post_recv,
    post_send,
    poll_cq,
    arm_cq,
    wait_cq,
    disconnect,
    pkey_index,
    set_pkey_index,
};

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

fn guarded(f: impl FnOnce() -> i32) -> i32 {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(-libc::EIO)
}

struct Endpoint {
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    channel: *mut ibv_comp_channel,
    cq: *mut ibv_cq,
    qp: *mut ibv_qp,
    port: u8,
    gid_index: i32,
    active_mtu: u32,
    roce: bool,
    info: RawEndpointInfo,
}

fn mtu_bytes(m: u32) -> u32 {
    match m {
        1 => 256,
        2 => 512,
        3 => 1024,
        4 => 2048,
        5 => 4096,
        _ => 1024,
    }
}

fn mtu_enum(bytes: u32) -> u32 {
    match bytes {
        0..=256 => 1,
        257..=512 => 2,
        513..=1024 => 3,
        1025..=2048 => 4,
        _ => 5,
    }
}

/// Opens the named device (or the first one).
unsafe fn open_device(name: *const c_char) -> Result<*mut ibv_context, i32> {
    let mut n: c_int = 0;
    let list = ibv_get_device_list(&mut n);
    if list.is_null() {
        return Err(-errno().max(1));
    }
    let mut chosen = ptr::null_mut();
    for i in 0..n.max(0) as usize {
        let dev = *list.add(i);
        if dev.is_null() {
            break;
        }
        if name.is_null() || CStr::from_ptr(ibv_get_device_name(dev)) == CStr::from_ptr(name) {
            chosen = dev;
            break;
        }
    }
    let ctx = if chosen.is_null() { ptr::null_mut() } else { ibv_open_device(chosen) };
    let err = errno();
    ibv_free_device_list(list);
    if chosen.is_null() {
        return Err(-libc::ENODEV);
    }
    if ctx.is_null() {
        return Err(-err.max(1));
    }
    Ok(ctx)
}

unsafe extern "C" fn device_count() -> i32 {
    guarded(|| unsafe {
        let mut n: c_int = 0;
        let list = ibv_get_device_list(&mut n);
        if list.is_null() {
            // No kernel support (ENOSYS) or no devices: nothing to use.
            return 0;
        }
        ibv_free_device_list(list);
        n.max(0)
    })
}

unsafe extern "C" fn describe(opts: *const RawOpenOptions, buf: *mut c_char, len: usize) -> i32 {
    guarded(|| unsafe {
        if opts.is_null() || buf.is_null() || len == 0 {
            return -libc::EINVAL;
        }
        let o = &*opts;
        let ctx = match open_device(o.device) {
            Ok(c) => c,
            Err(e) => return e,
        };
        let name = CStr::from_ptr(ibv_get_device_name((*ctx).device)).to_string_lossy().into_owned();
        let mut pa: ibv_port_attr = std::mem::zeroed();
        let rc = ___ibv_query_port(ctx, o.port, &mut pa);
        let text = if rc == 0 {
            format!(
                "{name} port {} ({}, MTU {})",
                o.port,
                if pa.link_layer == 2 { "RoCE" } else { "InfiniBand" },
                mtu_bytes(pa.active_mtu)
            )
        } else {
            format!("{name} port {}", o.port)
        };
        ibv_close_device(ctx);
        let b = text.as_bytes();
        let n = b.len().min(len - 1);
        ptr::copy_nonoverlapping(b.as_ptr(), buf as *mut u8, n);
        *buf.add(n) = 0;
        0
    })
}

unsafe extern "C" fn open(opts: *const RawOpenOptions, out: *mut Ep) -> i32 {
    guarded(|| unsafe {
        if opts.is_null() || out.is_null() {
            return -libc::EINVAL;
        }
        let o = &*opts;
        let ctx = match open_device(o.device) {
            Ok(c) => c,
            Err(e) => return e,
        };
        let mut ep = Box::new(Endpoint {
            ctx,
            pd: ptr::null_mut(),
            channel: ptr::null_mut(),
            cq: ptr::null_mut(),
            qp: ptr::null_mut(),
            port: if o.port == 0 { 1 } else { o.port },
            gid_index: o.gid_index,
            active_mtu: 3,
            roce: false,
            info: RawEndpointInfo::default(),
        });
        let rc = build(&mut ep, o);
        if rc != 0 {
            teardown(&mut ep);
            return rc;
        }
        *out = Box::into_raw(ep) as Ep;
        0
    })
}

unsafe fn build(ep: &mut Endpoint, o: &RawOpenOptions) -> i32 {
    let mut pa: ibv_port_attr = std::mem::zeroed();
    if ___ibv_query_port(ep.ctx, ep.port, &mut pa) != 0 {
        return -errno().max(1);
    }
    if pa.state != ibv_port_state::IBV_PORT_ACTIVE {
        return -libc::ENETDOWN;
    }
    ep.active_mtu = pa.active_mtu;
    ep.roce = pa.link_layer == 2;
    if ep.gid_index < 0 && ep.roce {
        ep.gid_index = 0;
    }
    ep.pd = ibv_alloc_pd(ep.ctx);
    if ep.pd.is_null() {
        return -errno().max(1);
    }
    ep.channel = ibv_create_comp_channel(ep.ctx);
    if ep.channel.is_null() {
        return -errno().max(1);
    }
    // Waiting polls the channel's fd with a timeout; reading it must not block.
    let fd = (*ep.channel).fd;
    let fl = libc::fcntl(fd, libc::F_GETFL);
    libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
    let depth = (o.max_send_wr + o.max_recv_wr).max(64) as c_int;
    ep.cq = ibv_create_cq(ep.ctx, depth, ptr::null_mut(), ep.channel, 0);
    if ep.cq.is_null() {
        return -errno().max(1);
    }
    let mut init: ibv_qp_init_attr = std::mem::zeroed();
    init.send_cq = ep.cq;
    init.recv_cq = ep.cq;
    init.cap.max_send_wr = o.max_send_wr.max(16);
    init.cap.max_recv_wr = o.max_recv_wr.max(16);
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    init.qp_type = ibv_qp_type::IBV_QPT_RC;
    init.sq_sig_all = 1;
    ep.qp = ibv_create_qp(ep.pd, &mut init);
    if ep.qp.is_null() {
        return -errno().max(1);
    }
    let mut a: ibv_qp_attr = std::mem::zeroed();
    a.qp_state = ibv_qp_state::IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = ep.port;
    a.qp_access_flags = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
        | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
        | ibv_access_flags::IBV_ACCESS_REMOTE_READ)
        .0;
    let mask = ibv_qp_attr_mask::IBV_QP_STATE
        | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
        | ibv_qp_attr_mask::IBV_QP_PORT
        | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
    if ibv_modify_qp(ep.qp, &mut a, mask.0 as c_int) != 0 {
        return -errno().max(1);
    }
    let mut gid = [0u8; 16];
    if ep.gid_index >= 0 {
        let mut g: ibv_gid = std::mem::zeroed();
        if ibv_query_gid(ep.ctx, ep.port, ep.gid_index, &mut g) != 0 {
            return -errno().max(1);
        }
        gid = g.raw;
    }
    // A start PSN that differs between connections.
    let mut t: libc::timespec = std::mem::zeroed();
    libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t);
    ep.info = RawEndpointInfo {
        qpn: (*ep.qp).qp_num,
        psn: ((t.tv_nsec as u32) ^ (*ep.qp).qp_num.wrapping_mul(2654435761)) & 0xff_ffff,
        lid: pa.lid,
        _pad: 0,
        mtu: mtu_bytes(pa.active_mtu),
        gid,
    };
    0
}

unsafe fn teardown(ep: &mut Endpoint) {
    if !ep.qp.is_null() {
        ibv_destroy_qp(ep.qp);
    }
    if !ep.cq.is_null() {
        ibv_destroy_cq(ep.cq);
    }
    if !ep.channel.is_null() {
        ibv_destroy_comp_channel(ep.channel);
    }
    if !ep.pd.is_null() {
        // EBUSY if registrations remain: the transport deregisters first.
        ibv_dealloc_pd(ep.pd);
    }
    if !ep.ctx.is_null() {
        ibv_close_device(ep.ctx);
    }
}

unsafe fn ep_ref<'a>(ep: Ep) -> Option<&'a mut Endpoint> {
    (ep as *mut Endpoint).as_mut()
}

unsafe extern "C" fn close(ep: Ep) {
    let _ = guarded(|| unsafe {
        if !ep.is_null() {
            let mut b = Box::from_raw(ep as *mut Endpoint);
            teardown(&mut b);
        }
        0
    });
}

unsafe extern "C" fn local_info(ep: Ep, out: *mut RawEndpointInfo) -> i32 {
    guarded(|| unsafe {
        match (ep_ref(ep), out.is_null()) {
            (Some(e), false) => {
                *out = e.info;
                0
            }
            _ => -libc::EINVAL,
        }
    })
}

unsafe extern "C" fn pkey_index(ep: Ep, pkey: u16, out: *mut u16) -> i32 {
    guarded(|| unsafe {
        let (Some(e), false) = (ep_ref(ep), out.is_null()) else { return -libc::EINVAL };
        let mut pa: ibv_port_attr = std::mem::zeroed();
        if ___ibv_query_port(e.ctx, e.port, &mut pa) != 0 {
            return -errno().max(1);
        }
        // The whole table, in host order (ibv_query_pkey gives network order).
        let mut table = Vec::with_capacity(pa.pkey_tbl_len as usize);
        for i in 0..pa.pkey_tbl_len as c_int {
            let mut k: u16 = 0;
            if ibv_query_pkey(e.ctx, e.port, i, &mut k as *mut u16 as *mut _) != 0 {
                return -errno().max(1);
            }
            table.push(u16::from_be(k));
        }
        match rgpu_transport::rdma::verbs::find_pkey_index(&table, pkey) {
            Some(i) => {
                *out = i;
                0
            }
            None => -libc::ENOENT,
        }
    })
}

unsafe extern "C" fn set_pkey_index(ep: Ep, index: u16) -> i32 {
    guarded(|| unsafe {
        let Some(e) = ep_ref(ep) else { return -libc::EINVAL };
        // INIT -> INIT may change the P_Key index (IB spec, QP state table).
        let mut a: ibv_qp_attr = std::mem::zeroed();
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = index;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX;
        if ibv_modify_qp(e.qp, &mut a, mask.0 as c_int) != 0 {
            return -errno().max(1);
        }
        0
    })
}

unsafe extern "C" fn connect(ep: Ep, remote: *const RawEndpointInfo) -> i32 {
    guarded(|| unsafe {
        let (Some(e), false) = (ep_ref(ep), remote.is_null()) else { return -libc::EINVAL };
        let r = &*remote;
        let mut a: ibv_qp_attr = std::mem::zeroed();
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = mtu_enum(r.mtu.min(mtu_bytes(e.active_mtu)));
        a.dest_qp_num = r.qpn;
        a.rq_psn = r.psn;
        a.max_dest_rd_atomic = 16;
        a.min_rnr_timer = 12;
        a.ah_attr.dlid = r.lid;
        a.ah_attr.sl = 0;
        a.ah_attr.src_path_bits = 0;
        a.ah_attr.port_num = e.port;
        if e.roce || r.gid != [0u8; 16] && e.gid_index >= 0 {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid.raw = r.gid;
            a.ah_attr.grh.sgid_index = e.gid_index.max(0) as u8;
            a.ah_attr.grh.hop_limit = 64;
        }
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_AV
            | ibv_qp_attr_mask::IBV_QP_PATH_MTU
            | ibv_qp_attr_mask::IBV_QP_DEST_QPN
            | ibv_qp_attr_mask::IBV_QP_RQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
        if ibv_modify_qp(e.qp, &mut a, mask.0 as c_int) != 0 {
            return -errno().max(1);
        }
        let mut a: ibv_qp_attr = std::mem::zeroed();
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        a.timeout = 14; // 4.096 us * 2^14 = 67 ms per try
        a.retry_cnt = 7;
        a.rnr_retry = 7; // infinite: credits make RNR impossible anyway
        a.sq_psn = e.info.psn;
        a.max_rd_atomic = 16;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_TIMEOUT
            | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
            | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
            | ibv_qp_attr_mask::IBV_QP_SQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
        if ibv_modify_qp(e.qp, &mut a, mask.0 as c_int) != 0 {
            return -errno().max(1);
        }
        0
    })
}

unsafe extern "C" fn reg_mr(ep: Ep, addr: *mut u8, len: usize, access: u32, out: *mut RawMr) -> i32 {
    guarded(|| unsafe {
        let (Some(e), false) = (ep_ref(ep), out.is_null()) else { return -libc::EINVAL };
        // The transport's Access bits are ibv_access_flags' values.
        let mr = ibv_reg_mr(e.pd, addr as *mut _, len, access as c_int);
        if mr.is_null() {
            return -errno().max(1);
        }
        *out = RawMr { addr: (*mr).addr as u64, len: (*mr).length as u64, lkey: (*mr).lkey, rkey: (*mr).rkey, handle: mr as u64 };
        0
    })
}

unsafe extern "C" fn dereg_mr(ep: Ep, mr: *const RawMr) -> i32 {
    guarded(|| unsafe {
        if ep_ref(ep).is_none() || mr.is_null() || (*mr).handle == 0 {
            return -libc::EINVAL;
        }
        let rc = ibv_dereg_mr((*mr).handle as *mut ibv_mr);
        if rc != 0 {
            -rc.abs()
        } else {
            0
        }
    })
}

unsafe extern "C" fn post_recv(ep: Ep, wr_id: u64, sge: *const RawSge) -> i32 {
    guarded(|| unsafe {
        let (Some(e), false) = (ep_ref(ep), sge.is_null()) else { return -libc::EINVAL };
        let s = &*sge;
        let mut sg = ibv_sge { addr: s.addr, length: s.len, lkey: s.lkey };
        let mut wr: ibv_recv_wr = std::mem::zeroed();
        wr.wr_id = wr_id;
        wr.sg_list = &mut sg;
        wr.num_sge = 1;
        let mut bad = ptr::null_mut();
        let rc = ibv_post_recv(e.qp, &mut wr, &mut bad);
        if rc != 0 {
            -rc.abs()
        } else {
            0
        }
    })
}

unsafe extern "C" fn post_send(ep: Ep, wr_id: u64, raw: *const RawWr) -> i32 {
    guarded(|| unsafe {
        let (Some(e), false) = (ep_ref(ep), raw.is_null()) else { return -libc::EINVAL };
        let r = &*raw;
        let mut sg = ibv_sge { addr: r.local.addr, length: r.local.len, lkey: r.local.lkey };
        let mut wr: ibv_send_wr = std::mem::zeroed();
        wr.wr_id = wr_id;
        wr.sg_list = &mut sg;
        wr.num_sge = if r.local.len == 0 { 0 } else { 1 };
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        match r.opcode {
            OP_SEND => wr.opcode = ibv_wr_opcode::IBV_WR_SEND,
            OP_WRITE_IMM => {
                wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
                wr.imm_data_invalidated_rkey_union.imm_data = r.imm.to_be();
                wr.wr.rdma.remote_addr = r.remote_addr;
                wr.wr.rdma.rkey = r.rkey;
            }
            OP_READ => {
                wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
                wr.wr.rdma.remote_addr = r.remote_addr;
                wr.wr.rdma.rkey = r.rkey;
            }
            _ => return -libc::EINVAL,
        }
        let mut bad = ptr::null_mut();
        let rc = ibv_post_send(e.qp, &mut wr, &mut bad);
        if rc != 0 {
            -rc.abs()
        } else {
            0
        }
    })
}

fn status_to_raw(s: u32) -> u32 {
    use ibv_wc_status::*;
    match s {
        IBV_WC_SUCCESS => ST_SUCCESS,
        IBV_WC_LOC_PROT_ERR => ST_LOC_PROT,
        IBV_WC_LOC_LEN_ERR => ST_LOC_LEN,
        IBV_WC_REM_ACCESS_ERR => ST_REM_ACCESS,
        IBV_WC_REM_INV_REQ_ERR => ST_REM_INV_REQ,
        IBV_WC_RETRY_EXC_ERR => ST_RETRY_EXC,
        IBV_WC_RNR_RETRY_EXC_ERR => ST_RNR_RETRY_EXC,
        IBV_WC_WR_FLUSH_ERR => ST_FLUSH,
        o => ST_OTHER_BASE + o,
    }
}

fn opcode_to_raw(o: u32) -> u32 {
    use ibv_wc_opcode::*;
    match o {
        IBV_WC_SEND => WC_SEND,
        IBV_WC_RDMA_WRITE => WC_WRITE,
        IBV_WC_RDMA_READ => WC_READ,
        IBV_WC_RECV_RDMA_WITH_IMM => WC_RECV_IMM,
        _ => WC_RECV,
    }
}

unsafe extern "C" fn poll_cq(ep: Ep, out: *mut RawCompletion, n: u32) -> i32 {
    guarded(|| unsafe {
        let (Some(e), false) = (ep_ref(ep), out.is_null()) else { return -libc::EINVAL };
        let mut wcs: [ibv_wc; 16] = std::mem::zeroed();
        let want = (n as usize).min(wcs.len()) as i32;
        let got = ibv_poll_cq(e.cq, want, wcs.as_mut_ptr());
        if got < 0 {
            return -libc::EIO;
        }
        for (i, w) in wcs[..got as usize].iter().enumerate() {
            let has_imm = w.wc_flags & ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
            // Opcode is only valid on success; flushed receives keep their tag.
            *out.add(i) = RawCompletion {
                wr_id: w.wr_id,
                status: status_to_raw(w.status),
                opcode: if w.status == 0 { opcode_to_raw(w.opcode) } else { WC_RECV },
                byte_len: w.byte_len,
                imm: if has_imm { u32::from_be(w.imm_data_invalidated_rkey_union.imm_data) } else { 0 },
                has_imm: has_imm as u32,
                vendor_err: w.vendor_err,
            };
        }
        got
    })
}

unsafe extern "C" fn arm_cq(ep: Ep) -> i32 {
    guarded(|| unsafe {
        let Some(e) = ep_ref(ep) else { return -libc::EINVAL };
        let rc = ibv_req_notify_cq(e.cq, 0);
        if rc != 0 {
            -rc.abs()
        } else {
            0
        }
    })
}

unsafe extern "C" fn wait_cq(ep: Ep, timeout_ms: u32) -> i32 {
    guarded(|| unsafe {
        let Some(e) = ep_ref(ep) else { return -libc::EINVAL };
        let mut p = libc::pollfd { fd: (*e.channel).fd, events: libc::POLLIN, revents: 0 };
        let rc = libc::poll(&mut p, 1, timeout_ms.min(i32::MAX as u32) as c_int);
        if rc < 0 {
            let err = errno();
            return if err == libc::EINTR { 0 } else { -err };
        }
        if rc == 0 {
            return 0;
        }
        let mut cq = ptr::null_mut();
        let mut ctx = ptr::null_mut();
        if ibv_get_cq_event(e.channel, &mut cq, &mut ctx) != 0 {
            let err = errno();
            return if err == libc::EAGAIN { 0 } else { -err };
        }
        ibv_ack_cq_events(cq, 1);
        1
    })
}

unsafe extern "C" fn disconnect(ep: Ep) {
    let _ = guarded(|| unsafe {
        if let Some(e) = ep_ref(ep) {
            let mut a: ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ibv_qp_state::IBV_QPS_ERR;
            ibv_modify_qp(e.qp, &mut a, ibv_qp_attr_mask::IBV_QP_STATE.0 as c_int);
        }
        0
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_versioned_and_complete() {
        let vt = unsafe { &*rgpu_rdma_plugin_v1() };
        assert_eq!(vt.abi_version, ABI_VERSION);
        assert_eq!(vt.size as usize, std::mem::size_of::<VerbsVtable>());
    }

    #[test]
    fn no_device_is_reported_not_fatal() {
        // On a host without RDMA this is 0; on one with, opening the first
        // device and closing it again must work.
        let n = unsafe { device_count() };
        assert!(n >= 0);
        let o = RawOpenOptions { device: ptr::null(), port: 1, gid_index: -1, max_send_wr: 64, max_recv_wr: 64 };
        let mut ep: Ep = ptr::null_mut();
        let rc = unsafe { open(&o, &mut ep) };
        if n == 0 {
            assert!(rc < 0 && ep.is_null());
        } else if rc == 0 {
            unsafe { close(ep) };
        }
        // Bad arguments are errors, not crashes.
        assert_eq!(unsafe { open(ptr::null(), &mut ep) }, -libc::EINVAL);
        assert_eq!(unsafe { post_send(ptr::null_mut(), 0, ptr::null()) }, -libc::EINVAL);
    }

    #[test]
    fn mtu_mapping_round_trips() {
        for m in 1..=5 {
            assert_eq!(mtu_enum(mtu_bytes(m)), m);
        }
    }
}
