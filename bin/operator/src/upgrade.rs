//! `spur-operator prepare-upgrade`: what the chart's pre-upgrade (and pre-rollback) hook runs
//! before `helm upgrade` changes anything (templates/upgrade.yaml, docs/install.md "Upgrading").
//!
//! A StatefulSet's `volumeClaimTemplates` cannot change: turning `jobs.persistence.enabled` or
//! `hub.persistence.enabled` on or off, or a new size, would make the upgrade fail half-way
//! ("spec: Forbidden: updates to statefulset spec for fields other than ..."), leaving the user to
//! delete the StatefulSet by hand. For each StatefulSet named, this compares the claim template in
//! force with the one the new chart renders and, when they differ, deletes the StatefulSet but
//! not its pods or claims (orphan propagation): helm then creates it anew, and the new one adopts
//! the running pod and replaces it with one of the new template. Stored data stays in its claim
//! (a claim left by persistence turned off is used again when it is turned back on).
//!
//! A larger size is first asked of the existing claim: the API server grants it only where the
//! StorageClass allows expansion, and says why not otherwise; the upgrade then stops before
//! anything changed. Another StorageClass for an existing claim is refused with what to do: a
//! claim's class cannot change.

use std::process::ExitCode;

use anyhow::{Context as _, Result, bail};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::{DeleteParams, Patch, PatchParams, PropagationPolicy};
use kube::{Api, Client};
use serde::Deserialize;

/// One StatefulSet's claim as the new chart renders it (`--statefulset`, JSON).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct Desired {
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
}

impl Desired {
    pub(crate) fn parse(json: &str) -> Result<Desired> {
        let d: Desired = serde_json::from_str(json)
            .with_context(|| format!("--statefulset {json}: not a claim description"))?;
        if d.name.is_empty() || d.claim.is_empty() {
            bail!("--statefulset {json}: name and claim must not be empty");
        }
        if d.enabled && d.size.as_deref().is_none_or(str::is_empty) {
            bail!("--statefulset {json}: an enabled claim needs a size");
        }
        Ok(d)
    }

    /// The claim of the StatefulSet's first (only) pod.
    fn pod_claim(&self) -> String {
        format!("{}-{}-0", self.claim, self.name)
    }
}

/// The claim template in force: `None` without one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Live {
    pub size: Option<String>,
    pub storage_class_name: Option<String>,
}

/// What to do before the upgrade.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    /// The template in force is the one the chart renders.
    Nothing,
    /// Ask the existing claim for `size`, then replace the StatefulSet.
    Resize(String),
    /// Delete the StatefulSet (orphaning its pods and claims) so helm creates it anew.
    Replace,
}

/// Decides from the live claim template (`None`: the StatefulSet has none), whether the pod's
/// claim exists, and the desired one.
pub(crate) fn plan(live: Option<&Live>, claim_exists: bool, want: &Desired) -> Result<Step> {
    let Some(live) = live else {
        return Ok(if want.enabled {
            Step::Replace
        } else {
            Step::Nothing
        });
    };
    if !want.enabled {
        return Ok(Step::Replace);
    }
    if live.storage_class_name != want.storage_class_name {
        if claim_exists {
            let shown = |c: &Option<String>| match c.as_deref() {
                None => "the cluster's default".to_owned(),
                Some("") => "none (\"-\")".to_owned(),
                Some(c) => format!("{c:?}"),
            };
            bail!(
                "{value}: the StorageClass would change from {from} to {to}, but claim {claim} \
                 exists and a claim's class cannot change. Keep {value}.storageClass as it was, \
                 or delete the claim (`kubectl delete pvc {claim}`; what it stores is lost) and \
                 upgrade again",
                value = want.value,
                from = shown(&live.storage_class_name),
                to = shown(&want.storage_class_name),
                claim = want.pod_claim(),
            );
        }
        return Ok(Step::Replace);
    }
    if live.size != want.size {
        let size = want.size.clone().unwrap_or_default();
        return Ok(if claim_exists {
            Step::Resize(size)
        } else {
            Step::Replace
        });
    }
    Ok(Step::Nothing)
}

fn live_template(sts: &StatefulSet, claim: &str) -> Option<Live> {
    let t = sts
        .spec
        .as_ref()?
        .volume_claim_templates
        .as_ref()?
        .iter()
        .find(|t| t.metadata.name.as_deref() == Some(claim))?;
    let spec = t.spec.as_ref();
    Some(Live {
        size: spec
            .and_then(|s| s.resources.as_ref())
            .and_then(|r| r.requests.as_ref())
            .and_then(|r| r.get("storage"))
            .map(|q| q.0.clone()),
        storage_class_name: spec.and_then(|s| s.storage_class_name.clone()),
    })
}

/// Prepares each StatefulSet of `wanted` in `namespace`; prints one line per StatefulSet.
pub(crate) async fn prepare_upgrade(
    kubeconfig: Option<std::path::PathBuf>,
    namespace: String,
    wanted: Vec<String>,
) -> Result<ExitCode> {
    let wanted = wanted
        .iter()
        .map(|w| Desired::parse(w))
        .collect::<Result<Vec<_>>>()?;
    let client = spur_bin_support::kube_client(kubeconfig.as_deref()).await?;
    // Every plan first: a refusal stops the upgrade before anything changed.
    let mut steps = Vec::new();
    for want in &wanted {
        let (step, what) = prepare_one(&client, &namespace, want).await?;
        steps.push((want, step, what));
    }
    for (want, step, what) in steps {
        let sts: Api<StatefulSet> = Api::namespaced(client.clone(), &namespace);
        if let Step::Resize(size) = &step {
            let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &namespace);
            let patch = serde_json::json!({"spec": {"resources": {"requests": {"storage": size}}}});
            pvcs.patch(
                &want.pod_claim(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
            .with_context(|| {
                format!(
                    "{}: claim {} cannot grow to {size} (the StorageClass must allow volume \
                         expansion); keep {}.size as it was",
                    want.value,
                    want.pod_claim(),
                    want.value
                )
            })?;
        }
        if step != Step::Nothing {
            let dp = DeleteParams {
                propagation_policy: Some(PropagationPolicy::Orphan),
                ..DeleteParams::default()
            };
            match sts.delete(&want.name, &dp).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => {
                    return Err(e).with_context(|| {
                        format!("deleting StatefulSet {namespace}/{} (orphan)", want.name)
                    });
                }
            }
        }
        println!("StatefulSet {namespace}/{}: {what}", want.name);
    }
    Ok(ExitCode::SUCCESS)
}

/// The step for one StatefulSet and the line that says it.
async fn prepare_one(client: &Client, namespace: &str, want: &Desired) -> Result<(Step, String)> {
    let sts: Api<StatefulSet> = Api::namespaced(client.clone(), namespace);
    let Some(live) = sts
        .get_opt(&want.name)
        .await
        .with_context(|| format!("reading StatefulSet {namespace}/{}", want.name))?
    else {
        return Ok((Step::Nothing, "not installed, nothing to do".into()));
    };
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), namespace);
    let claim_exists = pvcs
        .get_opt(&want.pod_claim())
        .await
        .with_context(|| format!("reading claim {namespace}/{}", want.pod_claim()))?
        .is_some();
    let template = live_template(&live, &want.claim);
    let step = plan(template.as_ref(), claim_exists, want)?;
    let what = match &step {
        Step::Nothing => "claim template unchanged, nothing to do".to_owned(),
        Step::Resize(size) => format!(
            "claim {} asked for {size}; StatefulSet replaced (pods and claims kept) for the new \
             claim template",
            want.pod_claim()
        ),
        Step::Replace if want.enabled => format!(
            "persistence changed ({}); StatefulSet replaced (pods and claims kept){}",
            want.value,
            if claim_exists {
                format!(", claim {} used again", want.pod_claim())
            } else {
                String::new()
            }
        ),
        Step::Replace => format!(
            "persistence turned off ({}); StatefulSet replaced (pods and claims kept){}",
            want.value,
            if claim_exists {
                format!(", claim {} kept for a later turn back on", want.pod_claim())
            } else {
                String::new()
            }
        ),
    };
    Ok((step, what))
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
        }
    }

    fn live(size: &str, class: Option<&str>) -> Live {
        Live {
            size: Some(size.into()),
            storage_class_name: class.map(Into::into),
        }
    }

    #[test]
    fn unchanged_persistence_leaves_the_statefulset() {
        let l = live("5Gi", None);
        assert_eq!(
            plan(Some(&l), true, &want(true, "5Gi", None)).unwrap(),
            Step::Nothing
        );
        assert_eq!(
            plan(None, false, &want(false, "", None)).unwrap(),
            Step::Nothing
        );
    }

    #[test]
    fn persistence_turned_on_or_off_replaces_the_statefulset() {
        let l = live("5Gi", Some("standard"));
        assert_eq!(
            plan(Some(&l), true, &want(false, "", None)).unwrap(),
            Step::Replace
        );
        assert_eq!(
            plan(None, true, &want(true, "5Gi", Some("standard"))).unwrap(),
            Step::Replace
        );
    }

    #[test]
    fn a_new_size_grows_the_claim_first() {
        let l = live("5Gi", None);
        assert_eq!(
            plan(Some(&l), true, &want(true, "10Gi", None)).unwrap(),
            Step::Resize("10Gi".into())
        );
        // No claim yet (the pod never started): the new template is enough.
        assert_eq!(
            plan(Some(&l), false, &want(true, "10Gi", None)).unwrap(),
            Step::Replace
        );
    }

    #[test]
    fn another_class_for_an_existing_claim_is_refused_with_what_to_do() {
        let l = live("5Gi", Some("standard"));
        let e = plan(Some(&l), true, &want(true, "5Gi", Some("fast")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("jobs.persistence"), "{e}");
        assert!(e.contains("\"standard\" to \"fast\""), "{e}");
        assert!(e.contains("kubectl delete pvc data-spur-jobs-0"), "{e}");
        // Without the claim the class may change.
        assert_eq!(
            plan(Some(&l), false, &want(true, "5Gi", Some("fast"))).unwrap(),
            Step::Replace
        );
        let e = plan(Some(&live("5Gi", None)), true, &want(true, "5Gi", Some("")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("the cluster's default to none"), "{e}");
    }

    #[test]
    fn bad_descriptions_are_refused() {
        for bad in [
            "",
            "{}",
            r#"{"name":"","value":"v","claim":"data","enabled":false}"#,
            r#"{"name":"s","value":"v","claim":"data","enabled":true}"#,
            r#"{"name":"s","value":"v","claim":"data","enabled":false,"extra":1}"#,
        ] {
            assert!(Desired::parse(bad).is_err(), "{bad}");
        }
        let d = Desired::parse(
            r#"{"name":"spur-hub","value":"hub.persistence","claim":"data","enabled":true,"size":"1Gi","storageClassName":""}"#,
        )
        .unwrap();
        assert_eq!(d.storage_class_name.as_deref(), Some(""));
        assert_eq!(d.pod_claim(), "data-spur-hub-0");
    }
}
