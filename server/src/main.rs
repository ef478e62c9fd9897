//! `rgpu-server`: see `rgpu-server --help`.

use std::process::ExitCode;

use anyhow::Context;
use rgpu_config::Settings as _;
use rgpu_server::config::{Config, Settings};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    // First, before any thread: may restart the binary (docs/performance.md, "TLS").
    rgpu_transport::rep_movsb::reexec_if_slow();
    // Before logging starts: `--help` and bad flags print and exit here.
    let settings = Settings::from_process().unwrap_or_else(|e| e.exit()).settings;
    let filter = EnvFilter::try_from_env("RGPU_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .init();
    match run(settings) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(settings: Settings) -> anyhow::Result<()> {
    let mut config = Config::from_settings(settings)?;
    let data_plane = rgpu_server::transport_select::DataPlane::new(&config.transport)?;
    // Bind first: the sim's device UUIDs default to being derived from the
    // address, so that two servers on one host never show the same device.
    let std_listener = std::net::TcpListener::bind(&config.listen)
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    std_listener.set_nonblocking(true).context("cannot make the listener non-blocking")?;
    let addr = std_listener.local_addr().context("cannot read the listening address")?;
    if config.sim.seed.is_none() {
        config.sim.seed = Some(addr.to_string());
    }
    let backend = rgpu_server::build_backend(&config)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(async {
        // Handlers go in before the "listening" line: a signal sent as soon
        // as the line appears must already mean "shut down".
        let signals = Signals::install().context("cannot install signal handlers")?;
        let listener = tokio::net::TcpListener::from_std(std_listener).context("cannot register the listener")?;
        let metrics = match &config.metrics {
            Some(a) => Some(rgpu_metrics::http::bind(a).await?),
            None => None,
        };
        let devices = backend.devices();
        // Not through tracing: scripts and tests wait for this exact line
        // whatever the log filter.
        eprintln!(
            "rgpu-server listening on {addr} (backend {}, {} device{})",
            backend.name(),
            devices.len(),
            if devices.len() == 1 { "" } else { "s" }
        );
        if config.security.is_tls() {
            info!("serving both planes under TLS");
        } else {
            warn!("--plaintext: lease tokens, session keys and CUDA data cross the network in clear");
        }
        for d in devices {
            info!(ordinal = d.ordinal, name = %d.name, total_mem = d.total_mem, "device");
        }
        // First signal: stop (draining first, with a broker); second: now.
        let (stop, shutdown) = (CancellationToken::new(), CancellationToken::new());
        let (s, now) = (stop.clone(), shutdown.clone());
        tokio::spawn(async move {
            let mut signals = signals;
            signals.wait().await;
            info!("signal received; shutting down");
            s.cancel();
            signals.wait().await;
            info!("second signal: stopping now");
            now.cancel();
        });
        rgpu_server::serve_draining(listener, metrics, backend, data_plane, &config, stop, shutdown).await;
        Ok(())
    })
}

struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> std::io::Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals { int: signal(SignalKind::interrupt())?, term: signal(SignalKind::terminate())? })
    }

    /// Resolves at the next SIGINT or SIGTERM.
    async fn wait(&mut self) {
        tokio::select! {
            _ = self.int.recv() => {}
            _ = self.term.recv() => {}
        }
    }
}
