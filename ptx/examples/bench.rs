//! Interpreter speed: thread-instructions per second on one core and on
//! all cores, for an arithmetic loop with loads and stores (the shape of
//! ordinary kernels: integer index math, float fma, compare and branch).
//!
//! Each is run on the interpreter and on the compiled tier, and the ratio printed.
//!
//! `cargo run --release -p rgpu-ptx --example bench`

use std::time::{Duration, Instant};

use rgpu_ptx::{launch, HostMemory, LaunchConfig, Module};

const PTX: &str = r#"
.version 8.0
.target sm_90
.address_size 64
.visible .entry bench(.param .u64 p, .param .u32 n)
{
  .reg .pred %p<2>;
  .reg .b32 %r<16>;
  .reg .f32 %f<8>;
  .reg .b64 %rd<8>;
  ld.param.u64 %rd1, [p];
  ld.param.u32 %r1, [n];
  cvta.to.global.u64 %rd1, %rd1;
  mov.u32 %r2, %ctaid.x;
  mov.u32 %r3, %ntid.x;
  mov.u32 %r4, %tid.x;
  mad.lo.s32 %r5, %r2, %r3, %r4;
  mul.wide.s32 %rd2, %r5, 4;
  add.s64 %rd3, %rd1, %rd2;
  ld.global.f32 %f1, [%rd3];
  mov.u32 %r6, 0;
  mov.f32 %f2, 0f00000000;
$LOOP:
  fma.rn.f32 %f2, %f1, 0f3F000000, %f2;
  add.s32 %r7, %r6, %r5;
  and.b32 %r8, %r7, 255;
  cvt.rn.f32.u32 %f3, %r8;
  add.f32 %f2, %f2, %f3;
  add.s32 %r6, %r6, 1;
  setp.lt.u32 %p1, %r6, %r1;
  @%p1 bra $LOOP;
  st.global.f32 [%rd3], %f2;
  ret;
}
"#;

/// Measured launches per tier and worker count; the fastest is reported.
const RUNS: usize = 5;

fn main() {
    let m = Module::parse(PTX).expect("bench PTX parses");
    let prog = m.lower("bench", &|_| None).expect("bench PTX lowers");
    let blocks = 256u32;
    let threads = 256u32;
    let iters = 200u32;
    let mut mem = HostMemory::new(0x7f00_0000_0000, 8 << 20);
    let buf = mem.alloc(blocks as u64 * threads as u64 * 4).expect("fits");
    let mut params = buf.to_le_bytes().to_vec();
    params.extend_from_slice(&iters.to_le_bytes());
    let mut first: Option<Vec<u8>> = None;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for workers in [1, cores] {
        let mut rates = [0f64; 2];
        for (k, compiled) in [false, true].into_iter().enumerate() {
            let cfg = LaunchConfig {
                grid: [blocks, 1, 1],
                block: [threads, 1, 1],
                dyn_shared: 0,
                workers,
                time_limit: Duration::from_secs(600),
                printf_limit: 0,
                compiled,
            };
            // The same answer from both tiers; one warm-up launch, then the measured ones.
            mem.write(buf, &vec![0u8; blocks as usize * threads as usize * 4]);
            launch(&prog, &cfg, &params, &mem).expect("bench runs");
            let got = mem.read(buf, 4096).expect("in bounds");
            // The best of a few launches: the machine may be shared with other work.
            let mut s = f64::MAX;
            let mut out = Default::default();
            for _ in 0..RUNS {
                mem.write(buf, &vec![0u8; blocks as usize * threads as usize * 4]);
                let t = Instant::now();
                out = launch(&prog, &cfg, &params, &mem).expect("bench runs");
                s = s.min(t.elapsed().as_secs_f64());
                assert_eq!(got, mem.read(buf, 4096).expect("in bounds"), "the launches agree");
            }
            let out: rgpu_ptx::LaunchOutput = out;
            if k == 0 {
                first.get_or_insert(got);
            } else {
                assert_eq!(first.as_ref(), Some(&mem.read(buf, 4096).expect("in bounds")), "the tiers agree");
            }
            rates[k] = out.thread_instructions as f64 / s / 1e6;
            println!(
                "{workers:>3} worker(s), {:<11}: {:>7.1} M thread-instructions/s ({} thread-instructions in {:.3} s; {:.1} M/s per core)",
                if compiled { "compiled" } else { "interpreter" },
                rates[k],
                out.thread_instructions,
                s,
                rates[k] / workers as f64
            );
        }
        println!("{workers:>3} worker(s): compiled tier / interpreter = {:.1}x", rates[1] / rates[0]);
    }
}
