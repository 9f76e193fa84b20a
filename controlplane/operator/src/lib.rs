//! Spur's Kubernetes controllers: Sandbox, ForkedWorkload, RouteGroup and RoutingConfig, each
//! thin and idempotent, writing with server-side apply under one field manager.

pub mod patch;
