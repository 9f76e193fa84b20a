//! Fuzzes the forward proxy's front ends (`spur_forward`, used by the tunnel proxy and
//! the workstation CLI): SOCKS5 (RFC 1928 CONNECT, RFC 1929 username/password) and HTTP
//! `CONNECT`, detected by the first byte, through the public `serve_one` on a loopback
//! connection.
//!
//! Each input is served twice, by a dialer without authentication and by one that requires
//! `user`/`pass`. A SOCKS5 stream is checked against an independent model of the handshake (the
//! target dialled, the user, the bytes answered); an HTTP stream must only dial what its
//! `CONNECT` line names.
//!
//! Input: the client's byte stream (it then closes its side).
#![no_main]

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Mutex;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use spur_forward::{ConnRecord, DialError, Dialer, ForwardConfig, Target, serve_one};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[path = "common/mod.rs"]
mod common;
use common::net;

/// Dials nothing: records the dial and hands back a stream whose far end is already closed.
/// Port 1 is refused, to cover the failure replies.
struct FuzzDialer {
    auth: bool,
    dials: Mutex<Vec<(Target, Option<String>)>>,
    record: Mutex<Option<ConnRecord>>,
}

impl Dialer for FuzzDialer {
    type Stream = tokio::io::DuplexStream;

    fn dial(
        &self,
        target: &Target,
        _client: SocketAddr,
        user: Option<&str>,
    ) -> impl Future<Output = Result<Self::Stream, DialError>> + Send {
        self.dials
            .lock()
            .expect("lock")
            .push((target.clone(), user.map(str::to_owned)));
        let port = match target {
            Target::Host(_, p) => *p,
            Target::Addr(a) => a.port(),
        };
        let result = if port == 1 {
            Err(DialError::from_io(
                target,
                &std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
            ))
        } else {
            Ok(tokio::io::duplex(64).0)
        };
        async move { result }
    }

    fn check_password(&self, user: &str, password: &str) -> Option<bool> {
        self.auth.then(|| user == "user" && password == "pass")
    }

    fn requires_auth(&self) -> bool {
        self.auth
    }

    fn finished(&self, record: &ConnRecord) {
        *self.record.lock().expect("lock") = Some(record.clone());
    }
}

/// Serves one connection on which the client sends `data` and closes; returns what the client
/// received.
fn serve(data: &[u8], dialer: &FuzzDialer) -> Vec<u8> {
    let (rt, listener) = net();
    let config = ForwardConfig {
        handshake_timeout: Duration::from_secs(5),
        dial_timeout: Duration::from_secs(5),
    };
    rt.block_on(async {
        let addr = listener.local_addr().expect("addr");
        let mut client = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (server, peer) = listener.accept().await.expect("accept");
        // Close with RST: millions of connections must not pile up in TIME_WAIT.
        for s in [&client, &server] {
            #[allow(deprecated)]
            s.set_linger(Some(Duration::ZERO)).expect("linger");
        }
        let client_side = async {
            let _ = client.write_all(data).await;
            let _ = client.shutdown().await;
            let mut got = vec![];
            let _ = client.read_to_end(&mut got).await;
            got
        };
        let ((), got) = tokio::join!(serve_one(server, peer, dialer, &config), client_side);
        got
    })
}

/// The forward proxy's host rule: a DNS name or an IP literal.
fn valid_host(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 253
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b':'))
}

/// What a SOCKS5 server must make of `d`: the target and user it dials, and the bytes it
/// answers before the dial result, or `None` if the handshake fails.
fn socks_model(d: &[u8], auth: bool) -> Option<(Target, Option<String>, Vec<u8>)> {
    let mut p = 0;
    let mut take = |n: usize| -> Option<&[u8]> {
        let s = d.get(p..p + n)?;
        p += n;
        Some(s)
    };
    let head = take(2)?;
    let methods = take(usize::from(head[1]))?;
    let want = if auth { 2 } else { 0 };
    if !methods.contains(&want) {
        return None;
    }
    let mut answered = vec![5, want];
    let mut user = None;
    if auth {
        let vl = take(2)?;
        let u = take(usize::from(vl[1]))?.to_vec();
        let pl = take(1)?[0];
        let pw = take(usize::from(pl))?;
        if !(vl[0] == 1 && u == b"user" && pw == b"pass") {
            return None;
        }
        answered.extend_from_slice(&[1, 0]);
        user = Some("user".to_owned());
    }
    let req = take(4)?;
    if req[0] != 5 {
        return None;
    }
    let target = match req[3] {
        1 => {
            let a = take(6)?;
            let ip = Ipv4Addr::new(a[0], a[1], a[2], a[3]);
            Target::Addr(SocketAddr::new(IpAddr::V4(ip), u16::from_be_bytes([a[4], a[5]])))
        }
        4 => {
            let a = take(18)?;
            let ip: [u8; 16] = a[..16].try_into().ok()?;
            let port = u16::from_be_bytes([a[16], a[17]]);
            Target::Addr(SocketAddr::new(IpAddr::V6(Ipv6Addr::from(ip)), port))
        }
        3 => {
            let n = take(1)?[0];
            let name = take(usize::from(n))?;
            let port = take(2)?;
            let host = std::str::from_utf8(name).ok().filter(|h| valid_host(h))?;
            Target::Host(host.to_owned(), u16::from_be_bytes([port[0], port[1]]))
        }
        _ => return None,
    };
    if req[1] != 1 {
        return None;
    }
    Some((target, user, answered))
}

fn check_socks(data: &[u8], auth: bool, dialer: &FuzzDialer, got: &[u8]) {
    let dials = dialer.dials.lock().expect("lock").clone();
    let record = dialer.record.lock().expect("lock").clone().expect("a record");
    assert_eq!(record.protocol, "socks5");
    match socks_model(data, auth) {
        Some((target, user, answered)) => {
            assert_eq!(dials, vec![(target.clone(), user.clone())], "auth {auth}");
            assert_eq!(record.target.as_ref(), Some(&target));
            assert_eq!(record.user, user);
            let port = match &target {
                Target::Host(_, p) => *p,
                Target::Addr(a) => a.port(),
            };
            let code = if port == 1 { 5 } else { 0 };
            answered
                .iter()
                .chain(&[5, code, 0, 1, 0, 0, 0, 0, 0, 0])
                .zip(got)
                .for_each(|(want, got)| assert_eq!(want, got, "answer {got:?}"));
            assert!(got.len() <= answered.len() + 10, "answer {got:?}");
        }
        None => {
            assert!(dials.is_empty(), "dialled {dials:?} for a failed handshake");
            assert!(record.target.is_none() && record.outcome != "ok");
        }
    }
}

fn check_http(data: &[u8], dialer: &FuzzDialer) {
    let dials = dialer.dials.lock().expect("lock").clone();
    let record = dialer.record.lock().expect("lock").clone().expect("a record");
    assert_eq!(record.protocol, "http-connect");
    assert!(dials.len() <= 1, "{dials:?}");
    let Some((target, user)) = dials.first() else {
        return;
    };
    assert_eq!(user, &None);
    assert_eq!(record.target.as_ref(), Some(target));
    // Only what the request line names: `CONNECT host:port HTTP/1.x`.
    let line = data.split(|&b| b == b'\n').next().expect("a line");
    let line = std::str::from_utf8(line).expect("hyper parsed it");
    let mut words = line.split(' ');
    assert_eq!(words.next(), Some("CONNECT"), "{line:?}");
    let authority = words.next().expect("a target");
    // Found here and fixed (artifacts-found/socks_connect/): `CONNECT user@host:port` used to
    // dial `host:port`; the authority form has no user info (RFC 9112 §3.2.3).
    assert!(!authority.contains('@'), "dialled {target:?} for {line:?}");
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    let (host, port) = authority.rsplit_once(':').expect("a port");
    let host = host.trim_matches(['[', ']']);
    assert!(valid_host(host), "{host:?}");
    let port: u16 = port.parse().expect("a port number");
    let expected = match host.parse::<IpAddr>() {
        Ok(ip) => Target::Addr(SocketAddr::new(ip, port)),
        Err(_) => Target::Host(host.to_owned(), port),
    };
    assert_eq!(target, &expected, "{line:?}");
}

fuzz_target!(|data: &[u8]| {
    for auth in [false, true] {
        let dialer = FuzzDialer {
            auth,
            dials: Mutex::new(vec![]),
            record: Mutex::new(None),
        };
        let got = serve(data, &dialer);
        match data.first() {
            Some(5) => check_socks(data, auth, &dialer, &got),
            Some(b) if b.is_ascii_uppercase() => check_http(data, &dialer),
            _ => {
                assert!(dialer.dials.lock().expect("lock").is_empty());
                assert!(got.is_empty());
            }
        }
    }
});
