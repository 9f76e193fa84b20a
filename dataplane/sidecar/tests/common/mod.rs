//! Shared by the sidecar's process tests: start a `spur-sidecar` on port 0 and learn its ports
//! from its "sidecar started" log line. Picking free ports first and passing them in races with
//! every other process of the suite (the node, parallel tests): a port the test frees can be
//! taken before the sidecar binds it; the sidecar then exits, and a readiness probe reaches the
//! other listener.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::process::{Child, ChildStderr};
use std::sync::mpsc::{Receiver, channel};
use std::thread::JoinHandle;
use std::time::Duration;

/// A child killed and reaped on drop, so no sidecar outlives a failed test.
pub(crate) struct Killed(pub(crate) Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The sidecar's stderr, read line by line on a thread; kept for failure messages.
pub(crate) struct Log {
    lines: Receiver<String>,
    reader: Option<JoinHandle<()>>,
    seen: Vec<String>,
}

impl Log {
    pub(crate) fn new(stderr: ChildStderr) -> Log {
        let (tx, lines) = channel();
        let reader = std::thread::spawn(move || {
            let lines = std::io::BufRead::lines(std::io::BufReader::new(stderr));
            for line in lines.map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Log {
            lines,
            reader: Some(reader),
            seen: Vec::new(),
        }
    }

    /// Waits up to 20 s for "sidecar started" and returns the inbound and admin addresses.
    pub(crate) fn started(&mut self) -> (SocketAddr, SocketAddr) {
        loop {
            match self.lines.recv_timeout(Duration::from_secs(20)) {
                Ok(line) if line.contains("sidecar started") => {
                    let addrs = (
                        logged_addr(&line, "inbound_addr"),
                        logged_addr(&line, "admin"),
                    );
                    self.seen.push(line);
                    return addrs;
                }
                Ok(line) => self.seen.push(line),
                Err(e) => panic!(
                    "no \"sidecar started\" line ({e}); stderr:\n{}",
                    self.text()
                ),
            }
        }
    }

    /// Everything read so far; after the sidecar exits, everything it wrote.
    pub(crate) fn text(&mut self) -> String {
        if self.reader.as_ref().is_some_and(|r| r.is_finished()) {
            let _ = self.reader.take().map(JoinHandle::join);
        }
        self.seen.extend(self.lines.try_iter());
        self.seen.join("\n")
    }
}

/// The address logged as `key=ADDR` or `key=Some(ADDR)`.
fn logged_addr(line: &str, key: &str) -> SocketAddr {
    let rest = line
        .split_once(&format!(" {key}="))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
        .1;
    let rest = rest.strip_prefix("Some(").unwrap_or(rest);
    let end = rest.find([' ', ')']).unwrap_or(rest.len());
    rest[..end].parse().unwrap()
}
