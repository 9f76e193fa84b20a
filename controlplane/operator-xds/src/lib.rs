//! The operator's Envoy and L4 configuration feature: the EnvoyConfig controller (revisions,
//! publication, rollback; docs/xds.md) with the node-id admission check its webhook calls, and
//! the ListenerSet controller (the L4 gateway's Services and status; docs/l4.md). The route
//! server serves what these publish over xDS.

pub mod envoyconfig;
pub mod listenerset;
