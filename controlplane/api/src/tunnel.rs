//! The contract between the tunnel proxy and the operator: while a workstation's reverse
//! tunnel is up, the tunnel-proxy replica carrying it keeps a `coordination.k8s.io` Lease
//! renewed in its own namespace. The Lease says which replica holds the tunnel, at which
//! address, and which tunnel-proxy port forwards each ExternalWorkload port. The operator reads
//! it into ExternalWorkload status and EndpointSlices and deletes Leases that stopped being
//! renewed long ago. Neither side writes the other's objects.

use std::collections::BTreeMap;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use serde::{Deserialize, Serialize};

use crate::keys::labels;

/// Label on tunnel Leases: the workstation (its name, a DNS label).
pub const WORKSTATION_LABEL: &str = "spur.dev/workstation";
/// Annotation: the address other pods reach the tunnel-proxy replica at (its pod IP).
pub const ADDRESS_ANNOTATION: &str = "spur.dev/tunnel-address";
/// Annotation: JSON list of [`PortAssignment`]s.
pub const PORTS_ANNOTATION: &str = "spur.dev/tunnel-ports";

/// Workstation credentials the tunnel proxy reads from its token namespace (the contract
/// between it, `spur local token|revoke`, and tunnel grants written by the operator).
pub mod credentials;

/// Name of the Lease for `workstation`.
pub fn lease_name(workstation: &str) -> String {
    format!("spur-tunnel-{workstation}")
}

/// One ExternalWorkload port and the tunnel-proxy port that carries it to the workstation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PortAssignment {
    pub namespace: String,
    pub external_workload: String,
    /// Container port of the baseline (`spec.mappings[].port`).
    pub port: i32,
    /// Port on the tunnel-proxy replica.
    pub proxy_port: i32,
}

/// A tunnel as its Lease describes it.
#[derive(Clone, Debug, PartialEq)]
pub struct Session {
    pub workstation: String,
    /// The tunnel-proxy pod holding the tunnel (`spec.holderIdentity`).
    pub proxy_pod: String,
    pub address: String,
    pub ports: Vec<PortAssignment>,
    /// Last renewal, Unix seconds.
    pub renewed: i64,
    /// Seconds a renewal stays valid.
    pub duration: i64,
    /// When the session started, Unix microseconds (`spec.acquireTime`): of two replicas
    /// claiming one workstation, the later session wins.
    pub started_micros: i64,
}

impl Session {
    /// The tunnel counts as up until its last renewal expires.
    pub fn is_fresh(&self, now: i64) -> bool {
        now < self.renewed.saturating_add(self.duration)
    }

    /// When a fresh session turns stale without another renewal.
    pub fn expires(&self) -> i64 {
        self.renewed.saturating_add(self.duration)
    }

    /// The proxy ports of one ExternalWorkload, by baseline port.
    pub fn ports_of(&self, namespace: &str, external_workload: &str) -> BTreeMap<i32, i32> {
        self.ports
            .iter()
            .filter(|p| p.namespace == namespace && p.external_workload == external_workload)
            .map(|p| (p.port, p.proxy_port))
            .collect()
    }

    /// Reads a tunnel Lease; the error says what is wrong with it.
    pub fn from_lease(lease: &Lease) -> Result<Session, String> {
        let meta = &lease.metadata;
        let workstation = meta
            .labels
            .as_ref()
            .and_then(|l| l.get(WORKSTATION_LABEL))
            .cloned()
            .ok_or_else(|| format!("no {WORKSTATION_LABEL} label"))?;
        let spec = lease.spec.as_ref().ok_or("no spec")?;
        let proxy_pod = spec
            .holder_identity
            .clone()
            .filter(|h| !h.is_empty())
            .ok_or("no holderIdentity")?;
        let renewed = spec
            .renew_time
            .as_ref()
            .or(spec.acquire_time.as_ref())
            .map(|t| t.0.as_second())
            .ok_or("no renewTime")?;
        let started_micros = spec
            .acquire_time
            .as_ref()
            .map_or(0, |t| t.0.as_microsecond());
        let duration = i64::from(
            spec.lease_duration_seconds
                .filter(|d| *d > 0)
                .ok_or("no leaseDurationSeconds")?,
        );
        let annotations = meta.annotations.clone().unwrap_or_default();
        // What an EndpointSlice accepts: a routable unicast address (no loopback, link-local
        // or unspecified address).
        let address = annotations
            .get(ADDRESS_ANNOTATION)
            .filter(|a| {
                a.parse::<std::net::IpAddr>().is_ok_and(|ip| match ip {
                    std::net::IpAddr::V4(v4) => {
                        !(v4.is_loopback()
                            || v4.is_link_local()
                            || v4.is_unspecified()
                            || v4.is_multicast())
                    }
                    std::net::IpAddr::V6(v6) => {
                        !(v6.is_loopback()
                            || v6.is_unspecified()
                            || v6.is_multicast()
                            || v6.is_unicast_link_local())
                    }
                })
            })
            .cloned()
            .ok_or_else(|| format!("{ADDRESS_ANNOTATION} is not a routable pod IP"))?;
        let ports: Vec<PortAssignment> = match annotations.get(PORTS_ANNOTATION) {
            None => Vec::new(),
            Some(text) => {
                serde_json::from_str(text).map_err(|e| format!("{PORTS_ANNOTATION}: {e}"))?
            }
        };
        if let Some(p) = ports
            .iter()
            .find(|p| !(1..=65535).contains(&p.port) || !(1..=65535).contains(&p.proxy_port))
        {
            return Err(format!("{PORTS_ANNOTATION}: port out of range in {p:?}"));
        }
        Ok(Session {
            workstation,
            proxy_pod,
            address,
            ports,
            renewed,
            duration,
            started_micros,
        })
    }

    /// The Lease the tunnel proxy keeps renewed for this session.
    pub fn to_lease(&self, namespace: &str) -> Result<Lease, String> {
        let ports = serde_json::to_string(&self.ports).map_err(|e| e.to_string())?;
        let renewed =
            k8s_openapi::jiff::Timestamp::from_second(self.renewed).map_err(|e| e.to_string())?;
        let duration = i32::try_from(self.duration).map_err(|e| e.to_string())?;
        let started = (self.started_micros > 0)
            .then(|| k8s_openapi::jiff::Timestamp::from_microsecond(self.started_micros))
            .transpose()
            .map_err(|e| e.to_string())?;
        Ok(Lease {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some(lease_name(&self.workstation)),
                namespace: Some(namespace.into()),
                labels: Some(BTreeMap::from([
                    (WORKSTATION_LABEL.to_string(), self.workstation.clone()),
                    (
                        labels::MANAGED_BY.to_string(),
                        labels::MANAGED_BY_VALUE.to_string(),
                    ),
                ])),
                annotations: Some(BTreeMap::from([
                    (ADDRESS_ANNOTATION.to_string(), self.address.clone()),
                    (PORTS_ANNOTATION.to_string(), ports),
                ])),
                ..Default::default()
            },
            spec: Some(k8s_openapi::api::coordination::v1::LeaseSpec {
                holder_identity: Some(self.proxy_pod.clone()),
                renew_time: Some(MicroTime(renewed)),
                acquire_time: started.map(MicroTime),
                lease_duration_seconds: Some(duration),
                ..Default::default()
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn session() -> Session {
        Session {
            workstation: "alice".into(),
            proxy_pod: "tp-0".into(),
            address: "10.1.2.3".into(),
            ports: vec![PortAssignment {
                namespace: "shop".into(),
                external_workload: "sb-api".into(),
                port: 8080,
                proxy_port: 31001,
            }],
            renewed: 1_700_000_000,
            duration: 10,
            started_micros: 1_699_999_990_123_456,
        }
    }

    #[test]
    fn lease_round_trip_and_freshness() {
        let s = session();
        let lease = s.to_lease("spur-system").unwrap();
        assert_eq!(lease.metadata.name.as_deref(), Some("spur-tunnel-alice"));
        let back = Session::from_lease(&lease).unwrap();
        assert_eq!(back, s);
        assert!(s.is_fresh(1_700_000_009));
        assert!(!s.is_fresh(1_700_000_010));
        assert_eq!(s.ports_of("shop", "sb-api").get(&8080), Some(&31001));
        assert!(s.ports_of("other", "sb-api").is_empty());
    }

    #[test]
    fn bad_leases_are_reported() {
        let mut lease = session().to_lease("ns").unwrap();
        lease
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(PORTS_ANNOTATION.into(), "[{\"port\": 1}]".into());
        assert!(
            Session::from_lease(&lease)
                .unwrap_err()
                .contains(PORTS_ANNOTATION)
        );
        let mut lease = session().to_lease("ns").unwrap();
        lease
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(ADDRESS_ANNOTATION.into(), "not-an-ip".into());
        assert!(Session::from_lease(&lease).is_err());
        for bad in ["127.0.0.1", "::1", "169.254.1.1", "0.0.0.0"] {
            let mut s = session();
            s.address = bad.into();
            let lease = s.to_lease("ns").unwrap();
            assert!(
                Session::from_lease(&lease)
                    .unwrap_err()
                    .contains("routable"),
                "{bad}"
            );
        }
        let mut s = session();
        s.ports[0].proxy_port = 70000;
        let lease = s.to_lease("ns").unwrap();
        assert!(
            Session::from_lease(&lease)
                .unwrap_err()
                .contains("out of range")
        );
    }
}
