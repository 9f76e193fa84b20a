//! Envoy v3 resources as users write them (an `EnvoyConfig`'s `spec.resources[].value`, proto3
//! JSON or YAML) decoded into their typed messages and encoded as protobuf, with errors that name
//! the field path.
//!
//! The message types come from the descriptor set of the `envoy-types` crate
//! (`src/descriptors.bin`, see this crate's README): every message Spur's xDS types are
//! generated from, extensions included, so an `Any` (`typed_config`, `typed_per_filter_config`,
//! ...) is decoded into the message its `@type` names, and an unknown field or a wrong type
//! deep inside one is refused like one at the top.
//!
//! What is checked is the proto3 JSON mapping: field names, types, enum values, `Any` type URLs,
//! well-known types (durations, wrappers, `Struct`); and one rule of Spur's: no data source may
//! read a file or an environment variable of the client's own pod ([`local_sources`]). Envoy's
//! own constraints (the PGV `validate.rules` annotations: required fields, ranges, lengths) and
//! semantic checks (a route pointing at an unknown cluster, a listener whose address changes)
//! are **not** checked here: the clients reject those, and a revision every client rejects is
//! rolled back (docs/xds.md).
//!
//! Bounds: a resource is at most [`RESOURCE_MAX`] bytes of text; JSON and YAML nest at most 128
//! levels (their parsers' limits); YAML has at most [`YAML_FLOW_MAX`] flow collections and its
//! aliases expand to at most [`EXPANDED_MAX`] bytes; the
//! encoded message must decode again within prost's recursion limit (100 nested messages), as
//! the clients' protobuf libraries impose one too.

use std::borrow::Cow;
use std::cell::Cell;
use std::collections::BTreeSet;
use std::fmt;
use std::sync::OnceLock;

use base64::Engine as _;
use prost::Message as _;
use prost::encoding::{WireType, encode_key, encode_varint};
use prost_reflect::{
    DescriptorPool, DeserializeOptions, DynamicMessage, FieldDescriptor, Kind, MessageDescriptor,
    ReflectMessage as _, Value,
};
use serde::de::{DeserializeSeed, MapAccess, SeqAccess, Visitor};
use spur_api::envoyconfig::{
    EncodedResource, EnvoyConfigSpec, EnvoyResourceType, MAX_RESOURCES, NODE_ID_MAX, RESOURCE_MAX,
    Serialization,
};

/// Errors of the decoder itself (a resource that does not decode is a [`DecodeError`]).
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The Envoy descriptor set did not load (a build fault: every EnvoyConfig waits).
    #[error("Envoy descriptors: {0}")]
    Descriptors(String),
}

#[cfg(test)]
mod tests;

pub mod descriptors;
mod local_sources;

/// Most bytes (scalars and keys) a YAML resource may expand to through aliases: a few anchors
/// are fine, a "billion laughs" is not.
pub const EXPANDED_MAX: usize = 4 * RESOURCE_MAX;

/// Most `[` and `{` in a YAML resource (in strings too: counting is all a bound needs). The
/// YAML scanner's time grows with the square of its flow nesting, which it reaches before any
/// depth limit applies: 16 000 nested `{a: ` take 3 s of CPU, 4 000 take 0.2 s. Block style
/// needs none; a resource in flow style is JSON, and `serialization: json` has no such limit.
pub const YAML_FLOW_MAX: usize = 4096;

const ANY: &str = "google.protobuf.Any";

/// One resource, decoded and encoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded {
    /// The message's `name` (`cluster_name` for a `ClusterLoadAssignment`).
    pub name: String,
    /// Its protobuf encoding, as served. Deterministic: map entries are written in key order
    /// (at every level, `Any` payloads included), so the same resource always gives the same
    /// bytes and revision versions can be hashed from them.
    pub bytes: Vec<u8>,
}

/// Why `spec.resources[index]` was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct DecodeError {
    pub index: usize,
    /// The resource's field at fault: `value` but for a secret's own fields.
    pub field: &'static str,
    /// Where in the resource, as written (`filter_chains[0].filters[0].typed_config.foo`);
    /// empty when the resource as a whole is wrong (syntax, length, name).
    pub path: String,
    pub message: String,
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "spec.resources[{}].{}: ", self.index, self.field)?;
        if !self.path.is_empty() {
            write!(f, "{}: ", self.path)?;
        }
        f.write_str(&self.message)
    }
}

/// The descriptor pool and the four resource messages.
#[derive(Debug)]
pub struct Decoder {
    pool: DescriptorPool,
    /// In the order of [`EnvoyResourceType::ALL`].
    messages: Vec<MessageDescriptor>,
    any: MessageDescriptor,
}

/// The decoder, built on first use (about 10 MiB of descriptors: not paid by an operator that
/// never sees an EnvoyConfig).
pub fn decoder() -> Result<&'static Decoder, Error> {
    static DECODER: OnceLock<Result<Decoder, String>> = OnceLock::new();
    DECODER
        .get_or_init(|| Decoder::new(descriptors::DESCRIPTORS))
        .as_ref()
        .map_err(|e| Error::Descriptors(e.clone()))
}

impl Decoder {
    /// A decoder over the descriptor set `bytes` (a `google.protobuf.FileDescriptorSet`).
    pub fn new(bytes: &[u8]) -> Result<Decoder, String> {
        let pool = DescriptorPool::decode(bytes)
            .map_err(|e| format!("the Envoy descriptor set does not load: {e}"))?;
        let get = |name: &str| {
            pool.get_message_by_name(name)
                .ok_or_else(|| format!("the Envoy descriptor set has no message {name}"))
        };
        let messages = EnvoyResourceType::ALL
            .iter()
            .map(|t| get(t.message_name()))
            .collect::<Result<Vec<_>, _>>()?;
        let any = get(ANY)?;
        Ok(Decoder {
            pool,
            messages,
            any,
        })
    }

    /// The pool, for callers that decode what this encoded.
    pub fn pool(&self) -> &DescriptorPool {
        &self.pool
    }

    fn message(&self, ty: EnvoyResourceType) -> &MessageDescriptor {
        let i = EnvoyResourceType::ALL
            .iter()
            .position(|t| *t == ty)
            .unwrap_or_default();
        &self.messages[i]
    }

    /// Decodes one resource of type `ty` written in `ser`. The error is the field path (empty
    /// for the resource as a whole) and what is wrong there.
    pub fn decode(
        &self,
        ty: EnvoyResourceType,
        ser: Serialization,
        text: &str,
    ) -> Result<Decoded, (String, String)> {
        let whole = |m: String| (String::new(), m);
        if text.len() > RESOURCE_MAX {
            return Err(whole(format!(
                "{} bytes, more than the {RESOURCE_MAX} a resource may have",
                text.len()
            )));
        }
        let value = parse(ser, text).map_err(whole)?;
        if !value.is_object() {
            return Err(whole(format!(
                "expected an object ({}), not {}",
                ty.message_name(),
                kind_of(&value)
            )));
        }
        let desc = self.message(ty).clone();
        let mut track = serde_path_to_error::Track::new();
        let msg = DynamicMessage::deserialize_with_options(
            desc.clone(),
            serde_path_to_error::Deserializer::new(&value, &mut track),
            &DeserializeOptions::new(),
        )
        .map_err(|e| error_at(&track.path(), e.to_string()))?;
        drop(value);
        local_sources::find(&self.pool, &msg)?;
        let name_field = match ty {
            EnvoyResourceType::Endpoint => "cluster_name",
            _ => "name",
        };
        let name = msg
            .get_field_by_name(name_field)
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        let mut bytes = Vec::with_capacity(msg.encoded_len());
        self.encode(&msg, &mut bytes).map_err(whole)?;
        // What the clients do first: a message nested deeper than protobuf libraries decode
        // (prost and Envoy's C++ both stop at 100) is refused here rather than NACKed.
        DynamicMessage::decode(desc, bytes.as_slice())
            .map_err(|e| whole(format!("does not decode as protobuf again: {e}")))?;
        Ok(Decoded { name, bytes })
    }

    /// Refuses an encoded resource of type `ty` (as a revision stores it) that has a data
    /// source reading the client's own pod (`filename`, `environment_variable`), or that does
    /// not decode: the field path and what is wrong there. The route server's second look at
    /// what it serves ([`local_sources`]).
    pub fn check_encoded(
        &self,
        ty: EnvoyResourceType,
        bytes: &[u8],
    ) -> Result<(), (String, String)> {
        let msg = DynamicMessage::decode(self.message(ty).clone(), bytes).map_err(|e| {
            (
                String::new(),
                format!("does not decode as a {}: {e}", ty.message_name()),
            )
        })?;
        local_sources::find(&self.pool, &msg)
    }

    /// Every resource of `spec`, in order. Also refuses more than [`MAX_RESOURCES`], a resource
    /// without a name (or one longer than [`NODE_ID_MAX`]) and two resources of one type with
    /// the same name.
    pub fn decode_all(&self, spec: &EnvoyConfigSpec) -> Result<Vec<EncodedResource>, DecodeError> {
        if spec.resources.len() > MAX_RESOURCES {
            return Err(DecodeError {
                index: MAX_RESOURCES,
                field: "value",
                path: String::new(),
                message: format!("more than {MAX_RESOURCES} resources"),
            });
        }
        let mut seen = BTreeSet::new();
        let mut out = Vec::with_capacity(spec.resources.len());
        for (index, r) in spec.resources.iter().enumerate() {
            let fail = |path: String, message: String| DecodeError {
                index,
                field: "value",
                path,
                message,
            };
            if r.type_ == EnvoyResourceType::Secret {
                let secret = secret_ref(index, r)?;
                if !seen.insert((r.type_, secret.clone())) {
                    return Err(DecodeError {
                        index,
                        field: "generateFromTlsSecret",
                        path: String::new(),
                        message: format!(
                            "a second secret generated from Secret {secret:?}: names are unique per type"
                        ),
                    });
                }
                out.push(EncodedResource {
                    type_: r.type_,
                    name: secret.clone(),
                    value: String::new(),
                    generate_from_tls_secret: Some(secret),
                    blueprint: Some(r.blueprint.unwrap_or_default()),
                });
                continue;
            }
            for (field, set) in [
                (
                    "generateFromTlsSecret",
                    r.generate_from_tls_secret.is_some(),
                ),
                ("blueprint", r.blueprint.is_some()),
            ] {
                if set {
                    return Err(DecodeError {
                        index,
                        field,
                        path: String::new(),
                        message: format!("only a resource of type secret has {field}"),
                    });
                }
            }
            if r.value.is_empty() {
                return Err(fail(
                    String::new(),
                    format!(
                        "a resource of type {} needs a value",
                        r.type_.message_name()
                    ),
                ));
            }
            let d = self
                .decode(r.type_, spec.serialization, &r.value)
                .map_err(|(p, m)| fail(p, m))?;
            let name_field = match r.type_ {
                EnvoyResourceType::Endpoint => "cluster_name",
                _ => "name",
            };
            if d.name.is_empty() {
                return Err(fail(
                    name_field.into(),
                    format!("a {} needs a name", r.type_.message_name()),
                ));
            }
            if d.name.len() > NODE_ID_MAX {
                return Err(fail(
                    name_field.into(),
                    format!("longer than {NODE_ID_MAX} bytes"),
                ));
            }
            if !seen.insert((r.type_, d.name.clone())) {
                return Err(fail(
                    name_field.into(),
                    format!(
                        "a second {} named {:?}: names are unique per type",
                        r.type_.message_name(),
                        d.name
                    ),
                ));
            }
            out.push(EncodedResource {
                type_: r.type_,
                name: d.name,
                value: base64::engine::general_purpose::STANDARD.encode(&d.bytes),
                generate_from_tls_secret: None,
                blueprint: None,
            });
        }
        Ok(out)
    }

    // === deterministic encoding ===
    //
    // prost-reflect keeps map fields in a `HashMap` and writes them in its iteration order,
    // which differs from one decode to the next. Here the fields without messages are written
    // by prost-reflect (deterministic), then every message field, with map entries sorted by
    // key and `Any` payloads re-encoded the same way.

    fn encode(&self, msg: &DynamicMessage, out: &mut Vec<u8>) -> Result<(), String> {
        if msg.descriptor().full_name() == ANY {
            return self.encode_any(msg, out);
        }
        let mut plain = DynamicMessage::new(msg.descriptor());
        let mut nested: Vec<(FieldDescriptor, &Value)> = Vec::new();
        for (field, value) in msg.fields() {
            if field.is_map() || matches!(field.kind(), Kind::Message(_)) {
                nested.push((field, value));
            } else {
                plain.set_field(&field, value.clone());
            }
        }
        if msg.extensions().next().is_some() {
            return Err("extension fields are not supported".into());
        }
        plain.encode_raw(out);
        for (field, value) in nested {
            match value {
                Value::Map(map) => self.encode_map(&field, map, out)?,
                Value::List(items) => {
                    for item in items {
                        self.encode_field_message(field.number(), item, out)?;
                    }
                }
                other => self.encode_field_message(field.number(), other, out)?,
            }
        }
        Ok(())
    }

    fn encode_field_message(
        &self,
        number: u32,
        v: &Value,
        out: &mut Vec<u8>,
    ) -> Result<(), String> {
        let m = v
            .as_message()
            .ok_or_else(|| format!("field {number}: expected a message"))?;
        let mut body = Vec::new();
        self.encode(m, &mut body)?;
        length_delimited(number, &body, out);
        Ok(())
    }

    fn encode_map(
        &self,
        field: &FieldDescriptor,
        map: &std::collections::HashMap<prost_reflect::MapKey, Value>,
        out: &mut Vec<u8>,
    ) -> Result<(), String> {
        let Kind::Message(entry) = field.kind() else {
            return Err(format!("map field {} without an entry type", field.name()));
        };
        let (key_field, value_field) = (entry.map_entry_key_field(), entry.map_entry_value_field());
        let value_is_message = matches!(value_field.kind(), Kind::Message(_));
        let mut entries: Vec<_> = map.iter().collect();
        entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
        for (k, v) in entries {
            let mut e = DynamicMessage::new(entry.clone());
            e.set_field(&key_field, Value::from(k.clone()));
            let mut body = Vec::new();
            if value_is_message {
                e.encode_raw(&mut body);
                self.encode_field_message(value_field.number(), v, &mut body)?;
            } else {
                e.set_field(&value_field, v.clone());
                e.encode_raw(&mut body);
            }
            length_delimited(field.number(), &body, out);
        }
        Ok(())
    }

    fn encode_any(&self, any: &DynamicMessage, out: &mut Vec<u8>) -> Result<(), String> {
        let type_url = any
            .get_field_by_number(1)
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        let payload = any
            .get_field_by_number(2)
            .and_then(|v| v.as_bytes().cloned())
            .unwrap_or_default();
        let name = type_url.rsplit('/').next().unwrap_or_default();
        let desc = self
            .pool
            .get_message_by_name(name)
            .ok_or_else(|| format!("{type_url:?} names no known message"))?;
        let inner = DynamicMessage::decode(desc, payload)
            .map_err(|e| format!("the payload of a {type_url} does not decode: {e}"))?;
        let mut body = Vec::new();
        self.encode(&inner, &mut body)?;
        let mut plain = DynamicMessage::new(self.any.clone());
        plain.set_field_by_number(1, Value::String(type_url));
        plain.set_field_by_number(2, Value::Bytes(body.into()));
        plain.encode_raw(out);
        Ok(())
    }
}

/// The path and message of a decoding error. An unknown field fails on its key, before
/// `serde_path_to_error` records it: the path then ends at the object, and the field is added
/// from prost-reflect's message so that the path names what to fix.
fn error_at(path: &serde_path_to_error::Path, message: String) -> (String, String) {
    let mut path = path.to_string();
    if path == "." {
        path.clear();
    }
    let unknown_field = message
        .strip_prefix("unrecognized field name '")
        .and_then(|f| f.strip_suffix('\''));
    // An `Any` whose `@type` names no message fails likewise, after its key.
    let unknown_type = message.starts_with("message '") && message.ends_with("' not found");
    if let Some(field) = unknown_field.or(unknown_type.then_some("@type")) {
        if !path.is_empty() {
            path.push('.');
        }
        path.push_str(field);
    }
    if unknown_type {
        return (path, format!("{message} in Envoy's v3 API"));
    }
    (path, message)
}

fn length_delimited(number: u32, body: &[u8], out: &mut Vec<u8>) {
    encode_key(number, WireType::LengthDelimited, out);
    encode_varint(body.len() as u64, out);
    out.extend_from_slice(body);
}

/// The text as a JSON value. Objects are `BTreeMap`s (serde_json without `preserve_order`), so
/// `@type` (which sorts before any field name) comes first in an `Any`: prost-reflect then
/// decodes the payload's fields through the tracked deserializer, paths included, instead of
/// buffering them untracked.
///
/// Both go through [`Budgeted`], which also refuses a key given twice (serde_json's own `Value`
/// keeps the last silently).
fn parse(ser: Serialization, text: &str) -> Result<serde_json::Value, String> {
    let budget = Cell::new(EXPANDED_MAX);
    match ser {
        Serialization::Json => {
            let mut de = serde_json::Deserializer::from_str(text);
            let v = Budgeted(&budget)
                .deserialize(&mut de)
                .map_err(|e| e.to_string())?;
            de.end().map_err(|e| e.to_string())?;
            Ok(v)
        }
        Serialization::Yaml => {
            let flows = text.bytes().filter(|b| matches!(b, b'[' | b'{')).count();
            if flows > YAML_FLOW_MAX {
                return Err(format!(
                    "more than {YAML_FLOW_MAX} '[' and '{{' in YAML: write it in block style, or as JSON (spec.serialization: json)"
                ));
            }
            Budgeted(&budget)
                .deserialize(serde_yaml_ng::Deserializer::from_str(text))
                .map_err(|e| e.to_string())
        }
    }
}

fn kind_of(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "a list",
        serde_json::Value::Object(_) => "an object",
    }
}

/// A JSON value from JSON or YAML, charging every scalar, key and node to a shared budget: YAML
/// aliases can make a small text expand without limit.
struct Budgeted<'a>(&'a Cell<usize>);

impl Budgeted<'_> {
    fn charge<E: serde::de::Error>(&self, n: usize) -> Result<(), E> {
        let left = self.0.get().checked_sub(n.max(1)).ok_or_else(|| {
            E::custom(format!(
                "expands to more than {EXPANDED_MAX} bytes (YAML aliases?)"
            ))
        })?;
        self.0.set(left);
        Ok(())
    }
}

impl<'de> DeserializeSeed<'de> for Budgeted<'_> {
    type Value = serde_json::Value;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Budgeted<'_> {
    type Value = serde_json::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON-compatible YAML value")
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Self::Value, E> {
        self.charge(1)?;
        Ok(v.into())
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
        self.charge(8)?;
        Ok(v.into())
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
        self.charge(8)?;
        Ok(v.into())
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Self::Value, E> {
        self.charge(8)?;
        serde_json::Number::from_f64(v)
            .map(serde_json::Value::Number)
            .ok_or_else(|| E::custom(format!("{v} is not a JSON number")))
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
        self.charge(v.len())?;
        Ok(v.into())
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        self.charge(1)?;
        Ok(serde_json::Value::Null)
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        self.visit_unit()
    }

    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        self.charge(1)?;
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(Budgeted(self.0))? {
            out.push(v);
        }
        Ok(serde_json::Value::Array(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        self.charge(1)?;
        let mut out = serde_json::Map::new();
        while let Some(k) = map.next_key::<Cow<'de, str>>()? {
            self.charge(k.len())?;
            let v = map.next_value_seed(Budgeted(self.0))?;
            if out.insert(k.to_string(), v).is_some() {
                return Err(serde::de::Error::custom(format!("duplicate key {k:?}")));
            }
        }
        Ok(serde_json::Value::Object(out))
    }
}

/// The Secret a `type: secret` resource is generated from, checked: a private key written into
/// an EnvoyConfig would be readable by everyone who may read EnvoyConfigs, so there is no inline
/// form.
fn secret_ref(
    index: usize,
    r: &spur_api::envoyconfig::EnvoyResource,
) -> Result<String, DecodeError> {
    let fail = |field: &'static str, message: String| DecodeError {
        index,
        field,
        path: String::new(),
        message,
    };
    if !r.value.is_empty() {
        return Err(fail(
            "value",
            "a secret is not written inline: name a kubernetes.io/tls Secret in generateFromTlsSecret (labelled spur.dev/envoy-secret=true) and it is served over SDS".into(),
        ));
    }
    let Some(name) = &r.generate_from_tls_secret else {
        return Err(fail(
            "generateFromTlsSecret",
            "a resource of type secret names the kubernetes.io/tls Secret it is generated from"
                .into(),
        ));
    };
    if !spur_api::validation::is_dns_subdomain(name) {
        return Err(fail(
            "generateFromTlsSecret",
            format!(
                "{name:?} is not a Secret name (a DNS subdomain: lowercase letters, digits, '-' and '.', at most 253)"
            ),
        ));
    }
    Ok(name.clone())
}
