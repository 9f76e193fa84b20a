//! A real Apache Kafka broker (3.9.2, KRaft, one node) on loopback for the Kafka tests, and the
//! real clients that talk to it: the Java client (`tests/kafka/Probe.java`, kafka-clients
//! unchanged), kcat (librdkafka, Debian's), and a raw client on the `kafka-protocol` crate for what
//! no client shows (a Fetch response as the broker sent it, a Produce of batches we wrote).
//!
//! The broker's jars come from `tests/kafka/fetch.sh` (`SPUR_KAFKA_DIR`, which tests/run.sh
//! exports, or run here). Each [`Broker`] has its own data directory and ports; a watchdog kills
//! the JVM if the test process dies without dropping it.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use kafka_protocol::messages::{ApiVersionsRequest, RequestHeader, ResponseHeader};
use kafka_protocol::protocol::{Decodable, Encodable, HeaderVersion, Request, StrBytes};
use spur_kube_harness::process::{Process, Watchdog};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::free_port;

/// The directory `tests/kafka/fetch.sh` filled (`lib/`, `classes/`, `log4j.properties`).
pub fn kafka_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("SPUR_KAFKA_DIR") {
        return PathBuf::from(dir);
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("kafka/fetch.sh");
    let out = Command::new(&script)
        .output()
        .expect("running tests/kafka/fetch.sh");
    assert!(
        out.status.success(),
        "tests/kafka/fetch.sh failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    PathBuf::from(
        stdout
            .lines()
            .last()
            .expect("fetch.sh prints its directory")
            .trim(),
    )
}

/// A running single-node broker; killed (and its data removed) on drop.
pub struct Broker {
    pub addr: SocketAddr,
    kafka: PathBuf,
    process: Process,
    watchdog: Watchdog,
    dir: tempfile::TempDir,
    starts: usize,
}

impl Broker {
    /// Starts a broker on loopback with `num.partitions=3` and no topic auto-creation; returns
    /// once it answers ApiVersions and lists itself in Metadata.
    pub async fn start() -> anyhow::Result<Broker> {
        Self::start_on(Ipv4Addr::LOCALHOST).await
    }

    /// [`Broker::start`] with its client listener on `ip` (a test namespace's host end, for
    /// clients inside namespaces); its controller stays on loopback.
    pub async fn start_on(ip: Ipv4Addr) -> anyhow::Result<Broker> {
        let kafka = kafka_dir();
        let mut last = None;
        // A port taken between choosing it and the JVM binding it: try again with others.
        for _ in 0..3 {
            match Self::try_start(&kafka, ip).await {
                Ok(b) => return Ok(b),
                Err(e) if format!("{e:#}").contains("Address already in use") => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("broker did not start")))
    }

    async fn try_start(kafka: &Path, ip: Ipv4Addr) -> anyhow::Result<Broker> {
        let dir = tempfile::tempdir()?;
        let (port, controller) = (free_port(), free_port());
        let props = dir.path().join("server.properties");
        std::fs::write(
            &props,
            format!(
                "process.roles=broker,controller\n\
                 node.id=1\n\
                 controller.quorum.voters=1@127.0.0.1:{controller}\n\
                 listeners=PLAINTEXT://{ip}:{port},CONTROLLER://127.0.0.1:{controller}\n\
                 advertised.listeners=PLAINTEXT://{ip}:{port}\n\
                 listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT\n\
                 controller.listener.names=CONTROLLER\n\
                 inter.broker.listener.name=PLAINTEXT\n\
                 log.dirs={}\n\
                 num.partitions=3\n\
                 offsets.topic.replication.factor=1\n\
                 offsets.topic.num.partitions=4\n\
                 transaction.state.log.replication.factor=1\n\
                 transaction.state.log.min.isr=1\n\
                 transaction.state.log.num.partitions=4\n\
                 group.initial.rebalance.delay.ms=0\n\
                 auto.create.topics.enable=false\n",
                dir.path().join("data").display()
            ),
        )?;
        // A cluster id is a Kafka Uuid: 16 bytes, base64url without padding.
        use base64::Engine as _;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let id = nanos ^ (u128::from(std::process::id()) << 64) ^ u128::from(port);
        let cluster_id = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(id.to_be_bytes());
        let format = java(kafka)
            .args(["kafka.tools.StorageTool", "format", "-t", &cluster_id, "-c"])
            .arg(&props)
            .output()
            .context("running kafka.tools.StorageTool")?;
        if !format.status.success() {
            bail!(
                "formatting the broker's storage failed:\n{}{}",
                String::from_utf8_lossy(&format.stdout),
                String::from_utf8_lossy(&format.stderr)
            );
        }
        let mut watchdog = Watchdog::spawn(dir.path())?;
        let mut cmd = java(kafka);
        cmd.args(["-Xmx512m", "-XX:+UseSerialGC", "kafka.Kafka"])
            .arg(&props);
        let mut process = Process::spawn("kafka", cmd, &dir.path().join("broker.log"))?;
        watchdog.watch(&process)?;
        let addr = SocketAddr::from((ip, port));
        Self::wait_up(&mut process, addr).await?;
        Ok(Broker {
            addr,
            kafka: kafka.to_path_buf(),
            process,
            watchdog,
            dir,
            starts: 1,
        })
    }

    /// Kills the broker (SIGKILL, as a node that crashed) and starts it again on the same
    /// address and data; returns once it answers again.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.process.kill();
        self.starts += 1;
        let mut cmd = java(&self.kafka);
        cmd.args(["-Xmx512m", "-XX:+UseSerialGC", "kafka.Kafka"])
            .arg(self.dir.path().join("server.properties"));
        let log = self.dir.path().join(format!("broker-{}.log", self.starts));
        let mut process = Process::spawn("kafka", cmd, &log)?;
        self.watchdog.watch(&process)?;
        Self::wait_up(&mut process, self.addr).await?;
        self.process = process;
        Ok(())
    }

    /// Until the broker at `addr` answers ApiVersions and lists itself in Metadata.
    async fn wait_up(process: &mut Process, addr: SocketAddr) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            if let Some(status) = process.exited()? {
                bail!("the broker exited ({status}):\n{}", process.log_tail());
            }
            if let Ok(mut raw) = Raw::connect(addr).await
                && raw
                    .call(
                        3,
                        &ApiVersionsRequest::default()
                            .with_client_software_name(StrBytes::from_static_str("spur-test"))
                            .with_client_software_version(StrBytes::from_static_str("0")),
                    )
                    .await
                    .is_ok_and(|r| r.error_code == 0)
                && raw.brokers().await.is_ok_and(|n| n > 0)
            {
                break;
            }
            if Instant::now() > deadline {
                bail!("the broker did not answer in 90 s:\n{}", process.log_tail());
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        Ok(())
    }

    /// The end of the broker's log, for assertion messages.
    pub fn log_tail(&self) -> String {
        self.process.log_tail()
    }

    pub fn bootstrap(&self) -> String {
        self.addr.to_string()
    }

    /// Runs the Java client harness (`Probe`) with `args` after its command; its stdout.
    pub async fn probe(&self, args: &[&str]) -> anyhow::Result<String> {
        self.probe_in(None, args).await
    }

    /// [`Broker::probe`] inside the network namespace `ns` (`ip netns exec`).
    pub async fn probe_in(&self, ns: Option<&str>, args: &[&str]) -> anyhow::Result<String> {
        run_probe(self.probe_command(ns, args), args).await
    }

    /// The command [`Broker::probe_in`] runs, to run while the broker itself is restarted
    /// ([`run_probe`]).
    pub fn probe_command(&self, ns: Option<&str>, args: &[&str]) -> tokio::process::Command {
        let java = java(&self.kafka);
        let mut cmd = in_ns(ns, java.get_program());
        cmd.args(java.get_args())
            .arg("Probe")
            .args(args)
            .kill_on_drop(true);
        cmd
    }

    /// [`Broker::probe`] as a running child with its stdout piped, for a test that acts on what
    /// the client prints while it runs (killed if dropped).
    pub fn probe_spawn(&self, args: &[&str]) -> anyhow::Result<tokio::process::Child> {
        let java = java(&self.kafka);
        let mut cmd = in_ns(None, java.get_program());
        cmd.args(java.get_args())
            .arg("Probe")
            .args(args)
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true);
        Ok(cmd.spawn()?)
    }

    /// Runs franz-go's harness (`tests/go-kafka`, built by `tests/go/build.sh`) with `args`; its
    /// stdout.
    pub async fn franz(&self, args: &[&str]) -> anyhow::Result<String> {
        self.franz_in(None, args).await
    }

    /// [`Broker::franz`] inside the network namespace `ns`.
    pub async fn franz_in(&self, ns: Option<&str>, args: &[&str]) -> anyhow::Result<String> {
        let bin = crate::go_bin_dir().join("kafka-client");
        let mut cmd = in_ns(ns, &bin);
        cmd.args(args).kill_on_drop(true);
        let out = tokio::time::timeout(Duration::from_secs(120), cmd.output())
            .await
            .context("franz-go ran for 120 s")??;
        if !out.status.success() {
            bail!(
                "kafka-client {args:?} failed ({}):\n{}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Produces one record per value with kcat (librdkafka), compressed with `codec`, each with
    /// the header `name: value` when given.
    pub async fn kcat_produce(
        &self,
        topic: &str,
        codec: &str,
        values: &[String],
        header: Option<(&str, &str)>,
    ) -> anyhow::Result<()> {
        let mut cmd = tokio::process::Command::new("kcat");
        cmd.args(["-P", "-b", &self.bootstrap(), "-t", topic, "-z", codec])
            .args(["-X", "linger.ms=20"]);
        if let Some((k, v)) = header {
            cmd.arg("-H").arg(format!("{k}={v}"));
        }
        cmd.stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().context("running kcat (Debian: kcat)")?;
        let mut stdin = child.stdin.take().context("kcat's stdin")?;
        stdin
            .write_all((values.join("\n") + "\n").as_bytes())
            .await?;
        drop(stdin);
        let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
            .await
            .context("kcat ran for 60 s")??;
        if !out.status.success() {
            bail!("kcat -P failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    }

    /// Reads the whole topic from the beginning with kcat, without a group; the values.
    pub async fn kcat_consume(&self, topic: &str) -> anyhow::Result<Vec<String>> {
        let mut cmd = tokio::process::Command::new("kcat");
        cmd.args([
            "-C",
            "-b",
            &self.bootstrap(),
            "-t",
            topic,
            "-o",
            "beginning",
            "-e",
        ])
        .args(["-f", "%s\\n", "-X", "check.crcs=true"])
        .kill_on_drop(true);
        let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
            .await
            .context("kcat ran for 60 s")??;
        if !out.status.success() {
            bail!("kcat -C failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect())
    }
}

/// `program`, inside the network namespace `ns` when given (`ip netns exec`).
/// Runs a command of [`Broker::probe_command`] (for at most 120 s): its stdout.
pub async fn run_probe(mut cmd: tokio::process::Command, args: &[&str]) -> anyhow::Result<String> {
    let out = tokio::time::timeout(Duration::from_secs(120), cmd.output())
        .await
        .context("the Java client ran for 120 s")??;
    if !out.status.success() {
        bail!(
            "java Probe {args:?} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn in_ns(ns: Option<&str>, program: impl AsRef<std::ffi::OsStr>) -> tokio::process::Command {
    match ns {
        None => tokio::process::Command::new(program),
        Some(ns) => {
            let mut c = tokio::process::Command::new("ip");
            c.args(["netns", "exec", ns]).arg(program);
            c
        }
    }
}

/// `java` with the broker's classpath, the Probe classes and its log4j configuration.
fn java(kafka: &Path) -> Command {
    let mut cmd = Command::new("java");
    cmd.arg("-cp")
        .arg(format!(
            "{}:{}",
            kafka.join("lib/*").display(),
            kafka.join("classes").display()
        ))
        .arg(format!(
            "-Dlog4j.configuration=file:{}",
            kafka.join("log4j.properties").display()
        ));
    cmd
}

/// A plain Kafka protocol connection: one request at a time, header and body encoded by the
/// `kafka-protocol` crate.
pub struct Raw {
    stream: TcpStream,
    correlation: i32,
}

impl Raw {
    pub async fn connect(addr: SocketAddr) -> anyhow::Result<Raw> {
        Ok(Raw {
            stream: TcpStream::connect(addr).await?,
            correlation: 0,
        })
    }

    /// Sends `req` as `version` and reads its response.
    pub async fn call<R: Request>(&mut self, version: i16, req: &R) -> anyhow::Result<R::Response> {
        self.correlation += 1;
        let header = RequestHeader::default()
            .with_request_api_key(R::KEY)
            .with_request_api_version(version)
            .with_correlation_id(self.correlation)
            .with_client_id(Some(StrBytes::from_static_str("spur-test")));
        let mut body = BytesMut::new();
        header.encode(&mut body, R::header_version(version))?;
        req.encode(&mut body, version)?;
        let mut frame = BytesMut::with_capacity(4 + body.len());
        frame.put_u32(u32::try_from(body.len())?);
        frame.extend_from_slice(&body);
        self.stream.write_all(&frame).await?;
        let len = self.stream.read_u32().await? as usize;
        let mut buf = vec![0u8; len];
        self.stream.read_exact(&mut buf).await?;
        let mut buf = Bytes::from(buf);
        let rh = ResponseHeader::decode(&mut buf, R::Response::header_version(version))?;
        if rh.correlation_id != self.correlation {
            bail!(
                "correlation id {} for request {}",
                rh.correlation_id,
                self.correlation
            );
        }
        let resp = R::Response::decode(&mut buf, version)?;
        if buf.has_remaining() {
            bail!("{} bytes after the response", buf.remaining());
        }
        Ok(resp)
    }

    /// How many brokers Metadata lists (all topics not asked for).
    async fn brokers(&mut self) -> anyhow::Result<usize> {
        let m = self
            .call(
                9,
                &kafka_protocol::messages::MetadataRequest::default().with_topics(Some(vec![])),
            )
            .await?;
        Ok(m.brokers.len())
    }
}

/// A decision on one record: whether the relay's consumer receives it.
pub type Keep = Arc<dyn Fn(&spur_kafka::Record<'_>) -> bool + Send + Sync>;

/// A loopback relay in front of a broker: every connection runs the product's relay
/// (`spur_proxy::kafka::relay`, a [`spur_kafka::Session`] in `role`) and filters Fetch responses
/// with `keep`. It advertises itself in place of the broker
/// (explicit listener), so clients bootstrapped through it stay on it. Stops on drop.
pub struct Relay {
    pub addr: SocketAddr,
    pub stats: Arc<Mutex<spur_kafka::SessionStats>>,
    /// Connections closed on an error, with the error.
    pub errors: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Relay {
    pub async fn start(broker: SocketAddr, role: spur_kafka::Role, keep: Keep) -> Relay {
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let cfg = spur_kafka::SessionConfig {
            role,
            limits: spur_kafka::Limits::default(),
            // The broker is node 1 (server.properties above).
            advertise: vec![(1, addr.ip().to_string(), i32::from(addr.port()))],
            front: None,
            topics: spur_kafka::TopicNames::default(),
        };
        let stats = Arc::new(Mutex::new(spur_kafka::SessionStats::default()));
        let errors = Arc::new(Mutex::new(Vec::new()));
        let sink = stats.clone();
        // The product's relay (spur-proxy), as the sidecar will run it.
        let relay = spur_proxy::kafka::KafkaRelay {
            session: cfg,
            max_frame: spur_kafka::frame::DEFAULT_MAX_FRAME,
            keep: Arc::new(move |_, _, r| keep(r)),
            on_stats: Arc::new(move |s| sink.lock().unwrap().add(s)),
            hold: None,
        };
        let e = errors.clone();
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                let (relay, e) = (relay.clone(), e.clone());
                conns.spawn(async move {
                    let result = match TcpStream::connect(broker).await {
                        Ok(upstream) => spur_proxy::kafka::relay(client, upstream, &relay)
                            .await
                            .map_err(anyhow::Error::from),
                        Err(err) => Err(err.into()),
                    };
                    if let Err(err) = result {
                        e.lock().unwrap().push(format!("{err:#}"));
                    }
                });
            }
        });
        Relay {
            addr,
            stats,
            errors,
            task,
        }
    }
}

impl Broker {
    /// Reads `topic` as a member of `group` with kcat's balanced consumer (librdkafka), through
    /// `bootstrap`, until every assigned partition reached its end; the values.
    pub async fn kcat_group(
        &self,
        bootstrap: SocketAddr,
        group: &str,
        topic: &str,
    ) -> anyhow::Result<Vec<String>> {
        self.kcat_group_in(None, bootstrap, group, topic).await
    }

    /// [`Broker::kcat_group`] inside the network namespace `ns`.
    pub async fn kcat_group_in(
        &self,
        ns: Option<&str>,
        bootstrap: SocketAddr,
        group: &str,
        topic: &str,
    ) -> anyhow::Result<Vec<String>> {
        let mut cmd = in_ns(ns, "kcat");
        cmd.args(["-b", &bootstrap.to_string(), "-G", group, topic, "-e"])
            .args(["-f", "%s\\n", "-X", "auto.offset.reset=earliest"])
            .kill_on_drop(true);
        let out = tokio::time::timeout(Duration::from_secs(90), cmd.output())
            .await
            .context("kcat -G ran for 90 s")??;
        if !out.status.success() {
            bail!("kcat -G failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect())
    }
}
