use spur_proto::traffic::{Body, Workload};

use super::*;

/// An exchange whose pusher's id is `id`; `authority` carries it too, so that tests can tell
/// exchanges apart once the store has given them its own ids.
fn ex(id: &str) -> Exchange {
    Exchange {
        id: id.into(),
        authority: id.into(),
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

/// The pushers' ids of `stored` (see [`ex`]).
fn ids(stored: &[StoredExchange]) -> Vec<&str> {
    stored
        .iter()
        .map(|s| s.exchange.as_ref().map_or("", |e| e.authority.as_str()))
        .collect()
}

/// `e` as the store gives it back with id `id`.
fn as_stored(mut e: Exchange, id: &str) -> Exchange {
    e.id = id.into();
    e
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
    let stored = store.insert("pod-uid-1", batch.clone()).await.unwrap();
    assert_eq!(ids(&stored), ["a", "b"]);
    let again = store.insert("pod-uid-1", batch).await.unwrap();
    assert!(again.is_empty());
    assert_eq!(store.stored_exchanges(), 2);
    let got = all(&store).await;
    assert_eq!(got.len(), 2);
    // What comes back is what went in, under the store's id.
    let a = &stored[0].exchange.as_ref().unwrap().id;
    assert!(
        got.iter()
            .any(|s| s.exchange == Some(as_stored(ex("a"), a)))
    );
    assert!(got.iter().all(|s| s.stored_unix_micros > 0));
}

/// Issue 42: a pusher's id was the record's key, so a pod that pushed another sidecar's
/// predictable id (`<pod>/<start>/<seq>`) first made the real exchange a "duplicate".
#[tokio::test]
async fn ids_are_the_stores_and_another_pushers_id_touches_nothing() {
    let store = memory(Limits::default());
    let real = with("backend-1/1700000000/7", |e| e.path = "/real".into());
    let forged = with("backend-1/1700000000/7", |e| {
        e.path = "/forged".into();
        e.authority = "forged".into();
    });
    let first = store.insert("attacker-uid", vec![forged]).await.unwrap();
    let second = store
        .insert("backend-uid", vec![real.clone()])
        .await
        .unwrap();
    assert_eq!(second.len(), 1, "the real exchange is stored");
    // And the other way round: a forged id pushed later replaces nothing.
    let again = store
        .insert(
            "attacker-uid-2",
            vec![with("backend-1/1700000000/7", |e| e.path = "/again".into())],
        )
        .await
        .unwrap();
    assert_eq!(again.len(), 1);
    let id = |s: &[StoredExchange]| s[0].exchange.as_ref().unwrap().id.clone();
    let got = all(&store).await;
    assert_eq!(got.len(), 3);
    let real_back = got
        .iter()
        .find(|s| s.exchange.as_ref().unwrap().path == "/real")
        .unwrap();
    assert_eq!(
        real_back.exchange.as_ref().unwrap(),
        &as_stored(real, &id(&second))
    );
    // The store's ids: distinct numbers, increasing, none the pusher's.
    let ids: Vec<u64> = [id(&first), id(&second), id(&again)]
        .iter()
        .map(|i| i.parse().unwrap())
        .collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
}

#[tokio::test]
async fn ids_are_never_given_twice_even_after_retention_empties_the_store() {
    let hour = 3_600_000_000i64;
    let (store, clock) = manual(
        Limits {
            max_age: Duration::from_secs(3600),
            ..Limits::default()
        },
        10 * hour,
    );
    let first = store.insert("p", vec![ex("a")]).await.unwrap();
    clock.store(12 * hour, Ordering::SeqCst);
    // "a" is removed by age in the same transaction as "b" is added.
    let second = store.insert("p", vec![ex("b")]).await.unwrap();
    assert_eq!(store.stored_exchanges(), 1);
    let id = |s: &[StoredExchange]| s[0].exchange.as_ref().unwrap().id.parse::<u64>().unwrap();
    assert!(id(&second) > id(&first));
}

fn in_namespace(id: &str, namespace: &str) -> Exchange {
    with(id, |e| {
        if let Some(b) = e.baseline.as_mut() {
            b.namespace = namespace.into();
        }
    })
}

async fn count_in(store: &Store, namespace: &str) -> usize {
    store
        .query(
            Filter {
                namespace: namespace.into(),
                ..Filter::default()
            },
            MAX_QUERY_LIMIT,
        )
        .await
        .unwrap()
        .len()
}

/// Issue 42: retention removed the store's oldest rows, whoever's they were, so one namespace
/// flooding the store removed every other namespace's exchanges.
#[tokio::test]
async fn a_namespace_flooding_the_store_removes_only_its_own_exchanges() {
    let store = memory(Limits {
        max_exchanges: 20,
        namespace_max_exchanges: 15,
        ..Limits::default()
    });
    let b: Vec<Exchange> = (0..8)
        .map(|i| in_namespace(&format!("b{i}"), "team-b"))
        .collect();
    store.insert("b-pod", b).await.unwrap();
    for round in 0..10 {
        let a: Vec<Exchange> = (0..10)
            .map(|i| in_namespace(&format!("a{round}-{i}"), "team-a"))
            .collect();
        store.insert("a-pod", a).await.unwrap();
    }
    assert_eq!(
        count_in(&store, "team-b").await,
        8,
        "team-b keeps everything"
    );
    // team-a: its quota (15), then the store's limit (20) taken from it, the larger.
    assert_eq!(count_in(&store, "team-a").await, 12);
    assert_eq!(store.stored_exchanges(), 20);
    // Its newest, oldest first removed.
    let mut kept = ids(&all(&store).await)
        .into_iter()
        .filter(|i| i.starts_with('a'))
        .map(String::from)
        .collect::<Vec<_>>();
    kept.sort();
    assert_eq!(kept[0], "a8-8");
    assert_eq!(store.retention_dropped(), 88);
    let evicted = |reason: &str| {
        store
            .shared()
            .evicted
            .get_or_create(&EvictedLabels {
                namespace: "team-a".into(),
                reason: match reason {
                    "namespace_quota" => "namespace_quota",
                    _ => "store_limit",
                },
            })
            .get()
    };
    assert_eq!(evicted("namespace_quota") + evicted("store_limit"), 88);
    assert!(evicted("store_limit") > 0);
}

#[tokio::test]
async fn a_namespaces_quota_counts_bytes_too() {
    let size = as_stored(in_namespace("a00", "team-a"), "")
        .encode_to_vec()
        .len() as u64;
    let store = memory(Limits {
        namespace_max_bytes: size * 3 + size / 2,
        ..Limits::default()
    });
    store
        .insert("b-pod", vec![in_namespace("b00", "team-b")])
        .await
        .unwrap();
    for i in 0..10 {
        store
            .insert("a-pod", vec![in_namespace(&format!("a{i:02}"), "team-a")])
            .await
            .unwrap();
    }
    assert_eq!(count_in(&store, "team-a").await, 3);
    assert_eq!(count_in(&store, "team-b").await, 1);
    assert_eq!(store.stored_bytes(), size * 4);
}

#[tokio::test]
async fn a_version_1_database_keeps_its_exchanges_under_the_stores_ids() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("traffic.db");
    {
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch(schema::SCHEMA_V1).unwrap();
        let blob = ex("old").encode_to_vec();
        conn.execute(
            "INSERT INTO exchanges (seq, id, sandbox, namespace, workload, method, path, status, \
             routed, start_unix_micros, stored_unix_micros, size, exchange) \
             VALUES (41, '42', 'sb1', 'default', 'backend', 'GET', '/api/items', 200, 1, 1000, \
             ?1, ?2, ?3)",
            params![i64::MAX / 2, blob.len() as i64, blob],
        )
        .unwrap();
    }
    let store = Store::open(Some(&path), Limits::default()).unwrap();
    assert_eq!(store.stored_exchanges(), 1);
    let got = all(&store).await;
    assert_eq!(ids(&got), ["old"]);
    assert_eq!(got[0].exchange.as_ref().unwrap().id, "41");
    // A new exchange whose pusher's id is "42" is stored, and under an id past the old rows'.
    let stored = store.insert("p", vec![ex("42")]).await.unwrap();
    assert_eq!(stored[0].exchange.as_ref().unwrap().id, "42");
    assert_eq!(store.stored_exchanges(), 2);
}

#[tokio::test]
async fn an_exchange_without_an_id_refuses_the_batch() {
    let store = memory(Limits::default());
    let err = store
        .insert("pod-uid-1", vec![ex("a"), with("", |_| {})])
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Invalid(_)), "{err}");
    let long = "x".repeat(MAX_ID_LEN + 1);
    assert!(store.insert("pod-uid-1", vec![ex(&long)]).await.is_err());
    assert_eq!(store.stored_exchanges(), 0);
    assert!(all(&store).await.is_empty());
}

#[tokio::test]
async fn each_filter_field_narrows_the_query() {
    let store = memory(Limits::default());
    store
        .insert(
            "pod-uid-1",
            vec![
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
            ],
        )
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
            .map(|e| e.authority.as_str())
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
    store.insert("pod-uid-1", batch).await.unwrap();
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
        .insert(
            "pod-uid-1",
            vec![
                with("pct", |e| e.path = "/a%b/x".into()),
                with("under", |e| e.path = "/a_b/x".into()),
                with("plain", |e| e.path = "/axb/x".into()),
                with("slash", |e| e.path = "/a\\b/x".into()),
                with("upper", |e| e.path = "/A_B/x".into()),
            ],
        )
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
        store
            .insert("pod-uid-1", vec![ex(&format!("e{i}"))])
            .await
            .unwrap();
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
    store.insert("pod-uid-1", batch).await.unwrap();
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
    // Stored without the pusher's id.
    let size = as_stored(ex("e00"), "").encode_to_vec().len() as u64;
    let store = memory(Limits {
        max_bytes: size * 4 + size / 2,
        ..Limits::default()
    });
    for i in 0..10 {
        store
            .insert("pod-uid-1", vec![ex(&format!("e{i:02}"))])
            .await
            .unwrap();
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
    store.insert("pod-uid-1", vec![big]).await.unwrap();
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
    store.insert("pod-uid-1", vec![ex("old")]).await.unwrap();
    clock.store(10 * hour + hour / 2, Ordering::SeqCst);
    store.insert("pod-uid-1", vec![ex("mid")]).await.unwrap();
    // An hour and a bit after "old" was stored: the next insert removes it, not "mid".
    clock.store(11 * hour + 1, Ordering::SeqCst);
    store.insert("pod-uid-1", vec![ex("new")]).await.unwrap();
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
    let stored = store.insert("pod-uid-1", vec![ex("a")]).await.unwrap();
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
        store
            .insert("pod-uid-1", vec![ex("a"), ex("b")])
            .await
            .unwrap();
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
    store.insert("pod-uid-1", vec![ex("c")]).await.unwrap();
    assert_eq!(store.stored_exchanges(), 2);
    assert_eq!(store.retention_dropped(), 1);
}
