//! A logged-in tenant's capability (`Session` in broker.capnp). Every call
//! is authorized against the session's identity (role, credential still
//! valid, the tenant's request rate) before it reaches the service, and
//! what changes something is written to the audit log.

use std::sync::Arc;

use capnp::capability::Rc;
use rgpu_protocol::auth::Role;
use rgpu_protocol::broker_capnp::session;

use super::encode::{write_audit, write_lease, write_server, write_status};
use super::{audit, fail, text};
use crate::identity::Identity;
use crate::inventory::Scope;
use crate::placement::Demand;
use crate::service::{now_ms, Service};
use crate::state::{BrokerError, Lease, LeaseRequest};

pub struct Session {
    service: Arc<Service>,
    id: Identity,
    actor: String,
    peer: String,
}

impl Session {
    pub fn new(service: Arc<Service>, id: Identity, peer: String) -> Session {
        let actor = id.actor();
        Session { service, id, actor, peer }
    }

    fn allow(&self, need: Role) -> Result<(), capnp::Error> {
        self.service.authorize(&self.id, need).map_err(fail)
    }

    /// Authorizes, and audits a refusal: a refused request that would have
    /// changed something is worth a record.
    fn allow_audited(&self, need: Role, op: &str, target: &str) -> Result<(), capnp::Error> {
        let r = self.service.authorize(&self.id, need);
        if r.is_err() {
            audit(&self.service, &self.actor, &self.peer, op, target, &r, |_| String::new());
        }
        r.map_err(fail)
    }
}

fn lease_id(id: u64) -> String {
    format!("{id:016x}")
}

impl session::Server for Session {
    async fn whoami(self: Rc<Self>, _: session::WhoamiParams, mut results: session::WhoamiResults) -> Result<(), capnp::Error> {
        self.allow(Role::User)?;
        let mut r = results.get();
        r.set_tenant(&self.id.tenant);
        r.set_role(self.id.role.name());
        r.set_serial(self.id.serial);
        Ok(())
    }

    async fn lease(self: Rc<Self>, params: session::LeaseParams, mut results: session::LeaseResults) -> Result<(), capnp::Error> {
        self.allow_audited(Role::User, "lease", &self.id.tenant)?;
        let r = params.get()?.get_request()?;
        let client_key = match r.get_client_key()? {
            [] => None,
            k => Some(<[u8; 32]>::try_from(k).map_err(|_| {
                capnp::Error::failed(format!("[invalid] clientKey must be an Ed25519 public key (32 bytes), not {} bytes", k.len()))
            })?),
        };
        let req = LeaseRequest {
            tenant: text(r.get_tenant()),
            demand: Demand {
                gpus: r.get_gpus(),
                memory: r.get_memory(),
                compute_milli: r.get_compute_milli(),
                models: r
                    .get_models()
                    .map(|l| l.iter().take(64).filter_map(|t| t.ok().and_then(|t| t.to_str().ok()).map(String::from)).collect())
                    .unwrap_or_default(),
                scope: Scope::from_wire(r.get_scope()),
                scope_required: r.get_scope_required(),
            },
            priority: r.get_priority(),
            ttl_ms: r.get_ttl_ms(),
            wait_ms: r.get_wait_ms(),
            key: text(r.get_key()),
            bandwidth: r.get_bandwidth(),
            client_key,
        };
        let l = self.service.lease(&self.id, req).await;
        let target = l.as_ref().map_or_else(|_| self.id.tenant.clone(), |l| lease_id(l.id));
        audit(&self.service, &self.actor, &self.peer, "lease", &target, &l, |l: &Lease| {
            let servers: Vec<&str> = l.gpus.iter().map(|g| g.server.as_str()).collect();
            let bound = l.client_key.map_or_else(
                || "bearer token".to_string(),
                |k| format!("token bound to client key {}", rgpu_protocol::binding::fingerprint(&k)),
            );
            format!("{} GPU(s) on {}, generation {}, {bound}", l.gpus.len(), servers.join(","), l.generation)
        });
        let l = l.map_err(fail)?;
        let token = self.service.token_for(&l);
        write_lease(results.get().init_lease(), &l, &token);
        Ok(())
    }

    async fn renew(self: Rc<Self>, params: session::RenewParams, mut results: session::RenewResults) -> Result<(), capnp::Error> {
        let p = params.get()?;
        let id = p.get_lease_id();
        self.allow_audited(Role::User, "renew", &lease_id(id))?;
        let l = self.service.renew(&self.id, id, p.get_ttl_ms()).await;
        audit(&self.service, &self.actor, &self.peer, "renew", &lease_id(id), &l, |l: &Lease| format!("deadline {}", l.deadline));
        let l = l.map_err(fail)?;
        let token = self.service.token_for(&l);
        write_lease(results.get().init_lease(), &l, &token);
        Ok(())
    }

    async fn release(self: Rc<Self>, params: session::ReleaseParams, mut results: session::ReleaseResults) -> Result<(), capnp::Error> {
        let id = params.get()?.get_lease_id();
        self.allow_audited(Role::User, "release", &lease_id(id))?;
        let r = self.service.release(&self.id, id).await;
        audit(&self.service, &self.actor, &self.peer, "release", &lease_id(id), &r, |&live: &bool| {
            if live { "released".into() } else { "not live".into() }
        });
        results.get().set_released(r.map_err(fail)?);
        Ok(())
    }

    async fn suspend(self: Rc<Self>, params: session::SuspendParams, mut results: session::SuspendResults) -> Result<(), capnp::Error> {
        let id = params.get()?.get_lease_id();
        self.allow_audited(Role::User, "suspend-request", &lease_id(id))?;
        let l = self.service.suspend(&self.id, id).await;
        audit(&self.service, &self.actor, &self.peer, "suspend-request", &lease_id(id), &l, |l: &Lease| l.state_name().into());
        let l = l.map_err(fail)?;
        let token = self.service.token_for(&l);
        write_lease(results.get().init_lease(), &l, &token);
        Ok(())
    }

    async fn resume(self: Rc<Self>, params: session::ResumeParams, mut results: session::ResumeResults) -> Result<(), capnp::Error> {
        let id = params.get()?.get_lease_id();
        self.allow_audited(Role::User, "resume-request", &lease_id(id))?;
        let l = self.service.resume(&self.id, id).await;
        audit(&self.service, &self.actor, &self.peer, "resume-request", &lease_id(id), &l, |l: &Lease| l.state_name().into());
        let l = l.map_err(fail)?;
        let token = self.service.token_for(&l);
        write_lease(results.get().init_lease(), &l, &token);
        Ok(())
    }

    async fn move_lease(self: Rc<Self>, params: session::MoveLeaseParams, mut results: session::MoveLeaseResults) -> Result<(), capnp::Error> {
        let p = params.get()?;
        let id = p.get_lease_id();
        let to = text(p.get_server_id());
        self.allow_audited(Role::Operator, "move", &lease_id(id))?;
        let l = self.service.move_lease(id, Some(to.as_str()).filter(|t| !t.is_empty())).await;
        audit(&self.service, &self.actor, &self.peer, "move", &lease_id(id), &l, |l: &Lease| {
            format!("to {}", l.moving.as_ref().map_or("-", |m| m.to.as_str()))
        });
        // The answer carries no token: the lease is its tenant's.
        write_lease(results.get().init_lease(), &l.map_err(fail)?, &[]);
        Ok(())
    }

    async fn list_leases(self: Rc<Self>, params: session::ListLeasesParams, mut results: session::ListLeasesResults) -> Result<(), capnp::Error> {
        self.allow(Role::User)?;
        let asked = text(params.get()?.get_tenant());
        if self.id.role < Role::Operator && !asked_ok(&asked, &self.id.tenant) {
            return Err(fail(BrokerError::Auth(format!("{} may list only its own tenant's leases", self.actor))));
        }
        // A user sees its own tenant's leases only.
        let tenant = if self.id.role >= Role::Operator { asked } else { self.id.tenant.clone() };
        let mut leases: Vec<Lease> = self
            .service
            .read(|st| st.leases().filter(|l| tenant.is_empty() || l.tenant == tenant).cloned().collect());
        leases.sort_by_key(|l| (l.granted, l.id));
        let mut out = results.get().init_leases(leases.len() as u32);
        for (i, l) in leases.iter().enumerate() {
            // Listings carry no tokens: a token is for its holder only.
            let mut b = out.reborrow().get(i as u32);
            write_lease(b.reborrow(), l, &[]);
            if let Some(u) = self.service.lease_usage(l.id) {
                u.write(b.init_usage());
            }
        }
        Ok(())
    }

    async fn list_servers(self: Rc<Self>, _: session::ListServersParams, mut results: session::ListServersResults) -> Result<(), capnp::Error> {
        self.allow(Role::User)?;
        self.service.read(|st| {
            let mut out = results.get().init_servers(st.servers.len() as u32);
            for (i, s) in st.servers.iter().enumerate() {
                let mut b = out.reborrow().get(i as u32);
                write_server(b.reborrow(), st, s);
                if let Some(u) = self.service.server_usage(&s.spec.id) {
                    u.write(b.init_usage());
                }
            }
        });
        Ok(())
    }

    async fn status(self: Rc<Self>, _: session::StatusParams, mut results: session::StatusResults) -> Result<(), capnp::Error> {
        self.allow(Role::User)?;
        let svc = self.service.clone();
        svc.read(|st| write_status(results.get().init_status(), st, &svc, now_ms()));
        if self.id.role < Role::Operator {
            // Where the broker keeps its files is the operators' business.
            results.get().get_status()?.set_data_dir("");
        }
        Ok(())
    }

    async fn drain(self: Rc<Self>, params: session::DrainParams, mut results: session::DrainResults) -> Result<(), capnp::Error> {
        let p = params.get()?;
        let id = text(p.get_server_id());
        self.allow_audited(Role::Operator, "drain", &id)?;
        let deadline = Some(p.get_deadline_ms()).filter(|&d| d != 0);
        let plan = if p.get_migrate() {
            let r = self.service.drain_migrate(&id, deadline).await;
            audit(&self.service, &self.actor, &self.peer, "drain", &id, &r, |plan| {
                let moving = plan.iter().filter(|(_, t)| t.is_ok()).count();
                format!("deadline {}, migrate: {moving} of {} lease(s) moving", deadline.unwrap_or(0), plan.len())
            });
            r.map_err(fail)?
        } else {
            let r = self.service.drain(&id, deadline, false).await;
            audit(&self.service, &self.actor, &self.peer, "drain", &id, &r, |_| format!("deadline {}", deadline.unwrap_or(0)));
            r.map_err(fail)?;
            Vec::new()
        };
        let mut moves = results.get().init_moves(plan.len() as u32);
        for (i, (lease, to)) in plan.iter().enumerate() {
            let mut m = moves.reborrow().get(i as u32);
            m.set_lease(*lease);
            match to {
                Ok(t) => m.set_target(t),
                Err(why) => m.set_reason(why),
            }
        }
        self.service.read(|st| {
            if let Some(s) = st.server(&id) {
                write_server(results.get().init_server(), st, s);
            }
        });
        Ok(())
    }

    async fn undrain(self: Rc<Self>, params: session::UndrainParams, mut results: session::UndrainResults) -> Result<(), capnp::Error> {
        let id = text(params.get()?.get_server_id());
        self.allow_audited(Role::Operator, "undrain", &id)?;
        let r = self.service.undrain(&id).await;
        audit(&self.service, &self.actor, &self.peer, "undrain", &id, &r, |_| String::new());
        r.map_err(fail)?;
        self.service.read(|st| {
            if let Some(s) = st.server(&id) {
                write_server(results.get().init_server(), st, s);
            }
        });
        Ok(())
    }

    async fn audit(self: Rc<Self>, params: session::AuditParams, mut results: session::AuditResults) -> Result<(), capnp::Error> {
        self.allow(Role::Operator)?;
        let p = params.get()?;
        let tenant = text(p.get_tenant());
        let records = self.service.audit.query(Some(tenant.as_str()).filter(|t| !t.is_empty()), p.get_limit() as usize);
        let mut out = results.get().init_records(records.len() as u32);
        for (i, r) in records.iter().enumerate() {
            write_audit(out.reborrow().get(i as u32), r);
        }
        Ok(())
    }

    async fn usage(self: Rc<Self>, params: session::UsageParams, mut results: session::UsageResults) -> Result<(), capnp::Error> {
        self.allow(Role::User)?;
        let p = params.get()?;
        let limit = match p.get_limit() {
            0 => 1000,
            n => (n as usize).min(crate::service::RECORDS_KEPT),
        };
        let records = self.service.usage(&self.id, &text(p.get_tenant()), p.get_since_ms(), limit).map_err(fail)?;
        let mut out = results.get().init_records(records.len() as u32);
        for (i, r) in records.iter().enumerate() {
            r.write(out.reborrow().get(i as u32));
        }
        Ok(())
    }

    async fn revoke_credentials(
        self: Rc<Self>,
        params: session::RevokeCredentialsParams,
        mut results: session::RevokeCredentialsResults,
    ) -> Result<(), capnp::Error> {
        let p = params.get()?;
        let tenant = text(p.get_tenant());
        self.allow_audited(Role::Admin, "revoke", &tenant)?;
        let r = self.service.revoke(&tenant, p.get_before_serial()).await;
        audit(&self.service, &self.actor, &self.peer, "revoke", &tenant, &r, |b| format!("serials before {b} refused"));
        results.get().set_before_serial(r.map_err(fail)?);
        Ok(())
    }
}

/// A user may name its own tenant, or none.
fn asked_ok(asked: &str, own: &str) -> bool {
    asked.is_empty() || asked == own
}
