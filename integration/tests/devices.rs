//! Several devices: two servers with one device each (server 1's device is
//! device 0), and one server with two devices.

use rgpu_integration::*;

const MEM_A: u64 = 2 << 30;
const MEM_B: u64 = 3 << 30;

fn check_order(out: &RunOutput, servers: &[&Server], mems: [u64; 2]) {
    for (dev, mem) in mems.iter().enumerate() {
        let want = format!("device {dev} totalGlobalMem {mem}");
        assert!(
            out.ok_lines().iter().any(|l| *l == want),
            "expected '{want}' (devices in server order)\n{}",
            out.describe(servers)
        );
    }
}

fn two_servers(variant: Variant) {
    let exe = build("rt_two_devices", variant);
    let a = Server::start(ServerOpts { devices: 1, memory: MEM_A, ..ServerOpts::default() });
    let b = Server::start(ServerOpts { devices: 1, memory: MEM_B, ..ServerOpts::default() });
    let out = run_on(&[&a, &b], &exe, &[]);
    out.assert_pass("rt_two_devices", &[&a, &b]);
    check_order(&out, &[&a, &b], [MEM_A, MEM_B]);

    // The other order: devices swap.
    let out = run_on(&[&b, &a], &exe, &[]);
    out.assert_pass("rt_two_devices", &[&b, &a]);
    check_order(&out, &[&b, &a], [MEM_B, MEM_A]);
}

fn one_server(variant: Variant) {
    let exe = build("rt_two_devices", variant);
    let s = Server::start(ServerOpts { devices: 2, memory: MEM_A, ..ServerOpts::default() });
    let out = run_on(&[&s], &exe, &[]);
    out.assert_pass("rt_two_devices", &[&s]);
    check_order(&out, &[&s], [MEM_A, MEM_A]);
}

mod two_servers {
    use super::*;
    #[test]
    fn cudart13_shared() {
        two_servers(Variant::Cudart13Shared)
    }
    #[test]
    fn cudart13_static() {
        two_servers(Variant::Cudart13Static)
    }
    #[test]
    fn cudart12_shared() {
        two_servers(Variant::Cudart12Shared)
    }
}

mod one_server_two_devices {
    use super::*;
    #[test]
    fn cudart13_shared() {
        one_server(Variant::Cudart13Shared)
    }
    #[test]
    fn cudart13_static() {
        one_server(Variant::Cudart13Static)
    }
    #[test]
    fn cudart12_shared() {
        one_server(Variant::Cudart12Shared)
    }
}
