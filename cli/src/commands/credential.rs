//! `rgpu credential issue|rotate|revoke`: the operator's side of tenants'
//! credentials. Issuing is local: a credential's secret is derived from the
//! broker's admin key, so whoever holds that key issues them without the
//! broker. Rotating issues a newer credential and tells the broker to
//! refuse every older one of the tenant; revoking only refuses.

use std::path::PathBuf;

use anyhow::{Context, Result};
use rgpu_broker_client::{Credential, Role};

use crate::pool::{self, BrokerArgs};

/// Issue, rotate or revoke tenants' credentials for the broker (operators,
/// with the broker's admin key).
#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Subcommand)]
enum Command {
    Issue(Issue),
    Rotate(Rotate),
    Revoke(Revoke),
}

#[derive(clap::Args)]
struct What {
    /// The tenant the credential is for (1 to 64 of A-Z a-z 0-9 . _ -).
    #[arg(long, value_name = "NAME")]
    tenant: String,
    /// user: its own leases; operator: also drain, undrain, every lease,
    /// the audit log; admin: also revoke credentials, release any lease.
    #[arg(long, default_value = "user", value_parser = parse_role)]
    role: Role,
    /// Where to write it (a new file, mode 0600); give it to the tenant.
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
}

/// Write a new credential file, made with the broker's admin key (no broker needed).
#[derive(clap::Args)]
struct Issue {
    #[command(flatten)]
    what: What,
    /// The broker's admin key file (or its token key file, if it has no admin key).
    #[arg(long, env = "RGPU_ADMIN_KEY_FILE", value_name = "FILE")]
    admin_key_file: PathBuf,
}

/// Issue a new credential and make the broker refuse every older one of the tenant.
#[derive(clap::Args)]
struct Rotate {
    #[command(flatten)]
    what: What,
    #[command(flatten)]
    broker: BrokerArgs,
}

/// Make the broker refuse every credential of a tenant issued until now.
#[derive(clap::Args)]
struct Revoke {
    /// The tenant whose credentials are refused from now on.
    #[arg(long, value_name = "NAME")]
    tenant: String,
    #[command(flatten)]
    broker: BrokerArgs,
}

fn parse_role(s: &str) -> Result<Role, String> {
    Role::parse(s).ok_or_else(|| "expected user, operator or admin".to_string())
}

fn issue(key_file: &std::path::Path, w: &What) -> Result<Credential> {
    let key = pool::read_key(key_file)?;
    let c = Credential::issue(&key, &w.tenant, w.role, pool::now_ms())?;
    c.write_new(&w.out)?;
    eprintln!(
        "Wrote {} for tenant {} (role {}, serial {}); the tenant passes it as --credential FILE or RGPU_CREDENTIAL",
        w.out.display(),
        c.tenant,
        c.role.name(),
        c.serial
    );
    Ok(c)
}

pub fn exec(a: Args) -> Result<i32> {
    match a.command {
        Command::Issue(i) => {
            issue(&i.admin_key_file, &i.what)?;
        }
        Command::Rotate(r) => {
            let key_file = r.broker.admin_key_file.clone().context("rotate needs --admin-key-file (or RGPU_ADMIN_KEY_FILE)")?;
            let c = issue(&key_file, &r.what)?;
            let before = r.broker.connect()?.revoke(&c.tenant, c.serial)?;
            eprintln!("The broker now refuses credentials of {} issued before serial {before}", c.tenant);
        }
        Command::Revoke(r) => {
            let before = r.broker.connect()?.revoke(&r.tenant, pool::now_ms())?;
            eprintln!("The broker now refuses credentials of {} issued before serial {before}", r.tenant);
        }
    }
    Ok(0)
}
