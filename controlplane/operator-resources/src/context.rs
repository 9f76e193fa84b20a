//! The resource controllers' context: the operator's shared one and where resources' steps run.

use std::sync::Arc;

use spur_operator_core::Context;

use crate::olm::ResourceConfig;

pub struct ResourcesContext {
    pub core: Arc<Context>,
    /// Sandbox resources: where their steps run. `None`: resources are not enabled.
    pub resources: Option<ResourceConfig>,
}

impl std::ops::Deref for ResourcesContext {
    type Target = Context;
    fn deref(&self) -> &Context {
        &self.core
    }
}

impl spur_controller::HasBackoff for ResourcesContext {
    fn backoff(&self) -> &spur_controller::Backoff {
        spur_controller::HasBackoff::backoff(&*self.core)
    }
}
