//! Fuzzes the sidecar-injection webhook's handling of an AdmissionReview, as
//! `controlplane/operator-admission/src/lib.rs` does it: the JSON body decoded as
//! `AdmissionReview<Pod>`, turned into a request, screened
//! (`spur_operator_admission::inject::screen`), and answered with `skip_patch` or
//! `inject_patch` (for a pod whose ReplicaSet belongs to a Deployment: the API lookup in between
//! is replaced by a fixed answer).
//!
//! Every patch must apply to the pod it was made for and leave a valid Pod; an injected pod must
//! carry the sidecar and be left alone when the webhook is invoked again (reinvocation).
//!
//! Input: the request body.
#![no_main]

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use libfuzzer_sys::fuzz_target;
use spur_api::keys::injection as keys;
use spur_operator_admission::inject::{
    self, Baseline, InjectionConfig, Interception, Placement, Screen, inject_patch, screen,
    skip_patch,
};

/// Applies `patch` to `pod` as the API server would; the result must be a Pod.
fn apply(pod: &Pod, patch: &json_patch::Patch) -> Pod {
    let mut value = serde_json::to_value(pod).expect("a Pod serializes");
    if let Err(e) = json_patch::patch(&mut value, patch) {
        panic!(
            "patch does not apply: {e}\npatch: {}\npod: {value}",
            serde_json::to_string(patch).unwrap_or_default()
        );
    }
    serde_json::from_value(value).expect("the patched pod is a Pod")
}

fn annotation<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

fn check_skip(pod: &Pod, reason: &str) -> json_patch::Patch {
    let patch = skip_patch(pod, reason).expect("skip patch");
    let patched = apply(pod, &patch);
    assert_eq!(annotation(&patched, keys::STATUS), Some("skipped"));
    assert_eq!(annotation(&patched, keys::REASON), Some(reason));
    patch
}

fn decide(
    pod: &Pod,
    namespace: &str,
    labels: Option<&BTreeMap<String, String>>,
    cfg: &InjectionConfig,
) -> Option<json_patch::Patch> {
    let owner = match screen(pod, namespace, labels, cfg) {
        Screen::Ignore => return None,
        Screen::Skip(reason) => return Some(check_skip(pod, &reason)),
        Screen::Resolve(owner) => owner,
    };
    let baseline = Baseline {
        kind: "Deployment",
        namespace: namespace.to_owned(),
        name: owner.name.clone(),
        // A fork's pod (with Kafka ports) is injected as a fork of some sandbox.
        fork_of_sandbox: owner.fork.then(|| "sb1".to_owned()),
    };
    // Found here and fixed (artifacts-found/admission_review/): for a pod without `spec` the
    // patch used to add `/spec/...` members whose parent does not exist.
    match inject_patch(pod, &baseline, cfg) {
        Ok(patch) => {
            let patched = apply(pod, &patch);
            assert_eq!(annotation(&patched, keys::STATUS), Some("injected"));
            let spec = patched.spec.as_ref().expect("a spec");
            let has = |cs: &[k8s_openapi::api::core::v1::Container]| {
                cs.iter().any(|c| c.name == keys::SIDECAR_CONTAINER)
            };
            assert!(has(&spec.containers) || spec.init_containers.as_deref().is_some_and(has));
            // The original containers are all still there, in order, after the injected ones.
            let before = pod.spec.as_ref().map_or(0, |s| s.containers.len());
            let names: Vec<_> = spec.containers.iter().map(|c| &c.name).collect();
            let orig: Vec<_> = pod
                .spec
                .iter()
                .flat_map(|s| s.containers.iter().map(|c| &c.name))
                .collect();
            assert!(names.ends_with(&orig) && names.len() >= before);
            // A reinvocation of the webhook leaves the injected pod alone.
            assert_eq!(screen(&patched, namespace, labels, cfg), Screen::Ignore);
            // The containers are as deterministic as the patch.
            let again = inject::containers(pod, &baseline, cfg).expect("containers");
            assert_eq!(again, inject::containers(pod, &baseline, cfg).expect("containers"));
            Some(patch)
        }
        // A malformed annotation: the pod is annotated with why.
        Err(spur_operator_admission::Error::Config(reason)) => Some(check_skip(pod, &reason)),
        Err(e) => panic!("internal error for a pod: {e}"),
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(review) = serde_json::from_slice::<AdmissionReview<Pod>>(data) else {
        return;
    };
    let Ok(request): Result<AdmissionRequest<Pod>, _> = review.try_into() else {
        return;
    };
    let response = AdmissionResponse::from(&request);
    if request.operation != Operation::Create {
        return;
    }
    let Some(pod) = &request.object else {
        return;
    };
    let namespace = request
        .namespace
        .clone()
        .or_else(|| pod.metadata.namespace.clone())
        .unwrap_or_else(|| "default".into());

    let opted_in = BTreeMap::from([(keys::INJECT.to_owned(), "true".to_owned())]);
    let native = InjectionConfig {
        interception: Interception::InitContainer,
        placement: Placement::Native,
        exclude_inbound_ports: vec![15090],
        ..InjectionConfig::default()
    };
    for (labels, cfg) in [
        (None, InjectionConfig::default()),
        (Some(&opted_in), native),
    ] {
        if let Some(patch) = decide(pod, &namespace, labels, &cfg) {
            let answered = response
                .clone()
                .with_patch(patch)
                .expect("the patch serializes");
            let body = serde_json::to_vec(&answered.into_review()).expect("the review serializes");
            let back: AdmissionReview<kube::core::DynamicObject> =
                serde_json::from_slice(&body).expect("the answer reads back");
            let back = back.response.expect("a response");
            assert!(back.allowed && back.uid == request.uid);
        }
    }
});
