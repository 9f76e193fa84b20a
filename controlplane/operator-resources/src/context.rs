//! The resource controllers' context: the operator's shared one and where resources' steps run.

use std::sync::Arc;

use spur_operator_core::Context;

use crate::olm::ResourceConfig;

pub struct ResourcesContext {
    pub core: Arc<Context>,
    /// Sandbox resources: where their steps run. `None`: resources are not enabled.
    pub resources: Option<ResourceConfig>,
}

spur_operator_core::feature_context!(ResourcesContext);
