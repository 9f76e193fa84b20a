use spur_proto::traffic::{Body, Workload};

use super::*;

fn ex(id: &str) -> Exchange {
    Exchange {
        id: id.into(),
        baseline: Some(Workload {
            kind: "Deployment".into(),
            namespace: "default".into(),
            name: "backend".into(),
        }),
        pod: "backend-1".into(),
        sandbox: "sb1".into(),
        routing_key: "k1".into(),
        destination: "fork.default:8080".into(),
        method: "GET".into(),
        path: "/api/items".into(),
        status: 200,
        start_unix_micros: 1_000,
        request_body: Some(Body {
            size: 5,
            data: b"hello".to_vec(),
            truncated: false,
        }),
        response_body: Some(Body {
            size: 10,
            data: b"0123456789".to_vec(),
            truncated: false,
        }),
        ..Exchange::default()
    }
}

fn with(id: &str, f: impl FnOnce(&mut Exchange)) -> Exchange {
    let mut e = ex(id);
    f(&mut e);
    e
}

fn ids(stored: &[StoredExchange]) -> Vec<&str> {
    stored
        .iter()
        .map(|s| s.exchange.as_ref().map_or("", |e| e.id.as_str()))
        .collect()
}

fn memory(limits: Limits) -> Store {
    Store::open(None, limits).unwrap()
}

fn manual(limits: Limits, now: i64) -> (Store, Arc<AtomicI64>) {
    let clock = Arc::new(AtomicI64::new(now));
    let store = Store::open_with(None, limits, Clock::Manual(Arc::clone(&clock))).unwrap();
    (store, clock)
}

async fn all(store: &Store) -> Vec<StoredExchange> {
    store
        .query(Filter::default(), MAX_QUERY_LIMIT)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_resent_batch_is_stored_once() {
    let store = memory(Limits::default());
    let batch = vec![ex("a"), ex("b"), ex("a")];
    let stored = store.insert(batch.clone()).await.unwrap();
    assert_eq!(ids(&stored), ["a", "b"]);
    let again = store.insert(batch).await.unwrap();
    assert!(again.is_empty());
    assert_eq!(store.stored_exchanges(), 2);
    let got = all(&store).await;
    assert_eq!(got.len(), 2);
    // What comes back is what went in.
    assert!(got.iter().any(|s| s.exchange == Some(ex("a"))));
    assert!(got.iter().all(|s| s.stored_unix_micros > 0));
}

#[tokio::test]
async fn an_exchange_without_an_id_refuses_the_batch() {
    let store = memory(Limits::default());
    let err = store
        .insert(vec![ex("a"), with("", |_| {})])
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Invalid(_)), "{err}");
    let long = "x".repeat(MAX_ID_LEN + 1);
    assert!(store.insert(vec![ex(&long)]).await.is_err());
    assert_eq!(store.stored_exchanges(), 0);
    assert!(all(&store).await.is_empty());
}

#[tokio::test]
async fn each_filter_field_narrows_the_query() {
    let store = memory(Limits::default());
    store
        .insert(vec![
            ex("base"),
            with("sandbox", |e| e.sandbox = "sb2".into()),
            with("namespace", |e| {
                e.baseline.as_mut().unwrap().namespace = "other".into()
            }),
            with("workload", |e| {
                e.baseline.as_mut().unwrap().name = "web".into()
            }),
            with("path", |e| e.path = "/health".into()),
            with("method", |e| e.method = "POST".into()),
            with("status", |e| e.status = 503),
            with("baseline-routed", |e| e.destination = String::new()),
            with("early", |e| e.start_unix_micros = 10),
            with("late", |e| e.start_unix_micros = 5_000),
        ])
        .await
        .unwrap();
    let q = |f: Filter| {
        let store = store.clone();
        async move {
            let mut got: Vec<String> = ids(&store.query(f, 0).await.unwrap())
                .into_iter()
                .map(String::from)
                .collect();
            got.sort();
            got
        }
    };
    assert_eq!(q(Filter::default()).await.len(), 10);
    let only = |f: Filter| async move {
        let got = q(f.clone()).await;
        assert_eq!(got.len(), 1, "{f:?}: {got:?}");
        got[0].clone()
    };
    let f = Filter::default;
    assert_eq!(
        only(Filter {
            sandbox: "sb2".into(),
            ..f()
        })
        .await,
        "sandbox"
    );
    assert_eq!(
        only(Filter {
            namespace: "other".into(),
            ..f()
        })
        .await,
        "namespace"
    );
    assert_eq!(
        only(Filter {
            workload: "web".into(),
            ..f()
        })
        .await,
        "workload"
    );
    assert_eq!(
        only(Filter {
            path_prefix: "/he".into(),
            ..f()
        })
        .await,
        "path"
    );
    assert_eq!(
        only(Filter {
            method: "POST".into(),
            ..f()
        })
        .await,
        "method"
    );
    assert_eq!(only(Filter { status: 503, ..f() }).await, "status");
    assert_eq!(
        only(Filter {
            routed: Routed::Baseline as i32,
            ..f()
        })
        .await,
        "baseline-routed"
    );
    assert_eq!(
        q(Filter {
            routed: Routed::Sandbox as i32,
            ..f()
        })
        .await
        .len(),
        9
    );
    assert_eq!(
        only(Filter {
            until_unix_micros: 1_000,
            ..f()
        })
        .await,
        "early"
    );
    assert_eq!(
        only(Filter {
            since_unix_micros: 1_001,
            ..f()
        })
        .await,
        "late"
    );
    assert_eq!(
        q(Filter {
            since_unix_micros: 1_000,
            until_unix_micros: 1_001,
            ..f()
        })
        .await
        .len(),
        8
    );
    // Fields combine.
    assert!(
        q(Filter {
            sandbox: "sb2".into(),
            method: "POST".into(),
            ..f()
        })
        .await
        .is_empty()
    );
    // The in-memory matcher (Tail's) agrees with the query on every case above.
    let stored = all(&store).await;
    for filter in [
        Filter {
            sandbox: "sb2".into(),
            ..f()
        },
        Filter {
            namespace: "other".into(),
            ..f()
        },
        Filter {
            workload: "web".into(),
            ..f()
        },
        Filter {
            path_prefix: "/he".into(),
            ..f()
        },
        Filter {
            routed: Routed::Sandbox as i32,
            ..f()
        },
        Filter {
            since_unix_micros: 1_000,
            until_unix_micros: 1_001,
            ..f()
        },
    ] {
        let mut by_matcher: Vec<&str> = stored
            .iter()
            .filter_map(|s| s.exchange.as_ref())
            .filter(|e| matches(&filter, e))
            .map(|e| e.id.as_str())
            .collect();
        by_matcher.sort();
        assert_eq!(by_matcher, q(filter.clone()).await, "{filter:?}");
    }
}

#[tokio::test]
async fn newest_first_and_limits() {
    let store = memory(Limits::default());
    let batch: Vec<Exchange> = (0..1_100)
        .map(|i| with(&format!("e{i}"), |e| e.start_unix_micros = i))
        .collect();
    store.insert(batch).await.unwrap();
    let got = store.query(Filter::default(), 3).await.unwrap();
    assert_eq!(ids(&got), ["e1099", "e1098", "e1097"]);
    assert_eq!(
        store.query(Filter::default(), 0).await.unwrap().len(),
        DEFAULT_QUERY_LIMIT as usize
    );
    assert_eq!(
        store.query(Filter::default(), 5_000).await.unwrap().len(),
        MAX_QUERY_LIMIT as usize
    );
}

#[tokio::test]
async fn path_prefix_wildcards_are_literal_and_case_matters() {
    let store = memory(Limits::default());
    store
        .insert(vec![
            with("pct", |e| e.path = "/a%b/x".into()),
            with("under", |e| e.path = "/a_b/x".into()),
            with("plain", |e| e.path = "/axb/x".into()),
            with("slash", |e| e.path = "/a\\b/x".into()),
            with("upper", |e| e.path = "/A_B/x".into()),
        ])
        .await
        .unwrap();
    let q = |prefix: &str| {
        let store = store.clone();
        let prefix = prefix.to_string();
        async move {
            let got = store
                .query(
                    Filter {
                        path_prefix: prefix,
                        ..Filter::default()
                    },
                    0,
                )
                .await
                .unwrap();
            ids(&got).into_iter().map(String::from).collect::<Vec<_>>()
        }
    };
    assert_eq!(q("/a%").await, ["pct"]);
    assert_eq!(q("/a_").await, ["under"]);
    assert_eq!(q("/a\\").await, ["slash"]);
    assert_eq!(q("/A_").await, ["upper"]);
    assert!(q("%").await.is_empty());
    assert!(q("_").await.is_empty());
    assert_eq!(like_prefix("a%b_c\\"), "a\\%b\\_c\\\\%");
}

#[tokio::test]
async fn invalid_filters_are_refused() {
    let store = memory(Limits::default());
    for f in [
        Filter {
            routed: 7,
            ..Filter::default()
        },
        Filter {
            since_unix_micros: -1,
            ..Filter::default()
        },
        Filter {
            since_unix_micros: 5,
            until_unix_micros: 5,
            ..Filter::default()
        },
        Filter {
            status: 1000,
            ..Filter::default()
        },
        Filter {
            path_prefix: "/".repeat(MAX_FILTER_FIELD + 1),
            ..Filter::default()
        },
    ] {
        let err = store.query(f.clone(), 0).await.unwrap_err();
        assert!(matches!(err, Error::Invalid(_)), "{f:?}: {err}");
    }
}

#[tokio::test]
async fn retention_by_count_drops_the_oldest() {
    let store = memory(Limits {
        max_exchanges: 3,
        ..Limits::default()
    });
    for i in 0..5 {
        store.insert(vec![ex(&format!("e{i}"))]).await.unwrap();
    }
    assert_eq!(store.stored_exchanges(), 3);
    assert_eq!(store.retention_dropped(), 2);
    let mut got: Vec<String> = ids(&all(&store).await)
        .into_iter()
        .map(String::from)
        .collect();
    got.sort();
    assert_eq!(got, ["e2", "e3", "e4"]);
    // One batch larger than the limit keeps its newest rows.
    let batch: Vec<Exchange> = (10..20).map(|i| ex(&format!("e{i}"))).collect();
    store.insert(batch).await.unwrap();
    assert_eq!(store.stored_exchanges(), 3);
    assert_eq!(store.retention_dropped(), 12);
    let mut got: Vec<String> = ids(&all(&store).await)
        .into_iter()
        .map(String::from)
        .collect();
    got.sort();
    assert_eq!(got, ["e17", "e18", "e19"]);
}

#[tokio::test]
async fn retention_by_bytes_keeps_the_total_under_the_limit() {
    let size = ex("e00").encode_to_vec().len() as u64;
    let store = memory(Limits {
        max_bytes: size * 4 + size / 2,
        ..Limits::default()
    });
    for i in 0..10 {
        store.insert(vec![ex(&format!("e{i:02}"))]).await.unwrap();
    }
    assert_eq!(store.stored_exchanges(), 4);
    assert_eq!(store.stored_bytes(), size * 4);
    assert_eq!(store.retention_dropped(), 6);
    let mut got: Vec<String> = ids(&all(&store).await)
        .into_iter()
        .map(String::from)
        .collect();
    got.sort();
    assert_eq!(got, ["e06", "e07", "e08", "e09"]);
    // A big exchange pushes several small ones out at once.
    let big = with("big", |e| {
        e.response_body = Some(Body {
            size: size * 3,
            data: vec![b'x'; (size * 3) as usize],
            truncated: false,
        })
    });
    store.insert(vec![big]).await.unwrap();
    assert!(store.stored_bytes() <= size * 4 + size / 2);
    assert_eq!(ids(&all(&store).await)[0], "big");
}

#[tokio::test]
async fn retention_by_age_uses_the_stores_clock() {
    let hour = 3_600_000_000i64;
    let (store, clock) = manual(
        Limits {
            max_age: Duration::from_secs(3600),
            ..Limits::default()
        },
        10 * hour,
    );
    store.insert(vec![ex("old")]).await.unwrap();
    clock.store(10 * hour + hour / 2, Ordering::SeqCst);
    store.insert(vec![ex("mid")]).await.unwrap();
    // An hour and a bit after "old" was stored: the next insert removes it, not "mid".
    clock.store(11 * hour + 1, Ordering::SeqCst);
    store.insert(vec![ex("new")]).await.unwrap();
    let got = all(&store).await;
    let mut names = ids(&got);
    names.sort();
    assert_eq!(names, ["mid", "new"]);
    assert_eq!(store.retention_dropped(), 1);
    assert_eq!(store.stored_exchanges(), 2);
    let stored_at: Vec<i64> = got.iter().map(|s| s.stored_unix_micros).collect();
    assert!(stored_at.contains(&(11 * hour + 1)));
}

#[tokio::test]
async fn without_stored_bodies_only_sizes_are_kept() {
    let store = memory(Limits {
        store_bodies: false,
        ..Limits::default()
    });
    let stored = store.insert(vec![ex("a")]).await.unwrap();
    let got = all(&store).await;
    assert_eq!(got[0].exchange, stored[0].exchange);
    let e = got[0].exchange.as_ref().unwrap();
    for (body, size) in [(&e.request_body, 5), (&e.response_body, 10)] {
        let body = body.as_ref().unwrap();
        assert!(body.data.is_empty());
        assert_eq!(body.size, size);
        assert!(body.truncated);
    }
    // Everything else is as sent.
    assert_eq!(e.path, "/api/items");
}

#[tokio::test]
async fn a_file_keeps_its_exchanges_and_totals_across_opens() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("traffic.db");
    {
        let store = Store::open(Some(&path), Limits::default()).unwrap();
        store.insert(vec![ex("a"), ex("b")]).await.unwrap();
    }
    let limits = Limits {
        max_exchanges: 2,
        ..Limits::default()
    };
    // The first store's thread may still be closing the file: SQLite's locks (and the busy
    // timeout) make that safe.
    let store = Store::open(Some(&path), limits).unwrap();
    assert_eq!(store.stored_exchanges(), 2);
    let bytes = store.stored_bytes();
    assert!(bytes > 0);
    // The totals read at open drive retention: one more insert drops one.
    store.insert(vec![ex("c")]).await.unwrap();
    assert_eq!(store.stored_exchanges(), 2);
    assert_eq!(store.retention_dropped(), 1);
}
