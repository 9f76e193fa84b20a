//! gRPC through the sidecar: unary and bidirectional streaming over h2c, with status and
//! trailers carried end to end, routed by key in metadata. Every test runs through the HTTP/2
//! relay (the default) and through hyper's path (`http2Relay: false`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use spur_demo_apps::grpc_client::{chat, hello};
use spur_e2e::{AppKind, Env, EnvOptions, metrics, sample};
use spur_proxy::ProxyConfig;

async fn grpc_env(relay: bool) -> Env {
    // Shown with a failing test's output: which path failed.
    eprintln!("the sidecar's HTTP/2 relay is on: {relay}");
    Env::start(EnvOptions {
        kind: AppKind::Grpc,
        proxy: ProxyConfig {
            http2_relay: relay,
            ..EnvOptions::default().proxy
        },
        ..EnvOptions::default()
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unary_routes_by_metadata_and_keeps_trailers() {
    for relay in [true, false] {
        let env = grpc_env(relay).await;
        let (reply, trailer) = hello(env.addr(), "a", &[]).await.unwrap();
        assert_eq!(reply.served_by, "baseline");
        assert_eq!(trailer.as_deref(), Some("baseline"));
        let (reply, trailer) = hello(env.addr(), "b", &[("baggage", "sd-routing-key=k1")])
            .await
            .unwrap();
        assert_eq!(reply.served_by, "fork");
        assert_eq!(
            reply.routing_key, "k1",
            "the key reaches the fork for further propagation"
        );
        assert_eq!(trailer.as_deref(), Some("fork"));
        let (reply, _) = hello(env.addr(), "c", &[("uberctx-sd-routing-key", "k1")])
            .await
            .unwrap();
        assert_eq!(reply.served_by, "fork");
        let m = metrics(env.admin()).await;
        assert!(
            sample(&m, "spur_connections_total{protocol=\"http2\"}") >= 3.0,
            "{m}"
        );
        env.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_status_travels_through() {
    for relay in [true, false] {
        let env = grpc_env(relay).await;
        let status = hello(env.addr(), "fail", &[("baggage", "sd-routing-key=k1")])
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::FailedPrecondition);
        assert_eq!(status.message(), "asked to fail");
        env.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bidirectional_streaming_with_trailers() {
    for relay in [true, false] {
        let env = grpc_env(relay).await;
        let names: Vec<String> = (0..50).map(|i| format!("m{i}")).collect();
        let (replies, trailer) = chat(
            env.addr(),
            names.clone(),
            &[("baggage", "sd-routing-key=k1")],
        )
        .await
        .unwrap();
        assert_eq!(replies.len(), 50);
        for (r, n) in replies.iter().zip(&names) {
            assert_eq!(r.message, format!("echo {n} from fork"));
        }
        assert_eq!(trailer.as_deref(), Some("fork"));
        let (replies, trailer) = chat(env.addr(), names, &[]).await.unwrap();
        assert!(replies.iter().all(|r| r.served_by == "baseline"));
        assert_eq!(trailer.as_deref(), Some("baseline"));
        env.shutdown().await;
    }
}
