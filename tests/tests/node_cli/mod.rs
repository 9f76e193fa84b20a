//! The `spur` command on the node (issue 46), against the chart as installed (webhooks, RBAC,
//! a kubelet that really pulls images): a docs example made with `spur sandbox apply --wait`
//! in a real terminal (tmux), its progress read off the screen as a person sees it; a sandbox
//! whose fork image does not exist fails `--wait` with the kubelet's reason and a non-zero exit
//! within a bounded time; `spur sandbox delete --wait` returns once the forks are gone.

pub(crate) mod propagation;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use spur_e2e::node::{Node, spur_bin};

/// What a `spur` run printed and how it ended.
pub(crate) struct Ran {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub took: Duration,
}

/// Runs `spur ARGS --kubeconfig KUBECONFIG` with `stdin`, killed after `limit`.
pub(crate) fn spur_with(kubeconfig: &Path, args: &[&str], stdin: &str, limit: Duration) -> Ran {
    use std::io::Write as _;
    let start = Instant::now();
    let mut child = Command::new("timeout")
        .args(["-s", "KILL", &limit.as_secs().to_string()])
        .arg(spur_bin("spur"))
        .args(args)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin.as_bytes()).unwrap();
    drop(input);
    let out = child.wait_with_output().unwrap();
    let ran = Ran {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        took: start.elapsed(),
    };
    eprintln!(
        "$ spur {} ({:.1?}, exit {:?})\n{}{}",
        args.join(" "),
        ran.took,
        ran.code,
        ran.stdout,
        ran.stderr
    );
    ran
}

/// A tmux server of its own (socket name per process), killed on drop.
struct Terminal {
    socket: String,
}

impl Terminal {
    fn tmux(&self) -> Command {
        let mut c = Command::new("tmux");
        c.args(["-L", &self.socket]);
        c
    }

    /// Runs `script` in a 160×50 terminal; returns the screen once it printed `EXIT=<code>`.
    fn run(script: &str, limit: Duration) -> (String, i32) {
        let term = Terminal {
            socket: format!("spur-node-cli-{}", std::process::id()),
        };
        let status = term
            .tmux()
            .args(["new-session", "-d", "-x", "160", "-y", "50", "-s", "cli"])
            // The pane stays after the command so its last screen can be read.
            .arg(format!("{script}; echo EXIT=$?; sleep 600"))
            .status()
            .unwrap();
        assert!(status.success(), "tmux new-session");
        let start = Instant::now();
        loop {
            let out = term
                .tmux()
                .args(["capture-pane", "-p", "-J", "-S", "-200", "-t", "cli"])
                .output()
                .unwrap();
            let screen = String::from_utf8_lossy(&out.stdout).into_owned();
            if let Some(code) = screen
                .lines()
                .find_map(|l| l.strip_prefix("EXIT="))
                .and_then(|c| c.trim().parse().ok())
            {
                return (screen.trim_end().to_string(), code);
            }
            assert!(
                start.elapsed() < limit,
                "no end of the command after {limit:?}; screen:\n{screen}"
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        let _ = self.tmux().arg("kill-server").status();
    }
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// `spur sandbox apply -f FILE --wait` in a terminal for the Sandbox `name` in `yaml`: every
/// step of its fork of `hotrod/route`, in order, and the summary are on the screen; returns the
/// printed routing key.
pub(crate) fn apply_ready_in_a_terminal(node: &Node, yaml: &str, name: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join(format!("{name}.yaml"));
    std::fs::write(&file, yaml).unwrap();
    let script = format!(
        "{} sandbox apply -f {} --wait --timeout 240s --kubeconfig {}",
        shell_quote(&spur_bin("spur").display().to_string()),
        shell_quote(&file.display().to_string()),
        shell_quote(&node.kubeconfig.display().to_string()),
    );
    let (screen, code) = Terminal::run(&script, Duration::from_secs(300));
    eprintln!("the terminal of `spur sandbox apply --wait`:\n{screen}");
    assert_eq!(code, 0, "{screen}\n{}", node.describe("hotrod"));
    let key = screen
        .lines()
        .find_map(|l| l.strip_prefix("Routing key: "))
        .map(|k| k.trim().to_string())
        .unwrap_or_else(|| panic!("no routing key on the screen:\n{screen}"));
    // Every progress line is `[ elapsed] item: step`.
    let steps: Vec<&str> = screen
        .lines()
        .filter_map(|l| l.split_once("] ").map(|(_, rest)| rest))
        .collect();
    // Per item, in this order.
    let orders = [
        vec![
            "sandbox: applied".to_string(),
            format!("sandbox: routing key {key}"),
        ],
        vec![
            "hotrod/route: waiting for the operator".into(),
            "hotrod/route: ForkedWorkload hotrod/".into(),
            "hotrod/route: Deployment hotrod/".into(),
            "hotrod/route: pod ".into(),
            "hotrod/route: scheduled on ".into(),
            "hotrod/route: images pulled".into(),
            "hotrod/route: pod ready".into(),
            "hotrod/route: routes published; ".into(),
        ],
    ];
    for order in orders {
        let item = order[0]
            .split_once(": ")
            .map(|(i, _)| i)
            .unwrap_or_default();
        let of_item: Vec<&&str> = steps
            .iter()
            .filter(|s| s.starts_with(&format!("{item}: ")))
            .collect();
        assert_eq!(of_item.len(), order.len(), "each step once:\n{screen}");
        for (got, want) in of_item.iter().zip(&order) {
            assert!(
                got.starts_with(want.as_str()),
                "{want:?}, not {got:?}:\n{screen}"
            );
        }
    }
    for want in [
        format!("Sandbox {name} is ready ("),
        format!("curl -H 'baggage: sd-routing-key={key}' http://route.hotrod.svc:"),
    ] {
        assert!(screen.contains(&want), "{want:?} on the screen:\n{screen}");
    }
    key
}

/// `spur sandbox delete NAME --wait`: exit 0 once it and its forks are gone.
pub(crate) fn delete_gone(node: &Node, name: &str) {
    let ran = spur_with(
        &node.kubeconfig,
        &["sandbox", "delete", name, "--wait", "--timeout", "120s"],
        "",
        Duration::from_secs(150),
    );
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert!(ran.stdout.contains(&format!("sandbox {name} deleted")));
    assert!(
        ran.stdout.contains("ForkedWorkload ") && ran.stdout.contains(": removed"),
        "{}",
        ran.stdout
    );
    assert!(ran.stdout.contains("gone in "), "{}", ran.stdout);
    let left = node.kubectl(&["get", "sandbox", name, "--ignore-not-found", "-o", "name"]);
    assert_eq!(left.unwrap().trim(), "", "{name} is gone");
}

/// A fork of `hotrod/route` whose image cannot be pulled: `--wait` ends with the kubelet's
/// reason, the pod to look at and exit 3, well before its time limit.
pub(crate) fn missing_image_fails(node: &Node) {
    // A registry port nothing listens on: the pull fails at once, every time.
    let yaml = r#"apiVersion: spur.dev/v1alpha1
kind: Sandbox
metadata:
  name: route-bad-image
spec:
  forks:
    - forkOf: {kind: Deployment, namespace: hotrod, name: route}
      customizations:
        images: [{image: "127.0.0.1:5999/spur/missing:none", container: hotrod}]
"#;
    let ran = spur_with(
        &node.kubeconfig,
        &["sandbox", "apply", "-f", "-", "--wait", "--timeout", "170s"],
        yaml,
        Duration::from_secs(200),
    );
    assert_eq!(ran.code, Some(3), "exit 3 (a failure): {}", ran.stderr);
    assert!(
        ran.took < Duration::from_secs(170),
        "the failure is seen before the time limit: {:?}",
        ran.took
    );
    let reason_seen = ["ErrImagePull", "ImagePullBackOff"].iter().any(|r| {
        ran.stderr
            .contains(&format!("sandbox route-bad-image failed: {r}: "))
    });
    assert!(reason_seen, "{}", ran.stderr);
    assert!(
        ran.stderr.contains("127.0.0.1:5999/spur/missing:none")
            && ran.stderr.contains("look at: pod hotrod/route-bad-image-"),
        "{}",
        ran.stderr
    );
    delete_gone(node, "route-bad-image");
}

/// `spur route explain` for the key of Sandbox `sandbox` through Service `route.hotrod`: the
/// key's owner and destination, and the rule live in every baseline pod's sidecar (read
/// through a port-forward made with the caller's rights); a key nobody has is not live (exit 3).
pub(crate) fn route_explained(node: &Node, sandbox: &str, key: &str) {
    let pods = node
        .pods("hotrod", "app=route")
        .unwrap()
        .into_iter()
        .filter(|p| !p.starts_with(sandbox))
        .collect::<Vec<_>>();
    assert!(!pods.is_empty(), "baseline pods of hotrod/route");
    // Routes reach the sidecars a moment after the Sandbox is Ready at the route server.
    let ran = spur_e2e::node::eventually(
        "the rule live in every baseline sidecar",
        Duration::from_secs(60),
        || {
            let ran = spur_with(
                &node.kubeconfig,
                &["route", "explain", "--key", key, "route.hotrod:8080"],
                "",
                Duration::from_secs(60),
            );
            Ok((ran.code == Some(0)).then_some(ran))
        },
    )
    .unwrap();
    assert!(
        ran.stdout.contains(&format!(
            "Key {key}: Sandbox {sandbox}.\n  sandbox {sandbox}: Service hotrod/route -> "
        )),
        "{}",
        ran.stdout
    );
    for pod in &pods {
        assert!(
            ran.stdout.lines().any(|l| l
                .starts_with(&format!("  {pod}  live (routing table version "))
                && l.contains("port 8080 -> ")),
            "{pod} live in:\n{}",
            ran.stdout
        );
    }
    let ran = spur_with(
        &node.kubeconfig,
        &[
            "route",
            "explain",
            "--key",
            "nobody-has-this",
            "route.hotrod:8080",
        ],
        "",
        Duration::from_secs(60),
    );
    assert_eq!(ran.code, Some(3), "{}", ran.stderr);
    assert!(
        ran.stdout
            .contains("Key nobody-has-this: no Sandbox or RouteGroup you can list has it")
            && ran.stdout.contains("NOT live"),
        "{}",
        ran.stdout
    );
}
