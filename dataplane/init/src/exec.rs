//! Running the rule tools: stdin script in, stdout out, stderr into the error, bounded in time.

use std::io::{ErrorKind, Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::Error;

/// No rule tool takes long; one that hangs (a wedged lock, a stuck modprobe) must not hang the
/// pod's start forever without saying why.
const TIMEOUT: Duration = Duration::from_secs(30);

/// Runs `program args`, feeding `input` on stdin, and returns its stdout.
pub(crate) fn run(program: &str, args: &[&str], input: Option<&str>) -> Result<String, Error> {
    let command = std::iter::once(program)
        .chain(args.iter().copied())
        .collect::<Vec<_>>()
        .join(" ");
    tracing::debug!(%command, "running");
    let mut child = Command::new(program)
        .args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| match source.kind() {
            ErrorKind::NotFound => Error::ToolNotFound {
                tool: program.to_owned(),
                hint: install_hint(program),
            },
            _ => Error::Spawn {
                command: command.clone(),
                source,
            },
        })?;
    let (stdin, stdout, stderr) = (child.stdin.take(), child.stdout.take(), child.stderr.take());
    // Reading and writing on their own threads: a tool that writes a lot before it reads all
    // of its input cannot deadlock against us.
    let (status, out, err) = std::thread::scope(|s| {
        s.spawn(move || {
            if let (Some(mut w), Some(text)) = (stdin, input) {
                // A tool that exits early closes the pipe; its status and stderr say why.
                let _ = w.write_all(text.as_bytes());
            }
        });
        let out = s.spawn(move || read_all(stdout));
        let err = s.spawn(move || read_all(stderr));
        let status = wait(&mut child);
        (
            status,
            out.join().unwrap_or_default(),
            err.join().unwrap_or_default(),
        )
    });
    match status {
        Ok(Some(status)) if status.success() => Ok(out),
        Ok(Some(status)) => Err(Error::ToolFailed {
            command,
            status: status.to_string(),
            stderr: explain(err.trim(), input),
        }),
        Ok(None) => Err(Error::ToolTimeout {
            command,
            seconds: TIMEOUT.as_secs(),
        }),
        Err(source) => Err(Error::Spawn { command, source }),
    }
}

/// Whether `program` is an executable file somewhere on PATH.
pub(crate) fn installed(program: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|dir| {
            std::fs::metadata(dir.join(program))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    })
}

/// The child's exit status, or `None` after it was killed for running past [`TIMEOUT`].
fn wait(child: &mut Child) -> std::io::Result<Option<ExitStatus>> {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn read_all(pipe: Option<impl Read>) -> String {
    let mut bytes = Vec::new();
    if let Some(mut p) = pipe {
        let _ = p.read_to_end(&mut bytes);
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// iptables-restore only says "line N failed"; quote that line of the script.
fn explain(stderr: &str, input: Option<&str>) -> String {
    let line = stderr
        .split("line ")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse::<usize>().ok());
    match (line, input) {
        (Some(n), Some(input)) if n > 0 => match input.lines().nth(n - 1) {
            Some(text) => format!("{stderr} (line {n}: {text})"),
            None => stderr.to_owned(),
        },
        _ if stderr.is_empty() => "(no output on stderr)".to_owned(),
        _ => stderr.to_owned(),
    }
}

fn install_hint(program: &str) -> &'static str {
    if program.starts_with("nft") {
        "install nftables (Debian: apt-get install nftables), or use --mode iptables"
    } else if program.contains("tables-legacy") {
        "install iptables (Debian's iptables package provides iptables-legacy), or use --mode nft"
    } else {
        "install it or put it on PATH"
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn failures_carry_stderr_and_the_failing_line() {
        let e = run(
            "sh",
            &[
                "-c",
                "cat >/dev/null; echo 'iptables-restore: line 2 failed' >&2; exit 1",
            ],
            Some("*nat\n-X NOPE\nCOMMIT\n"),
        )
        .unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("line 2 failed (line 2: -X NOPE)") && text.contains("exit status: 1"),
            "{text}"
        );
        assert_eq!(e.exit_code(), crate::exit::TOOL_FAILED);

        assert_eq!(run("sh", &["-c", "cat"], Some("in\n")).unwrap(), "in\n");

        let e = run("spur-init-no-such-tool", &[], None).unwrap_err();
        assert_eq!(e.exit_code(), crate::exit::TOOL_NOT_FOUND, "{e}");
        assert!(installed("sh") && !installed("spur-init-no-such-tool"));
    }
}
