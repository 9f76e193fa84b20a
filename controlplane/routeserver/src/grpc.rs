//! The Routes API over gRPC (`routes.Routes`), wire-compatible with the public `routesapi`.
//! The watch is served through [`crate::wire`], which writes each change's bytes once:
//! [`RoutesService`] serves the watch method through its codec, every other method through the
//! generated server.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::Stream;
use spur_proto::routes::routes_server::{Routes, RoutesServer};
use spur_proto::routes::{
    GetClusterServicesRequest, GetClusterServicesResponse, GetWorkloadRoutingRulesResponse,
    WatchOp, WorkloadRoutingRuleOp, WorkloadRoutingRulesRequest,
};
use tokio_util::sync::CancellationToken;
use tonic::codegen::{BoxFuture, Service, StdError, http};
use tonic::server::NamedService;
use tonic::{Request, Response, Status};

use crate::auth::{Authenticator, Grant, Scope};
use crate::index::{Filter, Index};
use crate::metrics::Metrics;
use crate::watch::{self, Op, Reader};
use crate::wire::{EncodedOp, WatchCodec};

pub(crate) struct RoutesHandler {
    pub(crate) index: Index,
    pub(crate) metrics: Metrics,
    pub(crate) buffer: usize,
    pub(crate) stop: CancellationToken,
    pub(crate) auth: Authenticator,
}

/// A watch stream's ops, ready for [`crate::wire::WatchCodec`].
pub(crate) type EncodedStream = Pin<Box<dyn Stream<Item = Result<EncodedOp, Status>> + Send>>;

/// Checks the `authorization` of a gRPC request for `scope` (counted and logged when refused).
pub(crate) async fn authorize<T>(
    auth: &Authenticator,
    metrics: &Metrics,
    request: &Request<T>,
    scope: Scope<'_>,
) -> Result<Grant, Status> {
    let header = request
        .metadata()
        .get("authorization")
        .map(|v| v.as_bytes());
    auth.check(header, scope).await.map_err(|d| {
        metrics.refused();
        let peer = request
            .extensions()
            .get::<spur_serving::tls::Peer>()
            .and_then(|p| p.remote);
        tracing::debug!(?peer, reason = %d, "gRPC request refused");
        Status::from(d)
    })
}

impl RoutesHandler {
    async fn authorize<T>(&self, request: &Request<T>, scope: Scope<'_>) -> Result<Grant, Status> {
        authorize(&self.auth, &self.metrics, request, scope).await
    }

    /// `WatchWorkloadRoutingRules`: the rules' bytes as the index encoded them.
    pub(crate) async fn watch(
        &self,
        request: Request<WorkloadRoutingRulesRequest>,
    ) -> Result<Response<EncodedStream>, Status> {
        let filter = Filter::from_request(request.get_ref());
        let grant = self.authorize(&request, Scope::Rules(&filter)).await?;
        let ops = watch::Watch::new(
            self.index.subscribe(),
            filter.clone(),
            self.buffer,
            self.metrics.clone(),
            self.stop.clone(),
        );
        let reader = Reader {
            auth: self.auth.clone(),
            authorization: request
                .metadata()
                .get("authorization")
                .map(|v| v.as_bytes().to_vec()),
            filter,
            grant,
            metrics: self.metrics.clone(),
        };
        let ops = futures_util::StreamExt::map(watch::guarded(ops, reader), |op| {
            Ok(match op.map_err(Status::from)? {
                Op::Add(e) => EncodedOp::new(WatchOp::Add, Some(e.wire.clone())),
                Op::Replace(e) => EncodedOp::new(WatchOp::Replace, Some(e.wire.clone())),
                Op::Remove(e) => EncodedOp::new(WatchOp::Remove, Some(e.wire.clone())),
                Op::Synced => EncodedOp::new(WatchOp::Synced, None),
            })
        });
        Ok(Response::new(Box::pin(ops)))
    }
}

#[tonic::async_trait]
impl Routes for RoutesHandler {
    async fn get_workload_routing_rules(
        &self,
        request: Request<WorkloadRoutingRulesRequest>,
    ) -> Result<Response<GetWorkloadRoutingRulesResponse>, Status> {
        let filter = Filter::from_request(request.get_ref());
        self.authorize(&request, Scope::Rules(&filter)).await?;
        let snap = self.index.current();
        let routing_rules = snap.matching(&filter).map(|e| e.proto.clone()).collect();
        Ok(Response::new(GetWorkloadRoutingRulesResponse {
            routing_rules,
        }))
    }

    type WatchWorkloadRoutingRulesStream =
        futures_util::stream::Empty<Result<WorkloadRoutingRuleOp, Status>>;

    /// Never reached: [`RoutesService`] serves this path with [`Self::watch`].
    async fn watch_workload_routing_rules(
        &self,
        _request: Request<WorkloadRoutingRulesRequest>,
    ) -> Result<Response<Self::WatchWorkloadRoutingRulesStream>, Status> {
        Err(Status::internal(
            "the watch is served by the pre-encoded path; reaching this is a bug",
        ))
    }

    async fn get_cluster_services(
        &self,
        request: Request<GetClusterServicesRequest>,
    ) -> Result<Response<GetClusterServicesResponse>, Status> {
        self.authorize(&request, Scope::ClusterServices).await?;
        Ok(Response::new(GetClusterServicesResponse {
            services: self.index.services().as_ref().clone(),
        }))
    }
}

/// The watch method's path.
const WATCH_PATH: &str = "/routes.Routes/WatchWorkloadRoutingRules";

/// `routes.Routes`: the watch through [`WatchCodec`], the rest through the generated server.
#[derive(Clone)]
pub(crate) struct RoutesService {
    handler: Arc<RoutesHandler>,
    generated: RoutesServer<RoutesHandler>,
}

impl RoutesService {
    pub(crate) fn new(handler: RoutesHandler) -> Self {
        let handler = Arc::new(handler);
        RoutesService {
            generated: RoutesServer::from_arc(handler.clone()),
            handler,
        }
    }
}

impl NamedService for RoutesService {
    const NAME: &'static str = <RoutesServer<RoutesHandler> as NamedService>::NAME;
}

/// The watch method as tonic's server-streaming service.
struct WatchMethod(Arc<RoutesHandler>);

impl tonic::server::ServerStreamingService<WorkloadRoutingRulesRequest> for WatchMethod {
    type Response = EncodedOp;
    type ResponseStream = EncodedStream;
    type Future = BoxFuture<tonic::Response<Self::ResponseStream>, Status>;

    fn call(&mut self, request: tonic::Request<WorkloadRoutingRulesRequest>) -> Self::Future {
        let handler = self.0.clone();
        Box::pin(async move { handler.watch(request).await })
    }
}

impl<B> Service<http::Request<B>> for RoutesService
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() == WATCH_PATH {
            let method = WatchMethod(self.handler.clone());
            Box::pin(async move {
                let mut grpc = tonic::server::Grpc::new(WatchCodec);
                Ok(grpc.server_streaming(method, req).await)
            })
        } else {
            self.generated.call(req)
        }
    }
}
