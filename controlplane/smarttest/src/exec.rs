//! Running a script step once, and recording it as an exchange: the exit status as the answer's
//! status, standard output as its body (the first [`MAX_KEPT`] bytes kept, the rest counted),
//! so the findings compare a script's passes as they compare answers. A program that cannot be
//! started or that runs past its timeout is the exchange's `error`, never a panic or a lost
//! step. Standard error is passed on to the runner's (a person's terminal, a Job's log);
//! standard input is empty.
//!
//! The environment is the runner's, less every `SPUR_*` variable (a runner pod's own
//! `SPUR_ROUTING_KEY` would send the baseline's passes to the sandbox), plus the step's `env`,
//! `SPUR_TEST_SIDE` (`sandbox` or `baseline`) and, when the pass carries one, `SPUR_ROUTING_KEY`
//! and `SPUR_BAGGAGE` (the whole `baggage` header a request of the pass carries: its key and,
//! with `--calls`, the run's marker).

use std::process::Stdio;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use http::HeaderMap;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use spur_proto::traffic::{Body, Exchange};
use tokio::io::AsyncReadExt as _;

use crate::script::{PreparedScript, RESERVED_ENV_PREFIX};
use crate::send::{MAX_KEPT, micros, route, unix_micros_now};

/// How long standard output and error are still read once the script has exited.
const OUTPUT_GRACE: Duration = Duration::from_secs(1);

/// The method an exchange of a script step carries (its protocol is unspecified).
pub const SCRIPT_METHOD: &str = "SCRIPT";

/// Which side a pass runs against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Baseline,
    Sandbox,
}

impl Side {
    pub fn as_str(self) -> &'static str {
        match self {
            Side::Baseline => "baseline",
            Side::Sandbox => "sandbox",
        }
    }
}

/// Runs `script` once against `side`, its requests to carry routing key `key` (`None`: none)
/// and the run's `marker`, and returns what it did within `timeout`. Whatever the script
/// started is killed when it exits or times out: a pass does not outlive itself.
pub async fn execute(
    script: &PreparedScript,
    timeout: Duration,
    side: Side,
    key: Option<&str>,
    marker: Option<&str>,
) -> Exchange {
    let mut x = Exchange {
        method: SCRIPT_METHOD.to_owned(),
        start_unix_micros: unix_micros_now(),
        routing_key: key.unwrap_or_default().to_owned(),
        ..Exchange::default()
    };
    let inherited = std::env::vars_os().map(|(name, _)| name);
    let mut cmd = command(script, side, key, marker, inherited);
    let started = Instant::now();
    let mut child = match cmd.spawn() {
        Ok(child) => child,
        Err(e) => {
            x.error = format!("cannot start {}: {e}", script.program);
            return x;
        }
    };
    let group = Group(AtomicI32::new(
        child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .unwrap_or(0),
    ));
    let mut stdout = child.stdout.take();
    let (mut kept, mut size) = (Vec::new(), 0u64);
    let read = async {
        let Some(out) = stdout.as_mut() else {
            return;
        };
        let mut buf = vec![0u8; 16 * 1024];
        // Read to the end, keeping the first MAX_KEPT bytes: memory stays bounded whatever the
        // script writes, and it never blocks on a full pipe.
        while let Ok(n) = out.read(&mut buf).await {
            if n == 0 {
                break;
            }
            size += n as u64;
            let room = MAX_KEPT.saturating_sub(kept.len());
            kept.extend_from_slice(&buf[..n.min(room)]);
        }
    };
    // Standard error is passed on, not inherited: a script in a process group of its own that
    // touched the terminal would be stopped (SIGTTOU) until its timeout.
    let stderr = child.stderr.take().map(|mut err| {
        tokio::spawn(async move {
            let mut buf = vec![0u8; 8 * 1024];
            while let Ok(n) = err.read(&mut buf).await {
                // A few KiB at a time to the runner's own stderr (a terminal, a Job's log):
                // written as it comes, a line the script flushed is not held back.
                if n == 0 || std::io::Write::write_all(&mut std::io::stderr(), &buf[..n]).is_err() {
                    break;
                }
            }
        })
    });
    let waited = async {
        let status = child.wait().await;
        // What the script left running would hold standard output open (and outlive the run).
        group.stop();
        status
    };
    let work = async {
        let (mut read, mut waited) = (std::pin::pin!(read), std::pin::pin!(waited));
        let mut read_all = false;
        let status = loop {
            tokio::select! {
                () = &mut read, if !read_all => read_all = true,
                status = &mut waited => break status,
            }
        };
        // A process that left the group (setsid) may still hold standard output: what it
        // wrote within the grace counts, and the script's own exit status stands.
        if !read_all {
            let _ = tokio::time::timeout(OUTPUT_GRACE, &mut read).await;
        }
        status
    };
    let outcome = tokio::time::timeout(timeout, work).await;
    x.duration_micros = micros(started.elapsed());
    x.response_micros = x.duration_micros;
    match outcome {
        Ok(Ok(status)) => x.status = exit_status(status),
        Ok(Err(e)) => x.error = format!("waiting for {}: {e}", script.program),
        Err(_) => {
            group.stop();
            // The leader itself too, should it have left its group.
            let _ = child.start_kill();
            let _ = child.wait().await;
            x.error = format!(
                "{} ran past its timeout of {} s: stopped",
                script.program,
                timeout.as_secs()
            );
        }
    }
    if let Some(task) = stderr {
        // Its writers are gone (or killed): what is left in the pipe is short.
        let _ = tokio::time::timeout(OUTPUT_GRACE, task).await;
    }
    x.response_body = Some(Body {
        size,
        truncated: size > kept.len() as u64,
        data: kept,
    });
    x
}

/// The process of one pass: `inherited` names the variables of the runner's environment.
fn command(
    script: &PreparedScript,
    side: Side,
    key: Option<&str>,
    marker: Option<&str>,
    inherited: impl Iterator<Item = std::ffi::OsString>,
) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(&script.program);
    cmd.args(&script.args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group, so everything it starts can be stopped with it.
        .process_group(0)
        .kill_on_drop(true);
    for name in inherited {
        if name.to_string_lossy().starts_with(RESERVED_ENV_PREFIX) {
            cmd.env_remove(name);
        }
    }
    cmd.envs(script.env.iter().map(|(n, v)| (n, v)));
    cmd.env("SPUR_TEST_SIDE", side.as_str());
    if let Some(key) = key {
        cmd.env("SPUR_ROUTING_KEY", key);
    }
    let mut headers = HeaderMap::new();
    route(&mut headers, key, marker);
    if let Some(baggage) = headers.get("baggage").and_then(|v| v.to_str().ok()) {
        cmd.env("SPUR_BAGGAGE", baggage);
    }
    cmd
}

/// A script's process group, killed (SIGKILL) once: when told to, or when dropped before that
/// (a run canceled while a script runs, its future dropped at Ctrl-C, takes the script and what
/// it started with it). It is killed just after its leader is reaped: the id stays the group's
/// while any member lives, and with none left the kill finds nothing (ESRCH), unless in that
/// instant the id went to a new process that made itself a group leader. Once only, so that
/// window is not opened again later.
struct Group(AtomicI32);

impl Group {
    fn stop(&self) {
        let group = self.0.swap(0, Ordering::Relaxed);
        if group > 0 {
            // ESRCH: nothing of it is left.
            let _ = killpg(Pid::from_raw(group), Signal::SIGKILL);
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The exit status as a shell reports it: the code, or 128 + the signal that ended it.
fn exit_status(status: std::process::ExitStatus) -> u32 {
    use std::os::unix::process::ExitStatusExt as _;
    match (status.code(), status.signal()) {
        (Some(code), _) => u32::try_from(code).unwrap_or(255),
        (None, Some(signal)) => 128 + u32::try_from(signal).unwrap_or(0),
        (None, None) => 255,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> PreparedScript {
        PreparedScript {
            program: "sh".into(),
            args: vec!["-c".into(), script.into()],
            env: vec![("GREETING".into(), "hello".into())],
        }
    }

    fn out(x: &Exchange) -> String {
        String::from_utf8_lossy(&x.response_body.as_ref().unwrap().data).into_owned()
    }

    #[tokio::test]
    async fn a_pass_sees_its_side_and_key_only_and_its_status_and_output_are_the_answer() {
        // A runner pod's own key is not passed on (the environment of this test has none).
        let runner =
            ["PATH", "SPUR_ROUTING_KEY", "SPUR_SANDBOX_NAME"].map(std::ffi::OsString::from);
        let cmd = command(&sh(""), Side::Baseline, None, None, runner.into_iter());
        let removed: Vec<_> = cmd
            .as_std()
            .get_envs()
            .filter(|(_, v)| v.is_none())
            .map(|(n, _)| n.to_owned())
            .collect();
        assert_eq!(removed, ["SPUR_ROUTING_KEY", "SPUR_SANDBOX_NAME"]);
        let s = sh(
            r#"echo "{\"side\":\"$SPUR_TEST_SIDE\",\"key\":\"${SPUR_ROUTING_KEY:-none}\",\"baggage\":\"${SPUR_BAGGAGE:-none}\",\"greeting\":\"$GREETING\"}"; exit 3"#,
        );
        let timeout = Duration::from_secs(10);
        let b = execute(&s, timeout, Side::Baseline, None, None).await;
        assert_eq!(b.error, "");
        assert_eq!(b.status, 3);
        assert_eq!(b.method, SCRIPT_METHOD);
        assert_eq!(
            out(&b),
            "{\"side\":\"baseline\",\"key\":\"none\",\"baggage\":\"none\",\"greeting\":\"hello\"}\n"
        );
        let s2 = execute(&s, timeout, Side::Sandbox, Some("k1"), Some("t.0.s")).await;
        let v: serde_json::Value = serde_json::from_str(&out(&s2)).unwrap();
        assert_eq!(v["side"], "sandbox");
        assert_eq!(v["key"], "k1");
        let baggage = v["baggage"].as_str().unwrap();
        assert!(
            baggage.contains("sd-routing-key=k1") && baggage.contains("spur-test-step=t.0.s"),
            "{baggage}"
        );
        assert_eq!(s2.routing_key, "k1");
    }

    /// A baseline pass of `script` without a key, within `seconds`.
    async fn baseline(script: &PreparedScript, seconds: u64) -> Exchange {
        let timeout = Duration::from_secs(seconds);
        execute(script, timeout, Side::Baseline, None, None).await
    }

    #[tokio::test]
    async fn output_is_bounded_a_timeout_stops_everything_it_started_and_a_missing_program_is_an_error()
     {
        let big = baseline(&sh("head -c 1000000 /dev/zero | tr '\\0' a"), 20).await;
        let body = big.response_body.unwrap();
        assert_eq!(
            (body.size, body.data.len(), body.truncated),
            (1_000_000, MAX_KEPT, true)
        );

        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("survived");
        let child = format!("(sleep 3; touch {m}) &", m = marker.display());
        // A child that would outlive the script, and a script that outlives its timeout.
        let started = Instant::now();
        let slow = baseline(&sh(&format!("{child} sleep 30")), 1).await;
        assert!(started.elapsed() < Duration::from_secs(10));
        assert!(
            slow.error.contains("ran past its timeout of 1 s"),
            "{}",
            slow.error
        );
        // A background child left by a script that exits is stopped too.
        let left = baseline(&sh(&format!("{child} echo done")), 20).await;
        assert_eq!((left.status, out(&left).as_str()), (0, "done\n"));
        // And a run dropped while its script runs (Ctrl-C in `spur test run`) stops it all.
        let dropped = tokio::time::timeout(
            Duration::from_millis(500),
            baseline(&sh(&format!("{child} sleep 30")), 60),
        )
        .await;
        assert!(dropped.is_err());
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert!(!marker.exists(), "a script's child outlived its pass");

        let missing = PreparedScript {
            program: "spur-no-such-program".into(),
            args: Vec::new(),
            env: Vec::new(),
        };
        let missing = baseline(&missing, 5).await;
        assert!(
            missing
                .error
                .starts_with("cannot start spur-no-such-program"),
            "{}",
            missing.error
        );
        let killed = baseline(&sh("kill -TERM $$"), 5).await;
        assert_eq!(killed.status, 128 + 15);

        // A process that left the group holds standard output: the script's exit status and
        // output still count once the grace is over, long before the timeout.
        let pid_file = dir.path().join("escaped.pid");
        let escaped = format!(
            "setsid sleep 20 & echo $! >{p}; echo out; exit 4",
            p = pid_file.display()
        );
        let started = Instant::now();
        let held = baseline(&sh(&escaped), 60).await;
        let pid: i32 = std::fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
        assert_eq!(
            (held.status, out(&held).as_str(), held.error.as_str()),
            (4, "out\n", "")
        );
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
    }
}
