//! What every Spur binary shares at run time: SIGTERM and Ctrl-C ([`shutdown_signal`]),
//! logging set-up ([`init_tracing`]), duration flags ([`parse_duration`]), accepting
//! connections with a back-off on errors ([`accept`]), draining with a deadline ([`Drain`])
//! and spreading retries ([`jitter`]), and who a per-peer cap counts ([`peer::PeerKey`]). No
//! binary should write these again. With feature
//! `admin`, the admin endpoints (`/live`, `/ready`, `/metrics`, `/config_dump`) of the
//! data-plane servers ([`admin`]); with feature `serve`, HTTP server settings whose deadlines
//! hold ([`serve`]).

use std::future::Future;
use std::net::SocketAddr;
use std::pin::{Pin, pin};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

#[cfg(feature = "admin")]
pub mod admin;
pub mod peer;
#[cfg(feature = "serve")]
pub mod serve;

/// How long [`accept`] waits after a failed accept before trying again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Resolves on SIGTERM (what Kubernetes sends) or Ctrl-C. The SIGTERM handler is installed
/// when this is called, not when it is first polled: call it before the listeners open, and a
/// SIGTERM from then on is a clean shutdown rather than the default exit.
pub fn shutdown_signal() -> impl Future<Output = ()> {
    #[cfg(unix)]
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    async move {
        #[cfg(unix)]
        if let Some(mut term) = term {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            return;
        }
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Logging for Spur binaries, on stderr: `SPUR_LOG` (or `RUST_LOG`) filter, else `default`.
/// (Feature `logging`.)
#[cfg(feature = "logging")]
pub fn init_tracing(default: &str) {
    let filter = std::env::var("SPUR_LOG")
        .or_else(|_| std::env::var("RUST_LOG"))
        .unwrap_or_else(|_| default.into());
    let filter = tracing_subscriber::EnvFilter::try_new(&filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only on a terminal: logs collected from files and containers stay plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_target(false)
        .with_writer(std::io::stderr)
        .try_init();
}

/// A duration flag or config value: `250ms`, `5s` (or `5`), `2m`, `1h`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid duration {s:?}: expected e.g. 500ms, 5s, 2m"))?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "" | "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n.saturating_mul(60)),
        "h" => Duration::from_secs(n.saturating_mul(3600)),
        _ => return Err(format!("invalid duration unit in {s:?}: use ms, s, m or h")),
    };
    Ok(d)
}

/// Hex digits, two per byte (a config value's bytes, e.g. an L4 routing key's `keyHex`); `None`
/// for an odd count or anything but a hex digit. The one parser of the gateways and the
/// ListenerSet validator, so that both refuse the same input.
pub fn parse_hex(s: &str) -> Option<Vec<u8>> {
    // Checked first: `from_str_radix` alone would take a sign (`+1`).
    if !s.len().is_multiple_of(2) || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|b| u8::from_str_radix(b, 16).ok()))
        .collect()
}

/// The next connection on `listener`, or None once `stop` resolves (checked first, so a
/// stopping server takes no new connection). A failed accept (EMFILE and friends) is logged,
/// naming the listener as `what`, and retried after a pause instead of spinning.
///
/// `stop` is e.g. `token.cancelled()`: `while let Some((stream, peer)) =
/// accept(&listener, token.cancelled(), "admin").await { … }`.
pub async fn accept(
    listener: &TcpListener,
    stop: impl Future<Output = ()>,
    what: &str,
) -> Option<(TcpStream, SocketAddr)> {
    let mut stop = std::pin::pin!(stop);
    loop {
        tokio::select! {
            biased;
            () = &mut stop => return None,
            r = listener.accept() => match r {
                Ok(accepted) => return Some(accepted),
                Err(e) => tracing::warn!(error = %e, listener = what, "accept failed"),
            },
        }
        tokio::select! {
            () = &mut stop => return None,
            () = tokio::time::sleep(ACCEPT_BACKOFF) => {}
        }
    }
}

/// Graceful drain with a deadline: one signal that stops listeners and asks connections to
/// finish, and a tracker that knows when they all have. Cloned into every listener and
/// connection task.
#[derive(Clone, Debug, Default)]
pub struct Drain {
    token: CancellationToken,
    tracker: TaskTracker,
}

impl Drain {
    pub fn new() -> Self {
        Self::default()
    }

    /// A drain that also starts when `parent` is cancelled (a server stopped by its caller's
    /// token).
    pub fn under(parent: &CancellationToken) -> Self {
        Drain {
            token: parent.child_token(),
            tracker: TaskTracker::new(),
        }
    }

    /// Starts draining: listeners stop accepting; connections finish what is in flight and
    /// close (HTTP/2 with GOAWAY).
    pub fn start(&self) {
        self.token.cancel();
    }

    pub fn is_draining(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Resolves when draining starts.
    pub async fn signaled(&self) {
        self.token.cancelled().await
    }

    /// The drain signal as a token, for APIs that stop on one (child tokens stop with it).
    pub fn token(&self) -> CancellationToken {
        self.token.clone()
    }

    /// Spawns a task that the drain waits for.
    pub fn spawn<F>(&self, fut: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tracker.spawn(fut)
    }

    /// Runs a connection to its end. When the drain starts, `graceful` is called on it once
    /// (hyper's `graceful_shutdown`: in-flight requests finish, HTTP/2 sends GOAWAY) and the
    /// connection is driven until it closes; [`Drain::wait`]'s deadline bounds that.
    pub async fn run_graceful<C>(&self, conn: C, graceful: impl FnOnce(Pin<&mut C>)) -> C::Output
    where
        C: Future,
    {
        let mut conn = pin!(conn);
        tokio::select! {
            out = conn.as_mut() => out,
            () = self.signaled() => {
                graceful(conn.as_mut());
                conn.await
            }
        }
    }

    /// Starts draining (if not yet) and waits up to `grace` for every tracked task to end.
    /// Returns the number of tasks still running when the grace period ran out (they are
    /// dropped with the runtime).
    pub async fn wait(&self, grace: Duration) -> usize {
        self.start();
        self.tracker.close();
        match tokio::time::timeout(grace, self.tracker.wait()).await {
            Ok(()) => 0,
            Err(_) => self.tracker.len(),
        }
    }

    /// Tasks currently tracked (connections, tunnels, listeners).
    pub fn in_flight(&self) -> usize {
        self.tracker.len()
    }
}

/// The wall clock in milliseconds since the Unix epoch, as Kafka stamps records (0 before the
/// epoch, `i64::MAX` past its range).
pub fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A random duration in [d/2, d]: retries and periodic checks of many clients started together
/// spread out instead of coming back in lockstep.
pub fn jitter(d: Duration) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    // RandomState is randomly seeded per instance: a dependency-free source of spread.
    let r = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    let half = d / 2;
    half + Duration::from_nanos(r % u64::try_from(half.as_nanos()).unwrap_or(u64::MAX).max(1))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn hex_is_two_digits_per_byte_and_nothing_else() {
        assert_eq!(parse_hex("00fFa1"), Some(vec![0, 0xff, 0xa1]));
        assert_eq!(parse_hex(""), Some(vec![]));
        for bad in ["6", "+1", "-1", "0x", " a", "gg", "ab\n"] {
            assert_eq!(parse_hex(bad), None, "{bad:?}");
        }
    }

    #[tokio::test]
    async fn drain_waits_for_graceful_tasks_and_cuts_the_rest_at_the_deadline() {
        let parent = CancellationToken::new();
        let drain = Drain::under(&parent);
        // A connection that closes shortly after it is asked to.
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let d = drain.clone();
        let polite = drain.spawn(async move {
            let conn = async move {
                let _ = rx.await;
                "closed"
            };
            d.run_graceful(conn, |_| {
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let _ = tx.send(());
                });
            })
            .await
        });
        // One that never closes.
        drain.spawn(std::future::pending::<()>());
        assert!(!drain.is_draining());
        parent.cancel();
        assert!(drain.is_draining(), "the parent's cancel starts the drain");
        assert_eq!(drain.wait(Duration::from_millis(500)).await, 1);
        assert_eq!(polite.await.unwrap(), "closed");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("5"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration(" 2m "), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        for bad in ["5x", "", "ms", "-1s", "1.5s", "99999999999999999999s"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn jitter_stays_within_half_and_full() {
        for _ in 0..100 {
            let j = jitter(Duration::from_millis(200));
            assert!(
                j >= Duration::from_millis(100) && j <= Duration::from_millis(200),
                "{j:?}"
            );
        }
    }

    #[tokio::test]
    async fn accept_returns_connections_until_stopped() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = tokio_util::sync::CancellationToken::new();
        let client = TcpStream::connect(addr).await.unwrap();
        let (_, peer) = accept(&listener, stop.cancelled(), "test").await.unwrap();
        assert_eq!(peer, client.local_addr().unwrap());
        stop.cancel();
        // Stopped wins over a waiting connection.
        let _queued = TcpStream::connect(addr).await.unwrap();
        assert!(accept(&listener, stop.cancelled(), "test").await.is_none());
    }
}
