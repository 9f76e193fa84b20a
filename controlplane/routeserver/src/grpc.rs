//! The Routes API over gRPC (`routes.Routes`), wire-compatible with the public `routesapi`.

use std::pin::Pin;

use futures_util::Stream;
use spur_proto::routes::routes_server::Routes;
use spur_proto::routes::{
    GetClusterServicesRequest, GetClusterServicesResponse, GetWorkloadRoutingRulesResponse,
    WatchOp, WorkloadRoutingRuleOp, WorkloadRoutingRulesRequest,
};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::index::{Filter, Index};
use crate::metrics::Metrics;
use crate::watch::{self, Op};

pub(crate) struct RoutesService {
    pub(crate) index: Index,
    pub(crate) metrics: Metrics,
    pub(crate) buffer: usize,
    pub(crate) stop: CancellationToken,
}

type OpStream = Pin<Box<dyn Stream<Item = Result<WorkloadRoutingRuleOp, Status>> + Send>>;

#[tonic::async_trait]
impl Routes for RoutesService {
    async fn get_workload_routing_rules(
        &self,
        request: Request<WorkloadRoutingRulesRequest>,
    ) -> Result<Response<GetWorkloadRoutingRulesResponse>, Status> {
        let filter = Filter::from_request(request.get_ref());
        let snap = self.index.current();
        let routing_rules = snap.matching(&filter).map(|e| e.proto.clone()).collect();
        Ok(Response::new(GetWorkloadRoutingRulesResponse {
            routing_rules,
        }))
    }

    type WatchWorkloadRoutingRulesStream = OpStream;

    async fn watch_workload_routing_rules(
        &self,
        request: Request<WorkloadRoutingRulesRequest>,
    ) -> Result<Response<OpStream>, Status> {
        let filter = Filter::from_request(request.get_ref());
        let rx = watch::spawn(
            self.index.subscribe(),
            filter,
            self.buffer,
            self.metrics.clone(),
            self.stop.clone(),
        );
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        let ops = futures_util::StreamExt::map(stream, |op| {
            Ok(match op {
                Op::Add(e) => WorkloadRoutingRuleOp {
                    op: WatchOp::Add.into(),
                    route: Some(e.proto.clone()),
                },
                Op::Replace(e) => WorkloadRoutingRuleOp {
                    op: WatchOp::Replace.into(),
                    route: Some(e.proto.clone()),
                },
                Op::Remove(e) => WorkloadRoutingRuleOp {
                    op: WatchOp::Remove.into(),
                    route: Some(e.proto.clone()),
                },
                Op::Synced => WorkloadRoutingRuleOp {
                    op: WatchOp::Synced.into(),
                    route: None,
                },
            })
        });
        Ok(Response::new(Box::pin(ops)))
    }

    async fn get_cluster_services(
        &self,
        _request: Request<GetClusterServicesRequest>,
    ) -> Result<Response<GetClusterServicesResponse>, Status> {
        Ok(Response::new(GetClusterServicesResponse {
            services: self.index.services().as_ref().clone(),
        }))
    }
}
