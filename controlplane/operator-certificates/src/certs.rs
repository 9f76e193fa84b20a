//! Certificate manager (runs on the leader only): keeps the operator's CA and the webhook's
//! serving certificate current in two Secrets of the operator's namespace, and the `caBundle`
//! of the webhook configurations the chart installs (the MutatingWebhookConfiguration of
//! sidecar injection, the ValidatingWebhookConfiguration of EnvoyConfigs).
//!
//! Rotation never breaks an admission call:
//! - The serving certificate is renewed at 80 % of its lifetime. The old one stays valid, and
//!   every webhook replica swaps to the new one when its watch delivers the Secret.
//! - The CA is renewed at 80 % of its lifetime in two steps. First the next CA is added to the
//!   bundle, next to the current one. Only once the webhook configuration has carried that
//!   bundle for the propagation delay does the next CA start signing. CAs leave the bundle
//!   when they expire.
//!
//! Secret `<ca-secret>` holds `ca.crt`/`ca.key` (the signing CA), `next.crt`/`next.key` during
//! a rotation, and `bundle.crt` (every CA to trust). Secret `<serving-secret>` is a
//! `kubernetes.io/tls` Secret with `tls.crt`, `tls.key` and `ca.crt` (the bundle).

use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{ObjectMeta, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;

use crate::pki_config::{PKI_LABEL, PkiConfig, ServingCert};
use plan::{CaState, Serving, bundle_copy_state, until};
use spur_operator_core::{Error, FIELD_MANAGER, Metrics};
use spur_serving::pki::{self, Pair, now_unix};

mod plan;

/// On the CA Secret during a rotation: when the webhook configuration was first seen carrying
/// the next CA (Unix seconds).
const NEXT_PUBLISHED: &str = "spur.dev/next-ca-published-at";
/// On the CA Secret, set by whoever wants the CA replaced now (Unix seconds, e.g.
/// `kubectl annotate secret spur-ca spur.dev/rotate-requested-at=$(date +%s)`): a CA made
/// before then is rotated, through the same two steps as at 80 % of its lifetime.
pub(crate) const ROTATE_REQUESTED: &str = "spur.dev/rotate-requested-at";
/// On the serving Secret: fingerprint of the CA that signed it.
const ISSUER: &str = "spur.dev/issuer";

/// Runs the certificate manager until `stop`: a pass at start, whenever one of its Secrets or
/// the webhook configuration changes, and when the next renewal is due.
pub(crate) async fn run(client: Client, cfg: PkiConfig, metrics: Metrics, stop: CancellationToken) {
    let manager = Manager {
        secrets: Api::namespaced(client.clone(), &cfg.namespace),
        config_maps: Api::namespaced(client.clone(), &cfg.namespace),
        namespaces: Api::all(client.clone()),
        namespace_bundle_synced: std::sync::Mutex::new(None),
        webhooks: Api::all(client.clone()),
        validating: Api::all(client.clone()),
        client,
        cfg,
        metrics,
    };
    let secrets = watcher(
        manager.secrets.clone(),
        watcher::Config::default().labels(PKI_LABEL),
    )
    .default_backoff()
    .map(|_| ());
    let webhooks = watcher(
        manager.webhooks.clone(),
        watcher::Config::default().fields(&format!(
            "metadata.name={}",
            manager.cfg.webhook_configuration
        )),
    )
    .default_backoff()
    .map(|_| ());
    let validating = match &manager.cfg.validating_webhook_configuration {
        Some(name) => watcher(
            manager.validating.clone(),
            watcher::Config::default().fields(&format!("metadata.name={name}")),
        )
        .default_backoff()
        .map(|_| ())
        .boxed(),
        None => futures_util::stream::pending().boxed(),
    };
    // The namespaces that get a bundle copy whatever the webhook does: a pass when one is
    // created (or changes), so a namespace made after the operator started (or made again)
    // gets its copy at once.
    let bundle_namespaces = if manager.cfg.namespace_bundle.is_some() {
        manager.cfg.bundle_namespaces.clone()
    } else {
        Vec::new()
    };
    let bundle_namespaces = futures_util::stream::select_all(bundle_namespaces.iter().map(|ns| {
        watcher(
            manager.namespaces.clone(),
            watcher::Config::default().fields(&format!("metadata.name={ns}")),
        )
        .default_backoff()
        .map(|_| ())
        .boxed()
    }));
    let mut changes = std::pin::pin!(futures_util::stream::select(
        futures_util::stream::select(secrets, bundle_namespaces),
        futures_util::stream::select(webhooks, validating)
    ));
    let mut failures = 0u32;
    let mut wake = tokio::time::Instant::now();
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep_until(wake) => {}
            Some(()) = changes.next() => {}
        }
        // Watch events come in bursts (a pass writes up to three objects): let them settle.
        tokio::time::sleep(Duration::from_millis(20)).await;
        while let Some(Some(())) = futures_util::FutureExt::now_or_never(changes.next()) {}
        match manager.pass().await {
            Ok(next) => {
                failures = 0;
                wake = tokio::time::Instant::now() + next;
            }
            Err(e) => {
                failures = failures.saturating_add(1);
                let delay = Duration::from_secs(1u64 << (failures - 1).min(6));
                tracing::warn!(error = %e, retry_in = ?delay, "certificate manager pass failed");
                manager.metrics.pki_failure();
                wake = tokio::time::Instant::now() + delay;
            }
        }
    }
}

struct Manager {
    client: Client,
    secrets: Api<Secret>,
    config_maps: Api<ConfigMap>,
    namespaces: Api<k8s_openapi::api::core::v1::Namespace>,
    /// The bundle every namespace copy was last brought to.
    namespace_bundle_synced: std::sync::Mutex<Option<String>>,
    webhooks: Api<MutatingWebhookConfiguration>,
    validating: Api<ValidatingWebhookConfiguration>,
    cfg: PkiConfig,
    metrics: Metrics,
}

pub(crate) use spur_operator_core::bundle::{NAMESPACE_BUNDLE_ROLE, namespace_bundle};

/// Sets `caBundle` to `want` in those of `webhooks` (name, current bundle) of configuration
/// `name` that carry another.
async fn patch_ca_bundles<K>(
    api: &Api<K>,
    name: &str,
    webhooks: Vec<(String, Option<ByteString>)>,
    want: &ByteString,
) -> Result<(), Error>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let stale: Vec<_> = webhooks
        .into_iter()
        .filter(|(_, bundle)| bundle.as_ref() != Some(want))
        .map(|(n, _)| n)
        .collect();
    if stale.is_empty() {
        return Ok(());
    }
    // A strategic merge patch keyed by webhook name touches only `caBundle`: everything else
    // stays as the chart wrote it.
    let patch = serde_json::json!({
        "webhooks": stale.iter().map(|n| serde_json::json!({
            "name": n,
            "clientConfig": {"caBundle": want},
        })).collect::<Vec<_>>()
    });
    api.patch(name, &PatchParams::default(), &Patch::Strategic(&patch))
        .await?;
    tracing::info!(configuration = %name, webhooks = stale.len(), "caBundle updated");
    Ok(())
}

impl Manager {
    /// One idempotent pass; returns how long until the next one is due.
    async fn pass(&self) -> Result<Duration, Error> {
        let now = now_unix();
        let cfg = &self.cfg;
        let loaded = plan::ca_state(self.secrets.get_opt(&cfg.ca_secret).await?);
        let (mut ca, made) = plan::renew_ca(&loaded, cfg, now)?;
        for _ in 0..made {
            self.metrics.cert_issued("ca");
        }
        if ca != loaded {
            self.write_ca(&ca).await?;
        }
        let bundle_pem = ca.bundle.concat();
        let carried = self.sync_webhook_configuration(&bundle_pem).await?;
        let mut due = Vec::new();
        let (changed, wait) = plan::advance_next(&mut ca, carried, now, cfg.propagation);
        if changed {
            self.write_ca(&ca).await?;
        }
        due.extend(wait);
        let signer = ca
            .current
            .clone()
            .ok_or_else(|| Error::Pki("no signing CA".into()))?;
        let signer_info = pki::info(&signer.cert)?;
        self.metrics
            .cert_expiry("ca", signer_info.validity.not_after);
        due.extend(plan::ca_due(&ca, &signer_info, cfg.ca_lifetime, now));
        due.extend(self.sync_every_serving(&signer, &bundle_pem, now).await?);
        if let Some(name) = &cfg.bundle_config_map {
            self.sync_bundle_config_map(name, &bundle_pem).await?;
        }
        if let Some(name) = &cfg.namespace_bundle {
            self.sync_namespace_bundles(name, &bundle_pem).await?;
            self.sync_listed_bundles(name, &bundle_pem).await?;
        }
        // Secrets written before the operator had an owner (an upgrade) are adopted here; new
        // ones are written owned.
        if let Some(owner) = &cfg.owner {
            for name in plan::secret_names(cfg) {
                spur_operator_core::owner::adopt(&self.secrets, name, owner).await?;
            }
        }
        Ok(plan::next_pass(due))
    }

    /// Keeps the webhook's serving certificate and every other configured one fresh; returns
    /// when each is due for renewal.
    async fn sync_every_serving(
        &self,
        signer: &Pair,
        bundle_pem: &str,
        now: i64,
    ) -> Result<Vec<Duration>, Error> {
        let cfg = &self.cfg;
        let webhook = ServingCert {
            secret: cfg.serving_secret.clone(),
            names: cfg.serving_names.clone(),
        };
        let mut due = Vec::new();
        let serving = self
            .sync_serving(&webhook, "serving", "spur-webhook", signer, bundle_pem, now)
            .await?;
        self.metrics
            .cert_expiry("serving", serving.validity.not_after);
        due.push(until(
            serving.validity.renew_at_for(cfg.serving_lifetime),
            now,
        ));
        for (role, target) in [
            ("tunnel-proxy", &cfg.tunnel_proxy),
            ("routeserver", &cfg.routeserver),
            ("ics", &cfg.ics),
            ("traffic", &cfg.traffic),
        ] {
            let Some(target) = target else { continue };
            let held = self
                .sync_serving(
                    target,
                    role,
                    &format!("spur-{role}"),
                    signer,
                    bundle_pem,
                    now,
                )
                .await?;
            self.metrics.cert_expiry(role, held.validity.not_after);
            due.push(until(held.validity.renew_at_for(cfg.serving_lifetime), now));
        }
        Ok(due)
    }

    async fn write_ca(&self, ca: &CaState) -> Result<(), Error> {
        let (data, annotations) = plan::ca_data(ca);
        self.apply_secret(&self.cfg.ca_secret, "ca", "Opaque", data, annotations)
            .await
    }

    /// Puts `bundle` into every webhook of both configurations. Returns whether the API servers
    /// can be taken to trust it: each configuration carries it, or does not exist (then
    /// nothing calls that webhook, and a rotation need not wait for it).
    async fn sync_webhook_configuration(&self, bundle: &str) -> Result<bool, Error> {
        let want = ByteString(bundle.as_bytes().to_vec());
        let name = &self.cfg.webhook_configuration;
        let found = self.webhooks.get_opt(name).await?.map(|c| {
            c.webhooks
                .unwrap_or_default()
                .into_iter()
                .map(|w| (w.name, w.client_config.ca_bundle))
                .collect()
        });
        match found {
            Some(webhooks) => patch_ca_bundles(&self.webhooks, name, webhooks, &want).await?,
            None => {
                tracing::warn!(configuration = %name, "MutatingWebhookConfiguration not found: the chart installs it; sidecars are not injected until it exists")
            }
        }
        if let Some(name) = &self.cfg.validating_webhook_configuration {
            let found = self.validating.get_opt(name).await?.map(|c| {
                c.webhooks
                    .unwrap_or_default()
                    .into_iter()
                    .map(|w| (w.name, w.client_config.ca_bundle))
                    .collect()
            });
            match found {
                Some(webhooks) => patch_ca_bundles(&self.validating, name, webhooks, &want).await?,
                None => {
                    tracing::warn!(configuration = %name, "ValidatingWebhookConfiguration not found: the chart installs it; EnvoyConfigs are admitted unchecked until it exists")
                }
            }
        }
        Ok(true)
    }

    /// Brings every namespace's copy of the bundle (made by the webhook) up to date. Runs
    /// through the namespaces only when the bundle changed since the last complete run.
    async fn sync_namespace_bundles(&self, name: &str, bundle: &str) -> Result<(), Error> {
        if self
            .namespace_bundle_synced
            .lock()
            .ok()
            .is_some_and(|b| b.as_deref() == Some(bundle))
        {
            return Ok(());
        }
        let namespaces = self
            .namespaces
            .list_metadata(&kube::api::ListParams::default())
            .await?;
        let mut updated = 0usize;
        for ns in namespaces.items {
            let Some(ns) = ns.metadata.name else { continue };
            let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), &ns);
            let Some(cm) = api.get_opt(name).await? else {
                continue;
            };
            let (ours, current) = bundle_copy_state(&cm, bundle);
            if !ours || current {
                continue;
            }
            let body = namespace_bundle(&ns, name, bundle);
            api.patch(
                name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&body),
            )
            .await?;
            updated += 1;
        }
        if updated > 0 {
            tracing::info!(config_map = %name, namespaces = updated, "CA bundle copies updated");
        }
        if let Ok(mut b) = self.namespace_bundle_synced.lock() {
            *b = Some(bundle.to_string());
        }
        Ok(())
    }

    /// Makes sure every namespace of `bundle_namespaces` holds a current copy of the bundle:
    /// creates a missing one, updates a stale one of ours, leaves any other ConfigMap of that
    /// name alone. A namespace that does not exist is skipped (its creation wakes the manager).
    async fn sync_listed_bundles(&self, name: &str, bundle: &str) -> Result<(), Error> {
        for ns in &self.cfg.bundle_namespaces {
            if *ns == self.cfg.namespace {
                continue;
            }
            let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), ns);
            let body = namespace_bundle(ns, name, bundle);
            match api.get_opt(name).await? {
                None => match api.create(&kube::api::PostParams::default(), &body).await {
                    Ok(_) => {
                        tracing::info!(namespace = %ns, config_map = %name, "CA bundle copied");
                    }
                    // Another writer (the webhook) was faster: looked at again next pass.
                    Err(kube::Error::Api(e)) if e.code == 409 => {}
                    Err(kube::Error::Api(e)) if e.code == 404 => {
                        tracing::debug!(namespace = %ns, "no such namespace (yet): no CA bundle copy");
                    }
                    Err(e) => return Err(e.into()),
                },
                Some(cm) => {
                    let (ours, current) = bundle_copy_state(&cm, bundle);
                    if !ours {
                        tracing::debug!(namespace = %ns, config_map = %name, "not our ConfigMap: left alone");
                    } else if !current {
                        api.patch(
                            name,
                            &PatchParams::apply(FIELD_MANAGER).force(),
                            &Patch::Apply(&body),
                        )
                        .await?;
                        tracing::info!(namespace = %ns, config_map = %name, "CA bundle copy updated");
                    }
                }
            }
        }
        Ok(())
    }

    /// Publishes the CA bundle in a ConfigMap anyone may be allowed to read (no key in it).
    async fn sync_bundle_config_map(&self, name: &str, bundle: &str) -> Result<(), Error> {
        if let Some(cm) = self.config_maps.get_opt(name).await?
            && cm
                .data
                .as_ref()
                .and_then(|d| d.get("ca.crt"))
                .map(String::as_str)
                == Some(bundle)
            && self
                .cfg
                .owner
                .as_ref()
                .is_none_or(|o| spur_operator_core::owner::owned_by(&cm, o))
        {
            return Ok(());
        }
        let mut body = serde_json::json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": name,
                "namespace": self.cfg.namespace,
                "labels": {
                    PKI_LABEL: "bundle",
                    (spur_api::keys::labels::MANAGED_BY): spur_api::keys::labels::MANAGED_BY_VALUE,
                },
            },
            "data": {"ca.crt": bundle},
        });
        if let Some(owner) = &self.cfg.owner {
            body["metadata"]["ownerReferences"] = serde_json::to_value([owner])?;
        }
        self.config_maps
            .patch(
                name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&body),
            )
            .await?;
        tracing::info!(config_map = %name, "CA bundle published");
        Ok(())
    }

    /// Keeps the serving certificate `target` fresh, signed by `signer`, with its names and
    /// the current bundle; returns what it holds.
    async fn sync_serving(
        &self,
        target: &ServingCert,
        role: &'static str,
        common_name: &str,
        signer: &Pair,
        bundle: &str,
        now: i64,
    ) -> Result<pki::Info, Error> {
        let secret = self.secrets.get_opt(&target.secret).await?;
        let lifetime = self.cfg.serving_lifetime;
        let issuer = pki::fingerprint(&signer.cert);
        let (pair, info) =
            match plan::serving(secret, target, common_name, signer, bundle, lifetime, now)? {
                Serving::Current(info) => return Ok(info),
                Serving::Write { pair, info, issued } => {
                    if issued {
                        self.metrics.cert_issued(role);
                        tracing::info!(
                            secret = %target.secret,
                            not_after = info.validity.not_after,
                            issuer = %issuer,
                            "serving certificate issued"
                        );
                    }
                    (pair, info)
                }
            };
        let (data, annotations) = plan::serving_data(pair, bundle, issuer);
        self.apply_secret(
            &target.secret,
            "serving",
            "kubernetes.io/tls",
            data,
            Some(annotations),
        )
        .await?;
        Ok(info)
    }

    async fn apply_secret(
        &self,
        name: &str,
        role: &str,
        type_: &str,
        data: BTreeMap<String, ByteString>,
        annotations: Option<BTreeMap<String, String>>,
    ) -> Result<(), Error> {
        let secret = Secret {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(self.cfg.namespace.clone()),
                labels: Some(BTreeMap::from([
                    (PKI_LABEL.to_string(), role.to_string()),
                    (
                        spur_api::keys::labels::MANAGED_BY.to_string(),
                        spur_api::keys::labels::MANAGED_BY_VALUE.to_string(),
                    ),
                ])),
                annotations,
                owner_references: self.cfg.owner.clone().map(|o| vec![o]),
                ..Default::default()
            },
            type_: Some(type_.into()),
            data: Some(data),
            ..Default::default()
        };
        let mut body = serde_json::to_value(&secret)?;
        body["apiVersion"] = "v1".into();
        body["kind"] = "Secret".into();
        self.secrets
            .patch(
                name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&body),
            )
            .await?;
        Ok(())
    }
}
