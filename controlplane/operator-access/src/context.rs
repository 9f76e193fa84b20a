//! The access controllers' context: the operator's shared one and where tunnel grants write.

use std::sync::Arc;

use spur_operator_core::Context;

pub struct AccessContext {
    pub core: Arc<Context>,
    /// The tunnel proxy's namespace, where workstation owner records live (a tunnel grant
    /// claims its workstation for its requester there).
    pub tunnel_namespace: String,
    /// The tunnel proxy's token namespace, where tunnel grants write their token Secrets
    /// (rights: the chart's `operator-access-token-rules.yaml` there). `None`: tunnel grants
    /// are refused.
    pub access_tokens: Option<String>,
}

spur_operator_core::feature_context!(AccessContext);
