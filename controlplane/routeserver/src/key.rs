//! The identity of a rule and of a route's history: (baseline, routing key).

use spur_routing::BaselineWorkload;

/// The identity of a rule: (baseline, routing key). Ordered by baseline first, so the rules of
/// one baseline form a contiguous range.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RuleKey {
    pub baseline: BaselineWorkload,
    pub routing_key: String,
}
