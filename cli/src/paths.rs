//! Where rgpu's own files are: the shim and the server binary sit next to
//! the `rgpu` executable (target/<profile>/ after `cargo build`).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

fn exe_dir() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot locate the rgpu executable")?;
    Ok(exe.parent().map(Path::to_path_buf).unwrap_or_default())
}

/// The shim library: $RGPU_SHIM, else libcuda.so beside this executable.
pub fn shim() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("RGPU_SHIM") {
        return Ok(PathBuf::from(p));
    }
    let p = exe_dir()?.join("libcuda.so");
    if !p.exists() {
        bail!("the rgpu shim is not at {} (build it with `cargo build --release`, or set RGPU_SHIM)", p.display());
    }
    Ok(p)
}

/// A folder holding `libcuda.so.1` -> the shim (and `libnvidia-ml.so.1` ->
/// rgpu's NVML library, when it was built beside the shim), to put first on
/// LD_LIBRARY_PATH. Made beside the shim (or in the temp folder if that is
/// read-only) and reused.
pub fn driver_dir() -> Result<PathBuf> {
    let shim = shim()?.canonicalize().context("cannot resolve the shim's path")?;
    let beside = shim.parent().map(|d| d.join("rgpu-driver"));
    let fallback = std::env::temp_dir().join(format!("rgpu-driver-{}", unsafe { libc::getuid() }));
    for dir in beside.into_iter().chain([fallback]) {
        if link_into(&dir, &shim).is_ok() {
            return Ok(dir);
        }
    }
    bail!("cannot create a libcuda.so.1 link to {}", shim.display())
}

fn link_into(dir: &Path, shim: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let nvml = shim.with_file_name("libnvidia_ml.so");
    let mut links = vec![(shim.to_path_buf(), "libcuda.so.1"), (shim.to_path_buf(), "libcuda.so")];
    if nvml.exists() {
        links.extend([(nvml.clone(), "libnvidia-ml.so.1"), (nvml, "libnvidia-ml.so")]);
    }
    for (target, name) in links {
        let link = dir.join(name);
        match std::fs::read_link(&link) {
            Ok(t) if t == target => continue,
            Ok(_) => std::fs::remove_file(&link)?,
            Err(_) => {}
        }
        // Several rgpu processes may race here; whichever link wins is right.
        match std::os::unix::fs::symlink(&target, &link) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The rgpu-server binary beside this executable.
pub fn server_binary() -> Result<PathBuf> {
    beside("rgpu-server")
}

/// The rgpu-broker binary beside this executable.
pub fn broker_binary() -> Result<PathBuf> {
    beside("rgpu-broker")
}

fn beside(name: &str) -> Result<PathBuf> {
    let p = exe_dir()?.join(name);
    if !p.exists() {
        bail!("{name} is not at {} (build it with `cargo build --release`)", p.display());
    }
    Ok(p)
}
