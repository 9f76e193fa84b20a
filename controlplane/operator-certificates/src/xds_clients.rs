//! xDS client credentials (runs on the leader only): every namespace labelled
//! `spur.dev/xds=enabled` gets a Secret (`spur-xds` by default) with a client certificate from
//! the operator's CA, the CA bundle, and a grpc-go bootstrap file pointing at the route server's
//! xDS port. A proxyless gRPC app there mounts the Secret and sets `GRPC_XDS_BOOTSTRAP`.
//!
//! The Secret is written by server-side apply and never read: outside its own namespace the
//! operator may create and patch Secrets, not read them. So it issues from what it remembers:
//! at start (a new leader), when a namespace opts in, when the signing CA changes, and at 80 %
//! of the certificate's lifetime. The old certificate stays valid until it expires, so a
//! client that has not yet re-read its files keeps working. A namespace that opts out gets its
//! Secret emptied (the operator cannot delete it); its last certificate works until it expires,
//! which a short lifetime bounds.

mod desired;
mod plan;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tokio_util::sync::CancellationToken;

pub use self::desired::bootstrap;
use self::plan::{CA_CHECK, Issued};
use crate::pki_config::{PkiConfig, signing_ca};
use spur_operator_core::{Error, FIELD_MANAGER, Metrics};
// Configured with the rest of the PKI; its public path stays here too.
pub use crate::pki_config::XdsClientConfig;
use spur_serving::pki::{self, Pair, now_unix};

/// The common-name prefix the route server's xDS port requires (`spur_routeserver::xds::
/// CLIENT_CN_PREFIX`; the operator does not depend on the route server).
pub const CLIENT_CN_PREFIX: &str = "system:spur:xds:";

/// The namespace label that asks for the Secret, and its value.
pub const XDS_LABEL: &str = "spur.dev/xds";
pub const XDS_LABEL_VALUE: &str = "enabled";
/// Where the bootstrap expects the Secret to be mounted (documented in docs/xds.md).
pub const MOUNT_PATH: &str = "/etc/spur/xds";

/// Runs until `stop`.
pub(crate) async fn run(
    client: Client,
    pki_cfg: PkiConfig,
    cfg: XdsClientConfig,
    metrics: Metrics,
    stop: CancellationToken,
) {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ca_secrets: Api<Secret> = Api::namespaced(client.clone(), &pki_cfg.namespace);
    let events = watcher(
        namespaces,
        watcher::Config::default().labels(&format!("{XDS_LABEL}={XDS_LABEL_VALUE}")),
    )
    .default_backoff();
    let mut events = std::pin::pin!(events);
    let mut wanted: HashSet<String> = HashSet::new();
    let mut relisting: Option<HashSet<String>> = None;
    let mut issued: HashMap<String, Issued> = HashMap::new();
    let mut wake = tokio::time::Instant::now() + CA_CHECK;
    let mut synced = false;
    loop {
        let mut removed = Vec::new();
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep_until(wake) => {}
            e = events.next() => match e {
                None => return,
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "namespace watch for xDS clients failed; retrying");
                    continue;
                }
                Some(Ok(watcher::Event::Apply(ns))) => {
                    wanted.insert(ns.name_any());
                }
                Some(Ok(watcher::Event::Delete(ns))) => {
                    wanted.remove(&ns.name_any());
                    removed.push(ns.name_any());
                }
                Some(Ok(watcher::Event::Init)) => relisting = Some(HashSet::new()),
                Some(Ok(watcher::Event::InitApply(ns))) => {
                    if let Some(r) = relisting.as_mut() {
                        r.insert(ns.name_any());
                    }
                }
                Some(Ok(watcher::Event::InitDone)) => {
                    if let Some(now) = relisting.take() {
                        removed.extend(wanted.difference(&now).cloned());
                        wanted = now;
                    }
                    synced = true;
                }
            }
        }
        if !synced {
            // Until the first complete list, only watch events wake the loop.
            wake = tokio::time::Instant::now() + CA_CHECK;
            continue;
        }
        let issuer = Issuer {
            ca_secrets: &ca_secrets,
            client: &client,
            pki: &pki_cfg,
            cfg: &cfg,
            metrics: &metrics,
        };
        for ns in removed {
            issued.remove(&ns);
            if let Err(e) = issuer.revoke(&ns).await {
                tracing::warn!(namespace = %ns, error = %e, "cannot empty the xDS client Secret of a namespace that opted out");
            }
        }
        let next = match issuer.pass(&wanted, &mut issued).await {
            Ok(next) => next,
            Err(e) => {
                tracing::warn!(error = %e, "cannot issue xDS client certificates; retrying");
                metrics.pki_failure();
                Duration::from_secs(10)
            }
        };
        wake = tokio::time::Instant::now() + next;
    }
}

struct Issuer<'a> {
    ca_secrets: &'a Api<Secret>,
    client: &'a Client,
    pki: &'a PkiConfig,
    cfg: &'a XdsClientConfig,
    metrics: &'a Metrics,
}

impl Issuer<'_> {
    /// Issues where needed; returns how long until the next renewal (or CA check).
    async fn pass(
        &self,
        wanted: &HashSet<String>,
        issued: &mut HashMap<String, Issued>,
    ) -> Result<Duration, Error> {
        let (signer, bundle) = self.signing_ca().await?;
        // The bundle too: when a CA rotation adds the next CA, clients must trust the route
        // server's certificate once that CA signs it.
        let issuer = format!(
            "{}/{}",
            pki::fingerprint(&signer.cert),
            pki::fingerprint_text(&bundle)
        );
        let now = now_unix();
        let mut failed = false;
        for ns in wanted {
            if !plan::due(issued.get(ns), &issuer, now) {
                continue;
            }
            // One namespace that cannot be written (terminating, a Secret of another type in
            // the way, a quota) must not hold up the others: retried at the next pass.
            match self.issue(ns, &signer, &bundle, now).await {
                Ok(renew_at) => {
                    issued.insert(
                        ns.clone(),
                        Issued {
                            renew_at,
                            issuer: issuer.clone(),
                        },
                    );
                }
                Err(e) => {
                    tracing::warn!(namespace = %ns, error = %e, "cannot issue the xDS client certificate of a namespace; retrying");
                    self.metrics.pki_failure();
                    failed = true;
                }
            }
        }
        let renew_ats = wanted
            .iter()
            .filter_map(|ns| issued.get(ns))
            .map(|i| i.renew_at);
        Ok(plan::next_wake(renew_ats, failed, now))
    }

    /// Issues and writes the credentials of `ns`; returns when they are due for renewal.
    async fn issue(&self, ns: &str, signer: &Pair, bundle: &str, now: i64) -> Result<i64, Error> {
        let pair = pki::issue_client_pair(
            signer,
            &format!("{CLIENT_CN_PREFIX}{ns}"),
            self.cfg.lifetime,
            now,
        )?;
        let info = pki::info(&pair.cert)?;
        self.apply(ns, Some((&pair, bundle))).await?;
        self.metrics.cert_issued("xds-client");
        tracing::info!(namespace = %ns, secret = %self.cfg.secret, not_after = info.validity.not_after, "xDS client certificate issued");
        Ok(info.validity.renew_at_for(self.cfg.lifetime))
    }

    async fn revoke(&self, ns: &str) -> Result<(), Error> {
        match self.apply(ns, None).await {
            // The namespace itself is gone, and its Secrets with it.
            Err(Error::Kube(kube::Error::Api(e))) if e.code == 404 => Ok(()),
            r => r,
        }
    }

    /// Writes the Secret of `ns`: the credentials, or (None) nothing.
    async fn apply(&self, ns: &str, creds: Option<(&Pair, &str)>) -> Result<(), Error> {
        let secret = desired::secret(self.cfg, ns, creds);
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), ns);
        secrets
            .patch(
                &self.cfg.secret,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&secret),
            )
            .await?;
        Ok(())
    }

    async fn signing_ca(&self) -> Result<(Pair, String), Error> {
        signing_ca(self.ca_secrets, &self.pki.ca_secret).await
    }
}
