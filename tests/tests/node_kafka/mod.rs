//! Kafka records by routing key on the node (issue 44, docs/async.md): a real broker pod, three
//! consumer Deployments (the Java client, franz-go, kcat/librdkafka) whose pods' sidecars relay
//! Kafka (`sidecar.spur.dev/kafka-ports`), and one Sandbox forking all three, created, made Ready
//! and deleted while each client's producer streams 1 000 records, a third of them carrying the
//! sandbox's routing key. Every record is handled by exactly one pod, counted per record id: the
//! fork handles exactly the keyed records stamped inside its route's span (`sinceMs`..`untilMs`
//! of the RoutingConfig's status), the baseline every other record. Nothing in the workers knows
//! about Spur: the fork runs the baseline's pod template, same `group.id`, same topic, same
//! bootstrap server.
//!
//! A producer service joins the go stream: `spur demo app --kafka` (`orders`, an injected
//! Deployment) writes a record per `POST /records`, with the request's trace context. While the
//! route is live, keyed and unkeyed requests reach it from a client pod; the keyed requests'
//! records are handled by the go worker's fork, the others by its baseline.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use serde_json::Value;
use spur_e2e::node::{Background, Node, eventually};

const KAFKA_IMAGE: &str = "localhost/spur-kafka:dev";
const SANDBOX: &str = "kafka-fix";
/// Records per client, a third keyed, one every `PAUSE_MS`: about 90 s per stream, long enough
/// for the sandbox to start, route for 15 s and drain while records keep coming.
const RECORDS: usize = 1_000;
const PAUSE_MS: u64 = 90;
/// How long the route stays live before the sandbox is deleted.
const LIVE: Duration = Duration::from_secs(15);
/// HTTP requests to the producer service while the route is live, half keyed.
const ORDERS: usize = 20;
/// The client whose topic the producer service writes to.
const ORDERS_TOPIC_OF: &str = "go";

/// The clients: (name, the worker's command, the producer's command). `{boot}`, `{topic}`,
/// `{key}` are filled in.
const CLIENTS: &[(&str, &str, &str)] = &[
    (
        "java",
        // sync: commits each poll's records before printing them.
        r#"["java", "-Xmx128m", "Probe", "consume", "{boot}", "{topic}", "workers-{client}", "1000000000", "3600000", "0", "sync"]"#,
        "java -Xmx128m Probe stream {boot} {topic} java {n} {key}/3 {pause}",
    ),
    (
        "go",
        r#"["kafka-client", "consume", "{boot}", "{topic}", "workers-{client}", "0", "3600000"]"#,
        "kafka-client stream {boot} {topic} go {n} {key}/3 {pause}",
    ),
    (
        "kcat",
        r#"["kcat", "-b", "{boot}", "-G", "workers-{client}", "{topic}", "-X", "auto.offset.reset=earliest", "-u", "-q", "-f", "record %p %o %s\n"]"#,
        // kcat -P reads its stdin to the end before it produces (CreateTime is then the end
        // of the stream for every record), so one kcat per record; it costs about as much as a
        // pause, hence the shorter sleep.
        r#"set -e
i=0
while [ $i -lt {n} ]; do
  if [ $((i % 3)) -eq 0 ]; then
    echo "kcat-$i" | kcat -P -b {boot} -t {topic} -H baggage=sd-routing-key={key}
  else
    echo "kcat-$i" | kcat -P -b {boot} -t {topic}
  fi
  i=$((i + 1)); sleep 0.05
done
echo produced"#,
    ),
];

fn fill(t: &str, boot: &str, topic: &str, key: &str) -> String {
    t.replace("{boot}", boot)
        .replace("{topic}", topic)
        .replace("{client}", topic.strip_prefix("records-").unwrap_or(topic))
        .replace("{key}", key)
        .replace("{n}", &RECORDS.to_string())
        .replace("{pause}", &PAUSE_MS.to_string())
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

pub(crate) fn kafka_on_the_node(node: &Node) {
    let stream = node
        .namespace(
            "stream",
            &[
                ("sidecar.spur.dev/inject", "true"),
                ("spur.dev/enabled", "true"),
            ],
        )
        .unwrap();
    let ns = stream.name.as_str();
    let boot = format!("kafka.{ns}.svc.cluster.local:9092");
    node.apply(&broker(ns)).unwrap();
    node.apply(&tools(ns)).unwrap();
    node.rollout(ns, "kafka").unwrap();
    node.rollout(ns, "tools").unwrap();
    let exec =
        |script: &str| node.kubectl(&["-n", ns, "exec", "deploy/tools", "--", "sh", "-c", script]);
    for (client, ..) in CLIENTS {
        let topic = format!("records-{client}");
        // The broker answers a little after its port opens.
        eventually(
            &format!("topic {topic} created"),
            Duration::from_secs(90),
            || Ok(Some(exec(&format!("java Probe create {boot} {topic} 3"))?)),
        )
        .with_context(|| node.describe(ns))
        .unwrap();
    }
    for (client, command, _) in CLIENTS {
        let command = fill(command, &boot, &format!("records-{client}"), "-");
        node.apply(&worker(ns, client, &command)).unwrap();
    }
    node.apply(&spur_e2e::node::demo_app_with(
        ns,
        "orders",
        &[
            format!("--kafka={boot}"),
            format!("--kafka-topic=records-{ORDERS_TOPIC_OF}"),
        ],
        &[],
    ))
    .unwrap();
    let client_pod = node.client_pod(ns).unwrap();
    node.rollout(ns, "orders").unwrap();
    for (client, ..) in CLIENTS {
        node.rollout(ns, &format!("worker-{client}")).unwrap();
        let pod = baseline_pod(node, ns, client).unwrap();
        let p = node.get_json(ns, &["pod", &pod]).unwrap();
        assert_eq!(
            p["metadata"]["annotations"]["sidecar.spur.dev/status"], "injected",
            "{pod}: {}",
            p["metadata"]["annotations"]
        );
    }

    // --- the sandbox comes while the records stream ------------------------------------------
    node.apply(&sandbox(ns)).unwrap();
    let key = eventually("the Sandbox's routing key", Duration::from_secs(60), || {
        let s = node.get_json("default", &["sandbox", SANDBOX])?;
        Ok(s["status"]["routingKey"].as_str().map(String::from))
    })
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let mut producers: Vec<Background> = CLIENTS
        .iter()
        .map(|(client, _, produce)| {
            let script = fill(produce, &boot, &format!("records-{client}"), &key);
            node.kubectl_spawn(
                &["-n", ns, "exec", "deploy/tools", "--", "sh", "-c", &script],
                &dir.path().join(format!("produce-{client}.log")),
            )
            .unwrap()
        })
        .collect();
    super::sandbox_ready(node, SANDBOX);
    // Each fork's output, followed until its pod goes.
    let mut forks: HashMap<&str, (String, Background)> = HashMap::new();
    for (client, ..) in CLIENTS {
        let pod = fork_pod(node, ns, client).unwrap();
        let follow = node
            .kubectl_spawn(
                &["-n", ns, "logs", "-f", &pod, "-c", "app"],
                &dir.path().join(format!("fork-{client}.log")),
            )
            .unwrap();
        forks.insert(client, (pod, follow));
    }
    let since = eventually(
        "a span per forked worker in the RoutingConfig",
        Duration::from_secs(60),
        || {
            let spans = spans(node, &key)?;
            Ok((spans.len() == CLIENTS.len()).then_some(spans))
        },
    )
    .unwrap();
    let live_from = since.values().map(|s| s.0).max().unwrap();
    // The producer service, while the route is live (a span starts a little after the operator
    // writes it): a record per request, keyed as it was.
    let wait = (live_from + 500 - now_ms()).max(0);
    std::thread::sleep(Duration::from_millis(u64::try_from(wait).unwrap()));
    let orders = format!("http://orders.{ns}.svc.cluster.local:8080/records");
    // One exec for all of them, so they take well under the live window even on a slow node;
    // each answer on a line of its own, "keyed " or "plain " first.
    let script = format!(
        r#"set -e
i=0
while [ $i -lt {ORDERS} ]; do
  if [ $((i % 2)) -eq 0 ]; then
    printf 'keyed '; curl -sS --fail-with-body --max-time 10 -X POST -H 'baggage: sd-routing-key={key}' {orders}
  else
    printf 'plain '; curl -sS --fail-with-body --max-time 10 -X POST {orders}
  fi
  i=$((i + 1))
done"#
    );
    let out = node
        .kubectl(&["-n", ns, "exec", &client_pod, "--", "sh", "-c", &script])
        .unwrap();
    let mut orders_keyed = Vec::new();
    let mut orders_unkeyed = Vec::new();
    for line in out.lines().filter(|l| !l.trim().is_empty()) {
        let (kind, json) = line.split_once(' ').unwrap_or(("", line));
        let answer: Value = serde_json::from_str(json.trim())
            .unwrap_or_else(|e| panic!("POST /records answered {line:?}: {e}"));
        let record = answer["record"].as_str().unwrap().to_owned();
        match kind {
            "keyed" => orders_keyed.push(record),
            "plain" => orders_unkeyed.push(record),
            _ => panic!("unexpected line {line:?}"),
        }
    }
    assert_eq!(
        (orders_keyed.len(), orders_unkeyed.len()),
        (ORDERS / 2, ORDERS / 2),
        "answers to POST /records:\n{out}"
    );
    assert!(
        now_ms() < live_from + i64::try_from(LIVE.as_millis()).unwrap(),
        "the {ORDERS} requests to the producer service outlasted the live window"
    );
    let wait = (live_from + i64::try_from(LIVE.as_millis()).unwrap() - now_ms()).max(0);
    std::thread::sleep(Duration::from_millis(u64::try_from(wait).unwrap()));
    assert!(
        producers
            .iter_mut()
            .all(|p| !p.wait(Duration::ZERO).unwrap()),
        "a producer ended before the sandbox was deleted ({:?} in): the streams are too short \
         for this node",
        started.elapsed()
    );

    // --- ... and goes while they still stream -------------------------------------------------
    node.kubectl(&["delete", "sandbox", SANDBOX, "--wait=false"])
        .unwrap();
    let spans = eventually(
        "every span to get its end (untilMs)",
        Duration::from_secs(60),
        || {
            let spans = spans(node, &key)?;
            let ended = spans.len() == CLIENTS.len() && spans.values().all(|s| s.1.is_some());
            Ok(ended.then_some(spans))
        },
    )
    .unwrap();
    for (client, p) in CLIENTS.iter().map(|c| c.0).zip(&mut producers) {
        assert!(
            p.wait(Duration::from_secs(300)).unwrap(),
            "the {client} producer did not finish in 300 s:\n{}",
            p.output()
        );
        assert!(
            p.output().lines().any(|l| l.starts_with("produced"))
                || p.output()
                    .lines()
                    .filter(|l| l.starts_with("sent "))
                    .count()
                    == RECORDS,
            "the {client} producer failed:\n{}",
            p.output()
        );
    }
    for (client, (pod, follow)) in &mut forks {
        assert!(
            follow.wait(Duration::from_secs(120)).unwrap(),
            "fork pod {pod} ({client}) still runs 120 s after its span ended"
        );
    }

    // --- every record, one consumer ------------------------------------------------------------
    for (client, ..) in CLIENTS {
        let topic = format!("records-{client}");
        let records = read_topic(node, ns, &boot, &topic).unwrap();
        let orders = if *client == ORDERS_TOPIC_OF {
            ORDERS
        } else {
            0
        };
        assert_eq!(records.len(), RECORDS + orders, "records in {topic}");
        let (span_since, span_until) = spans[&format!("worker-{client}")];
        let span_until = span_until.unwrap();
        let fork_handles = |r: &Record| r.keyed(&key) && span_since <= r.ts && r.ts < span_until;
        let baseline = baseline_pod(node, ns, client).unwrap();
        let expected_baseline = records.values().filter(|r| !fork_handles(r)).count();
        // The baseline may still be catching up on the last records.
        let baseline_log = eventually(
            &format!("{baseline} to handle its {expected_baseline} records"),
            Duration::from_secs(120),
            || {
                let log = node.kubectl(&["-n", ns, "logs", &baseline, "-c", "app"])?;
                Ok((handled(&log).len() >= expected_baseline).then_some(log))
            },
        )
        .unwrap_or_else(|e| {
            panic!(
                "{e:#}\n{}",
                node.kubectl(&["-n", ns, "logs", &baseline, "-c", "app", "--tail=20"])
                    .unwrap_or_default()
            )
        });
        let restarts =
            node.get_json(ns, &["pod", &baseline]).unwrap()["status"]["containerStatuses"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| c["restartCount"].as_u64().unwrap_or(0))
                .sum::<u64>();
        assert_eq!(
            restarts, 0,
            "{baseline} restarted: its earlier output is lost"
        );
        let (fork, follow) = &forks[client];
        let by: Vec<(&str, Vec<String>)> = vec![
            (baseline.as_str(), handled(&baseline_log)),
            (fork.as_str(), handled(&follow.output())),
        ];
        let mut handlers: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (pod, values) in &by {
            for v in values {
                handlers.entry(v.as_str()).or_default().push(pod);
            }
        }
        let mut wrong = Vec::new();
        let (mut keyed_before, mut keyed_in, mut keyed_after) = (0, 0, 0);
        for (value, r) in &records {
            let want = if fork_handles(r) {
                fork.as_str()
            } else {
                baseline.as_str()
            };
            let got = handlers.get(value.as_str()).cloned().unwrap_or_default();
            if got != [want] {
                wrong.push(format!(
                    "{value} (ts {}, keyed {}): handled by {got:?}, expected {want}",
                    r.ts,
                    r.keyed(&key)
                ));
            }
            if r.keyed(&key) {
                match (r.ts < span_since, r.ts < span_until) {
                    (true, _) => keyed_before += 1,
                    (false, true) => keyed_in += 1,
                    (false, false) => keyed_after += 1,
                }
            }
        }
        let unknown: Vec<&&str> = handlers
            .keys()
            .filter(|v| !records.contains_key(**v))
            .collect();
        assert!(
            unknown.is_empty(),
            "{client}: handled unknown records {unknown:?}"
        );
        assert!(
            wrong.is_empty(),
            "{client}: {} of {RECORDS} records not handled by exactly the expected pod \
             (span {span_since}..{span_until}):\n{}",
            wrong.len(),
            wrong.join("\n")
        );
        if *client == ORDERS_TOPIC_OF {
            // The producer service's records, by the requests that caused them.
            for (values, want) in [
                (&orders_keyed, fork.as_str()),
                (&orders_unkeyed, baseline.as_str()),
            ] {
                for v in values {
                    assert_eq!(
                        handlers.get(v.as_str()).cloned().unwrap_or_default(),
                        [want],
                        "{v}: the record of a POST /records {}",
                        if want == fork {
                            "with the key"
                        } else {
                            "without a key"
                        }
                    );
                }
            }
        }
        // The route came and went mid-stream: keyed records on both sides of each end.
        assert!(
            keyed_before > 0 && keyed_in >= 20 && keyed_after > 0,
            "{client}: keyed records before/in/after the span: {keyed_before}/{keyed_in}/{keyed_after}"
        );
        eprintln!(
            "kafka on the node, {client}: {} records ({orders} of them from POST /records), each \
             handled once; keyed before the route {keyed_before} (baseline), during {keyed_in} \
             (fork {fork}), after {keyed_after} (baseline)",
            records.len()
        );
    }
    drop(stream);
}

/// One record of a topic as the broker keeps it.
struct Record {
    ts: i64,
    headers: String,
}

impl Record {
    fn keyed(&self, key: &str) -> bool {
        self.headers.contains(&format!("sd-routing-key={key}"))
    }
}

/// Every record of `topic`, read directly from the broker (no sidecar, no group): value →
/// timestamp and headers.
fn read_topic(
    node: &Node,
    ns: &str,
    boot: &str,
    topic: &str,
) -> anyhow::Result<BTreeMap<String, Record>> {
    let out = node.kubectl(&[
        "-n",
        ns,
        "exec",
        "deploy/tools",
        "--",
        "kcat",
        "-C",
        "-b",
        boot,
        "-t",
        topic,
        "-e",
        "-q",
        "-f",
        "%T %s|%h\n",
    ])?;
    let mut records = BTreeMap::new();
    for line in out.lines().filter(|l| !l.is_empty()) {
        let (ts, rest) = line.split_once(' ').context("timestamp")?;
        let (value, headers) = rest.split_once('|').context("headers")?;
        let r = Record {
            ts: ts
                .parse()
                .with_context(|| format!("timestamp of {line:?}"))?,
            headers: headers.to_string(),
        };
        if records.insert(value.to_string(), r).is_some() {
            bail!("{topic} holds {value} twice: the producer sent it twice");
        }
    }
    Ok(records)
}

/// The values a worker printed ("record PARTITION OFFSET VALUE").
fn handled(log: &str) -> Vec<String> {
    log.lines()
        .filter_map(|l| l.strip_prefix("record "))
        .filter_map(|l| l.splitn(3, ' ').nth(2))
        .map(str::to_string)
        .collect()
}

/// The RoutingConfig spans of routing key `key`: baseline name → (sinceMs, untilMs).
fn spans(node: &Node, key: &str) -> anyhow::Result<HashMap<String, (i64, Option<i64>)>> {
    let all = node.get_json("default", &["routingconfigs"])?;
    let mut out = HashMap::new();
    for rc in all["items"].as_array().into_iter().flatten() {
        if rc["spec"]["routingKey"] != key {
            continue;
        }
        for s in rc["status"]["routeServer"]["spans"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let name = s["baseline"]["name"].as_str().context("span baseline")?;
            let since = s["sinceMs"].as_i64().context("sinceMs")?;
            out.insert(name.to_string(), (since, s["untilMs"].as_i64()));
        }
    }
    Ok(out)
}

fn baseline_pod(node: &Node, ns: &str, client: &str) -> anyhow::Result<String> {
    match node
        .pods(ns, &format!("app=worker-{client},!spur.dev/sandbox"))?
        .as_slice()
    {
        [one] => Ok(one.clone()),
        other => bail!("expected one baseline pod of worker-{client}, found {other:?}"),
    }
}

fn fork_pod(node: &Node, ns: &str, client: &str) -> anyhow::Result<String> {
    eventually(
        &format!("the fork pod of worker-{client}"),
        Duration::from_secs(180),
        || {
            let selector = format!("spur.dev/sandbox={SANDBOX},spur.dev/fork-of=worker-{client}");
            let pods = node.pods(ns, &selector)?;
            Ok(match pods.as_slice() {
                [one] => {
                    let p: Value = node.get_json(ns, &["pod", one])?;
                    (super::condition(&p, "Ready") == Some("True")).then(|| one.clone())
                }
                _ => None,
            })
        },
    )
    .with_context(|| node.describe(ns))
}

/// A one-replica Deployment `name` of the Kafka image: pods labelled `app: <name>` with the
/// pod-template `annotation` and the one container `container` (YAML, its first line `- name:`,
/// indented as a list item of `containers`).
fn deployment(ns: &str, name: &str, annotation: &str, container: &str) -> String {
    format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata: {{name: {name}, namespace: {ns}}}
spec:
  replicas: 1
  selector: {{matchLabels: {{app: {name}}}}}
  template:
    metadata:
      labels: {{app: {name}}}
      annotations: {{{annotation}}}
    spec:
      containers:
{container}"#
    )
}

fn broker(ns: &str) -> String {
    let container = format!(
        r#"        - name: broker
          image: {KAFKA_IMAGE}
          imagePullPolicy: IfNotPresent
          command: [spur-kafka-broker]
          env: [{{name: KAFKA_ADVERTISED_HOST, value: kafka.{ns}.svc.cluster.local}}]
          ports: [{{containerPort: 9092}}]
          readinessProbe: {{tcpSocket: {{port: 9092}}, periodSeconds: 2}}
          volumeMounts: [{{name: data, mountPath: /var/lib/kafka}}]
      volumes: [{{name: data, emptyDir: {{}}}}]
"#
    );
    format!(
        r#"{}---
apiVersion: v1
kind: Service
metadata: {{name: kafka, namespace: {ns}}}
spec:
  selector: {{app: kafka}}
  ports: [{{port: 9092, targetPort: 9092}}]
"#,
        deployment(
            ns,
            "kafka",
            r#"sidecar.spur.dev/inject: "false""#,
            &container
        )
    )
}

/// A pod to create topics, produce and read from (no sidecar: what it sends is as the clients
/// wrote it, what it reads is the broker's log as it is).
fn tools(ns: &str) -> String {
    let container = format!(
        r#"        - name: tools
          image: {KAFKA_IMAGE}
          imagePullPolicy: IfNotPresent
          command: [catatonit, -P]
"#
    );
    deployment(
        ns,
        "tools",
        r#"sidecar.spur.dev/inject: "false""#,
        &container,
    )
}

/// A consumer Deployment as its team wrote it, with only the annotation that its sidecar relays
/// Kafka on 9092. Ready 15 s after it starts (a warm-up, as many workers have): the fork inherits
/// it, so keyed records stream for a while before the route starts.
fn worker(ns: &str, client: &str, command: &str) -> String {
    let container = format!(
        r#"        - name: app
          image: {KAFKA_IMAGE}
          imagePullPolicy: IfNotPresent
          command: {command}
          readinessProbe: {{exec: {{command: ["true"]}}, initialDelaySeconds: 15, periodSeconds: 2}}
"#
    );
    deployment(
        ns,
        &format!("worker-{client}"),
        r#"sidecar.spur.dev/kafka-ports: "9092""#,
        &container,
    )
}

fn sandbox(ns: &str) -> String {
    let forks: String = CLIENTS
        .iter()
        .map(|(c, ..)| {
            format!("    - forkOf: {{kind: Deployment, namespace: {ns}, name: worker-{c}}}\n")
        })
        .collect();
    format!(
        "apiVersion: spur.dev/v1alpha1\nkind: Sandbox\nmetadata:\n  name: {SANDBOX}\nspec:\n  \
         description: Kafka workers on the node\n  forks:\n{forks}"
    )
}
