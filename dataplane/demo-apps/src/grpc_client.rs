//! Minimal clients for the demo gRPC service, for tests and `spur demo grpc`.

use std::net::SocketAddr;
use std::str::FromStr;

use http::uri::PathAndQuery;
use tonic::client::Grpc;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Status};
use tonic_prost::ProstCodec;

use crate::grpc::{CHAT_PATH, HELLO_PATH, PRICE_PATH};
use crate::{HelloReply, HelloRequest, PriceReply, PriceRequest, SERVED_BY};

/// Unary `Hello` against `http://addr` (h2c), with extra request metadata such as
/// `("baggage", "sd-routing-key=k")`. Returns the reply and the `x-served-by` trailer, if any.
///
/// tonic folds a unary call's trailers into the response metadata; the demo server only sends
/// `x-served-by` as a trailer, so finding it there means it arrived as one.
pub async fn hello(
    addr: SocketAddr,
    name: &str,
    metadata: &[(&str, &str)],
) -> Result<(HelloReply, Option<String>), Status> {
    let mut client = connect(addr).await?;
    let mut request = Request::new(HelloRequest {
        name: name.to_owned(),
    });
    add_metadata(request.metadata_mut(), metadata)?;
    let path = PathAndQuery::from_static(HELLO_PATH);
    let response = client.unary(request, path, ProstCodec::default()).await?;
    let served_by = served_by(response.metadata());
    Ok((response.into_inner(), served_by))
}

/// Unary `Price` of `sku` against `http://addr` (h2c).
pub async fn price(addr: SocketAddr, sku: &str) -> Result<PriceReply, Status> {
    let mut client = connect(addr).await?;
    let request = Request::new(PriceRequest {
        sku: sku.to_owned(),
    });
    let path = PathAndQuery::from_static(PRICE_PATH);
    let response = client.unary(request, path, ProstCodec::default()).await?;
    Ok(response.into_inner())
}

/// Bidirectional `Chat`: sends each of `names`, half-closes, and collects every reply.
/// Returns the replies plus the `x-served-by` trailer, if any.
pub async fn chat(
    addr: SocketAddr,
    names: Vec<String>,
    metadata: &[(&str, &str)],
) -> Result<(Vec<HelloReply>, Option<String>), Status> {
    let mut client = connect(addr).await?;
    let outbound = futures_util::stream::iter(names.into_iter().map(|name| HelloRequest { name }));
    let mut request = Request::new(outbound);
    add_metadata(request.metadata_mut(), metadata)?;
    let path = PathAndQuery::from_static(CHAT_PATH);
    let response = client
        .streaming(request, path, ProstCodec::default())
        .await?;
    let mut inbound = response.into_inner();
    let mut replies = Vec::new();
    while let Some(reply) = inbound.message().await? {
        replies.push(reply);
    }
    let trailers = inbound.trailers().await?;
    Ok((replies, trailers.as_ref().and_then(served_by)))
}

async fn connect(addr: SocketAddr) -> Result<Grpc<Channel>, Status> {
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| Status::invalid_argument(format!("bad endpoint {addr}: {e}")))?
        .connect()
        .await
        .map_err(|e| Status::unavailable(format!("cannot connect to {addr}: {e}")))?;
    let mut client = Grpc::new(channel);
    client
        .ready()
        .await
        .map_err(|e| Status::unavailable(format!("channel to {addr} not ready: {e}")))?;
    Ok(client)
}

fn add_metadata(map: &mut MetadataMap, metadata: &[(&str, &str)]) -> Result<(), Status> {
    for (key, value) in metadata {
        let k = MetadataKey::from_str(key)
            .map_err(|_| Status::invalid_argument(format!("invalid metadata key {key:?}")))?;
        let v = MetadataValue::from_str(value)
            .map_err(|_| Status::invalid_argument(format!("invalid metadata value {value:?}")))?;
        map.append(k, v);
    }
    Ok(())
}

fn served_by(map: &MetadataMap) -> Option<String> {
    map.get(SERVED_BY)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}
