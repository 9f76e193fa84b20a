//! Schema pieces derive attributes cannot say (the `SmartTest` resource embeds these types).

use schemars::{Schema, SchemaGenerator, json_schema};

/// Any JSON value, kept as written: `x-kubernetes-preserve-unknown-fields` without a `type` is
/// the one structural way to say that (a JSON body, a value a check compares with).
pub(crate) fn any_value(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "x-kubernetes-preserve-unknown-fields": true })
}
