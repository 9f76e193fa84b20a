//! What a certificate manager pass issues, renews and writes, as functions of what it read
//! (no apiserver): the CA's two-step rotation, the serving certificates, the Secrets' contents
//! and when the next pass is due.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use spur_serving::pki::{self, Pair};

use super::{ISSUER, NAMESPACE_BUNDLE_ROLE, NEXT_PUBLISHED, ROTATE_REQUESTED};
use crate::pki_config::{PKI_LABEL, PkiConfig, ServingCert};
use spur_operator_core::Error;

/// Never wait longer than this between passes: a safety net against missed watch events.
const MAX_SLEEP: Duration = Duration::from_secs(3600);

/// The CA Secret's contents.
#[derive(Debug, Clone, PartialEq, Default)]
pub(super) struct CaState {
    pub current: Option<Pair>,
    pub next: Option<Pair>,
    pub bundle: Vec<String>,
    pub next_published: Option<i64>,
    /// [`ROTATE_REQUESTED`]; the manager only reads it.
    pub rotate_requested: Option<i64>,
}

/// The CA Secret's contents as stored (an absent Secret holds nothing).
pub(super) fn ca_state(secret: Option<Secret>) -> CaState {
    let Some(secret) = secret else {
        return CaState::default();
    };
    let data = secret.data.unwrap_or_default();
    let text = |k: &str| {
        data.get(k)
            .and_then(|b| String::from_utf8(b.0.clone()).ok())
            .filter(|s| !s.trim().is_empty())
    };
    let pair = |c: &str, k: &str| match (text(c), text(k)) {
        (Some(cert), Some(key)) => Some(Pair { cert, key }),
        _ => None,
    };
    CaState {
        current: pair("ca.crt", "ca.key"),
        next: pair("next.crt", "next.key"),
        bundle: text("bundle.crt")
            .map(|b| pki::split_bundle(&b))
            .unwrap_or_default(),
        next_published: secret
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(NEXT_PUBLISHED))
            .and_then(|v| v.parse().ok()),
        rotate_requested: secret
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ROTATE_REQUESTED))
            .and_then(|v| v.trim().parse().ok()),
    }
}

/// The CA Secret's data and annotations for `ca`.
pub(super) fn ca_data(
    ca: &CaState,
) -> (
    BTreeMap<String, ByteString>,
    Option<BTreeMap<String, String>>,
) {
    let mut data = BTreeMap::new();
    let mut put = |k: &str, v: &str| {
        data.insert(k.to_string(), ByteString(v.as_bytes().to_vec()));
    };
    if let Some(c) = &ca.current {
        put("ca.crt", &c.cert);
        put("ca.key", &c.key);
    }
    if let Some(n) = &ca.next {
        put("next.crt", &n.cert);
        put("next.key", &n.key);
    }
    put("bundle.crt", &ca.bundle.concat());
    let annotations = ca
        .next_published
        .map(|t| BTreeMap::from([(NEXT_PUBLISHED.to_string(), t.to_string())]));
    (data, annotations)
}

/// What `p` says about itself when it is a signing CA valid at `now` with a readable key.
fn usable(p: Option<&Pair>, now: i64) -> Option<pki::Info> {
    p.and_then(|p| {
        let i = pki::info(&p.cert).ok()?;
        rcgen::KeyPair::from_pem(&p.key).ok()?;
        Some(i)
    })
    .filter(|i| i.is_ca && !i.validity.expired(now))
}

/// Step one of a pass: `loaded` with a usable signing CA (a new one when it has none), a next
/// CA when the current one is at 80 % of its lifetime or a rotation was requested since it was
/// made, and the bundle brought up to date. Also returns how many CAs it made.
pub(super) fn renew_ca(
    loaded: &CaState,
    cfg: &PkiConfig,
    now: i64,
) -> Result<(CaState, u32), Error> {
    let mut ca = loaded.clone();
    let mut made = 0;
    if usable(ca.current.as_ref(), now).is_none() {
        if ca.current.is_some() {
            tracing::warn!(secret = %cfg.ca_secret, "the CA is expired or unreadable: replacing it (clients that trust only the old one fail until they get the new bundle)");
        }
        ca = CaState {
            current: Some(pki::new_ca(
                &format!("spur CA {now}"),
                cfg.ca_lifetime,
                now,
            )?),
            next: None,
            next_published: None,
            bundle: ca.bundle,
            rotate_requested: ca.rotate_requested,
        };
        made += 1;
        tracing::info!("created a CA");
    }
    let current =
        usable(ca.current.as_ref(), now).ok_or_else(|| Error::Pki("new CA unusable".into()))?;
    if ca.next.is_some() && usable(ca.next.as_ref(), now).is_none() {
        ca.next = None;
        ca.next_published = None;
    }
    // A request from the future would rotate every CA made until then: ignored.
    let requested = ca.rotate_requested.filter(|&t| {
        let sane = t <= now + 60;
        if !sane {
            tracing::warn!(
                annotation = ROTATE_REQUESTED,
                at = t,
                "CA rotation requested for a time in the future: ignored"
            );
        }
        sane && t > current.validity.issued_at()
    });
    let aged = now >= current.validity.renew_at_for(cfg.ca_lifetime);
    if ca.next.is_none() && (aged || requested.is_some()) {
        ca.next = Some(pki::new_ca(
            &format!("spur CA {now}"),
            cfg.ca_lifetime,
            now,
        )?);
        ca.next_published = None;
        made += 1;
        if aged {
            tracing::info!("CA at 80% of its lifetime: next CA created and published");
        } else {
            tracing::info!(
                annotation = ROTATE_REQUESTED,
                "CA rotation requested: next CA created and published"
            );
        }
    }
    ca.bundle = bundle(&ca, now);
    Ok((ca, made))
}

/// Step two, once the webhook configurations were given the bundle (`carried`: they hold it):
/// the next CA is marked published, or promoted to signing once it has been published for
/// `propagation`. Returns whether `ca` changed (to be written) and when to look again.
pub(super) fn advance_next(
    ca: &mut CaState,
    carried: bool,
    now: i64,
    propagation: Duration,
) -> (bool, Option<Duration>) {
    let Some(next) = ca.next.clone() else {
        return (false, None);
    };
    match ca.next_published {
        None => {
            if carried {
                ca.next_published = Some(now);
            }
            (carried, Some(propagation))
        }
        Some(t) if now >= t.saturating_add(secs(propagation)) => {
            tracing::info!(
                ca = %pki::fingerprint(&next.cert),
                "next CA promoted: it signs from now on"
            );
            ca.current = Some(next);
            ca.next = None;
            ca.next_published = None;
            (true, None)
        }
        Some(t) => (false, Some(until(t.saturating_add(secs(propagation)), now))),
    }
}

/// When the CAs need a pass: the signing CA's renewal (unless a next one is on its way) and
/// each bundled CA's expiry (it leaves the bundle then).
pub(super) fn ca_due(
    ca: &CaState,
    signer: &pki::Info,
    lifetime: Duration,
    now: i64,
) -> Vec<Duration> {
    let mut due = Vec::new();
    if ca.next.is_none() {
        due.push(until(signer.validity.renew_at_for(lifetime), now));
    }
    for c in &ca.bundle {
        if let Ok(i) = pki::info(c) {
            due.push(until(i.validity.not_after.saturating_add(1), now));
        }
    }
    due
}

/// The pass after this one: the earliest of `due`, within bounds.
pub(super) fn next_pass(due: Vec<Duration>) -> Duration {
    due.into_iter()
        .min()
        .unwrap_or(MAX_SLEEP)
        .clamp(Duration::from_millis(200), MAX_SLEEP)
}

/// What to do with a serving certificate's Secret.
#[derive(Debug)]
pub(super) enum Serving {
    /// It holds a good certificate and the current bundle: left alone.
    Current(pki::Info),
    /// It is written with `pair` (newly issued when `issued`) and the current bundle.
    Write {
        pair: Pair,
        info: pki::Info,
        issued: bool,
    },
}

/// The serving certificate `target` needs, from its Secret as read: kept while it is before its
/// renewal time, has the wanted names, was signed by `signer` and has a readable key;
/// otherwise issued anew (as `common_name`).
pub(super) fn serving(
    secret: Option<Secret>,
    target: &ServingCert,
    common_name: &str,
    signer: &Pair,
    bundle: &str,
    lifetime: Duration,
    now: i64,
) -> Result<Serving, Error> {
    let (data, annotations) = secret
        .map(|s| {
            (
                s.data.unwrap_or_default(),
                s.metadata.annotations.unwrap_or_default(),
            )
        })
        .unwrap_or_default();
    let text = |k: &str| {
        data.get(k)
            .and_then(|b| String::from_utf8(b.0.clone()).ok())
    };
    let issuer = pki::fingerprint(&signer.cert);
    let held = match (text("tls.crt"), text("tls.key")) {
        (Some(cert), Some(key)) => pki::info(&cert)
            .ok()
            .filter(|i| {
                now < i.validity.renew_at_for(lifetime)
                    && i.sans == target.names
                    && annotations.get(ISSUER) == Some(&issuer)
                    && rcgen::KeyPair::from_pem(&key).is_ok()
            })
            .map(|i| (Pair { cert, key }, i)),
        _ => None,
    };
    Ok(match held {
        Some(h) if text("ca.crt").as_deref() == Some(bundle) => Serving::Current(h.1),
        Some((pair, info)) => Serving::Write {
            pair,
            info,
            issued: false,
        },
        None => {
            let pair = pki::issue_serving(signer, common_name, &target.names, lifetime, now)?;
            let info = pki::info(&pair.cert)?;
            Serving::Write {
                pair,
                info,
                issued: true,
            }
        }
    })
}

/// A serving Secret's data and annotations: `pair`, the bundle, and the signer's fingerprint.
pub(super) fn serving_data(
    pair: Pair,
    bundle: &str,
    issuer: String,
) -> (BTreeMap<String, ByteString>, BTreeMap<String, String>) {
    let data = BTreeMap::from([
        ("tls.crt".to_string(), ByteString(pair.cert.into_bytes())),
        ("tls.key".to_string(), ByteString(pair.key.into_bytes())),
        ("ca.crt".to_string(), ByteString(bundle.as_bytes().to_vec())),
    ]);
    (data, BTreeMap::from([(ISSUER.to_string(), issuer)]))
}

/// The Secrets the manager writes, by name: adopted by the operator's owner when written
/// before it had one.
pub(super) fn secret_names(cfg: &PkiConfig) -> Vec<&str> {
    [
        Some(cfg.ca_secret.as_str()),
        Some(cfg.serving_secret.as_str()),
        cfg.tunnel_proxy.as_ref().map(|t| t.secret.as_str()),
        cfg.routeserver.as_ref().map(|t| t.secret.as_str()),
        cfg.ics.as_ref().map(|t| t.secret.as_str()),
        cfg.traffic.as_ref().map(|t| t.secret.as_str()),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// Whether a namespace's bundle ConfigMap is a copy the operator made (its label), and whether
/// it already holds `bundle`.
pub(super) fn bundle_copy_state(cm: &ConfigMap, bundle: &str) -> (bool, bool) {
    let ours = cm
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(PKI_LABEL))
        .is_some_and(|v| v == NAMESPACE_BUNDLE_ROLE);
    let current = cm
        .data
        .as_ref()
        .and_then(|d| d.get("ca.crt"))
        .map(String::as_str)
        == Some(bundle);
    (ours, current)
}

/// The CAs to trust: the signing CA, the next one, and earlier ones until they expire (the
/// serving certificates they signed may still be in use).
fn bundle(ca: &CaState, now: i64) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    let candidates = ca
        .current
        .iter()
        .chain(ca.next.iter())
        .map(|p| p.cert.clone())
        .chain(ca.bundle.iter().cloned());
    for c in candidates {
        let Ok(i) = pki::info(&c) else { continue };
        if i.validity.expired(now) || !seen.insert(pki::fingerprint(&c)) {
            continue;
        }
        let c = if c.ends_with('\n') { c } else { c + "\n" };
        out.push(c);
    }
    out
}

fn secs(d: Duration) -> i64 {
    i64::try_from(d.as_secs()).unwrap_or(i64::MAX)
}

pub(super) fn until(t: i64, now: i64) -> Duration {
    Duration::from_secs(u64::try_from(t - now).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use spur_serving::pki::now_unix;

    const DAY: u64 = 24 * 3600;

    fn cfg(ca_days: u64) -> PkiConfig {
        let mut cfg = PkiConfig::new("spur-system", "spur-webhook");
        cfg.ca_lifetime = Duration::from_secs(ca_days * DAY);
        cfg
    }

    fn ca_made_at(at: i64, days: u64) -> CaState {
        let current = pki::new_ca("cur", Duration::from_secs(days * DAY), at).unwrap();
        CaState {
            bundle: vec![current.cert.clone()],
            current: Some(current),
            ..CaState::default()
        }
    }

    #[test]
    fn bundle_keeps_unexpired_cas_once_in_order() {
        let now = now_unix();
        let old = pki::new_ca("old", Duration::from_secs(100), now - 50).unwrap();
        let gone = pki::new_ca("gone", Duration::from_secs(10), now - 50).unwrap();
        let cur = pki::new_ca("cur", Duration::from_secs(100), now).unwrap();
        let next = pki::new_ca("next", Duration::from_secs(100), now).unwrap();
        let ca = CaState {
            current: Some(cur.clone()),
            next: Some(next.clone()),
            bundle: vec![cur.cert.clone(), old.cert.clone(), gone.cert.clone()],
            next_published: None,
            rotate_requested: None,
        };
        let b = bundle(&ca, now);
        let fps: Vec<_> = b.iter().map(|c| pki::fingerprint(c)).collect();
        assert_eq!(
            fps,
            vec![
                pki::fingerprint(&cur.cert),
                pki::fingerprint(&next.cert),
                pki::fingerprint(&old.cert)
            ]
        );
    }

    #[test]
    fn a_missing_or_expired_ca_is_made_and_a_good_one_kept() {
        let now = now_unix();
        let (ca, made) = renew_ca(&CaState::default(), &cfg(365), now).unwrap();
        assert_eq!(made, 1);
        let current = ca.current.clone().unwrap();
        assert!(pki::info(&current.cert).unwrap().is_ca);
        assert_eq!((ca.next.as_ref(), ca.bundle.len()), (None, 1));
        // A second pass changes nothing: nothing to write.
        let (again, made) = renew_ca(&ca, &cfg(365), now).unwrap();
        assert_eq!((again, made), (ca.clone(), 0));
        // Expired: replaced, and it leaves the bundle.
        let expired = ca_made_at(now - 3 * DAY as i64, 1);
        let (ca, made) = renew_ca(&expired, &cfg(365), now).unwrap();
        assert_eq!(made, 1);
        assert_ne!(ca.current, expired.current);
        assert_eq!(ca.bundle.len(), 1);
    }

    #[test]
    fn an_aged_ca_gets_a_next_one_beside_it() {
        let now = now_unix();
        // 80 % of 10 days is past after 9.
        let aged = ca_made_at(now - 9 * DAY as i64, 10);
        let (ca, made) = renew_ca(&aged, &cfg(10), now).unwrap();
        assert_eq!(made, 1);
        assert_eq!(ca.current, aged.current);
        assert!(ca.next.is_some() && ca.next_published.is_none());
        assert_eq!(ca.bundle.len(), 2);
        // An unusable next CA is dropped (and made again, the current one being aged).
        let mut broken = ca.clone();
        broken.next.as_mut().unwrap().key = "not a key".into();
        broken.next_published = Some(now);
        let (ca, made) = renew_ca(&broken, &cfg(10), now).unwrap();
        assert_eq!((made, ca.next_published), (1, None));
        assert_ne!(ca.next, broken.next);
    }

    #[test]
    fn a_rotation_request_counts_only_after_the_ca_was_made_and_not_from_the_future() {
        let now = now_unix();
        let made_at = now - 1000;
        let rotate = |at: i64| {
            let mut ca = ca_made_at(made_at, 365);
            ca.rotate_requested = Some(at);
            renew_ca(&ca, &cfg(365), now).unwrap()
        };
        let (ca, made) = rotate(now - 10);
        assert_eq!(made, 1);
        assert!(ca.next.is_some());
        for ignored in [now + 3600, made_at - 1000] {
            let (ca, made) = rotate(ignored);
            assert_eq!((made, ca.next), (0, None), "{ignored}");
        }
    }

    #[test]
    fn the_next_ca_is_published_then_promoted_after_the_propagation_delay() {
        let now = now_unix();
        let wait = Duration::from_secs(180);
        let mut ca = ca_made_at(now, 365);
        assert_eq!(advance_next(&mut ca, true, now, wait), (false, None));
        let next = pki::new_ca("next", Duration::from_secs(365 * DAY), now).unwrap();
        ca.next = Some(next.clone());
        // Not carried yet: nothing changes, looked at again after the delay.
        assert_eq!(advance_next(&mut ca, false, now, wait), (false, Some(wait)));
        assert_eq!(ca.next_published, None);
        assert_eq!(advance_next(&mut ca, true, now, wait), (true, Some(wait)));
        assert_eq!(ca.next_published, Some(now));
        assert_eq!(
            advance_next(&mut ca, true, now + 60, wait),
            (false, Some(Duration::from_secs(120)))
        );
        assert_eq!(advance_next(&mut ca, true, now + 180, wait), (true, None));
        assert_eq!(ca.current, Some(next));
        assert_eq!((ca.next.as_ref(), ca.next_published), (None, None));
    }

    #[test]
    fn passes_are_due_at_renewal_and_expiry_within_bounds() {
        let now = now_unix();
        let ca = ca_made_at(now, 10);
        let info = pki::info(&ca.current.as_ref().unwrap().cert).unwrap();
        let due = ca_due(&ca, &info, Duration::from_secs(10 * DAY), now);
        let renew = until(
            info.validity.renew_at_for(Duration::from_secs(10 * DAY)),
            now,
        );
        let expiry = until(info.validity.not_after + 1, now);
        assert_eq!(due, [renew, expiry]);
        // With a next CA on its way, the current one's renewal is not due.
        let mut rotating = ca.clone();
        rotating.next = ca.current.clone();
        assert_eq!(
            ca_due(&rotating, &info, Duration::from_secs(10 * DAY), now),
            [expiry]
        );
        // Days away: the safety net comes first.
        assert_eq!(next_pass(due), MAX_SLEEP);
        let soon = [90, 60, 600].map(Duration::from_secs).to_vec();
        assert_eq!(next_pass(soon), Duration::from_secs(60));
        assert_eq!(next_pass(Vec::new()), MAX_SLEEP);
        assert_eq!(next_pass(vec![Duration::ZERO]), Duration::from_millis(200));
        assert_eq!(next_pass(vec![10 * MAX_SLEEP]), MAX_SLEEP);
    }

    #[test]
    fn the_ca_secret_round_trips() {
        let now = now_unix();
        let mut ca = ca_made_at(now, 365);
        ca.next = ca.current.clone();
        ca.next_published = Some(now);
        // The bundle as stored: one certificate a block, each ending its line.
        ca.bundle = pki::split_bundle(&ca.bundle.concat());
        let (data, annotations) = ca_data(&ca);
        let mut secret = Secret {
            data: Some(data),
            ..Secret::default()
        };
        let mut annotations = annotations.unwrap();
        annotations.insert(ROTATE_REQUESTED.into(), " 42 ".into());
        secret.metadata.annotations = Some(annotations);
        let back = ca_state(Some(secret));
        assert_eq!(back.rotate_requested, Some(42));
        ca.rotate_requested = Some(42);
        assert_eq!(back, ca);
        assert_eq!(ca_state(None), CaState::default());
    }

    fn secret_of(pair: Pair, bundle: &str, issuer: String) -> Secret {
        let (data, annotations) = serving_data(pair, bundle, issuer);
        let mut s = Secret {
            data: Some(data),
            ..Secret::default()
        };
        s.metadata.annotations = Some(annotations);
        s
    }

    #[test]
    fn a_serving_certificate_is_kept_rewritten_or_issued() {
        let now = now_unix();
        let signer = ca_made_at(now, 365).current.unwrap();
        let target = ServingCert {
            secret: "tls".into(),
            names: vec!["a.svc".into()],
        };
        let life = Duration::from_secs(30 * DAY);
        let serve = |secret| serving(secret, &target, "spur-x", &signer, "B", life, now).unwrap();
        let Serving::Write { pair, info, issued } = serve(None) else {
            panic!("nothing held: issued")
        };
        assert!(issued);
        assert_eq!(info.sans, target.names);
        let issuer = pki::fingerprint(&signer.cert);
        // Good and with the bundle: kept.
        let held = secret_of(pair.clone(), "B", issuer.clone());
        assert!(matches!(serve(Some(held)), Serving::Current(i) if i == info));
        // Another bundle: the same certificate, rewritten.
        let stale = secret_of(pair.clone(), "A", issuer.clone());
        match serve(Some(stale)) {
            Serving::Write {
                pair: p, issued, ..
            } => assert_eq!((p, issued), (pair.clone(), false)),
            Serving::Current(_) => panic!("a stale bundle is rewritten"),
        }
        // Signed by another CA: issued anew.
        let other = secret_of(pair, "B", "someone".into());
        assert!(matches!(
            serve(Some(other)),
            Serving::Write { issued: true, .. }
        ));
    }

    #[test]
    fn every_configured_secret_is_named_and_copies_are_told_apart() {
        let mut cfg = cfg(365);
        assert_eq!(secret_names(&cfg), ["spur-ca", "spur-webhook-tls"]);
        cfg.ics = Some(ServingCert {
            secret: "ics-tls".into(),
            names: Vec::new(),
        });
        assert_eq!(
            secret_names(&cfg),
            ["spur-ca", "spur-webhook-tls", "ics-tls"]
        );

        let copy = super::super::namespace_bundle("app", "spur-ca", "B");
        assert_eq!(bundle_copy_state(&copy, "B"), (true, true));
        assert_eq!(bundle_copy_state(&copy, "C"), (true, false));
        let mut theirs = copy;
        theirs.metadata.labels = None;
        assert_eq!(bundle_copy_state(&theirs, "B"), (false, true));
    }
}
