//! The routing-key carriers a preview overwrites besides the standard ones: headers the preview's
//! key is written into, query parameters removed. The hub's own (`--routing-header`,
//! `--query-param`), and every one any namespace of the target's cluster has named since the
//! cluster connected (`sidecar.spur.dev/routing-headers`, `sidecar.spur.dev/query-param`, read
//! through the agent): not only the target namespace's, because the target's app may forward a
//! header that only a downstream namespace's sidecars read, and pods injected before an
//! annotation changed still read what it said then.

use std::collections::BTreeMap;
use std::collections::BTreeSet;

use http::HeaderName;
use spur_routing::extract::{ExtractConfig, KeyExtractor, is_valid_key};

/// A set of configured carriers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Carriers {
    /// Lower-case header names, none of them a standard carrier.
    headers: BTreeSet<String>,
    /// Query parameter names, each a valid key's characters.
    params: BTreeSet<String>,
}

impl Carriers {
    /// The hub's own: `cfg`'s headers and parameter, and `more_params`. Fails on a name a
    /// sidecar would refuse.
    pub fn new(cfg: &ExtractConfig, more_params: &[String]) -> Result<Carriers, String> {
        let ex = KeyExtractor::new(cfg).map_err(|e| e.to_string())?;
        let mut out = Carriers {
            headers: ex
                .custom_headers()
                .iter()
                .map(|h| h.as_str().to_owned())
                .collect(),
            params: ex.query_param().map(str::to_owned).into_iter().collect(),
        };
        for p in more_params {
            if !is_valid_key(p) {
                return Err(format!(
                    "invalid query parameter name {p:?}: 1-64 characters of [A-Za-z0-9._-]"
                ));
            }
            out.params.insert(p.clone());
        }
        Ok(out)
    }

    /// Adds what a namespace's annotations name, each valid name on its own (a malformed
    /// entry beside it is left out: the webhook refuses the whole annotation for new pods, but
    /// pods made before may read the other names).
    pub fn add_namespace(&mut self, annotations: &BTreeMap<String, String>) {
        let (headers, param) = spur_api::carriers::annotated(annotations);
        for h in headers {
            let one = ExtractConfig {
                custom_headers: vec![h.clone()],
                query_param: None,
            };
            if KeyExtractor::new(&one).is_ok() {
                self.headers.insert(h);
            }
        }
        if let Some(p) = param.filter(|p| is_valid_key(p)) {
            self.params.insert(p);
        }
    }

    /// Both sets together.
    pub fn union(&self, other: &Carriers) -> Carriers {
        Carriers {
            headers: self.headers.union(&other.headers).cloned().collect(),
            params: self.params.union(&other.params).cloned().collect(),
        }
    }

    pub fn header_names(&self) -> Vec<HeaderName> {
        self.headers
            .iter()
            .filter_map(|h| HeaderName::from_bytes(h.as_bytes()).ok())
            .collect()
    }

    pub fn params(&self) -> impl Iterator<Item = &str> {
        self.params.iter().map(String::as_str)
    }

    /// A sidecar's reading of a request, for each parameter a sidecar may be configured with
    /// (one, or none), every header included: a preview must find only its own key in each.
    pub fn extractors(&self) -> Vec<KeyExtractor> {
        let headers: Vec<String> = self.headers.iter().cloned().collect();
        let params: Vec<Option<String>> = if self.params.is_empty() {
            vec![None]
        } else {
            self.params.iter().cloned().map(Some).collect()
        };
        params
            .into_iter()
            .filter_map(|query_param| {
                KeyExtractor::new(&ExtractConfig {
                    custom_headers: headers.clone(),
                    query_param,
                })
                .ok()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use spur_api::keys::injection::{QUERY_PARAM, ROUTING_HEADERS};

    #[test]
    fn namespaces_add_each_valid_name_and_nothing_is_forgotten() {
        let hub = Carriers::new(
            &ExtractConfig {
                custom_headers: vec!["X-Route-To".into()],
                query_param: Some("sd-routing-key".into()),
            },
            &["other-q".into()],
        )
        .unwrap();
        assert!(Carriers::new(&ExtractConfig::default(), &["a b".into()]).is_err());
        let mut seen = Carriers::default();
        seen.add_namespace(&BTreeMap::from([
            (
                ROUTING_HEADERS.to_owned(),
                "X-Team, bad header, baggage,".to_owned(),
            ),
            (QUERY_PARAM.to_owned(), "team-key".to_owned()),
        ]));
        seen.add_namespace(&BTreeMap::from([(
            QUERY_PARAM.to_owned(),
            "bad param".to_owned(),
        )]));
        let all = hub.union(&seen);
        let headers: Vec<String> = all.header_names().iter().map(|h| h.to_string()).collect();
        assert_eq!(headers, ["x-route-to", "x-team"]);
        assert_eq!(
            all.params().collect::<Vec<_>>(),
            ["other-q", "sd-routing-key", "team-key"]
        );
        // One reading per parameter, each with every header.
        let ex = all.extractors();
        assert_eq!(ex.len(), 3);
        assert!(ex.iter().all(|e| e.custom_headers().len() == 2));
        assert_eq!(Carriers::default().extractors().len(), 1);
    }
}
