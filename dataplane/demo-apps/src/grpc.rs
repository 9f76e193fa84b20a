//! gRPC demo service `spur.demo.v1.Demo`, written against tonic's server primitives directly so
//! the crate needs neither a build script nor `protoc`.

use std::convert::Infallible;
use std::future::{Ready, ready};
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::StreamExt;
use http::HeaderValue;
use http_body_util::BodyExt;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::body::Body;
use tonic::codegen::{BoxFuture, BoxStream, Service};
use tonic::metadata::MetadataMap;
use tonic::server::{Grpc, NamedService, StreamingService, UnaryService};
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};
use tonic_prost::ProstCodec;

use crate::{Error, GRPC_SERVICE, SERVED_BY};

/// `spur.demo.v1.HelloRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HelloRequest {
    #[prost(string, tag = "1")]
    pub name: String,
}

/// `spur.demo.v1.HelloReply`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HelloReply {
    #[prost(string, tag = "1")]
    pub message: String,
    #[prost(string, tag = "2")]
    pub served_by: String,
    /// The `sd-routing-key` baggage member the request arrived with (empty if none), so tests
    /// can check what the proxy propagated.
    #[prost(string, tag = "3")]
    pub routing_key: String,
}

/// `spur.demo.v1.PriceRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PriceRequest {
    #[prost(string, tag = "1")]
    pub sku: String,
}

/// `spur.demo.v1.PriceReply`: the same for every replica and every caller (no replica name,
/// no routing key), so a sandbox's answer differs from the baseline's only where its code does.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PriceReply {
    #[prost(string, tag = "1")]
    pub sku: String,
    #[prost(int64, tag = "2")]
    pub price_cents: i64,
}

/// The demo catalog's prices, by SKU (the HTTP catalog of `spur demo app` lists the same).
pub const PRICES: [(&str, &str, i64); 3] = [
    ("A1", "apple", 300),
    ("B2", "bread", 150),
    ("C3", "cheese", 975),
];

pub(crate) const HELLO_PATH: &str = "/spur.demo.v1.Demo/Hello";
pub(crate) const PRICE_PATH: &str = "/spur.demo.v1.Demo/Price";
pub(crate) const CHAT_PATH: &str = "/spur.demo.v1.Demo/Chat";

/// Request name that makes `Hello` fail, to exercise error statuses end to end.
const FAIL_NAME: &str = "fail";

/// gRPC service `spur.demo.v1.Demo` over h2c:
/// `rpc Hello(HelloRequest) returns (HelloReply)` and
/// `rpc Chat(stream HelloRequest) returns (stream HelloReply)`.
///
/// Every response carries trailing metadata `x-served-by: <name>` (for error responses sent
/// trailers-only, that is the response headers). Runs until `shutdown` is cancelled, then stops
/// accepting and returns once in-flight calls have finished.
pub async fn serve_grpc(
    listener: TcpListener,
    name: String,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    serve_grpc_with(listener, name, GrpcBehaviour::default(), shutdown).await
}

/// How the demo service behaves besides its defaults.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GrpcBehaviour {
    /// Every call fails with UNAVAILABLE, as a broken build of the service would: what a smart
    /// test is to find in a sandbox.
    pub unavailable: bool,
}

/// [`serve_grpc`] with `behaviour`; also
/// `rpc Price(PriceRequest) returns (PriceReply)` (NOT_FOUND for an SKU not in [`PRICES`]).
pub async fn serve_grpc_with(
    listener: TcpListener,
    name: String,
    behaviour: GrpcBehaviour,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let svc = DemoServer::new(name, behaviour)?;
    // Server reflection (v1, and v1alpha for older clients), so grpcurl and smart tests
    // (`reflection: true`) learn the messages without a .proto. It answers even when the
    // service is broken (`unavailable`), as a real server's would.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::DEMO_DESCRIPTORS)
    };
    let v1 = reflection()
        .build_v1()
        .map_err(|e| Error::Reflection(e.to_string()))?;
    let v1alpha = reflection()
        .build_v1alpha()
        .map_err(|e| Error::Reflection(e.to_string()))?;
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    tonic::transport::Server::builder()
        .add_service(svc)
        .add_service(v1)
        .add_service(v1alpha)
        .serve_with_incoming_shutdown(incoming, shutdown.cancelled())
        .await?;
    Ok(())
}

struct Inner {
    name: String,
    served_by: HeaderValue,
    behaviour: GrpcBehaviour,
}

#[derive(Clone)]
struct DemoServer(Arc<Inner>);

impl DemoServer {
    fn new(name: String, behaviour: GrpcBehaviour) -> Result<Self, Error> {
        let served_by =
            HeaderValue::try_from(name.as_str()).map_err(|_| Error::InvalidName(name.clone()))?;
        Ok(Self(Arc::new(Inner {
            name,
            served_by,
            behaviour,
        })))
    }
}

impl NamedService for DemoServer {
    const NAME: &'static str = GRPC_SERVICE;
}

impl Service<http::Request<Body>> for DemoServer {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let inner = Arc::clone(&self.0);
        Box::pin(async move {
            let mut grpc = Grpc::new(ProstCodec::default());
            let resp = match req.uri().path() {
                _ if inner.behaviour.unavailable => {
                    Status::unavailable("this build of the service is broken").into_http()
                }
                HELLO_PATH => grpc.unary(Hello(Arc::clone(&inner)), req).await,
                PRICE_PATH => {
                    // Its own codec: another pair of message types.
                    Grpc::new(ProstCodec::default()).unary(Price, req).await
                }
                CHAT_PATH => grpc.streaming(Chat(Arc::clone(&inner)), req).await,
                _ => Status::unimplemented("no such method").into_http(),
            };
            Ok(with_served_by(resp, &inner.served_by))
        })
    }
}

/// tonic has no API for custom trailers on a successful response, so the trailers frame its
/// encoder emits (the one carrying `grpc-status`) is amended on the way out.
fn with_served_by(resp: http::Response<Body>, served_by: &HeaderValue) -> http::Response<Body> {
    let (mut parts, body) = resp.into_parts();
    if parts.headers.contains_key("grpc-status") {
        // Trailers-only response: the headers are the trailers.
        parts.headers.insert(SERVED_BY, served_by.clone());
        return http::Response::from_parts(parts, body);
    }
    let served_by = served_by.clone();
    let body = body.map_frame(move |mut frame| {
        if let Some(trailers) = frame.trailers_mut() {
            trailers.insert(SERVED_BY, served_by.clone());
        }
        frame
    });
    http::Response::from_parts(parts, Body::new(body))
}

/// The `sd-routing-key` member of the W3C `baggage` metadata, or empty. Deliberately naive
/// (no percent-decoding): the demo only needs to show what arrived.
fn routing_key(metadata: &MetadataMap) -> String {
    metadata
        .get_all("baggage")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .find_map(|member| {
            let key_value = member.split(';').next()?;
            let (k, v) = key_value.split_once('=')?;
            (k.trim() == "sd-routing-key").then(|| v.trim().to_owned())
        })
        .unwrap_or_default()
}

struct Hello(Arc<Inner>);

impl UnaryService<HelloRequest> for Hello {
    type Response = HelloReply;
    type Future = Ready<Result<Response<HelloReply>, Status>>;

    fn call(&mut self, request: Request<HelloRequest>) -> Self::Future {
        let routing_key = routing_key(request.metadata());
        let req = request.into_inner();
        if req.name == FAIL_NAME {
            return ready(Err(Status::failed_precondition("asked to fail")));
        }
        let name = &self.0.name;
        ready(Ok(Response::new(HelloReply {
            message: format!("hello {} from {name}", req.name),
            served_by: name.clone(),
            routing_key,
        })))
    }
}

struct Price;

impl UnaryService<PriceRequest> for Price {
    type Response = PriceReply;
    type Future = Ready<Result<Response<PriceReply>, Status>>;

    fn call(&mut self, request: Request<PriceRequest>) -> Self::Future {
        let sku = request.into_inner().sku;
        ready(match PRICES.iter().find(|(s, ..)| *s == sku) {
            Some((_, _, price_cents)) => Ok(Response::new(PriceReply {
                sku,
                price_cents: *price_cents,
            })),
            None => Err(Status::not_found(format!("no SKU {sku:?}"))),
        })
    }
}

struct Chat(Arc<Inner>);

impl StreamingService<HelloRequest> for Chat {
    type Response = HelloReply;
    type ResponseStream = BoxStream<HelloReply>;
    type Future = Ready<Result<Response<Self::ResponseStream>, Status>>;

    fn call(&mut self, request: Request<Streaming<HelloRequest>>) -> Self::Future {
        let routing_key = routing_key(request.metadata());
        let inner = Arc::clone(&self.0);
        // Replies are produced lazily from the request stream, so each message is answered as
        // soon as it arrives and the response ends when the client half-closes.
        let replies = request.into_inner().map(move |msg| {
            msg.map(|req| HelloReply {
                message: format!("echo {} from {}", req.name, inner.name),
                served_by: inner.name.clone(),
                routing_key: routing_key.clone(),
            })
        });
        ready(Ok(Response::new(Box::pin(replies))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_key_is_found_among_members_and_properties() {
        let mut md = MetadataMap::new();
        md.insert(
            "baggage",
            "a=1, sd-routing-key = feat-x ;prop=1,b=2".parse().unwrap(),
        );
        assert_eq!(routing_key(&md), "feat-x");
        assert_eq!(routing_key(&MetadataMap::new()), "");
    }
}
