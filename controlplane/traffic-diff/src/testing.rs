//! Exchanges for the tests.

use spur_proto::traffic::{Exchange, Header, Workload};

/// A captured exchange of `workload` (a Deployment in `default`), answered 200.
pub(crate) fn exchange(workload: &str, method: &str, path: &str, start: i64) -> Exchange {
    Exchange {
        id: format!("{workload}{method}{path}@{start}"),
        baseline: Some(Workload {
            kind: "Deployment".into(),
            namespace: "default".into(),
            name: workload.into(),
        }),
        method: method.into(),
        path: path.into(),
        start_unix_micros: start,
        status: 200,
        ..Exchange::default()
    }
}

pub(crate) fn header(name: &str, value: &[u8]) -> Header {
    Header {
        name: name.into(),
        value: value.to_vec(),
    }
}
