//! Harness for rgpu's end-to-end tests.
//!
//! The tests in `integration/tests/` compile the CUDA programs in
//! `integration/cuda/` with `nvcc` (from the PyPI toolchain that
//! `integration/setup-cuda.sh` installs), start `rgpu-server` processes with
//! the simulated backend, and run each program through `rgpu run`.
//!
//! Nothing here skips silently: a missing toolchain or missing rgpu binaries
//! fail the test with a message that says what to run.

pub mod proxy;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

/// `integration/` in the source tree.
pub fn integration_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `integration/cuda/`: the test programs.
pub fn cuda_src_dir() -> PathBuf {
    integration_dir().join("cuda")
}

fn env_nonempty(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

// ---------------------------------------------------------------------------
// CUDA toolchain
// ---------------------------------------------------------------------------

/// Where nvcc and the two NVIDIA runtimes are.
#[derive(Debug)]
pub struct Toolchain {
    pub venv: PathBuf,
    pub nvcc: PathBuf,
    pub cu13_include: PathBuf,
    pub cu13_lib: PathBuf,
    pub cu12_include: PathBuf,
    pub cu12_lib: PathBuf,
}

/// The venv that setup-cuda.sh installs into (same rule as the script).
pub fn default_venv() -> PathBuf {
    if let Some(v) = env_nonempty("RGPU_CUDA_VENV") {
        return PathBuf::from(v);
    }
    let cache = env_nonempty("RGPU_CUDA_CACHE").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env_nonempty("HOME").unwrap_or_else(|| "/root".into())).join(".cache/rgpu")
    });
    cache.join("cuda-venv")
}

fn find_toolchain() -> Result<Toolchain, String> {
    let venv = default_venv();
    let lib = venv.join("lib");
    let mut site = None;
    if let Ok(rd) = std::fs::read_dir(&lib) {
        for e in rd.flatten() {
            let cand = e.path().join("site-packages/nvidia");
            if e.file_name().to_string_lossy().starts_with("python") && cand.is_dir() {
                site = Some(cand);
            }
        }
    }
    let hint = "run `bash integration/setup-cuda.sh` (or set RGPU_CUDA_VENV to a venv it made)";
    let nvidia = site.ok_or_else(|| {
        format!("CUDA toolchain not found: no {}/lib/python3*/site-packages/nvidia; {hint}", venv.display())
    })?;
    let cu13 = nvidia.join("cu13");
    let cu12 = nvidia.join("cuda_runtime");
    let tc = Toolchain {
        nvcc: cu13.join("bin/nvcc"),
        cu13_include: cu13.join("include"),
        cu13_lib: cu13.join("lib"),
        cu12_include: cu12.join("include"),
        cu12_lib: cu12.join("lib"),
        venv,
    };
    for p in [
        tc.nvcc.clone(),
        tc.cu13_include.join("cuda_runtime.h"),
        tc.cu13_lib.join("libcudart.so"),
        tc.cu13_lib.join("libcudart_static.a"),
        tc.cu12_include.join("cuda_runtime.h"),
        tc.cu12_lib.join("libcudart.so"),
    ] {
        if !p.exists() {
            return Err(format!("CUDA toolchain incomplete: {} is missing; {hint}", p.display()));
        }
    }
    Ok(tc)
}

/// The toolchain, or a panic telling how to install it.
pub fn toolchain() -> &'static Toolchain {
    static TC: OnceLock<Result<Toolchain, String>> = OnceLock::new();
    match TC.get_or_init(find_toolchain) {
        Ok(t) => t,
        Err(e) => panic!("{e}"),
    }
}

// ---------------------------------------------------------------------------
// rgpu binaries
// ---------------------------------------------------------------------------

/// `rgpu`, `rgpu-server` and the shim `libcuda.so`.
#[derive(Debug)]
pub struct Binaries {
    pub dir: PathBuf,
    pub rgpu: PathBuf,
    pub server: PathBuf,
    pub libcuda: PathBuf,
}

/// `<target>/<profile>` of this test binary (`.../deps/<test>-<hash>`).
fn own_profile_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let deps = exe.parent()?;
    if deps.file_name()? == "deps" {
        Some(deps.parent()?.to_path_buf())
    } else {
        Some(deps.to_path_buf())
    }
}

/// The cargo target directory: $CARGO_TARGET_DIR, else the one this test
/// binary was built into, else `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    if let Some(t) = env_nonempty("CARGO_TARGET_DIR") {
        let p = PathBuf::from(t);
        return if p.is_absolute() { p } else { integration_dir().parent().unwrap().join(p) };
    }
    if let Some(p) = own_profile_dir().and_then(|d| d.parent().map(Path::to_path_buf)) {
        return p;
    }
    integration_dir().parent().unwrap().join("target")
}

fn find_binaries() -> Result<Binaries, String> {
    let mut candidates = Vec::new();
    if let Some(d) = env_nonempty("RGPU_BIN_DIR") {
        candidates.push(PathBuf::from(d));
    } else {
        if let Some(d) = own_profile_dir() {
            candidates.push(d);
        }
        candidates.push(target_dir().join("release"));
    }
    let mut report = String::new();
    for dir in &candidates {
        let b = Binaries {
            rgpu: dir.join("rgpu"),
            server: dir.join("rgpu-server"),
            libcuda: dir.join("libcuda.so"),
            dir: dir.clone(),
        };
        let missing: Vec<String> = [&b.rgpu, &b.server, &b.libcuda]
            .iter()
            .filter(|p| !p.exists())
            .map(|p| p.display().to_string())
            .collect();
        if missing.is_empty() {
            return Ok(b);
        }
        let _ = writeln!(report, "  in {}: missing {}", dir.display(), missing.join(", "));
    }
    Err(format!(
        "rgpu binaries not found:\n{report}build them first: `cargo build --release --workspace` \
         (then `cargo test --release -p rgpu-integration`), or point RGPU_BIN_DIR at them"
    ))
}

/// The rgpu binaries, or a panic telling how to build them.
pub fn binaries() -> &'static Binaries {
    static B: OnceLock<Result<Binaries, String>> = OnceLock::new();
    match B.get_or_init(find_binaries) {
        Ok(b) => b,
        Err(e) => panic!("{e}"),
    }
}

// ---------------------------------------------------------------------------
// Compiling the CUDA programs
// ---------------------------------------------------------------------------

/// How a test program is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Variant {
    /// `-cudart shared`, NVIDIA's libcudart.so.13.
    Cudart13Shared,
    /// nvcc's default: libcudart_static.a from CUDA 13 linked in.
    Cudart13Static,
    /// `-cudart shared` against CUDA 12.9's headers and libcudart.so.12
    /// (host code sees the 12.9 `cuda_runtime.h` first on the include path;
    /// nvcc 13's own `crt/` headers and device compiler are used, and the
    /// stub code they generate only needs `__cuda*` entry points that
    /// libcudart.so.12 exports).
    Cudart12Shared,
    /// Driver-API program: `-cudart none -lcuda`, linked against the shim.
    Driver,
}

impl Variant {
    pub fn name(self) -> &'static str {
        match self {
            Variant::Cudart13Shared => "cudart13-shared",
            Variant::Cudart13Static => "cudart13-static",
            Variant::Cudart12Shared => "cudart12-shared",
            Variant::Driver => "driver",
        }
    }

    /// Version prefix `cudaRuntimeGetVersion` must report, for runtime variants.
    pub fn runtime_major(self) -> Option<u32> {
        match self {
            Variant::Cudart13Shared | Variant::Cudart13Static => Some(13),
            Variant::Cudart12Shared => Some(12),
            Variant::Driver => None,
        }
    }
}

/// 64-bit FNV-1a: a hash that is stable across Rust versions, for the cache.
#[derive(Clone)]
struct Fnv(u64);
impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf29ce484222325)
    }
    fn add(&mut self, bytes: &[u8]) -> &mut Self {
        for &b in bytes {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x100000001b3);
        }
        // Separator so that ("ab","c") != ("a","bc").
        self.0 ^= 0xff;
        self.0 = self.0.wrapping_mul(0x100000001b3);
        self
    }
    fn hex(&self) -> String {
        format!("{:016x}", self.0)
    }
}

/// Allows two nvcc runs at a time in this process (the machines this runs
/// on are small, and nvcc is memory hungry).
struct Semaphore {
    count: Mutex<usize>,
    cv: Condvar,
}
struct Permit<'a>(&'a Semaphore);
impl Semaphore {
    fn acquire(&self) -> Permit<'_> {
        let mut n = self.count.lock().unwrap_or_else(|e| e.into_inner());
        while *n == 0 {
            n = self.cv.wait(n).unwrap_or_else(|e| e.into_inner());
        }
        *n -= 1;
        Permit(self)
    }
}
impl Drop for Permit<'_> {
    fn drop(&mut self) {
        *self.0.count.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        self.0.cv.notify_one();
    }
}
fn nvcc_slots() -> &'static Semaphore {
    static S: OnceLock<Semaphore> = OnceLock::new();
    S.get_or_init(|| {
        let n = env_nonempty("RGPU_TEST_NVCC_JOBS").and_then(|v| v.parse().ok()).unwrap_or(2usize);
        Semaphore { count: Mutex::new(n.max(1)), cv: Condvar::new() }
    })
}

/// One lock per output file, so two tests needing the same program build it once.
fn artifact_lock(key: &Path) -> Arc<Mutex<()>> {
    static LOCKS: OnceLock<Mutex<HashMap<PathBuf, Arc<Mutex<()>>>>> = OnceLock::new();
    let mut m = LOCKS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    m.entry(key.to_path_buf()).or_default().clone()
}

fn arch() -> String {
    env_nonempty("RGPU_TEST_ARCH").unwrap_or_else(|| "sm_90".into())
}

/// Directory for compiled test programs: `<target>/rgpu-integration/`.
pub fn build_dir() -> PathBuf {
    target_dir().join("rgpu-integration")
}

fn read(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
}

/// Runs nvcc (two at a time) and panics with its output if it fails.
fn nvcc(args: &[std::ffi::OsString], what: &str) {
    let tc = toolchain();
    let _permit = nvcc_slots().acquire();
    let out = Command::new(&tc.nvcc)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", tc.nvcc.display()));
    if !out.status.success() {
        panic!(
            "nvcc failed building {what} ({}):\n{} {}\n--- stdout\n{}\n--- stderr\n{}",
            out.status,
            tc.nvcc.display(),
            args.iter().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Produces `out` with `make(tmp)` unless it exists; atomic via rename.
fn cached(out: &Path, make: impl FnOnce(&Path)) -> PathBuf {
    let lock = artifact_lock(out);
    let _g = lock.lock().unwrap_or_else(|e| e.into_inner());
    if out.exists() {
        return out.to_path_buf();
    }
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    let tmp = out.with_file_name(format!(
        ".tmp-{}-{}",
        std::process::id(),
        out.file_name().unwrap().to_string_lossy()
    ));
    let _ = std::fs::remove_file(&tmp);
    make(&tmp);
    std::fs::rename(&tmp, out).unwrap_or_else(|e| panic!("renaming {}: {e}", tmp.display()));
    out.to_path_buf()
}

fn os(s: impl AsRef<std::ffi::OsStr>) -> std::ffi::OsString {
    s.as_ref().to_os_string()
}

/// Builds `integration/cuda/modules/<name>.cu` into a header with the
/// module as a fatbin (`module_fatbin[]`, `module_fatbin_len`) and as PTX
/// text (`module_ptx[]`, NUL-terminated); returns the header's directory.
fn module_header(name: &str, header: &str) -> PathBuf {
    let tc = toolchain();
    let src = cuda_src_dir().join("modules").join(format!("{name}.cu"));
    let mut h = Fnv::new();
    h.add(&read(&src)).add(tc.nvcc.to_string_lossy().as_bytes()).add(arch().as_bytes());
    let dir = build_dir().join("modules").join(format!("{name}-{}", h.hex()));
    let fatbin = cached(&dir.join(format!("{name}.fatbin")), |tmp| {
        nvcc(&[os("-fatbin"), os(format!("-arch={}", arch())), os("-o"), os(tmp), os(&src)], name)
    });
    let ptx = cached(&dir.join(format!("{name}.ptx")), |tmp| {
        nvcc(&[os("-ptx"), os(format!("-arch={}", arch())), os("-o"), os(tmp), os(&src)], name)
    });
    cached(&dir.join(header), |tmp| {
        let mut s = format!("// Generated by rgpu-integration from cuda/modules/{name}.cu. Do not edit.\n");
        let arr = |s: &mut String, cname: &str, bytes: &[u8], nul: bool| {
            let _ = write!(s, "static const unsigned char {cname}[] __attribute__((aligned(8))) = {{");
            for (i, b) in bytes.iter().chain(nul.then_some(&0u8)).enumerate() {
                if i % 16 == 0 {
                    s.push_str("\n   ");
                }
                let _ = write!(s, " 0x{b:02x},");
            }
            s.push_str("\n};\n");
        };
        let fb = read(&fatbin);
        arr(&mut s, "module_fatbin", &fb, false);
        let _ = writeln!(s, "static const unsigned module_fatbin_len = {};", fb.len());
        let pt = read(&ptx);
        arr(&mut s, "module_ptx_bytes", &pt, true);
        s.push_str("static const char *const module_ptx = (const char *)module_ptx_bytes;\n");
        std::fs::write(tmp, s).unwrap();
    });
    dir
}

/// Builds each of `integration/cuda/modules/<name>.cu` into relocatable PTX (`-rdc=true`:
/// external references left for a linker) and writes a header with each as a NUL-terminated
/// string `<name>_ptx`; returns the header's directory.
fn linker_inputs_header(names: &[&str], header: &str) -> PathBuf {
    let tc = toolchain();
    let mut h = Fnv::new();
    let srcs: Vec<PathBuf> = names.iter().map(|n| cuda_src_dir().join("modules").join(format!("{n}.cu"))).collect();
    for src in &srcs {
        h.add(&read(src));
    }
    h.add(tc.nvcc.to_string_lossy().as_bytes()).add(arch().as_bytes());
    let dir = build_dir().join("modules").join(format!("link-{}", h.hex()));
    let ptxs: Vec<PathBuf> = names
        .iter()
        .zip(&srcs)
        .map(|(name, src)| {
            cached(&dir.join(format!("{name}.ptx")), |tmp| {
                nvcc(&[os("-ptx"), os("-rdc=true"), os(format!("-arch={}", arch())), os("-o"), os(tmp), os(src)], name)
            })
        })
        .collect();
    cached(&dir.join(header), |tmp| {
        let mut s = String::from("// Generated by rgpu-integration from cuda/modules. Do not edit.\n");
        for (name, ptx) in names.iter().zip(&ptxs) {
            let _ = write!(s, "static const unsigned char {name}_ptx_bytes[] = {{");
            for (i, b) in read(ptx).iter().chain(std::iter::once(&0u8)).enumerate() {
                if i % 16 == 0 {
                    s.push_str("\n   ");
                }
                let _ = write!(s, " 0x{b:02x},");
            }
            let _ = writeln!(s, "\n}};\nstatic const char *const {name}_ptx = (const char *){name}_ptx_bytes;");
        }
        std::fs::write(tmp, s).unwrap();
    });
    dir
}

/// Compiles `integration/cuda/<program>.cu` in `variant` (cached by a hash of
/// the sources and flags) and returns the executable.
pub fn build(program: &str, variant: Variant) -> PathBuf {
    let tc = toolchain();
    let src = cuda_src_dir().join(format!("{program}.cu"));
    assert!(src.exists(), "no such test program: {}", src.display());

    // rt_newer_ptx carries SASS for sm_90 and PTX only for compute_120, as CuPy's CUB
    // kernels do: which of them a device may run is what it tests.
    let code: Vec<std::ffi::OsString> = match program {
        "rt_newer_ptx" => ["-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_120,code=compute_120"]
            .iter()
            .map(os)
            .collect(),
        // rt_per_thread tests the driver's per-thread-stream entry points, which cudart
        // calls only in a program built for them.
        "rt_per_thread" => vec![os(format!("-arch={}", arch())), os("--default-stream"), os("per-thread")],
        _ => vec![os(format!("-arch={}", arch()))],
    };
    let mut args: Vec<std::ffi::OsString> = code;
    args.extend([
        os("-std=c++17"),
        os("-O1"),
        os("-Xcompiler"),
        os("-Wall,-Wno-unused-function"),
        os("-I"),
        os(cuda_src_dir()),
    ]);
    match variant {
        Variant::Cudart13Shared => args.extend([
            os("-cudart"),
            os("shared"),
            os("-L"),
            os(&tc.cu13_lib),
            os("-Xlinker"),
            os(format!("-rpath,{}", tc.cu13_lib.display())),
        ]),
        Variant::Cudart13Static => args.extend([os("-cudart"), os("static")]),
        Variant::Cudart12Shared => args.extend([
            os("-cudart"),
            os("shared"),
            os("-I"),
            os(&tc.cu12_include),
            os("-L"),
            os(&tc.cu12_lib),
            os("-Xlinker"),
            os(format!("-rpath,{}", tc.cu12_lib.display())),
        ]),
        Variant::Driver => {
            let bins = binaries();
            // Plain host C++ (`-x c++`): a .cu file would register an empty
            // fatbin with cudart, which `-cudart none` leaves out.
            args.extend([os("-x"), os("c++"), os("-cudart"), os("none"), os("-L"), os(&bins.dir), os("-lcuda")]);
            // Driver programs with device code get it as an embedded image, built separately.
            if program == "drv_vmm" {
                args.extend([os("-I"), os(module_header("drv_vmm_kernels", "drv_vmm_images.h"))]);
            }
            if matches!(program, "drv_module" | "drv_graph") {
                args.extend([os("-I"), os(module_header("drv_module_kernels", "drv_module_images.h"))]);
            }
            if program == "drv_module" {
                args.extend([os("-I"), os(linker_inputs_header(&["drv_link_main", "drv_link_lib"], "drv_link_inputs.h"))]);
            }
        }
    }

    let mut h = Fnv::new();
    h.add(&read(&src)).add(&read(&cuda_src_dir().join("check.h")));
    h.add(tc.nvcc.to_string_lossy().as_bytes()).add(variant.name().as_bytes());
    for a in &args {
        h.add(a.to_string_lossy().as_bytes());
    }
    let out = build_dir().join(variant.name()).join(format!("{program}-{}", h.hex()));
    cached(&out, |tmp| {
        let mut all = args.clone();
        all.extend([os("-o"), os(tmp), os(&src)]);
        nvcc(&all, &format!("{program} ({})", variant.name()));
    })
}

// ---------------------------------------------------------------------------
// Processes
// ---------------------------------------------------------------------------

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        if c == '\x1b' {
            if it.peek() == Some(&'[') {
                it.next();
                for d in it.by_ref() {
                    if ('@'..='~').contains(&d) {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

/// Captures a pipe into a shared buffer; optionally sends each line on.
fn drain<R: Read + Send + 'static>(
    r: R,
    buf: Arc<Mutex<String>>,
    lines: Option<mpsc::Sender<String>>,
) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        let mut rd = BufReader::new(r);
        let mut line = Vec::new();
        loop {
            line.clear();
            match rd.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let s = String::from_utf8_lossy(&line).into_owned();
                    buf.lock().unwrap_or_else(|e| e.into_inner()).push_str(&s);
                    if let Some(tx) = &lines {
                        let _ = tx.send(strip_ansi(s.trim_end_matches(['\n', '\r'])));
                    }
                }
            }
        }
    })
}

fn kill_group(child: &mut Child) {
    // The child leads its own process group (see `process_group(0)`); kill
    // the group so that a program started by `rgpu run` goes too.
    let pid = child.id() as libc::pid_t;
    unsafe {
        libc::kill(-pid, libc::SIGKILL);
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A running `rgpu-server` (`--backend sim`, or `cuda` over the shim for a
/// chain), killed when dropped.
pub struct Server {
    child: Option<Child>,
    pub addr: SocketAddr,
    log: Arc<Mutex<String>>,
    args: Vec<String>,
}

/// Options for [`Server::start`].
#[derive(Clone, Debug)]
pub struct ServerOpts {
    pub devices: u32,
    /// Bytes of memory per simulated device.
    pub memory: u64,
    /// `--sim-compute-capability` (the server's default, 9.0, when None).
    pub compute_capability: Option<&'static str>,
    /// Serve under TLS with this certificate and key; None: `--plaintext`
    /// (every test but the TLS ones: `tests/tls.rs`).
    pub tls: Option<(PathBuf, PathBuf)>,
}

impl Default for ServerOpts {
    fn default() -> Self {
        ServerOpts { devices: 1, memory: DEFAULT_SIM_MEMORY, compute_capability: None, tls: None }
    }
}

static SERVER_SEQ: AtomicU64 = AtomicU64::new(0);

/// The memory size the tests give each simulated device (4 GiB).
pub const DEFAULT_SIM_MEMORY: u64 = 4 << 30;

impl Server {
    /// Starts a server on 127.0.0.1:0 and waits (up to 30 s) until it says
    /// `listening on 127.0.0.1:PORT`.
    pub fn start(opts: ServerOpts) -> Server {
        let seed = format!("rgpu-integration-{}-{}", std::process::id(), SERVER_SEQ.fetch_add(1, Ordering::Relaxed));
        Server::start_on("127.0.0.1:0", opts, &seed, &[])
    }

    /// As [`Server::start`], listening on `listen` (a stopped server's
    /// address, say), with device UUIDs from `seed` and `extra` flags.
    pub fn start_on(listen: &str, opts: ServerOpts, seed: &str, extra: &[String]) -> Server {
        let mut args: Vec<String> = vec![
            "--listen".into(),
            listen.into(),
            "--backend".into(),
            "sim".into(),
            "--sim-devices".into(),
            opts.devices.to_string(),
            "--sim-memory".into(),
            opts.memory.to_string(),
            // Sim UUIDs derive from host name and ordinal; the seed keeps
            // two servers on this host from exporting the same UUIDs.
            "--sim-seed".into(),
            seed.into(),
        ];
        if let Some(cc) = opts.compute_capability {
            args.extend(["--sim-compute-capability".to_string(), cc.to_string()]);
        }
        match &opts.tls {
            Some((cert, key)) => args.extend([
                "--tls-cert".to_string(),
                cert.display().to_string(),
                "--tls-key".to_string(),
                key.display().to_string(),
            ]),
            None => args.push("--plaintext".to_string()),
        }
        args.extend(extra.iter().cloned());
        Server::spawn(args, &[])
    }

    /// Starts `rgpu-server --backend cuda` whose CUDA driver is rgpu's own
    /// shim, pointed at `upstream`: a program run against the returned
    /// server goes client -> this server (cuda backend) -> `upstream`.
    /// That runs the cuda backend on a machine without a GPU.
    pub fn start_chain(upstream: &Server) -> Server {
        Server::start_chain_with(upstream, &[])
    }

    /// As [`Server::start_chain`], with `extra` server flags (e.g. a broker's).
    pub fn start_chain_with(upstream: &Server, extra: &[String]) -> Server {
        let mut args: Vec<String> =
            ["--listen", "127.0.0.1:0", "--backend", "cuda", "--plaintext"].iter().map(|s| s.to_string()).collect();
        args.extend_from_slice(extra);
        let dir = shim_driver_dir();
        let envs = [
            ("LD_LIBRARY_PATH".to_string(), dir.display().to_string()),
            ("RGPU_SERVERS".to_string(), upstream.addr_string()),
            // The server's own driver, rgpu's shim, to a plaintext upstream.
            ("RGPU_PLAINTEXT".to_string(), "1".to_string()),
        ];
        Server::spawn(args, &envs)
    }

    fn spawn(args: Vec<String>, envs: &[(String, String)]) -> Server {
        let bins = binaries();
        let mut child = Command::new(&bins.server)
            .args(&args)
            .envs(envs.iter().map(|(k, v)| (k, v)))
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", bins.server.display()));
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel();
        drain(child.stdout.take().unwrap(), log.clone(), Some(tx.clone()));
        drain(child.stderr.take().unwrap(), log.clone(), Some(tx));
        let mut server = Server { child: Some(child), addr: "0.0.0.0:0".parse().unwrap(), log, args };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some(addr) = parse_listening(&line) {
                        server.addr = addr;
                        // Keep draining; the receiver is dropped, sends fail quietly.
                        return server;
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    panic!("rgpu-server did not print 'listening on 127.0.0.1:PORT' within 30 s\n{}", server.describe())
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let st = server.child.as_mut().unwrap().wait();
                    panic!("rgpu-server exited before listening ({st:?})\n{}", server.describe())
                }
            }
        }
    }

    /// Starts a server with one device of [`DEFAULT_SIM_MEMORY`].
    pub fn start_default() -> Server {
        Server::start(ServerOpts::default())
    }

    pub fn addr_string(&self) -> String {
        self.addr.to_string()
    }

    /// Everything the server printed so far.
    pub fn log(&self) -> String {
        strip_ansi(&self.log.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Whether the server prints `needle` within `limit`: its output is
    /// read by another thread, so a line it wrote just before answering a
    /// call may not be in [`Server::log`] yet when the answer is.
    pub fn wait_for_log(&self, needle: &str, limit: Duration) -> bool {
        let until = Instant::now() + limit;
        loop {
            if self.log().contains(needle) {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills the server now (SIGKILL, like a crash) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            kill_group(&mut c);
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "--- rgpu-server {} ({})\n{}",
            self.args.join(" "),
            self.addr,
            tail(&self.log(), 150)
        )
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A folder holding `libcuda.so.1`, a link to the shim, and `libnvidia-ml.so.1`,
/// a link to rgpu's NVML (what `rgpu run` puts first on LD_LIBRARY_PATH),
/// private to this test process.
pub fn shim_driver_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("rgpu-shim-driver-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        // NVML beside the driver, as `rgpu run` links them: a chained server reads its
        // upstream's device telemetry through rgpu's NVML.
        let libcuda = &binaries().libcuda;
        for (target, name) in [(libcuda.clone(), "libcuda.so.1"), (libcuda.with_file_name("libnvidia_ml.so"), "libnvidia-ml.so.1")] {
            let link = dir.join(name);
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(&target, &link).unwrap_or_else(|e| panic!("linking {}: {e}", link.display()));
        }
        dir
    })
    .clone()
}

/// Finds `listening on HOST:PORT` in a log line.
pub fn parse_listening(line: &str) -> Option<SocketAddr> {
    let line = strip_ansi(line);
    let i = line.find("listening on")?;
    let rest = line[i + "listening on".len()..].trim_start_matches([' ', ':', '=', '"']);
    let tok: String = rest
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | ':' | '[' | ']'))
        .collect();
    tok.trim_end_matches([':', '.']).parse().ok()
}

fn tail(s: &str, lines: usize) -> String {
    let v: Vec<&str> = s.lines().collect();
    let start = v.len().saturating_sub(lines);
    let mut out = String::new();
    if start > 0 {
        let _ = writeln!(out, "[... {start} earlier lines]");
    }
    for l in &v[start..] {
        out.push_str(l);
        out.push('\n');
    }
    out
}

/// What a finished (or killed) program run produced.
#[derive(Debug)]
pub struct RunOutput {
    pub command: String,
    /// None when it was killed for running past its timeout.
    pub status: Option<ExitStatus>,
    pub timed_out: bool,
    pub elapsed: Duration,
    pub stdout: String,
    pub stderr: String,
}

impl RunOutput {
    pub fn code(&self) -> Option<i32> {
        self.status.and_then(|s| s.code())
    }

    /// A readable account of the run (and of the servers' logs).
    pub fn describe(&self, servers: &[&Server]) -> String {
        let mut s = format!(
            "command: {}\nstatus: {}{}\nelapsed: {:.1?}\n--- stdout\n{}--- stderr\n{}",
            self.command,
            match self.status {
                Some(st) => st.to_string(),
                None => "killed".into(),
            },
            if self.timed_out { " (TIMED OUT)" } else { "" },
            self.elapsed,
            tail(&self.stdout, 200),
            tail(&strip_ansi(&self.stderr), 200),
        );
        for sv in servers {
            s.push_str(&sv.describe());
        }
        s
    }

    /// Asserts the program exited 0 and printed `PASS <program>`.
    pub fn assert_pass(&self, program: &str, servers: &[&Server]) {
        let passed = self.status.map(|s| s.success()).unwrap_or(false)
            && self.stdout.lines().any(|l| l.trim() == format!("PASS {program}"));
        if !passed {
            let failed: Vec<&str> = self.stderr.lines().filter(|l| l.starts_with("FAIL ")).collect();
            panic!(
                "{program} did not pass{}\n{}",
                if failed.is_empty() { String::new() } else { format!(": {}", failed.join(" / ")) },
                self.describe(servers)
            );
        }
    }

    /// `ok:` lines, for tests that look at specific checks.
    pub fn ok_lines(&self) -> Vec<&str> {
        self.stdout.lines().filter_map(|l| l.strip_prefix("ok: ")).collect()
    }
}

/// The timeout for one program run: $RGPU_TEST_TIMEOUT seconds, default 60.
pub fn run_timeout() -> Duration {
    Duration::from_secs(env_nonempty("RGPU_TEST_TIMEOUT").and_then(|v| v.parse().ok()).unwrap_or(60))
}

/// A program started under `rgpu run`, still running.
pub struct Running {
    child: Option<Child>,
    pub command: String,
    started: Instant,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
    /// Each stdout line as it appears.
    pub lines: mpsc::Receiver<String>,
    readers: Vec<thread::JoinHandle<()>>,
}

/// Starts `rgpu run --server ADDRS -- exe args` in its own process group,
/// in plaintext, as the servers [`Server::start`] starts by default serve.
pub fn spawn_rgpu(server_addrs: &str, exe: &Path, args: &[&str]) -> Running {
    spawn_rgpu_env(server_addrs, exe, args, &[])
}

/// As [`spawn_rgpu`] (plaintext), with these environment variables set for
/// the program.
pub fn spawn_rgpu_env(server_addrs: &str, exe: &Path, args: &[&str], envs: &[(&str, &str)]) -> Running {
    let mut env: Vec<(&str, Option<&str>)> = vec![("RGPU_PLAINTEXT", Some("1")), ("RGPU_TLS_CA", None)];
    env.extend(envs.iter().map(|&(k, v)| (k, Some(v))));
    spawn_rgpu_with(server_addrs, exe, args, &env)
}

/// As [`spawn_rgpu`], with these variables set (`Some`) or removed
/// (`None`): the TLS settings, for the TLS tests.
pub fn spawn_rgpu_with(server_addrs: &str, exe: &Path, args: &[&str], env: &[(&str, Option<&str>)]) -> Running {
    spawn_rgpu_run(&["--server", server_addrs], exe, args, env)
}

/// `rgpu run RUN_ARGS -- EXE ARGS`: e.g. a leased run (`--broker ADDR
/// --gpus 1 ...`).
pub fn spawn_rgpu_run(run_args: &[&str], exe: &Path, args: &[&str], env: &[(&str, Option<&str>)]) -> Running {
    let bins = binaries();
    let shown = run_args.join(" ");
    let mut cmd = Command::new(&bins.rgpu);
    cmd.arg("run").args(run_args).arg("--").arg(exe).args(args);
    for (k, v) in env {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    cmd.env("NO_COLOR", "1").stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
    let command = format!(
        "{} run {} -- {} {}",
        bins.rgpu.display(),
        shown,
        exe.display(),
        args.join(" ")
    );
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("starting {command}: {e}"));
    let stdout = Arc::new(Mutex::new(String::new()));
    let stderr = Arc::new(Mutex::new(String::new()));
    let (tx, rx) = mpsc::channel();
    let readers = vec![
        drain(child.stdout.take().unwrap(), stdout.clone(), Some(tx)),
        drain(child.stderr.take().unwrap(), stderr.clone(), None),
    ];
    Running { child: Some(child), command, started: Instant::now(), stdout, stderr, lines: rx, readers }
}

impl Running {
    /// What the program has printed to stdout so far.
    pub fn stdout_so_far(&self) -> String {
        self.stdout.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Waits for a stdout line containing `needle`; false on timeout or exit.
    pub fn wait_for_line(&self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.contains(needle) => return true,
                Ok(_) => {}
                Err(_) => return false,
            }
        }
    }

    /// Waits up to `timeout` for the program to exit; kills it (and its
    /// process group) when it does not.
    pub fn wait(mut self, timeout: Duration) -> RunOutput {
        let mut child = self.child.take().unwrap();
        let deadline = Instant::now() + timeout;
        let mut timed_out = false;
        let status = loop {
            match child.try_wait() {
                Ok(Some(st)) => break Some(st),
                Ok(None) if Instant::now() >= deadline => {
                    timed_out = true;
                    kill_group(&mut child);
                    break None;
                }
                Ok(None) => thread::sleep(Duration::from_millis(20)),
                Err(e) => panic!("waiting for {}: {e}", self.command),
            }
        };
        let elapsed = self.started.elapsed();
        // Also end anything left in the group (e.g. the program, if `rgpu`
        // itself exited first), then collect the output.
        unsafe {
            libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL);
        }
        // A process that left the group could keep the pipes open: wait for
        // the readers a bounded time, then take what they have.
        let until = Instant::now() + Duration::from_secs(5);
        for r in self.readers.drain(..) {
            while !r.is_finished() && Instant::now() < until {
                thread::sleep(Duration::from_millis(10));
            }
            if r.is_finished() {
                let _ = r.join();
            }
        }
        RunOutput {
            command: self.command.clone(),
            status,
            timed_out,
            elapsed,
            stdout: self.stdout.lock().unwrap_or_else(|e| e.into_inner()).clone(),
            stderr: self.stderr.lock().unwrap_or_else(|e| e.into_inner()).clone(),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            kill_group(&mut c);
        }
    }
}

/// Runs `exe` under `rgpu run` against `servers` (their devices in order),
/// with [`run_timeout`].
pub fn run_on(servers: &[&Server], exe: &Path, args: &[&str]) -> RunOutput {
    let addrs: Vec<String> = servers.iter().map(|s| s.addr_string()).collect();
    spawn_rgpu(&addrs.join(","), exe, args).wait(run_timeout())
}

/// Builds `program` in `variant`, starts one default server, runs the
/// program and asserts it passes. Returns the output for further checks.
pub fn run_program(program: &str, variant: Variant, args: &[&str]) -> RunOutput {
    let exe = build(program, variant);
    let server = Server::start_default();
    let out = run_on(&[&server], &exe, args);
    out.assert_pass(program, &[&server]);
    out
}

/// Extra arguments for the launch programs: `--expect-supported` (the sim
/// runs kernels on its PTX interpreter), unless RGPU_EXPECT_LAUNCH=0 asks
/// for the old "launches are refused" behaviour.
pub fn launch_args() -> Vec<&'static str> {
    if env_nonempty("RGPU_EXPECT_LAUNCH").as_deref() == Some("0") {
        vec![]
    } else {
        vec!["--expect-supported"]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_listening_lines() {
        let a: SocketAddr = "127.0.0.1:4567".parse().unwrap();
        assert_eq!(parse_listening("rgpu-server listening on 127.0.0.1:4567"), Some(a));
        assert_eq!(
            parse_listening("2026-01-01T00:00:00Z  INFO rgpu_server: listening on 127.0.0.1:4567, backend sim"),
            Some(a)
        );
        assert_eq!(parse_listening("\x1b[32m INFO\x1b[0m listening on \x1b[1m127.0.0.1:4567\x1b[0m"), Some(a));
        assert_eq!(parse_listening("listening on: \"127.0.0.1:4567\""), Some(a));
        assert_eq!(parse_listening("listening on 127.0.0.1:4567."), Some(a));
        assert_eq!(parse_listening("starting"), None);
    }

    #[test]
    fn fnv_is_stable() {
        assert_eq!(Fnv::new().add(b"abc").hex(), Fnv::new().add(b"abc").hex());
        assert_ne!(Fnv::new().add(b"ab").add(b"c").hex(), Fnv::new().add(b"a").add(b"bc").hex());
    }
}
