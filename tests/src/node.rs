//! The node tier: a real one-node cluster (`tests/node/node.sh`: kubelet, containerd, CNI, kube-proxy,
//! CoreDNS, an RBAC-enforcing apiserver) shared by every node test of a run, and helpers to deploy
//! an image and see which pod answered a request.
//!
//! `tests/run.sh` starts the node (with Spur's images imported) before `cargo test` and exports
//! `SPUR_NODE_ENV`; it takes the node down when the run ends. A test binary run by hand without
//! `SPUR_NODE_ENV` starts a node of its own on first use (building the images from
//! `target/debug`), and a watchdog takes it down when the test process exits, however it exits.
//!
//! Each test works in namespaces of its own ([`Node::namespace`]) and removes them when done.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use serde_json::Value;

/// The Spur image every node test runs (`tests/node/image.sh`).
pub const SPUR_IMAGE: &str = "localhost/spur:dev";
/// An image with curl that sleeps until it is stopped: the client pods of the tests.
pub const CLIENT_IMAGE: &str = "localhost/spur-test-client:dev";
/// PostgreSQL 15 (server and psql): entrypoint `spur-postgres-server`, which needs
/// `POSTGRES_PASSWORD` on first start and serves on :5432 (tests/node/README.md).
pub const POSTGRES_IMAGE: &str = "localhost/spur-postgres:dev";
/// Where the chart goes.
pub const SPUR_NAMESPACE: &str = "spur-system";
/// The `helm install` values of the node tier: what a user with a registry sets, pointed at the
/// locally imported image, and one replica each (one node, two cores).
pub const CHART_VALUES: &[&str] = &[
    "--set",
    "image.repository=localhost/spur",
    "--set",
    "image.tag=dev",
    "--set",
    "operator.replicas=1",
    "--set",
    "routeserver.replicas=1",
    "--set",
    "tunnelProxy.replicas=1",
    // Every component at debug level: the node test checks no secret reaches a log.
    "--set",
    "logLevel=debug",
    "--set",
    "injection.sidecarLog=debug",
    // Serving certificates renewed every ~3 min, so the whole run crosses renewals of the
    // webhook's, the route server's and the tunnel proxy's; a requested CA rotation takes 40 s
    // to start signing (the node's kubelet refreshes mounted ConfigMaps every 10 s).
    "--set",
    "operator.pki.servingLifetime=4m",
    "--set",
    "operator.pki.caPropagation=40s",
    // A failing delete step of a sandbox resource is retried after 2 s, 4 s... (default 10 s).
    "--set",
    "resources.retryBase=2s",
];

/// A running node: what `node.sh up` wrote to its env file.
pub struct Node {
    pub root: PathBuf,
    pub netns: String,
    pub ip: String,
    pub kubeconfig: PathBuf,
    pub bindir: PathBuf,
    pub containerd: PathBuf,
    /// The node's cgroup, relative to each hierarchy's root (its pods are under `kubepods`).
    pub cgroup: String,
    // Held for the life of the process: when it closes, the watchdog takes the node down.
    _watchdog: Option<Mutex<Child>>,
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The node of this test run, started on first use when `SPUR_NODE_ENV` does not name one.
pub fn node() -> &'static Node {
    static NODE: OnceLock<Node> = OnceLock::new();
    NODE.get_or_init(|| match start_or_attach() {
        Ok(node) => node,
        Err(e) => panic!("no node for the node tier: {e:#}"),
    })
}

fn start_or_attach() -> anyhow::Result<Node> {
    if let Some(env) = std::env::var_os("SPUR_NODE_ENV") {
        return Node::from_env_file(Path::new(&env), None);
    }
    let bins = image_bindir();
    let images = bins.join("node-images");
    // The Kafka image takes the broker's jars and the Go client from their own builds.
    let out = run(Command::new(repo().join("tests/node/image.sh"))
        .env("SPUR_KAFKA_DIR", crate::kafka::kafka_dir())
        .env("SPUR_GO_BINDIR", crate::go_bin_dir())
        .arg(&bins)
        .arg(&images))
    .context("building the node's images (tests/node/image.sh)")?;
    // One line per image: name, archive, sizes.
    let tars: Vec<PathBuf> = out
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .filter(|p| p.ends_with(".tar"))
        .map(PathBuf::from)
        .collect();
    if tars.is_empty() {
        bail!("tests/node/image.sh printed no image archive:\n{out}");
    }
    let out = run(Command::new(repo().join("tests/node/node.sh"))
        .arg("up")
        .args(&tars))
    .context("starting the node (tests/node/node.sh up)")?;
    let env = out
        .lines()
        .last()
        .ok_or_else(|| anyhow!("tests/node/node.sh up printed nothing"))?;
    let env = PathBuf::from(env);
    let root = env
        .parent()
        .ok_or_else(|| anyhow!("no root for {}", env.display()))?
        .to_path_buf();
    // The watchdog waits for its stdin to close (this process exiting, in any way) and then takes
    // the node down. setsid: a Ctrl-C to the test's process group must not kill it first.
    let watchdog = Command::new("setsid")
        .arg("sh")
        .arg("-c")
        .arg("trap '' HUP INT TERM; cat >/dev/null; exec \"$0\" down \"$1\" >/dev/null 2>&1")
        .arg(repo().join("tests/node/node.sh"))
        .arg(&root)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting the node's watchdog")?;
    Node::from_env_file(&env, Some(watchdog))
}

/// Runs a command, returning its stdout; an error carries its stderr.
fn run(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl Node {
    fn from_env_file(path: &Path, watchdog: Option<Child>) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the node's env file {}", path.display()))?;
        let vars: HashMap<&str, &str> = text.lines().filter_map(|l| l.split_once('=')).collect();
        let var = |k: &str| {
            vars.get(k)
                .map(|v| v.to_string())
                .ok_or_else(|| anyhow!("{} has no {k}", path.display()))
        };
        Ok(Self {
            root: var("SPUR_NODE_ROOT")?.into(),
            netns: var("SPUR_NODE_NETNS")?,
            ip: var("SPUR_NODE_IP")?,
            kubeconfig: var("SPUR_NODE_KUBECONFIG")?.into(),
            bindir: var("SPUR_NODE_BINDIR")?.into(),
            containerd: var("SPUR_NODE_CONTAINERD")?.into(),
            cgroup: var("SPUR_NODE_CGROUP")?,
            _watchdog: watchdog.map(Mutex::new),
        })
    }

    /// An admin `kube::Client` for the node's apiserver.
    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        let kubeconfig = kube::config::Kubeconfig::read_from(&self.kubeconfig)?;
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
        Ok(kube::Client::try_from(config)?)
    }

    /// `kubectl` with the admin kubeconfig: its stdout, or an error with its stderr.
    pub fn kubectl(&self, args: &[&str]) -> anyhow::Result<String> {
        run(self.kubectl_cmd().args(args))
    }

    /// `kubectl` with the admin kubeconfig: its exit code and its stdout, trimmed, whatever the
    /// code (for commands like `auth can-i` whose exit code is the answer).
    pub fn kubectl_status(&self, args: &[&str]) -> anyhow::Result<(Option<i32>, String)> {
        let out = self
            .kubectl_cmd()
            .args(args)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running kubectl {args:?}"))?;
        Ok((
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
        ))
    }

    /// `kubectl <args>` in the background, its stdout into `out` (stderr too): for `logs -f` and
    /// long `exec`s. The caller kills it (or waits for it); [`Background`] does so on drop.
    pub fn kubectl_spawn(&self, args: &[&str], out: &Path) -> anyhow::Result<Background> {
        let mut cmd = self.kubectl_cmd();
        cmd.args(args);
        Background::spawn(cmd, out).with_context(|| format!("running kubectl {args:?}"))
    }

    fn kubectl_cmd(&self) -> Command {
        let mut cmd = Command::new(self.bindir.join("kubectl"));
        cmd.arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cache-dir")
            .arg(self.root.join("kubectl-cache"));
        cmd
    }

    /// `kubectl <args> -f -` with `yaml` on stdin (apply, create, delete, ...).
    pub fn kubectl_stdin(&self, args: &[&str], yaml: &str) -> anyhow::Result<String> {
        let mut all = args.to_vec();
        all.extend(["-f", "-"]);
        self.kubectl_input(&all, yaml)
    }

    /// `kubectl <args>` with `input` on its stdin (e.g. `exec -i`): its stdout.
    pub fn kubectl_input(&self, args: &[&str], input: &str) -> anyhow::Result<String> {
        let mut child = self
            .kubectl_cmd()
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        child
            .stdin
            .take()
            .ok_or_else(|| anyhow!("kubectl has no stdin"))?
            .write_all(input.as_bytes())?;
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "kubectl {args:?} failed ({}):\n{}\n--- input ---\n{input}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `kubectl apply -f -`.
    pub fn apply(&self, yaml: &str) -> anyhow::Result<String> {
        self.kubectl_stdin(&["apply"], yaml)
    }

    /// `kubectl get <what> -o json`, parsed.
    pub fn get_json(&self, namespace: &str, what: &[&str]) -> anyhow::Result<Value> {
        let mut args = vec!["-n", namespace, "get"];
        args.extend_from_slice(what);
        args.extend_from_slice(&["-o", "json"]);
        Ok(serde_json::from_str(&self.kubectl(&args)?)?)
    }

    /// Whether `kind`/`name` (in `namespace`, or cluster-scoped with `None`) is gone.
    pub fn is_gone(&self, namespace: Option<&str>, kind: &str, name: &str) -> anyhow::Result<bool> {
        let mut args = Vec::new();
        if let Some(ns) = namespace {
            args.extend(["-n", ns]);
        }
        args.extend(["get", kind, name, "--ignore-not-found", "-o", "name"]);
        Ok(self.kubectl(&args)?.trim().is_empty())
    }

    /// `helm` (built by tests/kube/build.sh) with the admin kubeconfig.
    pub fn helm(&self, args: &[&str]) -> anyhow::Result<String> {
        run(Command::new(self.bindir.join("helm"))
            .env("KUBECONFIG", &self.kubeconfig)
            // Helm's caches and config stay under the node's root, not in $HOME.
            .env("HELM_CACHE_HOME", self.root.join("helm/cache"))
            .env("HELM_CONFIG_HOME", self.root.join("helm/config"))
            .env("HELM_DATA_HOME", self.root.join("helm/data"))
            .args(args))
    }

    /// A fresh namespace `<prefix>-<n>` with `labels`, deleted when the guard drops.
    pub fn namespace(
        &self,
        prefix: &str,
        labels: &[(&str, &str)],
    ) -> anyhow::Result<Namespace<'_>> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("{prefix}-{}-{n}", std::process::id());
        let labels: String = labels
            .iter()
            .map(|(k, v)| format!("    {k}: {v:?}\n"))
            .collect();
        self.apply(&format!(
            "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {name}\n  labels:\n    spur.dev/test: node\n{labels}"
        ))?;
        Ok(Namespace { node: self, name })
    }

    /// Waits until `kubectl rollout status` says the Deployment is fully rolled out.
    pub fn rollout(&self, namespace: &str, deployment: &str) -> anyhow::Result<()> {
        self.kubectl(&[
            "-n",
            namespace,
            "rollout",
            "status",
            &format!("deployment/{deployment}"),
            "--timeout=180s",
        ])
        .map(drop)
        .with_context(|| self.describe(namespace))
    }

    /// What a failing test wants to see: the namespace's pods and their recent events.
    pub fn describe(&self, namespace: &str) -> String {
        let pods = self
            .kubectl(&["-n", namespace, "get", "pods", "-o", "wide"])
            .unwrap_or_else(|e| e.to_string());
        let events = self
            .kubectl(&["-n", namespace, "get", "events", "--sort-by=.lastTimestamp"])
            .unwrap_or_else(|e| e.to_string());
        format!("pods of {namespace}:\n{pods}\nevents:\n{events}")
    }

    /// The names of the running pods matching `selector`.
    pub fn pods(&self, namespace: &str, selector: &str) -> anyhow::Result<Vec<String>> {
        let list = self.get_json(
            namespace,
            &[
                "pods",
                "-l",
                selector,
                "--field-selector=status.phase=Running",
            ],
        )?;
        Ok(list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
            .filter_map(|p| p["metadata"]["name"].as_str().map(String::from))
            .collect())
    }

    /// A client pod (curl) in `namespace`, never injected, Ready when this returns.
    pub fn client_pod(&self, namespace: &str) -> anyhow::Result<String> {
        self.client_pod_with(namespace, "client", None)
    }

    /// [`Self::client_pod`] named `name`, optionally with a ConfigMap `(name, mount path)`
    /// mounted as the kubelet mounts one (and refreshes it).
    pub fn client_pod_with(
        &self,
        namespace: &str,
        name: &str,
        config_map: Option<(&str, &str)>,
    ) -> anyhow::Result<String> {
        let (mounts, volumes) = match config_map {
            Some((cm, path)) => (
                format!("\n      volumeMounts: [{{name: cm, mountPath: {path}, readOnly: true}}]"),
                format!("\n  volumes: [{{name: cm, configMap: {{name: {cm}}}}}]"),
            ),
            None => (String::new(), String::new()),
        };
        self.apply(&format!(
            r#"apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: {namespace}
  annotations: {{sidecar.spur.dev/inject: "false"}}
spec:
  terminationGracePeriodSeconds: 1
  containers:
    - name: client
      image: {CLIENT_IMAGE}
      imagePullPolicy: Never{mounts}{volumes}
"#
        ))?;
        self.kubectl(&[
            "-n",
            namespace,
            "wait",
            "--for=condition=Ready",
            &format!("pod/{name}"),
            "--timeout=120s",
        ])
        .with_context(|| self.describe(namespace))?;
        Ok(name.to_string())
    }

    /// `curl` run in `pod`: the status code and the body parsed as JSON (`Value::Null` when it is
    /// not JSON).
    pub fn curl(
        &self,
        namespace: &str,
        pod: &str,
        url: &str,
        headers: &[(&str, &str)],
    ) -> anyhow::Result<Answer> {
        let mut args: Vec<String> = [
            "-n",
            namespace,
            "exec",
            pod,
            "--",
            "curl",
            "-sS",
            "--max-time",
            "10",
            "-w",
            "\n%{http_code}",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        for (k, v) in headers {
            args.push("-H".into());
            args.push(format!("{k}: {v}"));
        }
        args.push(url.into());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = self.kubectl(&args)?;
        let (body, code) = out
            .trim_end()
            .rsplit_once('\n')
            .ok_or_else(|| anyhow!("curl printed no status line: {out:?}"))?;
        Ok(Answer {
            status: code.trim().parse()?,
            json: serde_json::from_str(body).unwrap_or(Value::Null),
            body: body.to_string(),
        })
    }

    /// Runs `cmd` inside the network namespace of a pod's container (found through containerd),
    /// from the host: for what the pod itself may not do, like listing its iptables rules.
    pub fn in_pod_netns(
        &self,
        namespace: &str,
        pod: &str,
        container: &str,
        cmd: &[&str],
    ) -> anyhow::Result<String> {
        let p = self.get_json(namespace, &["pod", pod])?;
        let statuses = p["status"]["containerStatuses"]
            .as_array()
            .ok_or_else(|| anyhow!("pod {pod} has no container statuses"))?;
        let id = statuses
            .iter()
            .find(|s| s["name"] == container)
            .and_then(|s| s["containerID"].as_str())
            .ok_or_else(|| anyhow!("pod {pod} has no running container {container}"))?;
        let pid = self.task_pid(id)?;
        run(Command::new("nsenter")
            .arg("-t")
            .arg(pid)
            .arg("-n")
            .args(cmd))
    }

    /// Stops the node's containerd and starts it again (`node.sh restart-containerd`): the pods'
    /// containers live on in their shims, the kubelet reconnects.
    pub fn restart_containerd(&self) -> anyhow::Result<()> {
        run(Command::new(repo().join("tests/node/node.sh"))
            .arg("restart-containerd")
            .arg(&self.root))
        .map(drop)
        .context("restarting the node's containerd (tests/node/node.sh restart-containerd)")
    }

    /// The host pid of a container's main process, from its id in a pod's status
    /// (`containerd://<id>`, or the bare id), as the node's containerd reports it.
    pub fn task_pid(&self, container_id: &str) -> anyhow::Result<String> {
        let id = container_id
            .strip_prefix("containerd://")
            .unwrap_or(container_id);
        let tasks = run(Command::new("ctr")
            .arg("--address")
            .arg(&self.containerd)
            .args(["-n", "k8s.io", "tasks", "ls"]))?;
        tasks
            .lines()
            .find_map(|l| {
                let mut f = l.split_whitespace();
                (f.next() == Some(id)).then(|| f.next()).flatten()
            })
            .map(String::from)
            .ok_or_else(|| anyhow!("containerd has no task {id}:\n{tasks}"))
    }
}

/// A background process on the host ([`Node::kubectl_spawn`], [`Background::spawn`]), killed on
/// drop.
pub struct Background {
    child: Child,
    pub out: PathBuf,
}

impl Background {
    /// Runs `cmd` on the host in the background, its stdout and stderr into `out`.
    pub fn spawn(mut cmd: Command, out: &Path) -> anyhow::Result<Self> {
        let file =
            std::fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
        let err = file.try_clone()?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(err)
            .spawn()
            .with_context(|| format!("starting {cmd:?}"))?;
        Ok(Background {
            child,
            out: out.to_path_buf(),
        })
    }

    /// Waits up to `limit` for it to exit; `true` if it did (its output is then complete).
    pub fn wait(&mut self, limit: Duration) -> anyhow::Result<bool> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if self.child.try_wait()?.is_some() {
                return Ok(true);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(false)
    }

    /// What it wrote so far.
    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A namespace of one test; deleted (without waiting) when dropped.
pub struct Namespace<'a> {
    node: &'a Node,
    pub name: String,
}

impl Drop for Namespace<'_> {
    fn drop(&mut self) {
        if let Err(e) = self
            .node
            .kubectl(&["delete", "namespace", &self.name, "--wait=false"])
        {
            eprintln!("could not delete namespace {}: {e:#}", self.name);
        }
    }
}

/// One HTTP answer seen by a client pod.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub json: Value,
    pub body: String,
}

impl Answer {
    /// The pod that answered at the end of the call chain (the innermost `upstream` of
    /// `spur demo app`'s JSON).
    pub fn answered_by(&self) -> Option<&str> {
        let mut v = &self.json;
        while !v["upstream"].is_null() {
            v = &v["upstream"];
        }
        v["pod"].as_str()
    }

    /// The `marker` of the innermost answer.
    pub fn marker(&self) -> Option<&str> {
        let mut v = &self.json;
        while !v["upstream"].is_null() {
            v = &v["upstream"];
        }
        v["marker"].as_str()
    }
}

/// The YAML of a Deployment and Service running `spur demo app` from the Spur image.
pub fn demo_app(namespace: &str, name: &str, call: Option<&str>) -> String {
    demo_app_annotated(namespace, name, call, &[])
}

/// [`demo_app`] with annotations on the pod template (e.g. the injection's per-pod settings).
pub fn demo_app_annotated(
    namespace: &str,
    name: &str,
    call: Option<&str>,
    annotations: &[(&str, &str)],
) -> String {
    let args: Vec<String> = call.map(|c| format!("--call={c}")).into_iter().collect();
    demo_app_with(namespace, name, &args, annotations)
}

/// [`demo_app_annotated`] with the app's further `args` (e.g. `--kafka=HOST:PORT`). With
/// `--grpc-listen=ADDR:PORT`, the container and the Service also have that port, named `grpc`.
pub fn demo_app_with(
    namespace: &str,
    name: &str,
    args: &[String],
    annotations: &[(&str, &str)],
) -> String {
    let call: String = args
        .iter()
        .map(|a| format!("\n            - {a}"))
        .collect();
    let (grpc_container_port, grpc_service_port) = args
        .iter()
        .find_map(|a| a.strip_prefix("--grpc-listen="))
        .and_then(|l| l.rsplit(':').next())
        .map(|p| {
            (
                format!("\n            - {{name: grpc, containerPort: {p}}}"),
                format!("\n    - {{name: grpc, port: {p}, targetPort: grpc}}"),
            )
        })
        .unwrap_or_default();
    let annotations = annotations
        .iter()
        .map(|(k, v)| format!("{k}: {v:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata:
  name: {name}
  namespace: {namespace}
spec:
  replicas: 1
  selector:
    matchLabels: {{app: {name}}}
  template:
    metadata:
      labels: {{app: {name}}}
      annotations: {{{annotations}}}
    spec:
      terminationGracePeriodSeconds: 5
      containers:
        - name: app
          image: {SPUR_IMAGE}
          imagePullPolicy: IfNotPresent
          args:
            - demo
            - app
            - --name={name}
            - --listen=0.0.0.0:8080{call}
          env:
            - name: POD_NAME
              valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}
          ports:
            - {{name: http, containerPort: 8080}}{grpc_container_port}
          readinessProbe:
            httpGet: {{path: /healthz, port: http}}
            periodSeconds: 1
---
apiVersion: v1
kind: Service
metadata:
  name: {name}
  namespace: {namespace}
spec:
  selector: {{app: {name}}}
  ports:
    - {{name: http, port: 8080, targetPort: http}}{grpc_service_port}
"#
    )
}

/// A PostgreSQL server as Deployment and Service `postgres` in `namespace` (no sidecar), its
/// superuser password from key `password` of Secret `admin_secret` there; waits until it is
/// ready.
pub fn postgres(node: &Node, namespace: &str, admin_secret: &str) -> anyhow::Result<()> {
    node.apply(&format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata: {{name: postgres, namespace: {namespace}}}
spec:
  replicas: 1
  selector: {{matchLabels: {{app: postgres}}}}
  template:
    metadata:
      labels: {{app: postgres}}
      annotations: {{sidecar.spur.dev/inject: "false"}}
    spec:
      terminationGracePeriodSeconds: 10
      volumes: [{{name: data, emptyDir: {{}}}}]
      containers:
        - name: postgres
          image: {POSTGRES_IMAGE}
          imagePullPolicy: IfNotPresent
          env:
            - name: POSTGRES_PASSWORD
              valueFrom: {{secretKeyRef: {{name: {admin_secret}, key: password}}}}
          ports: [{{name: pg, containerPort: 5432}}]
          volumeMounts: [{{name: data, mountPath: /var/lib/postgresql/data}}]
          readinessProbe:
            exec: {{command: [pg_isready, -h, 127.0.0.1, -U, postgres]}}
            periodSeconds: 1
---
apiVersion: v1
kind: Service
metadata: {{name: postgres, namespace: {namespace}}}
spec:
  selector: {{app: postgres}}
  ports: [{{name: pg, port: 5432, targetPort: pg}}]
"#
    ))?;
    node.rollout(namespace, "postgres")
}

/// `psql -tA -c sql` against database `db` of the [`postgres`] server in `namespace`, run in
/// its pod; the output, trimmed.
pub fn psql(
    node: &Node,
    namespace: &str,
    password: &str,
    db: &str,
    sql: &str,
) -> anyhow::Result<String> {
    let pod = node
        .pods(namespace, "app=postgres")?
        .into_iter()
        .next()
        .ok_or_else(|| anyhow!("no postgres pod in {namespace}"))?;
    let password = format!("PGPASSWORD={password}");
    node.kubectl(&[
        "-n",
        namespace,
        "exec",
        &pod,
        "--",
        "env",
        &password,
        "psql",
        "-h",
        "127.0.0.1",
        "-U",
        "postgres",
        "-d",
        db,
        "-tA",
        "-v",
        "ON_ERROR_STOP=1",
        "-c",
        sql,
    ])
    .map(|s| s.trim().to_string())
}

/// Polls `check` every 500 ms until it returns `Ok(Some)`, for at most `limit`; the error names
/// `what` and the last error seen.
pub fn eventually<T>(
    what: &str,
    limit: Duration,
    mut check: impl FnMut() -> anyhow::Result<Option<T>>,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + limit;
    let mut last = String::new();
    loop {
        match check() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last = format!("{e:#}"),
        }
        if Instant::now() > deadline {
            bail!("timed out after {limit:?} waiting for {what}; last error: {last}");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// A "laptop": a network namespace of the test's own, joined to the node's namespace by a veth
/// pair, with routes to the pods and Services and nothing else. Its processes are killed and the
/// namespace removed on drop (and by `node.sh down`/`cleanup` if the test process dies first).
pub struct Laptop {
    pub netns: String,
    pub ip: String,
    children: Vec<Child>,
}

impl Node {
    /// A new laptop namespace (`n` picks its /30; a few per run at most).
    pub fn laptop(&self, n: u8) -> anyhow::Result<Laptop> {
        let id = self
            .netns
            .strip_prefix("spur-node-")
            .ok_or_else(|| anyhow!("unexpected node namespace {}", self.netns))?;
        let netns = format!("spur-laptop-{id}-{n}");
        let (node_dev, laptop_dev) = (format!("lapn{n}"), format!("lap{n}"));
        let base = 4 * u32::from(n);
        let node_ip = format!("172.30.254.{}", base + 1);
        let ip = format!("172.30.254.{}", base + 2);
        let _ = run(Command::new("ip").args(["netns", "del", &netns]));
        run(Command::new("ip").args(["netns", "add", &netns]))?;
        let laptop = Laptop {
            netns: netns.clone(),
            ip: ip.clone(),
            children: Vec::new(),
        };
        let ip_cmd = |args: &[&str]| run(Command::new("ip").args(args));
        ip_cmd(&[
            "-n",
            &netns,
            "link",
            "add",
            &laptop_dev,
            "type",
            "veth",
            "peer",
            "name",
            &node_dev,
            "netns",
            &self.netns,
        ])?;
        ip_cmd(&["-n", &netns, "link", "set", "lo", "up"])?;
        ip_cmd(&[
            "-n",
            &netns,
            "addr",
            "add",
            &format!("{ip}/30"),
            "dev",
            &laptop_dev,
        ])?;
        ip_cmd(&["-n", &netns, "link", "set", &laptop_dev, "up"])?;
        ip_cmd(&[
            "-n",
            &self.netns,
            "addr",
            "add",
            &format!("{node_ip}/30"),
            "dev",
            &node_dev,
        ])?;
        ip_cmd(&["-n", &self.netns, "link", "set", &node_dev, "up"])?;
        // Pods and Services only: the laptop has no default route either.
        for cidr in ["10.244.0.0/16", "10.96.0.0/16"] {
            ip_cmd(&["-n", &netns, "route", "add", cidr, "via", &node_ip])?;
        }
        Ok(laptop)
    }
}

impl Laptop {
    /// Starts `program args` inside the laptop namespace, with `env`; killed on drop, or
    /// earlier by [`Laptop::stop`]. Its output is appended to `log`.
    pub fn spawn(
        &mut self,
        program: &Path,
        args: &[&str],
        env: &[(&str, &str)],
        log: &Path,
    ) -> anyhow::Result<LaptopProcess> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)?;
        let child = Command::new("ip")
            .args(["netns", "exec", &self.netns])
            .arg(program)
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {} in {}", program.display(), self.netns))?;
        self.children.push(child);
        Ok(LaptopProcess(self.children.len() - 1))
    }

    /// Waits, at most `limit`, for one process the laptop started to exit by itself: its exit
    /// status.
    pub fn wait(
        &mut self,
        process: &LaptopProcess,
        limit: Duration,
    ) -> anyhow::Result<std::process::ExitStatus> {
        let c = self
            .children
            .get_mut(process.0)
            .ok_or_else(|| anyhow!("no laptop process {}", process.0))?;
        let deadline = std::time::Instant::now() + limit;
        loop {
            if let Some(status) = c.try_wait()? {
                return Ok(status);
            }
            if std::time::Instant::now() >= deadline {
                bail!("laptop process {} still running after {limit:?}", process.0);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Sends SIGINT to one process the laptop started, as Ctrl-C in its terminal would
    /// (`ip netns exec` execs the program, so the child is the program itself).
    pub fn interrupt(&self, process: &LaptopProcess) -> anyhow::Result<()> {
        let c = self
            .children
            .get(process.0)
            .ok_or_else(|| anyhow!("no laptop process {}", process.0))?;
        run(Command::new("kill").args(["-s", "INT", &c.id().to_string()]))?;
        Ok(())
    }

    /// Kills one process the laptop started (a crash, say); the others keep running.
    pub fn stop(&mut self, process: LaptopProcess) {
        if let Some(c) = self.children.get_mut(process.0) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A process started by [`Laptop::spawn`].
#[derive(Debug)]
pub struct LaptopProcess(usize);

impl Drop for Laptop {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = run(Command::new("ip").args(["netns", "del", &self.netns]));
    }
}

/// A Spur binary of this checkout (`target/debug`, or `SPUR_IMAGE_BINDIR`): the same build the
/// image holds.
pub fn spur_bin(name: &str) -> PathBuf {
    image_bindir().join(name)
}

/// Where the binaries of the image are: `SPUR_IMAGE_BINDIR`, else the debug directory of
/// `CARGO_TARGET_DIR` or of `target/`.
fn image_bindir() -> PathBuf {
    if let Some(dir) = std::env::var_os("SPUR_IMAGE_BINDIR") {
        return PathBuf::from(dir);
    }
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("target"))
        .join("debug")
}
