//! `valueFrom.fork`: env values that point a fork at another fork of its sandbox. The value is
//! rendered here, from the other baseline and the Services selecting it (what its fork's
//! sandbox Services are made from), and written into the fork as a literal, so the fork does
//! not wait for the other fork to exist: the name of its Service is known before it is made.

use k8s_openapi::api::core::v1::Service;
use kube::ResourceExt;
use spur_api::sandbox::{Customizations, expression};
use spur_api::{WorkloadRef, names};

use crate::Error;
use crate::baseline::Baseline;
use crate::context::Term;

/// `c` with every `valueFrom.fork` rendered for a fork in namespace `ns` of `sandbox`, given
/// the Services of `ns` (read again for a baseline elsewhere); `Ok(Err)` is a message for the
/// user. Both the Sandbox's check and the ForkedWorkload's plan go through here.
pub(crate) async fn rendered(
    term: &Term,
    sandbox: &str,
    c: &Customizations,
    ns: &str,
    services: &[Service],
) -> Result<Result<Customizations, String>, Error> {
    let mut targets = Vec::new();
    for r in referenced(c) {
        let t = lookup(term, sandbox, r, ns, services).await?;
        targets.push((r.clone(), t));
    }
    Ok(resolved(c, &targets))
}

/// Where the fork of `baseline` in `sandbox` is reached, or why it has no address.
async fn lookup(
    term: &Term,
    sandbox: &str,
    baseline: &WorkloadRef,
    ns: &str,
    services: &[Service],
) -> Result<Result<ForkTarget, String>, Error> {
    let d = match term
        .baseline(baseline.kind, &baseline.namespace, &baseline.name)
        .await?
    {
        Ok(d) => d,
        Err((_, message)) => return Ok(Err(message)),
    };
    let elsewhere;
    let services = if baseline.namespace == ns {
        services
    } else {
        elsewhere = term.baseline_services(&baseline.namespace).await?;
        elsewhere.as_slice()
    };
    Ok(target(sandbox, &d, services))
}

/// Where a fork can be reached: its first sandbox Service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ForkTarget {
    /// `<sandbox Service>.<namespace>.svc`.
    pub(crate) host: String,
    /// The Service's first port.
    pub(crate) port: i32,
}

/// The baselines whose forks `c`'s env refers to, in env order, repeats included: for the watch
/// mappers, which run on every event and only ask whether one matches.
pub(crate) fn references(c: &Customizations) -> impl Iterator<Item = &WorkloadRef> {
    c.env
        .iter()
        .filter_map(|e| Some(&e.value_from.as_ref()?.fork.as_ref()?.fork_of))
}

/// The baselines whose forks `c`'s env refers to, each once.
pub(crate) fn referenced(c: &Customizations) -> Vec<&WorkloadRef> {
    let mut out: Vec<&WorkloadRef> = references(c).collect();
    out.sort();
    out.dedup();
    out
}

/// Where the fork of `baseline` in `sandbox` is reached, given the Services of the baseline's
/// namespace; the error is a message for the user.
pub(crate) fn target(
    sandbox: &str,
    baseline: &Baseline,
    services: &[Service],
) -> Result<ForkTarget, String> {
    let ns = baseline.namespace();
    let first = baseline
        .selecting(services)
        .into_iter()
        .next()
        .ok_or_else(|| {
            format!(
                "no Service selects {}, so its fork has no address",
                baseline.describe()
            )
        })?;
    let port = first
        .spec
        .as_ref()
        .and_then(|s| s.ports.as_ref()?.first())
        .map(|p| p.port)
        .ok_or_else(|| format!("Service {ns}/{} has no port", first.name_any()))?;
    Ok(ForkTarget {
        host: format!(
            "{}.{ns}.svc",
            names::sandbox_service_name(sandbox, &first.name_any())
        ),
        port,
    })
}

/// `c` with every `valueFrom.fork` replaced by its rendered value (`targets` holds one entry
/// per [`referenced`] baseline, or the reason it has no target). The error is a message for the
/// user naming the variable.
pub(crate) fn resolved(
    c: &Customizations,
    targets: &[(WorkloadRef, Result<ForkTarget, String>)],
) -> Result<Customizations, String> {
    let mut out = c.clone();
    for e in &mut out.env {
        let Some(f) = e.value_from.as_ref().and_then(|v| v.fork.as_ref()) else {
            continue;
        };
        let r = &f.fork_of;
        let target = targets
            .iter()
            .find(|(b, _)| b == r)
            .map(|(_, t)| t.as_ref())
            .ok_or_else(|| format!("env {}: valueFrom.fork: {r} was not looked up", e.name))?
            .map_err(|why| format!("env {}: valueFrom.fork: {why}", e.name))?;
        let value = expression::render(&f.expression, &target.host, target.port)
            .map_err(|why| format!("env {}: valueFrom.fork.expression {why}", e.name))?;
        e.value = Some(value);
        e.value_from = None;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;
    use spur_api::WorkloadKind;

    fn customizations() -> Customizations {
        serde_json::from_value(json!({"env": [
            {"name": "ROUTE_ADDR", "valueFrom": {"fork": {
                "forkOf": {"kind": "Deployment", "namespace": "hotrod", "name": "route"},
                "expression": "http://{{.Service.Host}}:{{ .Service.Port }}"}}},
            {"name": "ROUTE_HOST", "valueFrom": {"fork": {
                "forkOf": {"kind": "Deployment", "namespace": "hotrod", "name": "route"},
                "expression": "{{.Service.Host}}"}}},
            {"name": "LOG", "value": "debug"}
        ]}))
        .unwrap()
    }

    fn deployment() -> Baseline {
        Baseline::deployment(
            serde_json::from_value(json!({
                "metadata": {"name": "route", "namespace": "hotrod"},
                "spec": {"selector": {"matchLabels": {"app": "route"}},
                         "template": {"metadata": {"labels": {"app": "route"}},
                                      "spec": {"containers": [{"name": "route"}]}}}
            }))
            .unwrap(),
        )
    }

    fn service(name: &str, app: &str, port: i32) -> Service {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "hotrod"},
            "spec": {"selector": {"app": app}, "ports": [{"port": port}, {"port": 9}]}
        }))
        .unwrap()
    }

    #[test]
    fn renders_the_other_forks_first_service() {
        let c = customizations();
        let route = WorkloadRef::new(WorkloadKind::Deployment, "hotrod", "route");
        assert_eq!(referenced(&c), vec![&route]);
        let services = [
            service("z-route", "route", 80),
            service("route", "route", 8083),
            service("other", "other", 1),
        ];
        let t = target("sb1", &deployment(), &services).unwrap();
        let host = format!("{}.hotrod.svc", names::sandbox_service_name("sb1", "route"));
        assert_eq!(
            t,
            ForkTarget {
                host: host.clone(),
                port: 8083
            }
        );
        let out = resolved(&c, &[(route, Ok(t))]).unwrap();
        assert_eq!(
            out.env[0].value.as_deref(),
            Some(format!("http://{host}:8083").as_str())
        );
        assert_eq!(out.env[1].value.as_deref(), Some(host.as_str()));
        assert!(out.env.iter().all(|e| e.value_from.is_none()));
        assert_eq!(out.env[2], c.env[2]);
    }

    #[test]
    fn says_why_there_is_no_value() {
        let c = customizations();
        let route = WorkloadRef::new(WorkloadKind::Deployment, "hotrod", "route");
        let err = target("sb1", &deployment(), &[service("o", "other", 1)]).unwrap_err();
        assert!(err.contains("no Service selects"), "{err}");
        let err = resolved(&c, &[(route, Err(err))]).unwrap_err();
        assert!(
            err.starts_with("env ROUTE_ADDR: valueFrom.fork: no Service"),
            "{err}"
        );
        let err = resolved(&c, &[]).unwrap_err();
        assert!(err.contains("was not looked up"), "{err}");
    }
}
