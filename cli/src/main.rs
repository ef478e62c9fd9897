//! `rgpu`: run CUDA programs on remote GPUs.
//!
//! Each subcommand is a thin file in `commands/` that parses its arguments
//! and calls the library code; status goes to stderr, results to stdout.

mod bench;
mod commands;
mod driver;
mod frames;
mod lease_file;
mod moves;
mod operator;
mod paths;
mod pool;
mod server_process;
mod supervise;
mod table;
mod tls;
mod top;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "rgpu", version, about = "Run unmodified CUDA programs on remote GPUs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Run(commands::run::Args),
    Demo(commands::demo::Args),
    Bench(commands::bench::Args),
    Lease(commands::lease::Args),
    Renew(commands::renew::Args),
    Release(commands::release::Args),
    Suspend(commands::suspend::SuspendArgs),
    Resume(commands::suspend::ResumeArgs),
    Leases(commands::leases::Args),
    Servers(commands::servers::Args),
    Smi(commands::smi::Args),
    Drain(commands::drain::Args),
    Undrain(commands::undrain::Args),
    Status(commands::status::Args),
    Credential(commands::credential::Args),
    Audit(commands::audit::Args),
    Usage(commands::usage::Args),
    Top(commands::top::Args),
    Checkpoint(commands::checkpoint::Args),
    Restore(commands::restore::Args),
    Migrate(commands::migrate::Args),
    Sessions(commands::sessions::Args),
    Fault(commands::fault::Args),
}

fn main() {
    // First, before any thread: may restart the binary, so that the servers
    // and programs it starts inherit the fix (docs/performance.md, "TLS").
    rgpu_transport::rep_movsb::reexec_if_slow();
    // Like any Unix tool, end quietly when the reader of our output goes
    // away (`rgpu servers | head`), instead of panicking on a write.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let filter = tracing_subscriber::EnvFilter::try_from_env("RGPU_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => commands::run::exec(a),
        Command::Demo(a) => commands::demo::exec(a),
        Command::Bench(a) => commands::bench::exec(a),
        Command::Lease(a) => commands::lease::exec(a),
        Command::Renew(a) => commands::renew::exec(a),
        Command::Release(a) => commands::release::exec(a),
        Command::Suspend(a) => commands::suspend::suspend(a),
        Command::Resume(a) => commands::suspend::resume(a),
        Command::Leases(a) => commands::leases::exec(a),
        Command::Servers(a) => commands::servers::exec(a),
        Command::Smi(a) => commands::smi::exec(a),
        Command::Drain(a) => commands::drain::exec(a),
        Command::Undrain(a) => commands::undrain::exec(a),
        Command::Usage(a) => commands::usage::exec(a),
        Command::Top(a) => commands::top::exec(a),
        Command::Status(a) => commands::status::exec(a),
        Command::Credential(a) => commands::credential::exec(a),
        Command::Audit(a) => commands::audit::exec(a),
        Command::Checkpoint(a) => commands::checkpoint::exec(a),
        Command::Restore(a) => commands::restore::exec(a),
        Command::Migrate(a) => commands::migrate::exec(a),
        Command::Sessions(a) => commands::sessions::exec(a),
        Command::Fault(a) => commands::fault::exec(a),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(2);
        }
    }
}
