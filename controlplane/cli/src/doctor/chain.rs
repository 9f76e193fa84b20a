//! The chain of hops one traced request took, as sidecars recorded it, and where its routing key
//! went missing. Pure: the caller reads the sidecars.

use serde::Deserialize;

/// One hop of a sidecar's `/traces` (spur-sidecar's `trace::Hop`; unknown fields ignored).
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Hop {
    pub at_micros: u64,
    pub trace_id: String,
    #[serde(default)]
    pub trace_carriers: Vec<String>,
    #[serde(default)]
    pub keys: Vec<String>,
    #[serde(default)]
    pub key_carriers: Vec<String>,
    #[serde(default)]
    pub route: String,
    #[serde(default)]
    pub sandbox: Option<String>,
    #[serde(default)]
    pub path: String,
}

/// A hop with where it was seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Seen {
    /// `Deployment ns/name`: the workload whose sidecar saw it.
    pub workload: String,
    /// `ns/pod`.
    pub pod: String,
    pub hop: Hop,
}

/// What the chain says about the key.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// No sidecar recorded the trace.
    NotSeen,
    /// Every hop carried the key.
    Reached,
    /// The first hop seen came without the key: something before it dropped it.
    NeverArrived,
    /// Hop `at` came without the key, after hop `by` had it: `by`'s call dropped it.
    Dropped { by: usize, at: usize },
}

/// The hops of trace `trace_id` in the order they happened (by the sidecars' clocks: one node's
/// clock, or nodes' clocks as close as NTP keeps them), and the verdict for `key`.
pub(crate) fn analyse(mut seen: Vec<Seen>, trace_id: &str, key: &str) -> (Vec<Seen>, Verdict) {
    let ours = u128::from_str_radix(trace_id, 16).ok();
    // A tracer that keeps 64-bit ids (B3 allows it) carries on with the low half of ours.
    let same = |hop: &str| match (u128::from_str_radix(hop, 16).ok(), ours) {
        (Some(h), Some(t)) => h == t || (h >> 64 == 0 && h == t & u128::from(u64::MAX)),
        _ => hop == trace_id,
    };
    seen.retain(|s| same(&s.hop.trace_id));
    seen.sort_by(|a, b| {
        (a.hop.at_micros, &a.pod, &a.hop.path).cmp(&(b.hop.at_micros, &b.pod, &b.hop.path))
    });
    let has = |s: &Seen| s.hop.keys.iter().any(|k| k == key);
    let verdict = match seen.first() {
        None => Verdict::NotSeen,
        Some(first) if !has(first) => Verdict::NeverArrived,
        Some(_) => match seen.iter().position(|s| !has(s)) {
            None => Verdict::Reached,
            // The hop just before, in time, is the likeliest caller of a linear chain.
            Some(at) => Verdict::Dropped { by: at - 1, at },
        },
    };
    (seen, verdict)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const T: &str = "4bf92f3577b34da6a3ce929d0e0e5b0d";

    fn seen(workload: &str, at: u64, keys: &[&str], trace: &str) -> Seen {
        Seen {
            workload: format!("Deployment chain/{workload}"),
            pod: format!("chain/{workload}-0"),
            hop: Hop {
                at_micros: at,
                trace_id: trace.into(),
                trace_carriers: vec!["traceparent".into()],
                keys: keys.iter().map(|k| k.to_string()).collect(),
                key_carriers: if keys.is_empty() {
                    vec![]
                } else {
                    vec!["baggage".into()]
                },
                route: "baseline".into(),
                sandbox: None,
                path: "/".into(),
            },
        }
    }

    #[test]
    fn the_first_hop_without_the_key_names_its_caller() {
        let hops = vec![
            seen("c", 30, &[], T),
            seen("a", 10, &["k1"], T),
            seen("b", 20, &["k1"], T),
            seen("x", 15, &["k1"], "00000000000000000000000000005b0d"),
        ];
        let (chain, verdict) = analyse(hops, T, "k1");
        let order: Vec<&str> = chain.iter().map(|s| s.workload.as_str()).collect();
        assert_eq!(
            order,
            [
                "Deployment chain/a",
                "Deployment chain/b",
                "Deployment chain/c"
            ]
        );
        assert_eq!(verdict, Verdict::Dropped { by: 1, at: 2 });
    }

    #[test]
    fn reached_never_arrived_and_not_seen() {
        let all = vec![seen("a", 1, &["k1"], T), seen("b", 2, &["other", "k1"], T)];
        assert_eq!(analyse(all, T, "k1").1, Verdict::Reached);
        // Another key is not the key.
        let other = vec![seen("a", 1, &["k2"], T), seen("b", 2, &["k1"], T)];
        assert_eq!(analyse(other, T, "k1").1, Verdict::NeverArrived);
        assert_eq!(analyse(vec![], T, "k1").1, Verdict::NotSeen);
        let elsewhere = vec![seen("a", 1, &["k1"], "ab")];
        assert_eq!(analyse(elsewhere, T, "k1").1, Verdict::NotSeen);
        // A 64-bit tracer keeps the low half of the id.
        let short = vec![
            seen("a", 1, &["k1"], T),
            seen("b", 2, &[], "0000000000000000a3ce929d0e0e5b0d"),
        ];
        let (chain, verdict) = analyse(short, "4bf92f3577b34da6a3ce929d0e0e5b0d", "k1");
        assert_eq!(chain.len(), 2);
        assert_eq!(verdict, Verdict::Dropped { by: 0, at: 1 });
    }
}
