//! Hand-written schema pieces for what derive attributes cannot say.

use schemars::{Schema, SchemaGenerator, json_schema};

use crate::validation::{LABEL_KEY_MAX, LABEL_KEY_PATTERN};

/// Any JSON value, kept as written. `x-kubernetes-preserve-unknown-fields` without a `type` is
/// the one structural way to say that; used only for patch values, whose shape depends on the
/// patch type (checked in Rust).
pub(crate) fn any_value(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "x-kubernetes-preserve-unknown-fields": true })
}

/// Any JSON object, kept as written: a Kubernetes type embedded whole (a pod template), whose
/// full schema would make the CRD large; the operator checks it by decoding it.
pub(crate) fn any_object(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "type": "object", "x-kubernetes-preserve-unknown-fields": true })
}

/// CEL rule for the keys of a free-form label map (maps have no `propertyNames` in structural
/// schemas, so the key syntax needs CEL).
pub(crate) fn label_keys_rule() -> String {
    format!("self.all(k, size(k) <= {LABEL_KEY_MAX} && k.matches('{LABEL_KEY_PATTERN}'))")
}

/// CEL rule: no baseline appears in two of `forks[].forkOf`, `local[].from` and
/// `virtual[].workload`. The three fields have distinct schema types, which CEL's `==` does not
/// compare, so the references are compared field by field (`namespace` is a CEL reserved word,
/// hence `__namespace__`).
pub(crate) fn disjoint_baselines_rule() -> String {
    let same = |a: &str, b: &str| {
        format!(
            "({a}.kind == {b}.kind && {a}.__namespace__ == {b}.__namespace__ && {a}.name == {b}.name)"
        )
    };
    format!(
        "(!has(self.forks) || self.forks.all(f, \
         (!has(self.local) || !self.local.exists(l, {fl})) && \
         (!has(self.virtual) || !self.virtual.exists(v, {fv})))) && \
         (!has(self.local) || !has(self.virtual) || self.local.all(l, !self.virtual.exists(v, {lv})))",
        fl = same("l.from", "f.forkOf"),
        fv = same("v.workload", "f.forkOf"),
        lv = same("v.workload", "l.from"),
    )
}
