//! The jobs CA and what it signs. Separate from the operator's CA on purpose: the executor
//! accepts any client certificate (clientAuth) this CA signed, and it signs exactly one, the
//! jobs controller's own (kept in memory, reissued daily). Executors get a serving certificate
//! per namespace (`spur-job-executor.<namespace>`, Secret `spur-job-executor-tls` in that
//! namespace, mounted only into the runner pods' init container).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, Issuer, KeyPair, KeyUsagePurpose};
use spur_serving::pki::{self, Pair};

use crate::Error;

/// The Secret (in the component's namespace) holding the jobs CA.
pub const CA_SECRET: &str = "spur-jobs-ca";
/// The Secret, in every namespace with a runner group, that runner pods get their TLS from.
pub const EXECUTOR_SECRET: &str = "spur-job-executor-tls";
const FIELD_MANAGER: &str = "spur-jobs";
const CA_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
const SERVING_LIFETIME: Duration = Duration::from_secs(365 * 24 * 3600);
const CLIENT_LIFETIME: Duration = Duration::from_secs(7 * 24 * 3600);
const CLIENT_REISSUE: i64 = 24 * 3600;

/// The CA and the client configuration drivers dial executors with.
pub struct JobsPki {
    ca: Pair,
    client: Mutex<(i64, Arc<rustls::ClientConfig>)>,
}

impl std::fmt::Debug for JobsPki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobsPki")
            .field("ca", &self.ca)
            .finish_non_exhaustive()
    }
}

fn pki_err(e: impl std::fmt::Display) -> Error {
    Error::Pki(e.to_string())
}

/// Adds `owner` to the CA Secret's owners unless it is there. The patch carries the version it
/// was computed from, so an owner added meanwhile is never dropped; on a conflict the Secret is
/// read again: replicas of one StatefulSet starting together (an upgrade to two replicas) add
/// the same owner, and the one that loses the race finds it there rather than failing its start.
async fn add_owner(
    secrets: &Api<Secret>,
    mut secret: Secret,
    owner: &OwnerReference,
) -> Result<(), Error> {
    const ATTEMPTS: usize = 5;
    let mut attempt = 1;
    loop {
        let mut owners = secret.metadata.owner_references.clone().unwrap_or_default();
        if owners.iter().any(|o| o.uid == owner.uid) {
            return Ok(());
        }
        owners.push(owner.clone());
        let patch = serde_json::json!({"metadata": {
            "ownerReferences": owners,
            "resourceVersion": secret.metadata.resource_version,
        }});
        match secrets
            .patch(CA_SECRET, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 && attempt < ATTEMPTS => {
                secret = secrets.get(CA_SECRET).await?;
                attempt += 1;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

impl JobsPki {
    /// Reads the CA Secret, creating it on first start (a concurrent creator wins, and its CA
    /// is read back). With `owner` (the component's StatefulSet), the Secret goes with the
    /// installation.
    pub async fn load_or_create(
        client: &Client,
        namespace: &str,
        owner: Option<&OwnerReference>,
    ) -> Result<Self, Error> {
        let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
        let ca = match secrets.get_opt(CA_SECRET).await? {
            Some(s) => {
                let pair = read_pair(&s, "ca.crt", "ca.key").ok_or_else(|| {
                    Error::Pki(format!(
                        "Secret {namespace}/{CA_SECRET} lacks ca.crt or ca.key"
                    ))
                })?;
                if let Some(owner) = owner {
                    add_owner(&secrets, s, owner).await?;
                }
                pair
            }
            None => {
                let ca =
                    pki::new_ca("spur jobs CA", CA_LIFETIME, pki::now_unix()).map_err(pki_err)?;
                let secret = Secret {
                    metadata: ObjectMeta {
                        name: Some(CA_SECRET.into()),
                        namespace: Some(namespace.into()),
                        labels: Some(managed_labels()),
                        owner_references: owner.map(|o| vec![o.clone()]),
                        ..Default::default()
                    },
                    type_: Some("Opaque".into()),
                    data: Some(pair_data(&ca, "ca.crt", "ca.key")),
                    ..Default::default()
                };
                match secrets.create(&PostParams::default(), &secret).await {
                    Ok(_) => {
                        tracing::info!(secret = CA_SECRET, "created the jobs CA");
                        ca
                    }
                    Err(kube::Error::Api(s)) if s.code == 409 => {
                        let s = secrets.get(CA_SECRET).await?;
                        read_pair(&s, "ca.crt", "ca.key").ok_or_else(|| {
                            Error::Pki(format!("Secret {CA_SECRET} lacks ca.crt or ca.key"))
                        })?
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        };
        let client_cfg = client_config(&ca)?;
        Ok(JobsPki {
            ca,
            client: Mutex::new((pki::now_unix(), client_cfg)),
        })
    }

    /// In-memory CA, for tests.
    pub fn ephemeral() -> Result<Self, Error> {
        let ca = pki::new_ca("spur jobs CA", CA_LIFETIME, pki::now_unix()).map_err(pki_err)?;
        let client_cfg = client_config(&ca)?;
        Ok(JobsPki {
            ca,
            client: Mutex::new((pki::now_unix(), client_cfg)),
        })
    }

    pub fn ca_pem(&self) -> &str {
        &self.ca.cert
    }

    /// A serving certificate for `names` (the aggregated API's), signed by the jobs CA, which
    /// the APIService's caBundle carries.
    pub fn serving(&self, names: &[String]) -> Result<Pair, Error> {
        let cn = names.first().map_or("spur-jobs", String::as_str);
        pki::issue_serving(&self.ca, cn, names, SERVING_LIFETIME, pki::now_unix()).map_err(pki_err)
    }

    /// The client configuration; its certificate is reissued once a day.
    pub fn client(&self) -> Result<Arc<rustls::ClientConfig>, Error> {
        let mut g = self.client.lock().unwrap_or_else(|p| p.into_inner());
        let now = pki::now_unix();
        if now - g.0 >= CLIENT_REISSUE {
            *g = (now, client_config(&self.ca)?);
        }
        Ok(g.1.clone())
    }

    /// Makes sure `namespace` has a current executor Secret (created, or renewed at 80 % of its
    /// lifetime or when signed by another CA).
    pub async fn ensure_executor_secret(
        &self,
        client: &Client,
        namespace: &str,
        owner: Option<OwnerReference>,
    ) -> Result<(), Error> {
        let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
        let now = pki::now_unix();
        if let Some(s) = secrets.get_opt(EXECUTOR_SECRET).await? {
            let current = read_pair(&s, "tls.crt", "tls.key").zip(text(&s, "ca.crt"));
            if let Some((pair, ca)) = current
                && ca.trim() == self.ca.cert.trim()
                && pki::info(&pair.cert).is_ok_and(|i| now < i.validity.renew_at())
            {
                return Ok(());
            }
        }
        let name = spur_job_executor::client::server_name(namespace);
        let serving = pki::issue_serving(
            &self.ca,
            &name,
            std::slice::from_ref(&name),
            SERVING_LIFETIME,
            now,
        )
        .map_err(pki_err)?;
        let mut data = pair_data(&serving, "tls.crt", "tls.key");
        data.insert(
            "ca.crt".into(),
            ByteString(self.ca.cert.clone().into_bytes()),
        );
        let secret = Secret {
            metadata: ObjectMeta {
                name: Some(EXECUTOR_SECRET.into()),
                namespace: Some(namespace.into()),
                labels: Some(managed_labels()),
                owner_references: owner.map(|o| vec![o]),
                ..Default::default()
            },
            type_: Some("Opaque".into()),
            data: Some(data),
            ..Default::default()
        };
        secrets
            .patch(
                EXECUTOR_SECRET,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&secret),
            )
            .await?;
        tracing::info!(%namespace, "issued the job executors' serving certificate");
        Ok(())
    }
}

/// A client certificate (CN `spur-jobs`, clientAuth) and the configuration that presents it
/// and trusts only the jobs CA.
fn client_config(ca: &Pair) -> Result<Arc<rustls::ClientConfig>, Error> {
    let ca_key = KeyPair::from_pem(&ca.key).map_err(pki_err)?;
    let ca_der = {
        use rustls::pki_types::pem::PemObject;
        rustls::pki_types::CertificateDer::from_pem_slice(ca.cert.as_bytes()).map_err(pki_err)?
    };
    let issuer = Issuer::from_ca_cert_der(&ca_der, ca_key).map_err(pki_err)?;
    let key = KeyPair::generate().map_err(pki_err)?;
    let mut params = CertificateParams::default();
    params
        .distinguished_name
        .push(DnType::CommonName, "spur-jobs");
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::minutes(5);
    params.not_after = now + time::Duration::try_from(CLIENT_LIFETIME).map_err(pki_err)?;
    let cert = params.signed_by(&key, &issuer).map_err(pki_err)?;
    spur_job_executor::client::client_config(
        ca.cert.as_bytes(),
        cert.pem().as_bytes(),
        key.serialize_pem().as_bytes(),
    )
    .map_err(Error::Pki)
}

fn managed_labels() -> BTreeMap<String, String> {
    BTreeMap::from([(
        spur_api::keys::labels::MANAGED_BY.to_owned(),
        spur_api::keys::labels::MANAGED_BY_VALUE.to_owned(),
    )])
}

fn text(s: &Secret, key: &str) -> Option<String> {
    s.data
        .as_ref()?
        .get(key)
        .and_then(|b| String::from_utf8(b.0.clone()).ok())
        .filter(|t| !t.trim().is_empty())
}

fn read_pair(s: &Secret, cert: &str, key: &str) -> Option<Pair> {
    Some(Pair {
        cert: text(s, cert)?,
        key: text(s, key)?,
    })
}

fn pair_data(p: &Pair, cert: &str, key: &str) -> BTreeMap<String, ByteString> {
    BTreeMap::from([
        (cert.to_owned(), ByteString(p.cert.clone().into_bytes())),
        (key.to_owned(), ByteString(p.key.clone().into_bytes())),
    ])
}
