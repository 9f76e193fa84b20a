//! `proto/demo.fds`, what the demo gRPC service's reflection answers from, is generated from
//! `proto/demo.proto` and committed. This test compiles the .proto again and fails on any
//! difference (`SPUR_REGENERATE=1` rewrites the file), and checks that the hand-written prost
//! types of `grpc.rs` are the messages the descriptors describe.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use prost::Message;
use prost_reflect::{DescriptorPool, DynamicMessage};
use spur_demo_apps::{HelloReply, PriceReply};

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("proto")
}

#[test]
fn demo_descriptors_are_current() {
    let fds = protox::compile([dir().join("demo.proto")], [dir()]).unwrap();
    let fresh = fds.encode_to_vec();
    let path = dir().join("demo.fds");
    if std::env::var_os("SPUR_REGENERATE").is_some() {
        std::fs::write(&path, &fresh).unwrap();
        return;
    }
    assert!(
        std::fs::read(&path).unwrap() == fresh,
        "{} is stale: run `SPUR_REGENERATE=1 cargo test -p spur-demo-apps --test descriptors` and commit it",
        path.display()
    );
    assert_eq!(spur_demo_apps::DEMO_DESCRIPTORS, fresh.as_slice());
}

#[test]
fn the_hand_written_messages_are_the_described_ones() {
    let pool = DescriptorPool::decode(spur_demo_apps::DEMO_DESCRIPTORS).unwrap();
    let demo = pool
        .get_service_by_name(spur_demo_apps::GRPC_SERVICE)
        .unwrap();
    let methods: Vec<_> = demo.methods().map(|m| m.name().to_owned()).collect();
    assert_eq!(methods, ["Hello", "Price", "Chat"]);
    let decode = |name: &str, bytes: Vec<u8>| {
        let m = pool.get_message_by_name(name).unwrap();
        let m = DynamicMessage::decode(m, bytes.as_slice()).unwrap();
        serde_json::to_value(&m).unwrap()
    };
    let reply = PriceReply {
        sku: "A1".into(),
        price_cents: 300,
    };
    assert_eq!(
        decode("spur.demo.v1.PriceReply", reply.encode_to_vec()),
        serde_json::json!({"sku": "A1", "priceCents": "300"})
    );
    let hello = HelloReply {
        message: "hi".into(),
        served_by: "a".into(),
        routing_key: "k".into(),
    };
    assert_eq!(
        decode("spur.demo.v1.HelloReply", hello.encode_to_vec()),
        serde_json::json!({"message": "hi", "servedBy": "a", "routingKey": "k"})
    );
}
