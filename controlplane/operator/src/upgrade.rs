//! What the chart's pre-upgrade (and pre-rollback) hook does before `helm upgrade` changes
//! anything (`spur-operator prepare-upgrade`, charts/spur/templates/upgrade.yaml, docs/install.md
//! "Upgrading").
//!
//! A StatefulSet's `volumeClaimTemplates` cannot change: turning `jobs.persistence.enabled` or
//! `hub.persistence.enabled` on or off, or a new size, would make the upgrade fail half-way
//! ("spec: Forbidden: updates to statefulset spec for fields other than ..."), leaving the user to
//! delete the StatefulSet by hand. For each StatefulSet named, this compares the claim template in
//! force with the one the new chart renders and, when they differ, deletes the StatefulSet and its
//! pod but not its claims (foreground propagation: the StatefulSet goes once its pod has), waiting
//! until it is gone; helm then creates it anew, with a new pod. (Orphaning the pod for the new
//! StatefulSet to adopt does not work: a pod without the claim's volume is one the StatefulSet
//! controller tries to update in place, which the API server forbids, and it never replaces it.)
//! The component restarts as for any change of its pod template; its one replica would restart on
//! a rolling update anyway. Stored data stays in its claim (a claim left by persistence turned off
//! is used again when it is turned back on).
//!
//! The existing claim decides the rest: a size larger than it holds is asked of it first (the API
//! server grants that only where the StorageClass allows expansion, and says why not otherwise);
//! a StorageClass other than its own is refused, with what to do, since a claim's class cannot
//! change. Every refusal comes before anything changed: all plans are made first, then all claims
//! grown, then the StatefulSets replaced.

use std::time::Duration;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Secret};
use kube::api::{DeleteParams, Patch, PatchParams, PropagationPolicy};
use kube::{Api, Client};
use serde::Deserialize;

use crate::Error;

/// How long a replaced StatefulSet may take to go (its `foregroundDeletion` finalizer waits on
/// the garbage collector, which deletes its pod: the pod's grace period, 30 s by default).
const GONE_WAIT: Duration = Duration::from_secs(120);

/// One StatefulSet's claim as the new chart renders it (`--statefulset`, JSON).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Desired {
    /// The StatefulSet, in the hook's namespace.
    pub name: String,
    /// The chart value that sets its persistence, for messages (`jobs.persistence`).
    pub value: String,
    /// The claim template's name (`data`).
    pub claim: String,
    /// Whether the new chart renders a claim template at all.
    pub enabled: bool,
    /// Its `resources.requests.storage` (with `enabled`).
    #[serde(default)]
    pub size: Option<String>,
    /// Its `storageClassName`: absent for the cluster's default class, "" for none.
    #[serde(default)]
    pub storage_class_name: Option<String>,
    /// Secrets of the namespace the StatefulSet owns that must outlive it (the jobs CA: a new
    /// one would leave running runner pods with certificates of the old): its owner reference
    /// is taken off them before the deletion, and the new StatefulSet's pod adds its own.
    #[serde(default)]
    pub keep_secrets: Vec<String>,
}

impl Desired {
    /// Reads one `--statefulset` argument, refusing what the chart would never render.
    pub fn parse(json: &str) -> Result<Desired, Error> {
        let d: Desired = serde_json::from_str(json).map_err(|e| {
            Error::Config(format!(
                "--statefulset {json}: not a claim description: {e}"
            ))
        })?;
        if d.name.is_empty() || d.claim.is_empty() {
            return Err(Error::Config(format!(
                "--statefulset {json}: name and claim must not be empty"
            )));
        }
        if d.enabled {
            let size = d.size.as_deref().unwrap_or_default();
            bytes(size).map_err(|e| Error::Config(format!("--statefulset {json}: size: {e}")))?;
        }
        Ok(d)
    }

    /// The claim of the StatefulSet's first (only) pod.
    pub fn pod_claim(&self) -> String {
        format!("{}-{}-0", self.claim, self.name)
    }
}

/// The claim template in force, or an existing claim: its requested size and class.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Storage {
    pub size: Option<String>,
    pub storage_class_name: Option<String>,
}

/// What to do before the upgrade.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    /// Ask the existing claim for this size first.
    pub grow: Option<String>,
    /// Delete the StatefulSet and its pod (its claims stay) so helm creates it anew.
    pub replace: bool,
}

/// Decides from the claim template in force (`None`: the StatefulSet has none), the existing
/// claim of its pod, if any, and the one the chart renders.
pub fn plan(
    template: Option<&Storage>,
    claim: Option<&Storage>,
    want: &Desired,
) -> Result<Plan, Error> {
    if !want.enabled {
        return Ok(Plan {
            grow: None,
            replace: template.is_some(),
        });
    }
    let want_size = want.size.clone().unwrap_or_default();
    let want_bytes =
        bytes(&want_size).map_err(|e| Error::Config(format!("{}.size: {e}", want.value)))?;
    let mut grow = None;
    if let Some(claim) = claim {
        // Without a class named, the cluster's default is wanted: whatever class the claim got
        // from it (not readable here) is taken as that.
        if let Some(wanted) = &want.storage_class_name {
            let held = claim.storage_class_name.clone().unwrap_or_default();
            if held != *wanted {
                let shown = |c: &str| {
                    if c.is_empty() {
                        "none (\"-\")".to_owned()
                    } else {
                        format!("{c:?}")
                    }
                };
                return Err(Error::Upgrade(format!(
                    "{value}: StorageClass {to} wanted, but claim {claim} exists with {from}, and \
                     a claim's class cannot change. Set {value}.storageClass to {keep} (or \"\" \
                     for the cluster's default), or delete the claim (`kubectl delete pvc \
                     {claim}`; what it stores is lost) and upgrade again",
                    value = want.value,
                    to = shown(wanted),
                    from = shown(&held),
                    keep = if held.is_empty() {
                        "\"-\"".to_owned()
                    } else {
                        held.clone()
                    },
                    claim = want.pod_claim(),
                )));
            }
        }
        let held = claim.size.as_deref().unwrap_or_default();
        let held_bytes = bytes(held).map_err(|e| {
            Error::Upgrade(format!("claim {}: size {held:?}: {e}", want.pod_claim()))
        })?;
        if want_bytes > held_bytes {
            grow = Some(want_size.clone());
        }
    }
    let replace = match template {
        None => true,
        Some(t) => {
            t.storage_class_name != want.storage_class_name
                || t.size.as_deref().map(bytes).and_then(Result::ok) != Some(want_bytes)
        }
    };
    Ok(Plan { grow, replace })
}

/// The bytes a Kubernetes quantity stands for, rounded up to a whole byte (as the API server
/// does for storage): `5Gi`, `5368709120`, `1.5Gi`, `500M`, `5e9`. Bounded: at most 20 digits
/// and exponents up to 18, so the arithmetic cannot overflow.
pub fn bytes(q: &str) -> Result<u128, String> {
    let q = q.trim();
    let split = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(q.len());
    let (number, suffix) = q.split_at(split);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() || whole.len() + fraction.len() > 20 {
        return Err(format!("{q:?} is not a quantity (e.g. 5Gi)"));
    }
    let digits = format!("{whole}{fraction}");
    let mantissa: u128 = digits
        .parse()
        .map_err(|_| format!("{q:?} is not a quantity (e.g. 5Gi)"))?;
    // value = mantissa * num / den
    let (num, mut den): (u128, u128) = match suffix {
        "" => (1, 1),
        "Ki" => (1 << 10, 1),
        "Mi" => (1 << 20, 1),
        "Gi" => (1 << 30, 1),
        "Ti" => (1 << 40, 1),
        "Pi" => (1 << 50, 1),
        "Ei" => (1 << 60, 1),
        "m" => (1, 1000),
        "k" => (1_000, 1),
        "M" => (1_000_000, 1),
        "G" => (1_000_000_000, 1),
        "T" => (1_000_000_000_000, 1),
        "P" => (1_000_000_000_000_000, 1),
        "E" => (1_000_000_000_000_000_000, 1),
        s if s.starts_with(['e', 'E']) => {
            let exp: i32 = s[1..]
                .parse()
                .ok()
                .filter(|e: &i32| (-18..=18).contains(e))
                .ok_or_else(|| format!("{q:?}: exponent out of range"))?;
            let p = 10u128.pow(exp.unsigned_abs());
            if exp >= 0 { (p, 1) } else { (1, p) }
        }
        _ => return Err(format!("{q:?}: unknown suffix {suffix:?}")),
    };
    // `fraction.len()` is at most 20: 10^20 fits.
    den *= 10u128.pow(u32::try_from(fraction.len()).unwrap_or(20));
    let total = mantissa
        .checked_mul(num)
        .ok_or_else(|| format!("{q:?} is too large"))?;
    Ok(total.div_ceil(den))
}

fn storage_of(spec: Option<&k8s_openapi::api::core::v1::PersistentVolumeClaimSpec>) -> Storage {
    Storage {
        size: spec
            .and_then(|s| s.resources.as_ref())
            .and_then(|r| r.requests.as_ref())
            .and_then(|r| r.get("storage"))
            .map(|q| q.0.clone()),
        storage_class_name: spec.and_then(|s| s.storage_class_name.clone()),
    }
}

/// Prepares each StatefulSet of `wanted` in `namespace` for the upgrade; one line per
/// StatefulSet saying what was done.
pub async fn prepare(
    client: &Client,
    namespace: &str,
    wanted: &[Desired],
) -> Result<Vec<String>, Error> {
    let sts: Api<StatefulSet> = Api::namespaced(client.clone(), namespace);
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), namespace);
    // Every plan first: a refusal stops the upgrade before anything changed.
    let mut plans = Vec::new();
    for want in wanted {
        let Some(live) = sts.get_opt(&want.name).await? else {
            plans.push((want, None, Plan::default()));
            continue;
        };
        let template = live
            .spec
            .as_ref()
            .and_then(|s| s.volume_claim_templates.as_ref())
            .and_then(|ts| {
                ts.iter()
                    .find(|t| t.metadata.name.as_deref() == Some(want.claim.as_str()))
            })
            .map(|t| storage_of(t.spec.as_ref()));
        let claim = pvcs
            .get_opt(&want.pod_claim())
            .await?
            .map(|c| storage_of(c.spec.as_ref()));
        let plan = plan(template.as_ref(), claim.as_ref(), want)?;
        plans.push((want, live.metadata.uid.clone(), plan));
    }
    for (want, _, plan) in &plans {
        if let Some(size) = &plan.grow {
            let patch = serde_json::json!({"spec": {"resources": {"requests": {"storage": size}}}});
            pvcs.patch(
                &want.pod_claim(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
            .map_err(|e| {
                Error::Upgrade(format!(
                    "{value}.size: claim {claim} cannot grow to {size} ({e}); the StorageClass \
                         must allow volume expansion. Keep {value}.size as it was",
                    value = want.value,
                    claim = want.pod_claim(),
                ))
            })?;
        }
    }
    let mut lines = Vec::new();
    for (want, uid, plan) in &plans {
        let name = &want.name;
        let Some(uid) = uid else {
            lines.push(format!(
                "StatefulSet {namespace}/{name}: not installed, nothing to do"
            ));
            continue;
        };
        let mut what = Vec::new();
        if let Some(size) = &plan.grow {
            what.push(format!("claim {} asked for {size}", want.pod_claim()));
        }
        if plan.replace {
            let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
            for secret in &want.keep_secrets {
                crate::owner::disown(&secrets, secret, uid).await?;
            }
            replace(&sts, name, uid).await?;
            what.push(format!(
                "claim template changed ({}): StatefulSet and its pod deleted for helm to create \
                 anew, its claims kept",
                want.value
            ));
        }
        if what.is_empty() {
            what.push("claim template unchanged, nothing to do".into());
        }
        lines.push(format!(
            "StatefulSet {namespace}/{name}: {}",
            what.join("; ")
        ));
    }
    Ok(lines)
}

/// Deletes StatefulSet `name` (uid `uid`) and its pods, leaving its claims, and waits until it
/// is gone, so that helm, right after, creates it rather than patching the terminating object.
async fn replace(sts: &Api<StatefulSet>, name: &str, uid: &str) -> Result<(), Error> {
    let dp = DeleteParams {
        propagation_policy: Some(PropagationPolicy::Foreground),
        ..DeleteParams::default()
    };
    match sts.delete(name, &dp).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(()),
        Err(e) => return Err(e.into()),
    }
    let deadline = tokio::time::Instant::now() + GONE_WAIT;
    loop {
        match sts.get_opt(name).await? {
            None => return Ok(()),
            Some(s) if s.metadata.uid.as_deref() != Some(uid) => return Ok(()),
            Some(_) if tokio::time::Instant::now() >= deadline => {
                return Err(Error::Upgrade(format!(
                    "StatefulSet {name} still terminating {}s after its deletion (it goes once \
                     its pod has); upgrade again once it is gone",
                    GONE_WAIT.as_secs()
                )));
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn want(enabled: bool, size: &str, class: Option<&str>) -> Desired {
        Desired {
            name: "spur-jobs".into(),
            value: "jobs.persistence".into(),
            claim: "data".into(),
            enabled,
            size: enabled.then(|| size.into()),
            storage_class_name: class.map(Into::into),
            keep_secrets: Vec::new(),
        }
    }

    fn storage(size: &str, class: Option<&str>) -> Storage {
        Storage {
            size: Some(size.into()),
            storage_class_name: class.map(Into::into),
        }
    }

    fn p(grow: Option<&str>, replace: bool) -> Plan {
        Plan {
            grow: grow.map(Into::into),
            replace,
        }
    }

    #[test]
    fn unchanged_persistence_leaves_the_statefulset() {
        let s = storage("5Gi", None);
        assert_eq!(
            plan(Some(&s), Some(&s), &want(true, "5Gi", None)).unwrap(),
            p(None, false)
        );
        // The API server writes quantities in canonical form: 5120Mi is 5Gi.
        assert_eq!(
            plan(Some(&s), Some(&s), &want(true, "5120Mi", None)).unwrap(),
            p(None, false)
        );
        assert_eq!(
            plan(None, None, &want(false, "", None)).unwrap(),
            p(None, false)
        );
    }

    #[test]
    fn persistence_turned_on_or_off_replaces_the_statefulset() {
        let s = storage("5Gi", Some("standard"));
        assert_eq!(
            plan(Some(&s), Some(&s), &want(false, "", None)).unwrap(),
            p(None, true)
        );
        // Back on: the claim kept while it was off is used again, grown if asked for more.
        assert_eq!(
            plan(None, Some(&s), &want(true, "5Gi", Some("standard"))).unwrap(),
            p(None, true)
        );
        assert_eq!(
            plan(None, Some(&s), &want(true, "8Gi", Some("standard"))).unwrap(),
            p(Some("8Gi"), true)
        );
        assert_eq!(
            plan(None, None, &want(true, "5Gi", None)).unwrap(),
            p(None, true)
        );
    }

    #[test]
    fn a_larger_size_grows_the_claim_first_a_smaller_one_only_the_template() {
        let s = storage("5Gi", None);
        assert_eq!(
            plan(Some(&s), Some(&s), &want(true, "10Gi", None)).unwrap(),
            p(Some("10Gi"), true)
        );
        // A claim grown by hand past the new size is left as it is.
        let grown = storage("20Gi", None);
        assert_eq!(
            plan(Some(&s), Some(&grown), &want(true, "10Gi", None)).unwrap(),
            p(None, true)
        );
        // No claim yet (the pod never started): the new template is enough.
        assert_eq!(
            plan(Some(&s), None, &want(true, "10Gi", None)).unwrap(),
            p(None, true)
        );
    }

    #[test]
    fn another_class_for_an_existing_claim_is_refused_with_what_to_do() {
        let t = storage("5Gi", Some("standard"));
        let e = plan(Some(&t), Some(&t), &want(true, "5Gi", Some("fast")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("jobs.persistence"), "{e}");
        assert!(e.contains("\"fast\" wanted"), "{e}");
        assert!(e.contains("exists with \"standard\""), "{e}");
        assert!(e.contains("kubectl delete pvc data-spur-jobs-0"), "{e}");
        // Without the claim the class may change.
        assert_eq!(
            plan(Some(&t), None, &want(true, "5Gi", Some("fast"))).unwrap(),
            p(None, true)
        );
        // Naming the class the default gave the claim is no change of class.
        let defaulted = storage("5Gi", None);
        let claim = storage("5Gi", Some("standard"));
        assert_eq!(
            plan(
                Some(&defaulted),
                Some(&claim),
                &want(true, "5Gi", Some("standard"))
            )
            .unwrap(),
            p(None, true)
        );
        let e = plan(Some(&defaulted), Some(&claim), &want(true, "5Gi", Some("")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("none (\"-\") wanted"), "{e}");
    }

    #[test]
    fn quantities_are_read_as_the_api_server_reads_them() {
        assert_eq!(bytes("5Gi"), Ok(5 << 30));
        assert_eq!(bytes("5120Mi"), Ok(5 << 30));
        assert_eq!(bytes("1.5Gi"), Ok(3 << 29));
        assert_eq!(bytes("500M"), Ok(500_000_000));
        assert_eq!(bytes("5e9"), Ok(5_000_000_000));
        assert_eq!(bytes("1500m"), Ok(2));
        assert_eq!(bytes("42"), Ok(42));
        for bad in [
            "",
            "Gi",
            "5 Gi",
            "5GB",
            "-5Gi",
            "5e99",
            "123456789012345678901Gi",
            "1.2.3",
        ] {
            assert!(bytes(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bad_descriptions_are_refused() {
        for bad in [
            "",
            "{}",
            r#"{"name":"","value":"v","claim":"data","enabled":false}"#,
            r#"{"name":"s","value":"v","claim":"data","enabled":true}"#,
            r#"{"name":"s","value":"v","claim":"data","enabled":true,"size":"lots"}"#,
            r#"{"name":"s","value":"v","claim":"data","enabled":false,"extra":1}"#,
        ] {
            assert!(Desired::parse(bad).is_err(), "{bad}");
        }
        let d = Desired::parse(
            r#"{"name":"spur-hub","value":"hub.persistence","claim":"data","enabled":true,"size":"1Gi","storageClassName":"","keepSecrets":["spur-hub-x"]}"#,
        )
        .unwrap();
        assert_eq!(d.storage_class_name.as_deref(), Some(""));
        assert_eq!(d.keep_secrets, ["spur-hub-x"]);
        assert_eq!(d.pod_claim(), "data-spur-hub-0");
    }
}
