//! Pairing: each sandbox exchange with the baseline exchange that answered the same request.

use spur_proto::traffic::Exchange;

/// What a pair was matched on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PairedOn {
    PathAndQuery,
    Path,
}

/// A sandbox exchange and the baseline exchange it is compared with.
pub struct Pair<'a> {
    pub sandbox: &'a Exchange,
    pub baseline: &'a Exchange,
    pub on: PairedOn,
}

/// The (namespace, name) of the workload an exchange was captured for.
pub fn workload_key(x: &Exchange) -> (String, String) {
    let w = x.baseline.clone().unwrap_or_default();
    (w.namespace, w.name)
}

/// `namespace/name` of the workload an exchange was captured for.
pub fn workload_name(x: &Exchange) -> String {
    let (ns, name) = workload_key(x);
    format!("{ns}/{name}")
}

fn without_query(path: &str) -> &str {
    path.split_once('?').map_or(path, |(p, _)| p)
}

/// Pairs each sandbox exchange with the baseline exchange of the same workload and method
/// closest in time: on the same path and query if there is one, else on the same path. A
/// baseline exchange may serve several sandbox exchanges (one reference request, many tries).
pub fn pair_exchanges<'a>(
    sandbox: &'a [Exchange],
    baseline: &'a [Exchange],
) -> (Vec<Pair<'a>>, Vec<&'a Exchange>) {
    let mut pairs = Vec::new();
    let mut unpaired = Vec::new();
    for s in sandbox {
        let key = workload_key(s);
        let closest = |same_path: &dyn Fn(&Exchange) -> bool| {
            baseline
                .iter()
                .filter(|b| b.method == s.method && workload_key(b) == key && same_path(b))
                .min_by_key(|b| b.start_unix_micros.abs_diff(s.start_unix_micros))
        };
        let found = closest(&|b| b.path == s.path)
            .map(|b| (b, PairedOn::PathAndQuery))
            .or_else(|| {
                closest(&|b| without_query(&b.path) == without_query(&s.path))
                    .map(|b| (b, PairedOn::Path))
            });
        match found {
            Some((baseline, on)) => pairs.push(Pair {
                sandbox: s,
                baseline,
                on,
            }),
            None => unpaired.push(s),
        }
    }
    (pairs, unpaired)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::unpaired_line;
    use crate::testing::exchange;

    #[test]
    fn pairs_closest_in_time_then_without_query() {
        let baseline = [
            exchange("api", "GET", "/items?page=1", 100),
            exchange("api", "GET", "/items?page=1", 900),
            exchange("api", "GET", "/items?page=2", 1000),
            exchange("api", "POST", "/orders", 1000),
            exchange("web", "GET", "/about", 1000),
        ];
        let sandbox = [
            exchange("api", "GET", "/items?page=1", 1000),
            exchange("api", "GET", "/items?page=3", 1000),
            exchange("api", "GET", "/orders", 1000),
            exchange("api", "GET", "/about", 1000),
        ];
        let (pairs, unpaired) = pair_exchanges(&sandbox, &baseline);
        let got: Vec<_> = pairs
            .iter()
            .map(|p| (p.baseline.id.as_str(), p.on))
            .collect();
        assert_eq!(
            got,
            [
                ("apiGET/items?page=1@900", PairedOn::PathAndQuery),
                ("apiGET/items?page=2@1000", PairedOn::Path),
            ]
        );
        let unpaired: Vec<_> = unpaired.iter().map(|x| x.path.as_str()).collect();
        assert_eq!(unpaired, ["/orders", "/about"]);
        assert_eq!(
            unpaired_line(&sandbox[2]),
            "no baseline exchange for GET /orders (add a virtual workload of default/api to a \
             reference sandbox and send the same request with its key)"
        );
    }
}
