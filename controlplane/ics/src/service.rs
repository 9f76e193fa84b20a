//! The gRPC handlers: who the pod is, which unit it is, and what that unit may read and write.

use std::collections::{BTreeMap, HashSet};

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use spur_api::ObjectLifecycleMethods;
use spur_api::names::io_context_secret_name;
use spur_api::resources::{OUTPUT_VALUE_MAX, UnitPhase, WorkUnit, Workflow, io_key};
use spur_proto::io::io_context_server::IoContext;
use spur_proto::io::{Inputs, Outputs, PutOutputsResponse, UnitRef, Value};
use tonic::{Request, Response, Status};

use crate::auth::{Authenticator, PodIdentity};
use crate::metrics::Metrics;

/// Most bytes one unit may store in one call: a resource's values share one Secret (1 MiB).
const OUTPUTS_MAX: usize = 512 * 1024;

pub(crate) struct Handler {
    pub(crate) auth: Authenticator,
    pub(crate) client: Client,
    /// Where the io context Secrets are.
    pub(crate) namespace: String,
    pub(crate) metrics: Metrics,
}

/// The unit a verified pod is, with its OLM's io context.
struct Unit {
    context: String,
    spec: WorkUnit,
    phase: UnitPhase,
}

#[tonic::async_trait]
impl IoContext for Handler {
    async fn get_inputs(&self, req: Request<UnitRef>) -> Result<Response<Inputs>, Status> {
        let out = self.inputs(req).await;
        self.metrics.call("GetInputs", code(&out));
        out.map(Response::new)
    }

    async fn put_outputs(
        &self,
        req: Request<Outputs>,
    ) -> Result<Response<PutOutputsResponse>, Status> {
        let out = self.outputs(req).await;
        self.metrics.call("PutOutputs", code(&out));
        out.map(Response::new)
    }
}

fn code<T>(r: &Result<T, Status>) -> tonic::Code {
    match r {
        Ok(_) => tonic::Code::Ok,
        Err(s) => s.code(),
    }
}

impl Handler {
    async fn inputs(&self, req: Request<UnitRef>) -> Result<Inputs, Status> {
        let pod = self.auth.pod(&req).await?;
        let r = req.into_inner();
        let unit = self.unit(&pod, &r).await?;
        // Only while the unit runs: a finished pod (failed ones are kept for their logs) has
        // no more use for its inputs.
        if unit.phase != UnitPhase::Running {
            return Err(Status::failed_precondition(
                "the unit is not running: its inputs are no longer served",
            ));
        }
        let mut inputs = Vec::with_capacity(unit.spec.inputs.len());
        let mut secret: Option<BTreeMap<String, ByteString>> = None;
        for input in &unit.spec.inputs {
            let value = match (&input.value, &input.iocontext) {
                (Some(v), _) => v.clone().into_bytes(),
                (None, Some(c)) => {
                    // Defence in depth: validation already refuses another context.
                    if c.name != unit.context {
                        return Err(Status::permission_denied(format!(
                            "input {}: io context {} is not this unit's",
                            input.name, c.name
                        )));
                    }
                    if secret.is_none() {
                        secret = Some(self.context_data(&unit.context).await?);
                    }
                    let data = secret.as_ref().map(|d| d.get(&c.key));
                    match data.flatten() {
                        Some(v) => v.0.clone(),
                        None => {
                            return Err(Status::failed_precondition(format!(
                                "input {}: output {} was never written (did that step declare and export it?)",
                                input.name, c.key
                            )));
                        }
                    }
                }
                (None, None) => {
                    return Err(Status::internal(format!(
                        "input {} has no source",
                        input.name
                    )));
                }
            };
            inputs.push(Value {
                name: input.name.clone(),
                value,
            });
        }
        tracing::info!(olm = %r.olm, workflow = %r.workflow, unit = %r.unit, pod = %pod.name, inputs = inputs.len(), "inputs served");
        Ok(Inputs { inputs })
    }

    async fn outputs(&self, req: Request<Outputs>) -> Result<PutOutputsResponse, Status> {
        let pod = self.auth.pod(&req).await?;
        let o = req.into_inner();
        let r = o
            .unit
            .ok_or_else(|| Status::invalid_argument("unit is required"))?;
        let unit = self.unit(&pod, &r).await?;
        if matches!(
            unit.phase,
            UnitPhase::Succeeded | UnitPhase::Failed | UnitPhase::Skipped
        ) {
            return Err(Status::failed_precondition(
                "the unit has finished: its outputs can no longer change",
            ));
        }
        let declared: HashSet<&str> = unit.spec.outputs.iter().map(|x| x.name.as_str()).collect();
        let mut seen = HashSet::new();
        let mut data = serde_json::Map::new();
        let mut bytes = 0u64;
        for v in &o.outputs {
            if !declared.contains(v.name.as_str()) {
                return Err(Status::invalid_argument(format!(
                    "{}: not a declared output of unit {} (nothing stored)",
                    v.name, r.unit
                )));
            }
            if !seen.insert(v.name.as_str()) {
                return Err(Status::invalid_argument(format!(
                    "{}: sent twice (nothing stored)",
                    v.name
                )));
            }
            if v.value.len() > OUTPUT_VALUE_MAX {
                return Err(Status::invalid_argument(format!(
                    "{}: {} bytes, the limit is {OUTPUT_VALUE_MAX} (nothing stored)",
                    v.name,
                    v.value.len()
                )));
            }
            bytes += v.value.len() as u64;
            if bytes > OUTPUTS_MAX as u64 {
                return Err(Status::invalid_argument(format!(
                    "the outputs total more than {OUTPUTS_MAX} bytes (nothing stored)"
                )));
            }
            data.insert(
                io_key(&r.unit, &v.name),
                serde_json::to_value(ByteString(v.value.clone()))
                    .map_err(|e| Status::internal(e.to_string()))?,
            );
        }
        if !data.is_empty() {
            let api: Api<Secret> = Api::namespaced(self.client.clone(), &self.namespace);
            let name = io_context_secret_name(&unit.context);
            api.patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({ "data": data })),
            )
            .await
            .map_err(|e| match e {
                kube::Error::Api(ae) if ae.code == 404 => Status::failed_precondition(format!(
                    "io context {} is gone (its resource was deleted)",
                    unit.context
                )),
                // Refused for good (the Secret would grow past its limit, say): retrying
                // would not help.
                kube::Error::Api(ae) if (400..500).contains(&ae.code) && ae.code != 429 => {
                    Status::failed_precondition(format!(
                        "the API server refused the outputs: {}",
                        ae.message
                    ))
                }
                e => {
                    tracing::warn!(error = %e, "cannot store outputs");
                    Status::unavailable("cannot store the outputs now; retry")
                }
            })?;
        }
        self.metrics.output_bytes.inc_by(bytes);
        let stored: Vec<String> = o.outputs.iter().map(|v| v.name.clone()).collect();
        // Names, exit code and message only: values never reach a log.
        tracing::info!(olm = %r.olm, workflow = %r.workflow, unit = %r.unit, pod = %pod.name, stored = ?stored, exit_code = o.exit_code, message = %o.message, "outputs stored");
        Ok(PutOutputsResponse { stored })
    }

    /// The unit `r` names, if `pod` is the pod its OLM's status records for it.
    async fn unit(&self, pod: &PodIdentity, r: &UnitRef) -> Result<Unit, Status> {
        let workflow = Workflow::parse(&r.workflow)
            .ok_or_else(|| Status::invalid_argument("workflow must be preStart or postStop"))?;
        let denied = || {
            Status::permission_denied(format!(
                "pod {}/{} is not the pod of unit {}/{}/{}",
                pod.namespace, pod.name, r.olm, r.workflow, r.unit
            ))
        };
        let api: Api<ObjectLifecycleMethods> = Api::all(self.client.clone());
        let olm = api.get_opt(&r.olm).await.map_err(|e| {
            tracing::warn!(error = %e, "cannot read the ObjectLifecycleMethods");
            Status::unavailable("cannot read the workflow now; retry")
        })?;
        // Whether the OLM exists is not told to a pod that is not its own.
        let olm = olm.ok_or_else(denied)?;
        let spec = olm
            .spec
            .unit(workflow, &r.unit)
            .cloned()
            .ok_or_else(denied)?;
        let status = olm.status.unwrap_or_default();
        let unit_status = status
            .units(workflow)
            .iter()
            .find(|u| u.name == r.unit)
            .ok_or_else(denied)?;
        let recorded = unit_status.exec_unit.as_ref().ok_or_else(denied)?;
        if recorded.namespace != pod.namespace || recorded.name != pod.name {
            return Err(denied());
        }
        if recorded.uid.is_empty() {
            return Err(Status::unavailable(
                "the operator has not recorded this pod yet; retry",
            ));
        }
        if recorded.uid != pod.uid {
            return Err(denied());
        }
        Ok(Unit {
            context: olm.spec.io_context_name.clone(),
            spec,
            phase: unit_status.phase,
        })
    }

    async fn context_data(&self, context: &str) -> Result<BTreeMap<String, ByteString>, Status> {
        let api: Api<Secret> = Api::namespaced(self.client.clone(), &self.namespace);
        match api.get_opt(&io_context_secret_name(context)).await {
            Ok(Some(s)) => Ok(s.data.unwrap_or_default()),
            Ok(None) => Err(Status::failed_precondition(format!(
                "io context {context} is gone (its resource was deleted)"
            ))),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the io context");
                Err(Status::unavailable("cannot read the io context now; retry"))
            }
        }
    }
}
