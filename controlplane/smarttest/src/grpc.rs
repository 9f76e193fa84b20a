//! gRPC steps: a call's request made ready (its method, metadata and message, from base64 or
//! from JSON with the method's types, of a descriptor set or learned by reflection), and the
//! framing of gRPC messages on the wire, which the runner and reflection share.

use base64::Engine as _;
use http::{HeaderValue, Method};
use serde_json::Value;

use crate::spec::{
    GrpcRequest, MAX_BODY, MAX_DESCRIPTOR_SET_BASE64, MAX_STREAM_MESSAGES, PreparedRequest,
    Reflect, headers,
};

impl GrpcRequest {
    pub(crate) fn prepare(&self) -> Result<PreparedRequest, String> {
        let authority: http::uri::Authority = self
            .target
            .parse()
            .map_err(|e| format!("grpc.target {:?}: {e}", self.target))?;
        let port = authority
            .port_u16()
            .ok_or_else(|| format!("grpc.target {:?}: needs a port", self.target))?;
        if authority.as_str().contains('@') {
            return Err(format!("grpc.target {:?}: not host:port", self.target));
        }
        let (service, method) = self
            .method
            .split_once('/')
            .filter(|(s, m)| {
                let ok = |x: &str| {
                    !x.is_empty()
                        && x.bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.')
                };
                ok(s) && ok(m) && !m.contains('.')
            })
            .ok_or_else(|| {
                format!(
                    "grpc.method {:?}: must be package.Service/Method",
                    self.method
                )
            })?;
        if self.reflection && !self.descriptor_set_base64.is_empty() {
            return Err("set at most one of grpc.reflection and grpc.descriptorSetBase64".into());
        }
        let types = self.types(service, method)?;
        let message = match (&self.json, &types) {
            (Some(_), _) if !self.message_base64.is_empty() => {
                return Err("set at most one of grpc.messageBase64 and grpc.json".into());
            }
            // Encoded once reflection has told the types (`reflect::resolve`).
            (Some(_), None) if self.reflection => Vec::new(),
            (Some(_), None) => {
                return Err(
                    "grpc.json needs grpc.descriptorSetBase64 or grpc.reflection (the types to encode it with)".into(),
                );
            }
            (Some(json), Some(types)) => encode_json(types, json)?,
            (None, _) => {
                let message = base64::engine::general_purpose::STANDARD
                    .decode(self.message_base64.trim())
                    .map_err(|e| format!("grpc.messageBase64: {e}"))?;
                if message.len() > MAX_BODY {
                    return Err(format!(
                        "grpc.messageBase64: a message of {} bytes: at most {MAX_BODY}",
                        message.len()
                    ));
                }
                frame(message)
            }
        };
        let reflect = self.reflection.then(|| Reflect {
            service: service.to_owned(),
            method: method.to_owned(),
            json: self.json.clone(),
        });
        // Framed already; empty while reflection is yet to tell the types of `json`.
        let body = message;
        let mut headers = headers(&self.metadata, "grpc.metadata")?;
        if let Some((n, _)) = headers
            .iter()
            .find(|(n, _)| n.as_str().starts_with("grpc-") || n == "content-type" || n == "te")
        {
            return Err(format!(
                "grpc.metadata {n}: reserved by gRPC, set by the runner"
            ));
        }
        headers.push((
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc"),
        ));
        headers.push((http::header::TE, HeaderValue::from_static("trailers")));
        Ok(PreparedRequest {
            grpc: true,
            method: Method::POST,
            host: authority.host().to_owned(),
            port,
            authority: authority.as_str().to_owned(),
            path_and_query: format!("/{service}/{method}"),
            headers,
            body,
            grpc_server_streaming: types.as_ref().is_some_and(|t| t.server_streaming),
            grpc_output: types.map(|t| t.output),
            reflect,
        })
    }

    /// The method's input and output types, from the descriptor set when there is one.
    fn types(&self, service: &str, method: &str) -> Result<Option<MethodTypes>, String> {
        if self.descriptor_set_base64.is_empty() {
            return Ok(None);
        }
        if self.descriptor_set_base64.len() > MAX_DESCRIPTOR_SET_BASE64 {
            return Err(format!(
                "grpc.descriptorSetBase64: larger than {} KiB",
                MAX_DESCRIPTOR_SET_BASE64 / 4 * 3 / 1024
            ));
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(self.descriptor_set_base64.trim())
            .map_err(|e| format!("grpc.descriptorSetBase64: {e}"))?;
        let pool = prost_reflect::DescriptorPool::decode(bytes.as_slice()).map_err(|e| {
            format!("grpc.descriptorSetBase64: not a FileDescriptorSet with its imports: {e}")
        })?;
        method_types(&pool, "grpc.descriptorSetBase64", service, method).map(Some)
    }
}

/// A method's types in a descriptor pool.
#[derive(Clone, Debug)]
pub(crate) struct MethodTypes {
    pub(crate) input: prost_reflect::MessageDescriptor,
    pub(crate) output: prost_reflect::MessageDescriptor,
    /// The client sends a stream of messages (client-streaming or bidirectional).
    pub(crate) client_streaming: bool,
    /// The server answers with a stream (server-streaming or bidirectional).
    pub(crate) server_streaming: bool,
}

/// A method's types in `pool` (`what`: where its descriptors came from).
pub(crate) fn method_types(
    pool: &prost_reflect::DescriptorPool,
    what: &str,
    service: &str,
    method: &str,
) -> Result<MethodTypes, String> {
    let svc = pool
        .get_service_by_name(service)
        .ok_or_else(|| format!("{what} has no service {service} (grpc.method)"))?;
    let m = svc
        .methods()
        .find(|m| m.name() == method)
        .ok_or_else(|| format!("service {service} has no method {method}"))?;
    Ok(MethodTypes {
        input: m.input(),
        output: m.output(),
        client_streaming: m.is_client_streaming(),
        server_streaming: m.is_server_streaming(),
    })
}

/// The request body of a call given as JSON (`grpc.json`): one message of the input type, or,
/// for a method the client streams to, a list of them (sent in order, then the stream ends); at
/// most [`MAX_BODY`] bytes and [`MAX_STREAM_MESSAGES`] messages.
pub(crate) fn encode_json(types: &MethodTypes, json: &Value) -> Result<Vec<u8>, String> {
    let input = &types.input;
    let one = |json: &Value| -> Result<Vec<u8>, String> {
        let m = prost_reflect::DynamicMessage::deserialize(input.clone(), json.clone())
            .map_err(|e| format!("grpc.json is not a {}: {e}", input.full_name()))?;
        Ok(prost::Message::encode_to_vec(&m))
    };
    let messages = match (json, types.client_streaming) {
        (Value::Array(list), true) => {
            if list.is_empty() || list.len() > MAX_STREAM_MESSAGES {
                return Err(format!(
                    "grpc.json: a list of 1 to {MAX_STREAM_MESSAGES} messages (the method streams them), not {}",
                    list.len()
                ));
            }
            list.iter().map(one).collect::<Result<Vec<_>, _>>()?
        }
        (_, true) => {
            return Err(format!(
                "grpc.json: the method takes a stream of {}: give a list of messages",
                input.full_name()
            ));
        }
        (Value::Array(_), false) => {
            return Err(format!(
                "grpc.json: the method takes one {}, not a list",
                input.full_name()
            ));
        }
        (json, false) => vec![one(json)?],
    };
    let bytes: usize = messages.iter().map(Vec::len).sum();
    if bytes > MAX_BODY {
        return Err(format!(
            "grpc.json: a request of {bytes} bytes: at most {MAX_BODY}"
        ));
    }
    Ok(messages.into_iter().flat_map(frame).collect())
}

/// One gRPC message on the wire: uncompressed, its 4-byte big-endian length, the bytes.
pub(crate) fn frame(message: Vec<u8>) -> Vec<u8> {
    let mut body = Vec::with_capacity(message.len() + 5);
    body.push(0);
    // Bounded by MAX_BODY (or, for reflection questions, a name's length).
    body.extend(
        u32::try_from(message.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    body.extend(message);
    body
}

/// The messages of a gRPC body, when it holds only whole, uncompressed ones (else `None`).
#[cfg(feature = "run")]
pub(crate) fn messages(mut body: &[u8]) -> Option<Vec<&[u8]>> {
    let mut out = Vec::new();
    while !body.is_empty() {
        let (&[flag, a, b, c, d], after) = body.split_first_chunk::<5>()?;
        let len = u32::from_be_bytes([a, b, c, d]) as usize;
        if flag != 0 || after.len() < len {
            return None;
        }
        out.push(&after[..len]);
        body = &after[len..];
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The demo gRPC service's descriptors (dataplane/demo-apps/proto): unary Hello and
    /// bidirectional Chat.
    fn demo_method(method: &str) -> MethodTypes {
        let pool = prost_reflect::DescriptorPool::decode(
            &include_bytes!("../../../dataplane/demo-apps/proto/demo.fds")[..],
        )
        .unwrap();
        method_types(&pool, "demo.fds", "spur.demo.v1.Demo", method).unwrap()
    }

    /// A method the client streams to takes a list of messages, framed one after another; a
    /// unary one takes one message, not a list; both are bounded.
    #[test]
    fn streaming_calls_take_a_list_of_messages() {
        let chat = demo_method("Chat");
        assert!(chat.client_streaming);
        let body = encode_json(&chat, &serde_json::json!([{"name": "a"}, {"name": "bb"}])).unwrap();
        let frames = messages(&body).unwrap();
        assert_eq!(frames.len(), 2);
        assert_eq!(frames[1], b"\x0a\x02bb");
        let e = encode_json(&chat, &serde_json::json!({"name": "a"})).unwrap_err();
        assert!(e.contains("give a list of messages"), "{e}");
        let many = Value::Array(vec![serde_json::json!({}); MAX_STREAM_MESSAGES + 1]);
        assert!(
            encode_json(&chat, &many)
                .unwrap_err()
                .contains("a list of 1 to")
        );
        assert!(encode_json(&chat, &serde_json::json!([])).is_err());

        let hello = demo_method("Hello");
        assert!(!hello.client_streaming);
        let e = encode_json(&hello, &serde_json::json!([{"name": "a"}])).unwrap_err();
        assert!(
            e.contains("takes one spur.demo.v1.HelloRequest, not a list"),
            "{e}"
        );
        let body = encode_json(&hello, &serde_json::json!({"name": "a"})).unwrap();
        assert_eq!(messages(&body).unwrap(), [b"\x0a\x01a"]);
    }
}
