//! gRPC server reflection: the types of a step with `reflection: true`, asked of the server
//! (`grpc.reflection.v1.ServerReflection`, else `v1alpha` for servers that only speak that)
//! before the run, at the baseline (no routing key).
//!
//! - The file that defines the service is asked for by symbol, then every file it imports, by
//!   name, until none is missing: servers (tonic's, grpc-go's) answer one file per question.
//! - Bounded: at most [`MAX_FILES`] files, [`MAX_BYTES`] of descriptors and [`MAX_ROUNDS`]
//!   rounds of questions; each round is one call within the step's timeout.
//! - The answer is read with the types written here by hand (the few fields of
//!   `reflection.proto` used): no generated client for one call.
//! - Servers are asked once per (address, service) for the whole test.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use http::{HeaderValue, Method};
use prost::Message;
use prost_reflect::DescriptorPool;

use crate::Error;
use crate::spec::{Action, Prepared, PreparedRequest, Reflect};

/// Most descriptor files one service may need.
pub const MAX_FILES: usize = 64;
/// Most bytes of descriptors (the same bound as a step's own descriptor set).
pub const MAX_BYTES: usize = 512 * 1024;
/// Most rounds of questions (the depth of the import graph).
pub const MAX_ROUNDS: usize = 16;

const V1: &str = "grpc.reflection.v1.ServerReflection";
const V1ALPHA: &str = "grpc.reflection.v1alpha.ServerReflection";
/// `UNIMPLEMENTED`: the server has no such service (then v1alpha is asked).
const UNIMPLEMENTED: u32 = 12;

/// `grpc.reflection.v1.ServerReflectionRequest` (v1alpha's is the same message).
#[derive(Clone, PartialEq, Message)]
struct Question {
    #[prost(string, tag = "1")]
    host: String,
    #[prost(oneof = "Ask", tags = "3, 4")]
    ask: Option<Ask>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum Ask {
    #[prost(string, tag = "3")]
    FileByFilename(String),
    #[prost(string, tag = "4")]
    FileContainingSymbol(String),
}

/// `ServerReflectionResponse`, the fields read.
#[derive(Clone, PartialEq, Message)]
struct Answer {
    #[prost(oneof = "Response", tags = "4, 7")]
    response: Option<Response>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum Response {
    #[prost(message, tag = "4")]
    Files(Files),
    #[prost(message, tag = "7")]
    Error(Refusal),
}

/// `FileDescriptorResponse`: serialized `FileDescriptorProto`s.
#[derive(Clone, PartialEq, Message)]
struct Files {
    #[prost(bytes = "vec", repeated, tag = "1")]
    file_descriptor_proto: Vec<Vec<u8>>,
}

/// `ErrorResponse`.
#[derive(Clone, PartialEq, Message)]
struct Refusal {
    #[prost(int32, tag = "1")]
    error_code: i32,
    #[prost(string, tag = "2")]
    error_message: String,
}

/// The fields of a `FileDescriptorProto` the walk needs: its name and its imports.
#[derive(Clone, PartialEq, Message)]
struct FileHead {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(string, repeated, tag = "3")]
    dependency: Vec<String>,
}

/// Gives every step with `reflection: true` its types: the request's JSON is encoded with them
/// and the answers are decoded by them. The first step whose server cannot say is the error.
pub async fn resolve(steps: &mut [Prepared]) -> Result<(), Error> {
    let mut pools: HashMap<(String, String), DescriptorPool> = HashMap::new();
    for step in steps.iter_mut() {
        let timeout = step.timeout;
        let Action::Request(r) = &mut step.action else {
            continue;
        };
        let Some(reflect) = r.reflect.take() else {
            continue;
        };
        let at = format!("{}:{}", r.host, r.port);
        let name = &step.name;
        let fail = |e: String| {
            Error::Reflection(format!(
                "step {name}: gRPC reflection at {at} for {}: {e}",
                reflect.service
            ))
        };
        let key = (r.authority.clone(), reflect.service.clone());
        let pool = match pools.get(&key) {
            Some(pool) => pool.clone(),
            None => {
                let pool = descriptors(r, timeout, &reflect.service)
                    .await
                    .map_err(fail)?;
                pools.insert(key, pool.clone());
                pool
            }
        };
        apply(r, &reflect, &pool).map_err(fail)?;
    }
    Ok(())
}

/// Sets the types (and the body, from the JSON) of a step's request.
fn apply(r: &mut PreparedRequest, reflect: &Reflect, pool: &DescriptorPool) -> Result<(), String> {
    let types = crate::grpc::method_types(
        pool,
        "the server's reflection",
        &reflect.service,
        &reflect.method,
    )?;
    if let Some(json) = &reflect.json {
        r.body = crate::grpc::encode_json(&types, json)?;
    }
    r.grpc_server_streaming = types.server_streaming;
    r.grpc_output = Some(types.output);
    Ok(())
}

/// The descriptors of `service` and everything it imports, from the server `r` is sent to, each
/// call within `timeout`.
async fn descriptors(
    r: &PreparedRequest,
    timeout: Duration,
    service: &str,
) -> Result<DescriptorPool, String> {
    match walk(r, timeout, V1, service).await {
        Err(Walk::Unimplemented) => walk(r, timeout, V1ALPHA, service).await.map_err(|e| match e {
            Walk::Unimplemented => {
                "the server has no reflection service (neither grpc.reflection.v1 nor v1alpha): give the step a descriptorSetBase64 instead".to_owned()
            }
            Walk::Failed(e) => e,
        }),
        Err(Walk::Failed(e)) => Err(e),
        Ok(pool) => Ok(pool),
    }
}

enum Walk {
    Unimplemented,
    Failed(String),
}

async fn walk(
    r: &PreparedRequest,
    timeout: Duration,
    api: &str,
    service: &str,
) -> Result<DescriptorPool, Walk> {
    let mut files: BTreeMap<String, (Vec<u8>, Vec<String>)> = BTreeMap::new();
    let mut bytes = 0usize;
    let mut asks = vec![Ask::FileContainingSymbol(service.to_owned())];
    for _ in 0..MAX_ROUNDS {
        let body = call(r, timeout, api, &asks).await?;
        let answered = files_in(&body, asks.len())
            .map_err(|e| Walk::Failed(format!("{e} (asked for {})", describe(&asks))))?;
        for file in answered {
            bytes += file.bytes.len();
            if bytes > MAX_BYTES {
                return Err(Walk::Failed(format!(
                    "more than {} KiB of descriptors",
                    MAX_BYTES / 1024
                )));
            }
            files.insert(file.name, (file.bytes, file.imports));
            if files.len() > MAX_FILES {
                return Err(Walk::Failed(format!("more than {MAX_FILES} files")));
            }
        }
        let missing: BTreeSet<&String> = files
            .values()
            .flat_map(|(_, deps)| deps)
            .filter(|d| !files.contains_key(*d))
            .collect();
        if missing.is_empty() {
            return descriptor_pool(files.into_values().map(|(bytes, _)| bytes))
                .map_err(Walk::Failed);
        }
        asks = missing
            .into_iter()
            .map(|d| Ask::FileByFilename(d.clone()))
            .collect();
    }
    Err(Walk::Failed(format!(
        "imports nested more than {MAX_ROUNDS} deep"
    )))
}

fn describe(asks: &[Ask]) -> String {
    let names: Vec<String> = asks
        .iter()
        .map(|a| match a {
            Ask::FileByFilename(f) => format!("file {f}"),
            Ask::FileContainingSymbol(s) => format!("symbol {s}"),
        })
        .collect();
    names.join(", ")
}

/// One call: every question in the request stream; the answer's body (gRPC messages).
async fn call(
    r: &PreparedRequest,
    timeout: Duration,
    api: &str,
    asks: &[Ask],
) -> Result<Vec<u8>, Walk> {
    let mut body = Vec::new();
    for ask in asks {
        let q = Question {
            host: String::new(),
            ask: Some(ask.clone()),
        };
        body.extend(crate::grpc::frame(q.encode_to_vec()));
    }
    let question = PreparedRequest {
        grpc: true,
        method: Method::POST,
        host: r.host.clone(),
        port: r.port,
        authority: r.authority.clone(),
        path_and_query: format!("/{api}/ServerReflectionInfo"),
        headers: vec![
            (
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/grpc"),
            ),
            (http::header::TE, HeaderValue::from_static("trailers")),
        ],
        body,
        grpc_output: None,
        grpc_server_streaming: false,
        reflect: None,
    };
    let x = crate::send::send(&question, timeout, None, None).await;
    if !x.error.is_empty() {
        return Err(Walk::Failed(x.error));
    }
    match crate::run::grpc_status(&x) {
        Some(0) => {}
        Some(UNIMPLEMENTED) => return Err(Walk::Unimplemented),
        Some(code) => {
            return Err(Walk::Failed(format!(
                "grpc-status {code}{}",
                crate::run::grpc_message(&x)
                    .map(|m| format!(" ({m})"))
                    .unwrap_or_default()
            )));
        }
        None => {
            return Err(Walk::Failed(format!(
                "HTTP {} without a grpc-status: not a gRPC server?",
                x.status
            )));
        }
    }
    let body = x.response_body.unwrap_or_default();
    if body.truncated {
        return Err(Walk::Failed(format!(
            "an answer larger than {} KiB",
            crate::send::MAX_KEPT / 1024
        )));
    }
    Ok(body.data)
}

/// One descriptor file a reflection answer held.
#[derive(Debug)]
pub struct ReflectedFile {
    pub name: String,
    /// The files it imports, by name.
    pub imports: Vec<String>,
    /// The serialized `FileDescriptorProto`, as the server sent it.
    pub bytes: Vec<u8>,
}

/// The files in the body of a reflection call that asked `asked` questions: exactly one answer
/// per question, each a list of descriptor files (an error answer is the error). Untrusted
/// bytes (the server's): whole, uncompressed gRPC messages only; fuzzed
/// (`fuzz/fuzz_targets/grpc_reflection.rs`).
pub fn files_in(body: &[u8], asked: usize) -> Result<Vec<ReflectedFile>, String> {
    let messages = crate::grpc::messages(body)
        .ok_or_else(|| "an answer that is not whole, uncompressed gRPC messages".to_owned())?;
    if messages.len() != asked {
        return Err(format!("{} answers to {asked} questions", messages.len()));
    }
    let mut out = Vec::new();
    for m in messages {
        let answer =
            Answer::decode(m).map_err(|e| format!("an answer that does not decode: {e}"))?;
        let files = match answer.response {
            Some(Response::Files(f)) => f.file_descriptor_proto,
            Some(Response::Error(r)) => {
                return Err(format!(
                    "the server answered {} ({})",
                    r.error_code, r.error_message
                ));
            }
            None => return Err("an answer with neither descriptors nor an error".into()),
        };
        for bytes in files {
            let head = FileHead::decode(bytes.as_slice())
                .map_err(|e| format!("a descriptor that is not a FileDescriptorProto: {e}"))?;
            out.push(ReflectedFile {
                name: head.name,
                imports: head.dependency,
                bytes,
            });
        }
    }
    Ok(out)
}

/// The pool of a set of serialized `FileDescriptorProto`s (any order: imports are resolved
/// across the set); an import missing from it is the error.
pub fn descriptor_pool(files: impl IntoIterator<Item = Vec<u8>>) -> Result<DescriptorPool, String> {
    let mut set = Vec::new();
    for file in files {
        prost::encoding::bytes::encode(1, &file, &mut set);
    }
    DescriptorPool::decode(set.as_slice())
        .map_err(|e| format!("the descriptors do not make a whole set: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, imports: &[&str]) -> Vec<u8> {
        FileHead {
            name: name.into(),
            dependency: imports.iter().map(|s| s.to_string()).collect(),
        }
        .encode_to_vec()
    }

    fn answer(response: Response) -> Vec<u8> {
        crate::grpc::frame(
            Answer {
                response: Some(response),
            }
            .encode_to_vec(),
        )
    }

    #[test]
    fn an_answer_is_read_strictly() {
        let files = |names: &[(&str, &[&str])]| {
            answer(Response::Files(Files {
                file_descriptor_proto: names.iter().map(|(n, i)| file(n, i)).collect(),
            }))
        };
        let mut body = files(&[("shop.proto", &["money.proto"])]);
        body.extend(files(&[("money.proto", &[])]));
        let got = files_in(&body, 2).unwrap();
        assert_eq!(got[0].name, "shop.proto");
        assert_eq!(got[0].imports, ["money.proto"]);
        assert_eq!(got[1].name, "money.proto");

        assert_eq!(files_in(&body, 1).unwrap_err(), "2 answers to 1 questions");
        let refused = answer(Response::Error(Refusal {
            error_code: 5,
            error_message: "symbol 'x' not found".into(),
        }));
        assert_eq!(
            files_in(&refused, 1).unwrap_err(),
            "the server answered 5 (symbol 'x' not found)"
        );
        // Compressed, cut, or not an answer at all: refused, never guessed at.
        let mut compressed = files(&[("a.proto", &[])]);
        compressed[0] = 1;
        assert!(files_in(&compressed, 1).is_err());
        let cut = &body[..body.len() - 1];
        assert!(files_in(cut, 2).is_err());
        assert!(files_in(&crate::grpc::frame(vec![0xff; 8]), 1).is_err());
        // Imports not in the set: no pool.
        assert!(descriptor_pool([file("shop.proto", &["money.proto"])]).is_err());
    }
}
