//! The wire format shared by both transports: length-prefixed JSON frames on the control stream
//! and at the start of every data stream. Frames are validated once, here, at the edge.

use std::fmt;

use bytes::{BufMut, BytesMut};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::{Error, RefusalCode};

/// The protocol version sent in `hello` and `welcome`.
pub const PROTOCOL_VERSION: u32 = 1;
/// ALPN of the QUIC transport.
pub const QUIC_ALPN: &[u8] = b"spur-tunnel/1";
/// ALPN of the HTTP/2-over-TLS transport: plain `h2`, so the fallback looks like ordinary HTTPS.
pub const H2_ALPN: &[u8] = b"h2";
/// HTTP/2 request path of the control stream (always the first request of a connection).
pub const H2_CONTROL_PATH: &str = "/spur.tunnel.v1/control";
/// HTTP/2 request path of every data stream.
pub const H2_STREAM_PATH: &str = "/spur.tunnel.v1/stream";
/// HTTP/2 frame size both ends accept: larger than HTTP/2's 16 KiB default, for fewer frames
/// per byte on bulk streams.
pub(crate) const H2_MAX_FRAME: u32 = 64 * 1024;

/// Longest bind id, in bytes.
pub const MAX_BIND_ID: usize = 128;
/// Longest bind metadata, in bytes.
pub const MAX_BIND_META: usize = 4096;
/// Longest client name, in bytes.
pub(crate) const MAX_CLIENT_NAME: usize = 256;
/// Longest host in a connect header (a DNS name is at most 253).
pub(crate) const MAX_HOST: usize = 255;
/// Longest reason string carried in a reply, refusal or goaway (longer ones are truncated).
pub(crate) const MAX_REASON: usize = 512;

/// What a data stream is for: the first frame of every data stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum StreamHeader {
    /// Client → server: connect to `host:port` in the cluster (workstation → cluster).
    Connect { host: String, port: u16 },
    /// Server → client: a connection arrived for the client's reverse listener `bind`
    /// (cluster → workstation). Over HTTP/2 the client opens this stream on the server's
    /// request and echoes the server's `open_id`.
    Reverse {
        bind: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        open_id: Option<u64>,
    },
}

impl StreamHeader {
    pub(crate) fn validate(&self) -> Result<(), Error> {
        match self {
            StreamHeader::Connect { host, port } => {
                validate_host(host)?;
                if *port == 0 {
                    return Err(Error::Protocol("connect to port 0".into()));
                }
                Ok(())
            }
            StreamHeader::Reverse { bind, .. } => validate_bind_id(bind),
        }
    }

    /// The stream's direction, as used in metrics.
    pub fn kind(&self) -> StreamKind {
        match self {
            StreamHeader::Connect { .. } => StreamKind::Forward,
            StreamHeader::Reverse { .. } => StreamKind::Reverse,
        }
    }
}

/// Forward (workstation → cluster) or reverse (cluster → workstation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StreamKind {
    Forward,
    Reverse,
}

impl StreamKind {
    pub fn as_str(self) -> &'static str {
        match self {
            StreamKind::Forward => "forward",
            StreamKind::Reverse => "reverse",
        }
    }
}

/// The acceptor's answer to a [`StreamHeader`]: the second frame of every data stream, sent
/// the other way. Raw bytes follow an `ok`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub(crate) enum Reply {
    Ok,
    Error { reason: String },
}

/// A bearer token. Its `Debug` never shows the value, so it cannot leak into logs.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Token(String);

impl Token {
    pub fn new(token: impl Into<String>) -> Self {
        Token(token.into())
    }

    /// The secret itself; only for authenticators.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

/// Messages on the control stream (one per session, opened by the client first).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum Control {
    /// Client → server, first message.
    Hello {
        version: u32,
        client_name: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token: Option<Token>,
    },
    /// Server → client: the session is established.
    Welcome {
        version: u32,
        session_id: u64,
        identity: String,
    },
    /// Server → client: the session is refused; the server closes after sending it.
    Refused {
        code: RefusalCode,
        reason: String,
        retry: bool,
    },
    /// Client → server: register (or update) reverse listener `id`.
    Bind {
        id: String,
        meta: String,
    },
    /// Server → client: answer to `bind`; `error` is absent on success.
    BindAck {
        id: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
    /// Client → server: the reverse listener is gone.
    Unbind {
        id: String,
    },
    /// Server → client, HTTP/2 only: open a reverse stream for `bind` carrying `open_id`.
    OpenReverse {
        open_id: u64,
        bind: String,
    },
    /// Either side; answered with `pong` carrying the same `seq`.
    Ping {
        seq: u64,
    },
    Pong {
        seq: u64,
    },
    /// Either side: no new streams; finish the open ones, then `drained`.
    GoAway {
        reason: String,
    },
    /// Either side, after `goaway`: none of my streams is open any more.
    Drained,
    /// A message type from a newer peer; ignored.
    #[serde(other)]
    Unknown,
}

impl Control {
    /// Checks the fields a peer controls. Unknown messages pass (they are ignored).
    pub(crate) fn validate(&self) -> Result<(), Error> {
        match self {
            Control::Hello { client_name, .. } => {
                if client_name.len() > MAX_CLIENT_NAME || client_name.chars().any(char::is_control)
                {
                    return Err(Error::Protocol("invalid client name".into()));
                }
                Ok(())
            }
            Control::Bind { id, meta } => {
                validate_bind_id(id)?;
                if meta.len() > MAX_BIND_META {
                    return Err(Error::Protocol(format!(
                        "bind metadata of {} bytes exceeds {MAX_BIND_META}",
                        meta.len()
                    )));
                }
                Ok(())
            }
            Control::Unbind { id } | Control::BindAck { id, .. } => validate_bind_id(id),
            Control::OpenReverse { bind, .. } => validate_bind_id(bind),
            _ => Ok(()),
        }
    }
}

/// Bind ids: 1–128 bytes of `[A-Za-z0-9._:/-]`, so they are safe in logs, labels and names.
pub(crate) fn validate_bind_id(id: &str) -> Result<(), Error> {
    let ok = !id.is_empty()
        && id.len() <= MAX_BIND_ID
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'/' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(Error::Protocol(format!(
            "invalid bind id {:?}",
            truncate(id, MAX_BIND_ID)
        )))
    }
}

/// Hosts: a DNS name or an IP literal (IPv6 with or without brackets); printable ASCII without
/// the characters that would make it a URL.
pub(crate) fn validate_host(host: &str) -> Result<(), Error> {
    let ok = !host.is_empty()
        && host.len() <= MAX_HOST
        && host
            .bytes()
            .all(|b| b.is_ascii_graphic() && !matches!(b, b'/' | b'@' | b'?' | b'#' | b'\\'));
    if ok {
        Ok(())
    } else {
        Err(Error::Protocol(format!(
            "invalid host {:?}",
            truncate(host, MAX_HOST)
        )))
    }
}

/// Cuts `s` to at most `max` bytes on a character boundary.
pub(crate) fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// Serializes `msg` as one frame: a 4-byte big-endian length, then that many bytes of JSON.
pub(crate) fn encode<T: Serialize>(msg: &T, max: usize) -> Result<BytesMut, Error> {
    let json = serde_json::to_vec(msg).map_err(|e| Error::Protocol(e.to_string()))?;
    if json.len() > max {
        return Err(Error::FrameTooLarge {
            len: json.len(),
            max,
        });
    }
    let len = u32::try_from(json.len()).map_err(|_| Error::FrameTooLarge {
        len: json.len(),
        max,
    })?;
    let mut buf = BytesMut::with_capacity(4 + json.len());
    buf.put_u32(len);
    buf.put_slice(&json);
    Ok(buf)
}

/// Writes one frame: a big-endian u32 length, then `msg` as JSON; refused beyond `max` bytes.
/// Also for protocols layered on a stream (the hub's, `spur-hub`).
pub async fn write_frame<W, T>(w: &mut W, msg: &T, max: usize) -> Result<(), Error>
where
    W: AsyncWrite + Unpin,
    T: Serialize,
{
    let buf = encode(msg, max)?;
    w.write_all(&buf).await?;
    w.flush().await?;
    Ok(())
}

/// Reads one frame. `Ok(None)` is a clean end of stream before the frame started. The length
/// is checked against `max` before anything is allocated.
pub async fn read_frame<R, T>(r: &mut R, max: usize) -> Result<Option<T>, Error>
where
    R: AsyncRead + Unpin,
    T: DeserializeOwned,
{
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < len.len() {
        let n = r.read(&mut len[got..]).await?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(Error::Protocol("stream ended inside a frame length".into()));
        }
        got += n;
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > max {
        return Err(Error::FrameTooLarge { len, max });
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf).await.map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            Error::Protocol("stream ended inside a frame".into())
        } else {
            Error::Io(e)
        }
    })?;
    serde_json::from_slice(&buf)
        .map(Some)
        .map_err(|e| Error::Protocol(format!("malformed frame: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_round_trip_and_bound() {
        let msg = Control::Bind {
            id: "web-8080".into(),
            meta: "{\"port\":8080}".into(),
        };
        let buf = encode(&msg, 1024).unwrap();
        let mut r = &buf[..];
        let back: Control = read_frame(&mut r, 1024).await.unwrap().unwrap();
        assert!(matches!(back, Control::Bind { ref id, .. } if id == "web-8080"));

        // The length is checked before allocation.
        let mut huge = vec![];
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        let mut r = &huge[..];
        let err = read_frame::<_, Control>(&mut r, 1024).await.unwrap_err();
        assert!(matches!(err, Error::FrameTooLarge { .. }));
        assert!(matches!(encode(&msg, 4), Err(Error::FrameTooLarge { .. })));

        // Clean EOF at a boundary, truncated frame inside.
        let mut r = &b""[..];
        assert!(
            read_frame::<_, Control>(&mut r, 1024)
                .await
                .unwrap()
                .is_none()
        );
        let mut r = &buf[..buf.len() - 1];
        assert!(read_frame::<_, Control>(&mut r, 1024).await.is_err());
    }

    #[test]
    fn unknown_messages_and_codes_are_tolerated() {
        let m: Control = serde_json::from_str(r#"{"type":"future_thing","x":1}"#).unwrap();
        assert!(matches!(m, Control::Unknown));
        let m: Control = serde_json::from_str(
            r#"{"type":"refused","code":"new_code","reason":"r","retry":false}"#,
        )
        .unwrap();
        assert!(matches!(
            m,
            Control::Refused {
                code: RefusalCode::Other,
                ..
            }
        ));
    }

    #[test]
    fn headers_are_validated() {
        let ok = StreamHeader::Connect {
            host: "redis.default.svc.cluster.local".into(),
            port: 6379,
        };
        ok.validate().unwrap();
        for host in ["", "a b", "x/y", "u@h", &"a".repeat(300)] {
            let h = StreamHeader::Connect {
                host: host.into(),
                port: 1,
            };
            assert!(h.validate().is_err(), "{host:?}");
        }
        assert!(
            StreamHeader::Connect {
                host: "::1".into(),
                port: 0
            }
            .validate()
            .is_err()
        );
        for id in ["", "a b", "é", &"a".repeat(129)] {
            assert!(validate_bind_id(id).is_err(), "{id:?}");
        }
        validate_bind_id("sandbox-x/web:8080").unwrap();
        let json = serde_json::to_string(&StreamHeader::Reverse {
            bind: "b".into(),
            open_id: None,
        })
        .unwrap();
        assert_eq!(json, r#"{"kind":"reverse","bind":"b"}"#);
    }

    #[test]
    fn tokens_are_redacted() {
        let hello = Control::Hello {
            version: 1,
            client_name: "laptop".into(),
            token: Some(Token::new("s3cr3t")),
        };
        assert!(!format!("{hello:?}").contains("s3cr3t"));
        assert!(serde_json::to_string(&hello).unwrap().contains("s3cr3t"));
    }
}
