//! Wire compatibility of the route server with the REAL public Go client of the Signadot Routes
//! API, `github.com/signadot/routesapi/go-routesapi` (Apache-2.0, fetched from the Go module
//! proxy at the version pinned in `tests/go/go.mod`):
//!
//! * `sdroutes`, their CLI, unchanged: `GetWorkloadRoutingRules` with every filter flag, and
//!   `-watch` (protojson output, parsed here);
//! * `routesapi-watch` (`tests/go/main.go`), our harness importing their `watched` package (the
//!   retrying watch cache), their `workload.Router` (what the DevMesh sidecar uses) and their
//!   generated gRPC client dialed like sdroutes at HEAD (keepalive pings every 5 s).
//!
//! `tests/go/build.sh` builds both once per test run; Go is required (the test fails if it is
//! missing). Every process is killed on drop, all traffic stays on 127.0.0.1, every wait is
//! bounded.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use spur_routeserver::{RouteServer, RouteServerConfig};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::time::{Instant, sleep, timeout};

/// Longest single wait for anything a client prints.
const WAIT: Duration = Duration::from_secs(15);
/// How long "nothing else arrives" is checked for.
const QUIET: Duration = Duration::from_millis(1500);

// === building the Go clients ===

fn go_bin(name: &str) -> PathBuf {
    spur_e2e::go_bin_dir().join(name)
}

// === rules ===

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Baseline {
    kind: &'static str,
    namespace: &'static str,
    name: &'static str,
}

const WEB: Baseline = Baseline {
    kind: "Deployment",
    namespace: "ns1",
    name: "web",
};
const API: Baseline = Baseline {
    kind: "Deployment",
    namespace: "ns2",
    name: "api",
};
/// Same namespace and name as [`WEB`], another kind: only the kind tells them apart.
const WEB_ROLLOUT: Baseline = Baseline {
    kind: "ArgoRollout",
    namespace: "ns1",
    name: "web",
};

/// A rule as the clients report it. Identity: (baseline, routing key).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Rule {
    baseline: (String, String, String),
    key: String,
    sandbox: String,
    mappings: Vec<(u32, Vec<(String, u32)>)>,
}

impl Rule {
    fn new(key: &str, b: &Baseline, sandbox: &str, mappings: &[(u32, &[(&str, u32)])]) -> Rule {
        Rule {
            baseline: (b.kind.into(), b.namespace.into(), b.name.into()),
            key: key.into(),
            sandbox: sandbox.into(),
            mappings: mappings
                .iter()
                .map(|(p, ds)| (*p, ds.iter().map(|(h, p)| ((*h).to_string(), *p)).collect()))
                .collect(),
        }
    }

    /// The rule file format (the Routes API REST schema, camelCase).
    fn to_json(&self) -> Value {
        serde_json::json!({
            "routingKey": self.key,
            "baseline": {"kind": self.baseline.0, "namespace": self.baseline.1, "name": self.baseline.2},
            "destinationSandbox": {"name": self.sandbox},
            "mappings": self.mappings.iter().map(|(p, ds)| serde_json::json!({
                "workloadPort": p,
                "destinations": ds.iter().map(|(h, p)| serde_json::json!({"host": h, "port": p})).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        })
    }

    /// The same in block-style YAML.
    fn to_yaml(&self) -> String {
        let (kind, ns, name) = &self.baseline;
        let mut s = format!(
            "- routingKey: {}\n  baseline:\n    kind: {kind}\n    namespace: {ns}\n    name: {name}\n  destinationSandbox:\n    name: {}\n",
            self.key, self.sandbox
        );
        if self.mappings.is_empty() {
            s.push_str("  mappings: []\n");
        } else {
            s.push_str("  mappings:\n");
            for (p, ds) in &self.mappings {
                s.push_str(&format!("    - workloadPort: {p}\n      destinations:\n"));
                for (h, dp) in ds {
                    s.push_str(&format!("        - host: {h}\n          port: {dp}\n"));
                }
            }
        }
        s
    }

    /// `<key> <kind>/<ns>/<name> <sandbox> <mappings>`: the line format of `routesapi-watch`.
    fn describe(&self) -> String {
        let (kind, ns, name) = &self.baseline;
        let mappings = if self.mappings.is_empty() {
            "-".to_string()
        } else {
            self.mappings
                .iter()
                .map(|(p, ds)| {
                    let ds: Vec<String> = ds.iter().map(|(h, p)| format!("{h}:{p}")).collect();
                    format!("{p}->{}", ds.join(","))
                })
                .collect::<Vec<_>>()
                .join(";")
        };
        format!(
            "{} {kind}/{ns}/{name} {} {mappings}",
            self.key, self.sandbox
        )
    }

    /// Parses a rule printed by sdroutes: protojson with proto field names (`routing_key`,
    /// `destination_sandbox`, `workload_port`) and unpopulated fields emitted.
    fn from_protojson(v: &Value) -> Rule {
        let s = |v: &Value, f: &str| -> String {
            v.get(f)
                .and_then(Value::as_str)
                .unwrap_or_else(|| panic!("no string field {f:?} in {v}"))
                .to_string()
        };
        let u = |v: &Value, f: &str| -> u32 {
            let n = v
                .get(f)
                .and_then(Value::as_u64)
                .unwrap_or_else(|| panic!("no number field {f:?} in {v}"));
            u32::try_from(n).unwrap()
        };
        let b = &v["baseline"];
        assert!(b.is_object(), "rule without baseline: {v}");
        let sb = &v["destination_sandbox"];
        assert!(sb.is_object(), "rule without destination_sandbox: {v}");
        let mappings = v["mappings"]
            .as_array()
            .unwrap_or_else(|| panic!("no mappings array in {v}"))
            .iter()
            .map(|m| {
                let ds = m["destinations"]
                    .as_array()
                    .unwrap_or_else(|| panic!("no destinations array in {m}"))
                    .iter()
                    .map(|d| (s(d, "host"), u(d, "port")))
                    .collect();
                (u(m, "workload_port"), ds)
            })
            .collect();
        Rule {
            baseline: (s(b, "kind"), s(b, "namespace"), s(b, "name")),
            key: s(v, "routing_key"),
            sandbox: s(sb, "name"),
            mappings,
        }
    }
}

fn set(rules: &[&Rule]) -> BTreeSet<Rule> {
    rules.iter().map(|r| (*r).clone()).collect()
}

/// The rules directory of a test: files are written atomically (hidden temp file + rename).
struct Rules {
    dir: tempfile::TempDir,
}

impl Rules {
    fn new() -> Rules {
        Rules {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn write(&self, file: &str, rules: &[&Rule]) {
        let body = if file.ends_with(".json") {
            serde_json::to_string_pretty(&Value::Array(rules.iter().map(|r| r.to_json()).collect()))
                .unwrap()
        } else if rules.is_empty() {
            "[]\n".to_string()
        } else {
            rules.iter().map(|r| r.to_yaml()).collect()
        };
        let tmp = self.dir.path().join(format!(".{file}.tmp"));
        std::fs::write(&tmp, body).unwrap();
        std::fs::rename(&tmp, self.dir.path().join(file)).unwrap();
    }

    fn remove(&self, file: &str) {
        std::fs::remove_file(self.dir.path().join(file)).unwrap();
    }
}

/// The fixture: six rules over three baselines (two namespaces, two kinds), three sandboxes,
/// three files (block YAML, flow-ish YAML extension `.yml`, JSON).
struct Fixture {
    k1_web: Rule,
    k2_web: Rule,
    k5_web: Rule,
    k1_api: Rule,
    k3_api: Rule,
    k4_rollout: Rule,
}

impl Fixture {
    fn new() -> Fixture {
        Fixture {
            k1_web: Rule::new(
                "k1",
                &WEB,
                "sb1",
                &[
                    (8080, &[("sb1-web.ns1.svc", 8080)]),
                    (9090, &[("sb1-web.ns1.svc", 9090)]),
                ],
            ),
            k2_web: Rule::new(
                "k2",
                &WEB,
                "sb2",
                &[(
                    8080,
                    &[("sb2-web.ns1.svc", 8080), ("sb2-web-alt.ns1.svc", 8081)],
                )],
            ),
            // No mappings: the baseline has no Service (allowed by the Routes API).
            k5_web: Rule::new("k5", &WEB, "sb3", &[]),
            k1_api: Rule::new("k1", &API, "sb1", &[(80, &[("sb1-api.ns2.svc", 80)])]),
            k3_api: Rule::new("k3", &API, "sb3", &[(80, &[("10.0.0.7", 8000)])]),
            k4_rollout: Rule::new(
                "k4",
                &WEB_ROLLOUT,
                "sb2",
                &[(8080, &[("sb2-web-ro.ns1.svc", 8080)])],
            ),
        }
    }

    fn all(&self) -> Vec<&Rule> {
        vec![
            &self.k1_web,
            &self.k2_web,
            &self.k5_web,
            &self.k1_api,
            &self.k3_api,
            &self.k4_rollout,
        ]
    }

    fn write(&self, rules: &Rules) {
        rules.write("a.yaml", &[&self.k1_web, &self.k2_web, &self.k1_api]);
        rules.write("b.yml", &[&self.k3_api, &self.k4_rollout]);
        rules.write("c.json", &[&self.k5_web]);
    }
}

/// The change applied by the watch tests: on WEB, k1 changes (same sandbox), k2 goes, k6 comes,
/// k5 goes with its whole file; on API, k1 and k3 change; WEB_ROLLOUT is untouched.
struct Changed {
    k1_web: Rule,
    k6_web: Rule,
    k1_api: Rule,
    k3_api: Rule,
}

impl Changed {
    fn new() -> Changed {
        Changed {
            k1_web: Rule::new(
                "k1",
                &WEB,
                "sb1",
                &[
                    (8080, &[("sb1-web.ns1.svc", 8080)]),
                    (9090, &[("sb1-web-v2.ns1.svc", 9191)]),
                ],
            ),
            k6_web: Rule::new("k6", &WEB, "sb6", &[(8080, &[("sb6-web.ns1.svc", 8080)])]),
            k1_api: Rule::new("k1", &API, "sb1", &[(80, &[("sb1-api-v2.ns2.svc", 80)])]),
            k3_api: Rule::new("k3", &API, "sb3", &[(80, &[("10.0.0.8", 8000)])]),
        }
    }

    fn apply(&self, f: &Fixture, rules: &Rules) {
        rules.write("a.yaml", &[&self.k1_web, &self.k6_web, &self.k1_api]);
        rules.write("b.yml", &[&self.k3_api, &f.k4_rollout]);
        rules.remove("c.json");
    }
}

// === the route server ===

async fn start_server(rules: &Rules, grpc_addr: SocketAddr) -> RouteServer {
    let cfg = RouteServerConfig {
        poll_interval: Duration::from_millis(50),
        grpc_addr,
        http_addr: "127.0.0.1:0".parse().unwrap(),
        ..RouteServerConfig::new(rules.dir.path())
    };
    // Rebinding the port of a server that just stopped may briefly fail; retry for a while.
    let deadline = Instant::now() + WAIT;
    loop {
        match timeout(WAIT, RouteServer::start(cfg.clone())).await {
            Ok(Ok(s)) => return s,
            Ok(Err(e)) if Instant::now() < deadline && grpc_addr.port() != 0 => {
                eprintln!("route server start on {grpc_addr} failed ({e}); retrying");
                sleep(Duration::from_millis(200)).await;
            }
            Ok(Err(e)) => panic!("route server did not start on {grpc_addr}: {e}"),
            Err(_) => panic!("route server did not start within {WAIT:?}"),
        }
    }
}

async fn stop_server(server: RouteServer) {
    timeout(WAIT, server.shutdown())
        .await
        .unwrap_or_else(|_| panic!("route server shutdown did not finish within {WAIT:?} (open watch streams must not hold it)"));
}

// === running the clients ===

/// A running Go client: stdout read line by line, stderr collected for failure messages.
struct Proc {
    what: String,
    child: Child,
    _stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    stderr: Arc<Mutex<String>>,
}

impl Proc {
    fn spawn(bin: &str, args: &[String]) -> Proc {
        let path = go_bin(bin);
        let mut child = Command::new(&path)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", path.display()));
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut err_pipe = child.stderr.take().unwrap();
        let sink = stderr.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err_pipe.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Proc {
            what: format!("{bin} {}", args.join(" ")),
            _stdin: child.stdin.take().unwrap(),
            lines: BufReader::new(child.stdout.take().unwrap()).lines(),
            child,
            stderr,
        }
    }

    fn diag(&self) -> String {
        format!(
            "`{}`; its stderr:\n{}",
            self.what,
            self.stderr.lock().unwrap()
        )
    }

    /// The next stdout line, or `None` if none arrives within `limit`. Panics on end of output.
    async fn try_line(&mut self, limit: Duration) -> Option<String> {
        match timeout(limit, self.lines.next_line()).await {
            Err(_) => None,
            Ok(Ok(Some(l))) => Some(l),
            Ok(Ok(None)) => {
                sleep(Duration::from_millis(100)).await;
                panic!(
                    "{} exited ({:?}) — {}",
                    self.what,
                    self.child.try_wait(),
                    self.diag()
                )
            }
            Ok(Err(e)) => panic!("reading {}: {e}", self.what),
        }
    }

    async fn line(&mut self, waiting_for: &str) -> String {
        match self.try_line(WAIT).await {
            Some(l) => l,
            None => panic!(
                "no output within {WAIT:?} while waiting for {waiting_for} from {}",
                self.diag()
            ),
        }
    }

    /// The next protojson document (sdroutes prints multi-line JSON, one document per message).
    async fn try_json(&mut self, limit: Duration) -> Option<Value> {
        let deadline = Instant::now() + limit;
        let mut buf = String::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let Some(line) = self.try_line(left).await else {
                assert!(buf.is_empty(), "partial JSON from {}: {buf}", self.what);
                return None;
            };
            buf.push_str(&line);
            buf.push('\n');
            match serde_json::from_str::<Value>(&buf) {
                Ok(v) => return Some(v),
                Err(e) if e.is_eof() => continue,
                Err(e) => panic!("{} printed invalid JSON ({e}): {buf}", self.what),
            }
        }
    }

    async fn json(&mut self, waiting_for: &str) -> Value {
        match self.try_json(WAIT).await {
            Some(v) => v,
            None => panic!(
                "no output within {WAIT:?} while waiting for {waiting_for} from {}",
                self.diag()
            ),
        }
    }

    fn is_running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

/// Runs `sdroutes` (no -watch) with `filter` and returns the rules it printed.
async fn sdroutes_get(addr: SocketAddr, filter: &[&str]) -> BTreeSet<Rule> {
    let bin = go_bin("sdroutes");
    let mut cmd = Command::new(&bin);
    cmd.arg("-addr").arg(addr.to_string()).args(filter);
    cmd.stdin(Stdio::null()).kill_on_drop(true);
    let out = timeout(WAIT, cmd.output())
        .await
        .unwrap_or_else(|_| panic!("sdroutes {filter:?} did not finish within {WAIT:?}"))
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "sdroutes {filter:?} failed ({}): {stderr}",
        out.status
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "sdroutes {filter:?} printed invalid JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    let obj = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"));
    assert_eq!(
        obj.keys().collect::<Vec<_>>(),
        ["routingRules"],
        "response fields: {v}"
    );
    let list = v["routingRules"]
        .as_array()
        .unwrap_or_else(|| panic!("routingRules is not an array: {v}"));
    let rules: BTreeSet<Rule> = list.iter().map(Rule::from_protojson).collect();
    assert_eq!(rules.len(), list.len(), "duplicate rules in {v}");
    rules
}

fn sdroutes_watch(addr: SocketAddr, filter: &[&str]) -> Proc {
    let mut args = vec!["-addr".to_string(), addr.to_string(), "-watch".to_string()];
    args.extend(filter.iter().map(|s| s.to_string()));
    Proc::spawn("sdroutes", &args)
}

/// One WatchOp printed by sdroutes: `{"op": "...", "route": {...} | null}`.
fn parse_op(v: &Value) -> (String, Option<Rule>) {
    let op = v["op"]
        .as_str()
        .unwrap_or_else(|| panic!("no op in {v}"))
        .to_string();
    let route = match &v["route"] {
        Value::Null => None,
        r => Some(Rule::from_protojson(r)),
    };
    (op, route)
}

/// Reads ops until SYNCED; asserts every op before it is an ADD with a route (the official
/// client panics otherwise) and returns the added rules.
async fn sdroutes_initial(p: &mut Proc) -> BTreeSet<Rule> {
    let mut added = BTreeSet::new();
    loop {
        let v = p.json("the initial ADDs and SYNCED").await;
        match parse_op(&v) {
            (op, None) if op == "SYNCED" => return added,
            (op, Some(r)) if op == "ADD" => assert!(added.insert(r), "duplicate ADD {v}"),
            _ => panic!("before SYNCED only ADD ops with a route may arrive, got {v}"),
        }
    }
}

/// Reads `n` ops and returns them as (op, rule); every one must carry a complete route.
async fn sdroutes_ops(p: &mut Proc, n: usize) -> BTreeSet<(String, Rule)> {
    let mut ops = BTreeSet::new();
    for i in 0..n {
        let v = p.json(&format!("op {} of {n}", i + 1)).await;
        let (op, r) = parse_op(&v);
        let r = r.unwrap_or_else(|| panic!("{op} without a route: {v}"));
        assert!(
            matches!(op.as_str(), "ADD" | "REPLACE" | "REMOVE"),
            "unexpected op after SYNCED: {v}"
        );
        ops.insert((op, r));
    }
    ops
}

async fn assert_quiet(p: &mut Proc, what: &str) {
    if let Some(v) = p.try_json(QUIET).await {
        panic!("{what}: unexpected op {v}");
    }
}

/// `routesapi-watch` in `mode` on baseline `b`.
fn go_watch(addr: SocketAddr, mode: &str, b: &Baseline, extra: &[&str]) -> Proc {
    let mut args = vec![
        format!("-addr={addr}"),
        format!("-mode={mode}"),
        format!("-kind={}", b.kind),
        format!("-namespace={}", b.namespace),
        format!("-name={}", b.name),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    Proc::spawn("routesapi-watch", &args)
}

/// The view of a `routesapi-watch -mode=watched` process: routing key → described rule.
struct View {
    p: Proc,
    rules: BTreeMap<String, String>,
}

impl View {
    async fn start(addr: SocketAddr, b: &Baseline, keys: &str) -> View {
        let mut p = go_watch(addr, "watched", b, &[&format!("-keys={keys}")]);
        let mut rules = BTreeMap::new();
        loop {
            let l = p.line("the initial content and SYNCED").await;
            if l == "SYNCED" {
                break;
            }
            let rest = l
                .strip_prefix("ADD ")
                .unwrap_or_else(|| panic!("before SYNCED only ADD lines, got {l:?}"));
            let key = rest.split(' ').next().unwrap().to_string();
            assert!(
                rules.insert(key, rest.to_string()).is_none(),
                "duplicate {l:?}"
            );
        }
        View { p, rules }
    }

    fn apply(&mut self, l: &str) {
        let (op, rest) = l.split_once(' ').unwrap_or((l, ""));
        let key = rest.split(' ').next().unwrap().to_string();
        match op {
            "ADD" => assert!(
                self.rules.insert(key, rest.to_string()).is_none(),
                "ADD of a present key: {l:?}"
            ),
            "REPLACE" => assert!(
                self.rules.insert(key, rest.to_string()).is_some(),
                "REPLACE of an absent key: {l:?}"
            ),
            "REMOVE" => assert!(
                self.rules.remove(&key).is_some(),
                "REMOVE of an absent key: {l:?}"
            ),
            _ => panic!("unexpected line {l:?} from {}", self.p.diag()),
        }
    }

    /// Waits (bounded by `limit`) until the view equals `want`.
    async fn converge(&mut self, want: &[&Rule], limit: Duration) {
        let want: BTreeMap<String, String> =
            want.iter().map(|r| (r.key.clone(), r.describe())).collect();
        let deadline = Instant::now() + limit;
        while self.rules != want {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.p.try_line(left).await {
                Some(l) => self.apply(&l),
                None => panic!(
                    "the watched client did not converge within {limit:?}:\n have {:#?}\n want {want:#?}\n{}",
                    self.rules,
                    self.p.diag()
                ),
            }
        }
    }
}

fn want_lines(rules: &[&Rule]) -> BTreeMap<String, String> {
    rules
        .iter()
        .map(|r| (r.key.clone(), r.describe()))
        .collect()
}

// === an HTTP/2 frame tap ===

/// HTTP/2 frame counts seen by an [`H2Tap`].
#[derive(Default)]
struct FrameCounts {
    /// PING frames without ACK from client to server (keepalive pings).
    client_pings: AtomicUsize,
    /// PING frames with ACK from server to client.
    server_ping_acks: AtomicUsize,
    /// GOAWAY frames from server to client.
    server_goaways: AtomicUsize,
}

/// A TCP relay on 127.0.0.1 in front of `upstream` that counts the HTTP/2 frames crossing it, so
/// a test can prove keepalive pings really happened and were acknowledged.
struct H2Tap {
    addr: SocketAddr,
    counts: Arc<FrameCounts>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for H2Tap {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl H2Tap {
    async fn start(upstream: SocketAddr) -> H2Tap {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let counts = Arc::new(FrameCounts::default());
        let c = counts.clone();
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((down, _)) = listener.accept().await {
                let Ok(up) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let (dr, dw) = down.into_split();
                let (ur, uw) = up.into_split();
                conns.spawn(Self::pump(dr, uw, true, c.clone()));
                conns.spawn(Self::pump(ur, dw, false, c.clone()));
            }
        });
        H2Tap { addr, counts, task }
    }

    /// Copies `from` to `to`, parsing HTTP/2 frames (after the client preface when
    /// `from_client`).
    async fn pump(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        from_client: bool,
        counts: Arc<FrameCounts>,
    ) {
        const PREFACE: usize = 24;
        let mut skip = if from_client { PREFACE } else { 0 };
        let mut pending: Vec<u8> = Vec::new();
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if to.write_all(&buf[..n]).await.is_err() {
                return;
            }
            pending.extend_from_slice(&buf[..n]);
            let drop_now = skip.min(pending.len());
            pending.drain(..drop_now);
            skip -= drop_now;
            while pending.len() >= 9 {
                let len = (usize::from(pending[0]) << 16)
                    | (usize::from(pending[1]) << 8)
                    | usize::from(pending[2]);
                if pending.len() < 9 + len {
                    break;
                }
                let (kind, ack) = (pending[3], pending[4] & 1 == 1);
                match (from_client, kind, ack) {
                    (true, 6, false) => counts.client_pings.fetch_add(1, Ordering::SeqCst),
                    (false, 6, true) => counts.server_ping_acks.fetch_add(1, Ordering::SeqCst),
                    (false, 7, _) => counts.server_goaways.fetch_add(1, Ordering::SeqCst),
                    _ => 0,
                };
                pending.drain(..9 + len);
            }
        }
    }
}

// === tests ===

/// `sdroutes` (their CLI, GetWorkloadRoutingRules) lists every rule with full content, and each
/// filter flag alone and combined selects exactly the matching rules. sdroutes always sends a
/// baseline and a destination sandbox message with empty fields: empty must mean "any".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdroutes_get_lists_and_filters() {
    spur_e2e::go_bin_dir();
    let rules = Rules::new();
    let f = Fixture::new();
    f.write(&rules);
    let server = start_server(&rules, "127.0.0.1:0".parse().unwrap()).await;
    let addr = server.grpc_addr;

    // The server reads the directory asynchronously: wait until all rules are served.
    let all = set(&f.all());
    let deadline = Instant::now() + WAIT;
    loop {
        let got = sdroutes_get(addr, &[]).await;
        if got == all {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "sdroutes never listed all rules:\n got {got:#?}\n want {all:#?}"
        );
        sleep(Duration::from_millis(100)).await;
    }

    let cases: Vec<(Vec<&str>, Vec<&Rule>)> = vec![
        (
            vec!["-namespace", "ns1"],
            vec![&f.k1_web, &f.k2_web, &f.k5_web, &f.k4_rollout],
        ),
        (vec!["-namespace", "ns2"], vec![&f.k1_api, &f.k3_api]),
        (vec!["-namespace", "nope"], vec![]),
        (vec!["-name", "api"], vec![&f.k1_api, &f.k3_api]),
        (
            vec!["-name", "web"],
            vec![&f.k1_web, &f.k2_web, &f.k5_web, &f.k4_rollout],
        ),
        (vec!["-kind", "ArgoRollout"], vec![&f.k4_rollout]),
        (
            vec!["-kind", "Deployment"],
            vec![&f.k1_web, &f.k2_web, &f.k5_web, &f.k1_api, &f.k3_api],
        ),
        (vec!["-routing-key", "k1"], vec![&f.k1_web, &f.k1_api]),
        (vec!["-routing-key", "k3"], vec![&f.k3_api]),
        (vec!["-routing-key", "zz"], vec![]),
        (vec!["-sandbox-name", "sb2"], vec![&f.k2_web, &f.k4_rollout]),
        (vec!["-sandbox-name", "sb1"], vec![&f.k1_web, &f.k1_api]),
        (
            vec!["-kind", "Deployment", "-namespace", "ns1", "-name", "web"],
            vec![&f.k1_web, &f.k2_web, &f.k5_web],
        ),
        (
            vec!["-routing-key", "k1", "-namespace", "ns2"],
            vec![&f.k1_api],
        ),
        (
            vec!["-sandbox-name", "sb2", "-kind", "ArgoRollout"],
            vec![&f.k4_rollout],
        ),
        (vec!["-sandbox-name", "sb3", "-routing-key", "k1"], vec![]),
    ];
    for (filter, want) in cases {
        let got = sdroutes_get(addr, &filter).await;
        assert_eq!(got, set(&want), "sdroutes {filter:?}");
    }
    stop_server(server).await;
}

/// `sdroutes -watch` (their CLI, WatchWorkloadRoutingRules): a baseline watch gets ADDs then one
/// SYNCED, then exactly REPLACE/ADD/REMOVE for its baseline's changes (complete routes, REMOVE
/// carrying the removed rule) and nothing for other baselines; a routing-key watch spans
/// baselines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdroutes_watch_streams_diffs() {
    spur_e2e::go_bin_dir();
    let rules = Rules::new();
    let f = Fixture::new();
    f.write(&rules);
    let server = start_server(&rules, "127.0.0.1:0".parse().unwrap()).await;
    let addr = server.grpc_addr;
    // Wait until the rules are loaded, so the initial ADDs are the full set.
    let deadline = Instant::now() + WAIT;
    while sdroutes_get(addr, &[]).await.len() != f.all().len() {
        assert!(Instant::now() < deadline, "rules never loaded");
        sleep(Duration::from_millis(100)).await;
    }

    let mut web = sdroutes_watch(
        addr,
        &["-kind", "Deployment", "-namespace", "ns1", "-name", "web"],
    );
    let mut rollout = sdroutes_watch(
        addr,
        &["-kind", "ArgoRollout", "-namespace", "ns1", "-name", "web"],
    );
    let mut k1 = sdroutes_watch(addr, &["-routing-key", "k1"]);
    assert_eq!(
        sdroutes_initial(&mut web).await,
        set(&[&f.k1_web, &f.k2_web, &f.k5_web])
    );
    assert_eq!(sdroutes_initial(&mut rollout).await, set(&[&f.k4_rollout]));
    assert_eq!(
        sdroutes_initial(&mut k1).await,
        set(&[&f.k1_web, &f.k1_api])
    );
    assert_quiet(&mut web, "nothing changed yet").await;

    let c = Changed::new();
    c.apply(&f, &rules);
    let want: BTreeSet<(String, Rule)> = [
        ("REPLACE", &c.k1_web),
        ("REMOVE", &f.k2_web),
        ("ADD", &c.k6_web),
        ("REMOVE", &f.k5_web),
    ]
    .into_iter()
    .map(|(op, r)| (op.to_string(), r.clone()))
    .collect();
    assert_eq!(
        sdroutes_ops(&mut web, want.len()).await,
        want,
        "ops on the web baseline watch"
    );
    let want_k1: BTreeSet<(String, Rule)> = [
        ("REPLACE".to_string(), c.k1_web.clone()),
        ("REPLACE".to_string(), c.k1_api.clone()),
    ]
    .into();
    assert_eq!(
        sdroutes_ops(&mut k1, 2).await,
        want_k1,
        "ops on the routing-key watch"
    );
    assert_quiet(&mut web, "web watch after its changes").await;
    assert_quiet(&mut k1, "routing-key watch after its changes").await;
    assert_quiet(&mut rollout, "the ArgoRollout baseline did not change").await;

    // Rewriting files with identical content is not a change.
    rules.write("a.yaml", &[&c.k1_web, &c.k6_web, &c.k1_api]);
    rules.write("b.yml", &[&c.k3_api, &f.k4_rollout]);
    sleep(Duration::from_millis(300)).await;
    assert_quiet(&mut web, "identical rewrite").await;
    assert!(web.is_running() && k1.is_running() && rollout.is_running());
    drop((web, k1, rollout));
    stop_server(server).await;
}

/// Their `watched` package (the retrying watch cache behind `watched.NewBaselineWatched`)
/// converges to the served rules after SYNCED and after changes, and — after the route server
/// stops, the rules change while it is down and a new server starts on the same port — it
/// reconnects by itself and converges to the new rules.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watched_client_converges_across_changes_and_restart() {
    spur_e2e::go_bin_dir();
    let rules = Rules::new();
    let f = Fixture::new();
    f.write(&rules);
    let server = start_server(&rules, "127.0.0.1:0".parse().unwrap()).await;
    let addr = server.grpc_addr;
    let deadline = Instant::now() + WAIT;
    while sdroutes_get(addr, &[]).await.len() != f.all().len() {
        assert!(Instant::now() < deadline, "rules never loaded");
        sleep(Duration::from_millis(100)).await;
    }

    let keys = "k1,k2,k3,k4,k5,k6,k7";
    let mut view = View::start(addr, &WEB, keys).await;
    assert_eq!(
        view.rules,
        want_lines(&[&f.k1_web, &f.k2_web, &f.k5_web]),
        "content at SYNCED"
    );
    let mut api_view = View::start(addr, &API, keys).await;
    assert_eq!(
        api_view.rules,
        want_lines(&[&f.k1_api, &f.k3_api]),
        "content at SYNCED"
    );

    let c = Changed::new();
    c.apply(&f, &rules);
    view.converge(&[&c.k1_web, &c.k6_web], WAIT).await;
    api_view.converge(&[&c.k1_api, &c.k3_api], WAIT).await;

    // Restart: stop, change the rules while down, start again on the same port.
    stop_server(server).await;
    let k7_web = Rule::new("k7", &WEB, "sb7", &[(8080, &[("sb7-web.ns1.svc", 8080)])]);
    let k6_moved = Rule::new(
        "k6",
        &WEB,
        "sb6",
        &[(8080, &[("sb6-web-v3.ns1.svc", 8443)])],
    );
    rules.write("a.yaml", &[&k6_moved, &k7_web, &c.k1_api]);
    rules.write("b.yml", &[&f.k4_rollout]);
    sleep(Duration::from_millis(500)).await;
    let server = start_server(&rules, addr).await;
    assert_eq!(server.grpc_addr, addr);
    view.converge(&[&k6_moved, &k7_web], WAIT).await;
    api_view.converge(&[&c.k1_api], WAIT).await;

    // And it keeps following the new server.
    rules.write("c.json", &[&f.k2_web]);
    view.converge(&[&k6_moved, &k7_web, &f.k2_web], WAIT).await;
    assert!(view.p.is_running() && api_view.p.is_running());
    drop((view, api_view));
    stop_server(server).await;
}

/// Their `workload.Router.GetTarget(port, keys...)` — the DevMesh sidecar's lookup — answers the
/// first destination of the mapping for the port, and follows changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workload_router_get_target() {
    spur_e2e::go_bin_dir();
    let rules = Rules::new();
    let f = Fixture::new();
    f.write(&rules);
    let server = start_server(&rules, "127.0.0.1:0".parse().unwrap()).await;
    let addr = server.grpc_addr;
    let deadline = Instant::now() + WAIT;
    while sdroutes_get(addr, &[]).await.len() != f.all().len() {
        assert!(Instant::now() < deadline, "rules never loaded");
        sleep(Duration::from_millis(100)).await;
    }

    let mut p = go_watch(addr, "router", &WEB, &["-keys=k1,k2,k5,k6", "-port=8080"]);
    assert_eq!(p.line("SYNCED").await, "SYNCED");
    let mut targets = BTreeMap::new();
    let want = |pairs: &[(&str, &str)]| {
        pairs
            .iter()
            .map(|(k, t)| (k.to_string(), t.to_string()))
            .collect()
    };
    read_targets(
        &mut p,
        &mut targets,
        want(&[
            ("k1", "sb1-web.ns1.svc:8080"),
            ("k2", "sb2-web.ns1.svc:8080"),
            ("k5", "-"),
            ("k6", "-"),
        ]),
    )
    .await;
    let c = Changed::new();
    c.apply(&f, &rules);
    read_targets(
        &mut p,
        &mut targets,
        want(&[
            ("k1", "sb1-web.ns1.svc:8080"),
            ("k2", "-"),
            ("k5", "-"),
            ("k6", "sb6-web.ns1.svc:8080"),
        ]),
    )
    .await;
    drop(p);
    stop_server(server).await;
}

/// Reads `TARGET <key> 8080 <target>` lines into `targets` until it equals `want`.
async fn read_targets(
    p: &mut Proc,
    targets: &mut BTreeMap<String, String>,
    want: BTreeMap<String, String>,
) {
    let deadline = Instant::now() + WAIT;
    while *targets != want {
        let left = deadline.saturating_duration_since(Instant::now());
        let Some(l) = p.try_line(left).await else {
            panic!(
                "router targets did not converge:\n have {targets:#?}\n want {want:#?}\n{}",
                p.diag()
            );
        };
        let parts: Vec<&str> = l.split(' ').collect();
        assert!(
            parts.len() == 4 && parts[0] == "TARGET" && parts[2] == "8080",
            "unexpected line {l:?}"
        );
        targets.insert(parts[1].to_string(), parts[3].to_string());
    }
}

/// The Go clients dial with keepalive pings every 5 s (grpc-go raises it to its 10 s minimum);
/// a watch stream kept open well past that is not cut (no GOAWAY `too_many_pings`) and still
/// delivers updates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalive_pings_do_not_break_watch_streams() {
    spur_e2e::go_bin_dir();
    let rules = Rules::new();
    let f = Fixture::new();
    f.write(&rules);
    let server = start_server(&rules, "127.0.0.1:0".parse().unwrap()).await;
    let addr = server.grpc_addr;
    let deadline = Instant::now() + WAIT;
    while sdroutes_get(addr, &[]).await.len() != f.all().len() {
        assert!(Instant::now() < deadline, "rules never loaded");
        sleep(Duration::from_millis(100)).await;
    }

    // The raw watcher goes through a frame tap, to prove pings happen and are acknowledged.
    let tap = H2Tap::start(addr).await;
    let mut raw = go_watch(tap.addr, "raw", &API, &[]);
    let mut initial = BTreeSet::new();
    loop {
        let l = raw.line("the initial ADDs").await;
        if l == "SYNCED" {
            break;
        }
        assert!(l.starts_with("ADD "), "before SYNCED only ADDs: {l:?}");
        initial.insert(l);
    }
    let want: BTreeSet<String> = [&f.k1_api, &f.k3_api]
        .iter()
        .map(|r| format!("ADD {}", r.describe()))
        .collect();
    assert_eq!(initial, want);

    // Idle for 13 s: at least one keepalive ping goes out and must be acknowledged, not punished.
    let idle_until = Instant::now() + Duration::from_secs(13);
    while Instant::now() < idle_until {
        let left = idle_until.saturating_duration_since(Instant::now());
        if let Some(l) = raw.try_line(left.min(Duration::from_secs(1))).await {
            panic!("unexpected line while idle: {l:?}; {}", raw.diag());
        }
    }
    assert!(
        raw.is_running(),
        "the raw watcher exited while idle; {}",
        raw.diag()
    );
    let pings = tap.counts.client_pings.load(Ordering::SeqCst);
    let acks = tap.counts.server_ping_acks.load(Ordering::SeqCst);
    assert!(pings >= 1, "no keepalive ping from the client in 13 s idle");
    assert!(
        acks >= pings,
        "{pings} keepalive pings but only {acks} acknowledged"
    );
    assert_eq!(
        tap.counts.server_goaways.load(Ordering::SeqCst),
        0,
        "the server sent GOAWAY"
    );

    let k3 = Rule::new("k3", &API, "sb3", &[(80, &[("10.0.0.9", 8000)])]);
    rules.write("b.yml", &[&k3, &f.k4_rollout]);
    assert_eq!(
        raw.line("the REPLACE after the idle period").await,
        format!("REPLACE {}", k3.describe())
    );
    assert!(raw.is_running());
    assert_eq!(
        tap.counts.server_goaways.load(Ordering::SeqCst),
        0,
        "the server sent GOAWAY"
    );
    drop(raw);
    stop_server(server).await;
}

/// An empty rule set still yields SYNCED (the official client's `Get` blocks until it), and the
/// first rule then arrives as an ADD on every client kind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_rule_set_syncs_then_adds() {
    spur_e2e::go_bin_dir();
    let rules = Rules::new();
    let server = start_server(&rules, "127.0.0.1:0".parse().unwrap()).await;
    let addr = server.grpc_addr;
    assert_eq!(sdroutes_get(addr, &[]).await, BTreeSet::new());

    let mut sd = sdroutes_watch(addr, &[]);
    assert_eq!(sdroutes_initial(&mut sd).await, BTreeSet::new());
    let mut view = View::start(addr, &WEB, "k1").await;
    assert!(view.rules.is_empty(), "{:?}", view.rules);

    let k1 = Rule::new("k1", &WEB, "sb1", &[(8080, &[("sb1-web.ns1.svc", 8080)])]);
    rules.write("a.yaml", &[&k1]);
    assert_eq!(
        sdroutes_ops(&mut sd, 1).await,
        [("ADD".to_string(), k1.clone())].into()
    );
    view.converge(&[&k1], WAIT).await;
    assert_quiet(&mut sd, "one rule added").await;
    drop((sd, view));
    stop_server(server).await;
}

/// The compatibility endpoint (`RouteServerConfig::compat`, `--compat-grpc-addr`): Signadot's
/// own clients, unchanged, read and watch the rules there in plaintext without a token (their
/// `sdroutes` lists and filters, their `watched` cache follows a change), its REST side answers
/// the Routes API and nothing else (no `/metrics`, no `/healthz`), while the main ports keep
/// their own settings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_compatibility_endpoint_serves_signadots_clients() {
    spur_e2e::go_bin_dir();
    let rules = Rules::new();
    let f = Fixture::new();
    f.write(&rules);
    let cfg = RouteServerConfig {
        poll_interval: Duration::from_millis(50),
        grpc_addr: "127.0.0.1:0".parse().unwrap(),
        http_addr: "127.0.0.1:0".parse().unwrap(),
        compat: Some(spur_routeserver::CompatConfig {
            grpc_addr: "127.0.0.1:0".parse().unwrap(),
            http_addr: "127.0.0.1:0".parse().unwrap(),
        }),
        ..RouteServerConfig::new(rules.dir.path())
    };
    let server = timeout(WAIT, RouteServer::start(cfg))
        .await
        .unwrap()
        .unwrap();
    let (compat_grpc, compat_http) = server.compat_addrs.unwrap();
    assert_ne!(compat_grpc, server.grpc_addr);

    let all = set(&f.all());
    let deadline = Instant::now() + WAIT;
    while sdroutes_get(compat_grpc, &[]).await != all {
        assert!(Instant::now() < deadline, "sdroutes never listed all rules");
        sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        sdroutes_get(compat_grpc, &["-routing-key", "k1"]).await,
        set(&[&f.k1_web, &f.k1_api])
    );
    let mut view = View::start(compat_grpc, &WEB, "k1,k2,k3,k4,k5,k6,k7").await;
    assert_eq!(
        view.rules,
        want_lines(&[&f.k1_web, &f.k2_web, &f.k5_web]),
        "content at SYNCED"
    );
    let c = Changed::new();
    c.apply(&f, &rules);
    view.converge(&[&c.k1_web, &c.k6_web], WAIT).await;
    drop(view);

    let got = spur_e2e::get(
        compat_http,
        "/api/v1/workloads/routing-rules?routingKey=k3",
        &[],
    )
    .await
    .unwrap();
    assert_eq!(got.status, 200, "{got:?}");
    let body: Value = serde_json::from_str(&got.body).unwrap();
    assert_eq!(
        body["routingRules"].as_array().map(Vec::len),
        Some(1),
        "{body}"
    );
    for path in ["/metrics", "/healthz"] {
        let got = spur_e2e::get(compat_http, path, &[]).await.unwrap();
        assert_eq!(
            got.status, 404,
            "{path} on the compatibility endpoint: {got:?}"
        );
        let main = spur_e2e::get(server.http_addr, path, &[]).await.unwrap();
        assert_eq!(main.status, 200, "{path} on the main port: {main:?}");
    }
    stop_server(server).await;
}
