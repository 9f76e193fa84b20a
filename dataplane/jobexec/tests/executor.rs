//! The job executor over its real gRPC API on loopback, with real TLS and real processes:
//! live logs, exit codes, cancel and timeout killing the whole process tree (setsid'd
//! grandchildren and SIGTERM-ignoring ones too), artifacts (and what may not be one), the log
//! limit, and who may call it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use spur_job_executor::{Limits, client, tls};
use spur_proto::jobs::job_executor_client::JobExecutorClient;
use spur_proto::jobs::{self as pb, attempt_status::State};
use tonic::transport::Channel;

struct Pki {
    ca_pem: String,
    client: (String, String),
    server: (String, String),
}

fn issue(
    ca: &Issuer<'_, KeyPair>,
    cn: &str,
    eku: ExtendedKeyUsagePurpose,
    dns: &[&str],
) -> (String, String) {
    let key = KeyPair::generate().unwrap();
    let mut p =
        CertificateParams::new(dns.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
    p.distinguished_name.push(DnType::CommonName, cn);
    p.extended_key_usages = vec![eku];
    let cert = p.signed_by(&key, ca).unwrap();
    (cert.pem(), key.serialize_pem())
}

fn pki() -> Pki {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::default();
    ca.distinguished_name.push(DnType::CommonName, "jobs CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    Pki {
        ca_pem: ca_cert.pem(),
        client: issue(
            &issuer,
            "spur-operator",
            ExtendedKeyUsagePurpose::ClientAuth,
            &[],
        ),
        server: issue(
            &issuer,
            "executor",
            ExtendedKeyUsagePurpose::ServerAuth,
            &["spur-job-executor.test"],
        ),
    }
}

/// The executor binary, as a runner pod runs it: each test gets its own process (a job's
/// descendants are the executor's, and a test process holds several).
struct Executor {
    addr: std::net::SocketAddr,
    pki: Pki,
    child: std::process::Child,
    _work: tempfile::TempDir,
    tls_dir: tempfile::TempDir,
}

async fn executor(limits: Limits) -> Executor {
    use std::io::BufRead;
    let pki = pki();
    let tls_dir = tempfile::tempdir().unwrap();
    std::fs::write(tls_dir.path().join(tls::CA_FILE), &pki.ca_pem).unwrap();
    std::fs::write(tls_dir.path().join(tls::CERT_FILE), &pki.server.0).unwrap();
    std::fs::write(tls_dir.path().join(tls::KEY_FILE), &pki.server.1).unwrap();
    let work = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_spur-job-executor"))
        .args(["serve", "--listen", "127.0.0.1:0", "--tls-dir"])
        .arg(tls_dir.path())
        .arg("--work-dir")
        .arg(work.path().join("work"))
        .args(["--max-log-bytes", &limits.max_log_bytes.to_string()])
        .args([
            "--kill-grace",
            &format!("{}ms", limits.kill_grace.as_millis()),
        ])
        .args(
            limits
                .routing_key_file
                .iter()
                .flat_map(|f| [std::ffi::OsStr::new("--routing-key-file"), f.as_os_str()]),
        )
        .env("SPUR_LOG", "info")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The port, from the "job executor listening local=…" line; later lines are echoed.
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            eprintln!("executor: {line}");
            if let Some(rest) = line.split("local=").nth(1)
                && let Some(t) = tx.take()
            {
                let addr = rest
                    .split_whitespace()
                    .next()
                    .unwrap_or_default()
                    .to_owned();
                let _ = t.send(addr);
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the executor logs its address")
        .parse()
        .unwrap();
    assert!(
        !tls_dir.path().join(tls::KEY_FILE).exists(),
        "the key is deleted once read"
    );
    Executor {
        addr,
        pki,
        child,
        _work: work,
        tls_dir,
    }
}

impl Executor {
    fn client(&self) -> JobExecutorClient<Channel> {
        let cfg = client::client_config(
            self.pki.ca_pem.as_bytes(),
            self.pki.client.0.as_bytes(),
            self.pki.client.1.as_bytes(),
        )
        .unwrap();
        client::connect(self.addr, "spur-job-executor.test", cfg).unwrap()
    }

    /// SIGTERM, as the kubelet sends; the executor must exit within its grace.
    async fn stop(mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "executor exited with {status}");
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the executor did not stop on SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn limits() -> Limits {
    Limits {
        max_log_bytes: 1 << 20,
        kill_grace: Duration::from_millis(500),
        routing_key_file: None,
    }
}

fn script(uid: &str, text: &str) -> pb::StartRequest {
    pb::StartRequest {
        attempt_uid: uid.into(),
        program: Some(pb::start_request::Program::Script(text.into())),
        ..Default::default()
    }
}

/// Reads the whole log and the final status.
async fn log(c: &mut JobExecutorClient<Channel>, uid: &str) -> (String, pb::AttemptStatus) {
    let mut s = c
        .logs(pb::LogsRequest {
            attempt_uid: uid.into(),
            offset: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let mut out = Vec::new();
    while let Some(m) = tokio::time::timeout(Duration::from_secs(30), s.message())
        .await
        .expect("log stream stalls")
        .unwrap()
    {
        assert_eq!(m.offset as usize, out.len());
        out.extend_from_slice(&m.data);
        if let Some(f) = m.r#final {
            return (String::from_utf8(out).unwrap(), f);
        }
    }
    panic!(
        "log ended without a final status: {}",
        String::from_utf8_lossy(&out)
    );
}

fn alive(pid: i32) -> bool {
    // A zombie counts as gone: it runs nothing.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.rsplit_once(')').unwrap().1.trim_start().starts_with('Z'))
        .unwrap_or(false)
}

#[tokio::test]
async fn runs_a_script_streams_its_log_live_and_reports_the_exit_code() {
    let ex = executor(limits()).await;
    let mut c = ex.client();
    assert_eq!(
        c.status(pb::StatusRequest {})
            .await
            .unwrap()
            .into_inner()
            .state,
        State::Idle as i32
    );
    let mut req = script(
        "job-1.1",
        "#!/bin/sh\necho \"first $GREETING\"\necho to-stderr >&2\nsleep 1\necho last\nexit 3\n",
    );
    req.env = vec![pb::EnvVar {
        name: "GREETING".into(),
        value: "hello".into(),
    }];
    let started = c.start(req.clone()).await.unwrap().into_inner();
    assert_eq!(started.state, State::Running as i32);
    // Idempotent: the same attempt again is its status, another one is refused.
    assert_eq!(
        c.start(req).await.unwrap().into_inner().attempt_uid,
        "job-1.1"
    );
    let other = c.start(script("job-2.1", "true")).await.unwrap_err();
    assert_eq!(other.code(), tonic::Code::FailedPrecondition);

    // The first line arrives while the job still runs.
    let mut s = c
        .logs(pb::LogsRequest {
            attempt_uid: "job-1.1".into(),
            offset: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let first = s.message().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first.data).starts_with("first hello\n"));
    let now = c.status(pb::StatusRequest {}).await.unwrap().into_inner();
    assert_eq!(
        now.state,
        State::Running as i32,
        "first line before the end"
    );

    let (text, fin) = log(&mut c, "job-1.1").await;
    assert_eq!(text, "first hello\nto-stderr\nlast\n");
    assert_eq!(fin.state, State::Exited as i32);
    assert_eq!(fin.exit_code, Some(3));
    assert!(!fin.timed_out && !fin.canceled);
    assert_eq!(fin.log_bytes, text.len() as u64);

    // A later reader resumes from an offset.
    let mut tail = c
        .logs(pb::LogsRequest {
            attempt_uid: "job-1.1".into(),
            offset: 12,
        })
        .await
        .unwrap()
        .into_inner();
    let m = tail.message().await.unwrap().unwrap();
    assert_eq!(m.offset, 12);
    assert_eq!(String::from_utf8_lossy(&m.data), "to-stderr\nlast\n");

    // Release makes it idle; then another attempt may start.
    let idle = c
        .release(pb::ReleaseRequest {
            attempt_uid: "job-1.1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(idle.state, State::Idle as i32);
    // A released attempt never runs again (a late or repeated Start).
    let again = c.start(script("job-1.1", "echo again")).await.unwrap_err();
    assert_eq!(again.code(), tonic::Code::AlreadyExists);
    let cmd = pb::StartRequest {
        attempt_uid: "job-2.1".into(),
        program: Some(pb::start_request::Program::Command(pb::Command {
            args: vec!["/bin/sh".into(), "-c".into(), "pwd; echo $SPUR_X".into()],
        })),
        env: vec![pb::EnvVar {
            name: "SPUR_X".into(),
            value: "y".into(),
        }],
        ..Default::default()
    };
    c.start(cmd).await.unwrap();
    let (text, fin) = log(&mut c, "job-2.1").await;
    assert!(text.ends_with("/workdir\ny\n"), "{text}");
    assert_eq!(fin.exit_code, Some(0));
    ex.stop().await;
}

/// `client::read_log`, as the replicas of `spur jobs` read a running attempt: the one that drives
/// it and a standby that serves its log follow it at once, each from its own offset; a bounded
/// read stops at its bound; a reader that leaves stops its stream; a released attempt is gone.
#[tokio::test]
async fn several_readers_follow_one_attempt() {
    /// Reads into a string: (the offset reached, whether the process had exited, the text).
    async fn read(
        c: &mut JobExecutorClient<Channel>,
        offset: u64,
        until: u64,
    ) -> Result<(u64, bool, String), tonic::Status> {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(4);
        let collect = tokio::spawn(async move {
            let mut got = Vec::new();
            while let Some(piece) = rx.recv().await {
                got.extend_from_slice(&piece);
            }
            String::from_utf8(got).unwrap()
        });
        let mut end = offset;
        let r = client::read_log(c, "job-5.1", &mut end, until, &tx).await;
        drop(tx);
        let text = collect.await.unwrap();
        r.map(|exited| (end, exited, text))
    }
    let ex = executor(limits()).await;
    let mut c = ex.client();
    c.start(script(
        "job-5.1",
        "#!/bin/sh\necho one\nsleep 0.5\necho two\nsleep 0.5\necho three\n",
    ))
    .await
    .unwrap();
    let follow = |offset: u64, until: u64| {
        let mut c = ex.client();
        tokio::spawn(async move { read(&mut c, offset, until).await.unwrap() })
    };
    let (driver, standby, tail, bounded) = (
        follow(0, u64::MAX),
        follow(0, u64::MAX),
        follow(4, u64::MAX),
        follow(0, 6),
    );
    // The bounded reader returns at its bound, before the job has written it all.
    let got = tokio::time::timeout(Duration::from_secs(20), bounded)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got, (6, false, "one\ntw".to_owned()));
    let all = "one\ntwo\nthree\n";
    for (reader, from) in [(driver, 0), (standby, 0), (tail, 4)] {
        let got = tokio::time::timeout(Duration::from_secs(20), reader)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, (all.len() as u64, true, all[from..].to_owned()));
    }
    // Exited, not yet released: a bounded reader gets what is there and returns.
    assert_eq!(
        read(&mut c, 0, 4).await.unwrap(),
        (4, false, "one\n".to_owned())
    );
    // A reader that is gone ends the read at once.
    let (tx, rx) = tokio::sync::mpsc::channel::<Vec<u8>>(1);
    drop(rx);
    let mut end = 0;
    let exited = client::read_log(&mut c, "job-5.1", &mut end, u64::MAX, &tx)
        .await
        .unwrap();
    assert!(!exited && end == 0, "{end} {exited}: nothing was sent");
    c.release(pb::ReleaseRequest {
        attempt_uid: "job-5.1".into(),
    })
    .await
    .unwrap();
    let gone = read(&mut c, 0, u64::MAX).await.unwrap_err();
    assert_eq!(gone.code(), tonic::Code::NotFound);
    ex.stop().await;
}

#[tokio::test]
async fn cancel_kills_the_whole_process_tree() {
    let ex = executor(limits()).await;
    let mut c = ex.client();
    // A grandchild in its own session (escapes the process group) and a child that ignores
    // SIGTERM: both must die.
    c.start(script(
        "cancel.1",
        "#!/bin/sh\nsetsid sh -c 'echo $$ > escaped.pid; exec sleep 300' &\ntrap '' TERM\necho $$ > main.pid\necho ready\nwhile :; do sleep 1; done\n",
    ))
    .await
    .unwrap();
    let mut s = c
        .logs(pb::LogsRequest {
            attempt_uid: "cancel.1".into(),
            offset: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let first = s.message().await.unwrap().unwrap();
    assert_eq!(String::from_utf8_lossy(&first.data), "ready\n");
    let work = ex._work.path().join("work/attempt-0/workdir");
    let read_pid = |f: &str| -> i32 {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Ok(s) = std::fs::read_to_string(work.join(f))
                && let Ok(p) = s.trim().parse()
            {
                return p;
            }
            assert!(Instant::now() < deadline, "{f} never written");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let (main, escaped) = (read_pid("main.pid"), read_pid("escaped.pid"));
    assert!(alive(main) && alive(escaped));

    let t = Instant::now();
    c.cancel(pb::CancelRequest {
        attempt_uid: "cancel.1".into(),
    })
    .await
    .unwrap();
    let (_, fin) = log(&mut c, "cancel.1").await;
    assert!(fin.canceled && !fin.timed_out, "{fin:?}");
    assert_eq!(
        fin.signal,
        Some(9),
        "SIGTERM was ignored: SIGKILL after the grace"
    );
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert!(!alive(main), "main process survived");
    assert!(!alive(escaped), "setsid grandchild survived");
    ex.stop().await;
}

#[tokio::test]
async fn a_timeout_ends_the_attempt_as_timed_out() {
    let ex = executor(limits()).await;
    let mut c = ex.client();
    let mut req = script("slow.1", "#!/bin/sh\necho start\nsleep 60\n");
    req.timeout_ms = 700;
    c.start(req).await.unwrap();
    let t = Instant::now();
    let (text, fin) = log(&mut c, "slow.1").await;
    assert_eq!(text, "start\n");
    assert!(fin.timed_out && !fin.canceled, "{fin:?}");
    assert_eq!(fin.exit_code, None);
    assert!(t.elapsed() < Duration::from_secs(10));
    ex.stop().await;
}

#[tokio::test]
async fn start_errors_and_output_beyond_the_limit() {
    let ex = executor(Limits {
        max_log_bytes: 1000,
        kill_grace: Duration::from_millis(200),
        routing_key_file: None,
    })
    .await;
    let mut c = ex.client();
    let missing = pb::StartRequest {
        attempt_uid: "missing.1".into(),
        program: Some(pb::start_request::Program::Command(pb::Command {
            args: vec!["/no/such/binary".into()],
        })),
        ..Default::default()
    };
    c.start(missing).await.unwrap();
    let (text, fin) = log(&mut c, "missing.1").await;
    assert!(fin.start_error.contains("/no/such/binary"), "{fin:?}");
    assert!(text.contains("cannot start"), "{text}");
    c.release(pb::ReleaseRequest {
        attempt_uid: "missing.1".into(),
    })
    .await
    .unwrap();

    c.start(script(
        "loud.1",
        "head -c 10000 /dev/zero | tr '\\0' x\necho done >&2\n",
    ))
    .await
    .unwrap();
    let (text, fin) = log(&mut c, "loud.1").await;
    assert!(fin.log_truncated);
    assert_eq!(
        fin.exit_code,
        Some(0),
        "a script without #! runs with /bin/sh"
    );
    assert!(text.starts_with(&"x".repeat(1000)));
    assert!(
        text.contains("output beyond 1000 bytes was dropped"),
        "{text}"
    );
    assert!(text.len() < 1200);

    let bad = c.start(script("bad uid", "true")).await.unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    ex.stop().await;
}

#[tokio::test]
async fn artifacts_are_sent_byte_for_byte_and_special_files_refused() {
    let ex = executor(limits()).await;
    let mut c = ex.client();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let mut req = script(
        "art.1",
        &format!(
            "#!/bin/sh\nhead -c 200000 /dev/urandom > {d}/blob\nmkdir -p {d}/out/sub\necho a > {d}/out/a\necho b > {d}/out/sub/b\nln -s /proc/self/environ {d}/leak\n"
        ),
    );
    req.artifact_paths = vec![
        format!("{d}/blob"),
        format!("{d}/out"),
        format!("{d}/leak"),
        format!("{d}/missing"),
        "/proc/self/mem".into(),
    ];
    c.start(req).await.unwrap();
    let (_, fin) = log(&mut c, "art.1").await;
    assert_eq!(fin.exit_code, Some(0));

    let mut s = c
        .artifacts(pb::ArtifactsRequest {
            attempt_uid: "art.1".into(),
            max_bytes: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    let mut skipped = Vec::new();
    while let Some(m) = s.message().await.unwrap() {
        match m.part.unwrap() {
            pb::artifact_chunk::Part::File(f) => files.push((f.path, Vec::new())),
            pb::artifact_chunk::Part::Data(b) => files.last_mut().unwrap().1.extend_from_slice(&b),
            pb::artifact_chunk::Part::Skipped(sk) => skipped.push((sk.declared, sk.reason)),
        }
    }
    let names: Vec<&str> = files.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(
        names,
        [
            format!("{d}/blob"),
            format!("{d}/out/a"),
            format!("{d}/out/sub/b")
        ]
    );
    assert_eq!(files[0].1, std::fs::read(dir.path().join("blob")).unwrap());
    assert_eq!(files[1].1, b"a\n");
    assert_eq!(skipped.len(), 3, "{skipped:?}");
    assert!(skipped[0].1.contains("symlink"));
    assert_eq!(skipped[1].1, "does not exist");
    assert!(skipped[2].1.contains("/proc"));

    // A limit below the total stops the stream.
    let mut s = c
        .artifacts(pb::ArtifactsRequest {
            attempt_uid: "art.1".into(),
            max_bytes: 1000,
        })
        .await
        .unwrap()
        .into_inner();
    let err = loop {
        match s.message().await {
            Ok(Some(_)) => {}
            Ok(None) => panic!("no error beyond the limit"),
            Err(e) => break e,
        }
    };
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    ex.stop().await;
}

#[tokio::test]
async fn only_the_operators_client_certificate_may_call() {
    let ex = executor(limits()).await;
    let call = |cfg: Arc<rustls::ClientConfig>| {
        let addr = ex.addr;
        async move {
            let mut c = client::connect(addr, "spur-job-executor.test", cfg).unwrap();
            c.status(pb::StatusRequest {}).await
        }
    };
    // No client certificate.
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(ex.pki.ca_pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    use rustls::pki_types::pem::PemObject;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut anon = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    anon.alpn_protocols = vec![b"h2".to_vec()];
    assert!(call(Arc::new(anon)).await.is_err(), "no client certificate");

    // The executor's own certificate (serverAuth only), as a hostile job could present if it
    // had read it.
    let server_as_client = client::client_config(
        ex.pki.ca_pem.as_bytes(),
        ex.pki.server.0.as_bytes(),
        ex.pki.server.1.as_bytes(),
    )
    .unwrap();
    assert!(
        call(server_as_client).await.is_err(),
        "serverAuth certificate"
    );

    // A client certificate of another CA.
    let other = pki();
    let foreign = client::client_config(
        ex.pki.ca_pem.as_bytes(),
        other.client.0.as_bytes(),
        other.client.1.as_bytes(),
    )
    .unwrap();
    assert!(call(foreign).await.is_err(), "foreign CA");

    // The operator's certificate, against the wrong server name: refused by the client.
    let ours = client::client_config(
        ex.pki.ca_pem.as_bytes(),
        ex.pki.client.0.as_bytes(),
        ex.pki.client.1.as_bytes(),
    )
    .unwrap();
    let mut wrong = client::connect(ex.addr, "spur-job-executor.other", ours.clone()).unwrap();
    assert!(
        wrong.status(pb::StatusRequest {}).await.is_err(),
        "wrong name"
    );
    assert!(call(ours).await.is_ok(), "the operator's certificate");
    assert!(ex.tls_dir.path().join(tls::CA_FILE).exists());
    ex.stop().await;
}

#[tokio::test]
async fn stopping_the_executor_kills_a_running_job() {
    let ex = executor(limits()).await;
    let mut c = ex.client();
    c.start(script(
        "orphan.1",
        "#!/bin/sh\necho $$ > main.pid\nsleep 300\n",
    ))
    .await
    .unwrap();
    let pid_file = ex._work.path().join("work/attempt-0/workdir/main.pid");
    let deadline = Instant::now() + Duration::from_secs(5);
    let pid: i32 = loop {
        if let Ok(s) = std::fs::read_to_string(&pid_file)
            && let Ok(p) = s.trim().parse()
        {
            break p;
        }
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(alive(pid));
    let t = Instant::now();
    ex.stop().await;
    assert!(t.elapsed() < Duration::from_secs(10));
    assert!(!alive(pid), "the job outlived its executor");
}

#[tokio::test]
async fn the_key_file_holds_the_key_only_while_its_job_runs() {
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("routing-key");
    let ex = executor(Limits {
        routing_key_file: Some(key_file.clone()),
        ..limits()
    })
    .await;
    assert_eq!(
        std::fs::read_to_string(&key_file).unwrap(),
        "",
        "empty at start"
    );
    let mut c = ex.client();
    let mut req = script(
        "inject.1",
        &format!("#!/bin/sh\necho \"during=$(cat {})\"\n", key_file.display()),
    );
    req.inject_routing_key = "k3y-1".into();
    c.start(req).await.unwrap();
    let (text, fin) = log(&mut c, "inject.1").await;
    assert_eq!(text, "during=k3y-1\n");
    assert_eq!(fin.exit_code, Some(0));
    assert_eq!(
        std::fs::read_to_string(&key_file).unwrap(),
        "",
        "emptied after"
    );
    c.release(pb::ReleaseRequest {
        attempt_uid: "inject.1".into(),
    })
    .await
    .unwrap();
    // A job that did not ask for injection runs with an empty file.
    std::fs::write(&key_file, "stale").unwrap();
    c.start(script(
        "plain.1",
        &format!("#!/bin/sh\necho \"during=$(cat {})\"\n", key_file.display()),
    ))
    .await
    .unwrap();
    let (text, _) = log(&mut c, "plain.1").await;
    assert_eq!(text, "during=\n");
    ex.stop().await;

    // Without a key file, injection is refused rather than silently skipped.
    let ex = executor(limits()).await;
    let mut c = ex.client();
    let mut req = script("inject.2", "true");
    req.inject_routing_key = "k".into();
    let err = c.start(req).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert!(
        err.message().contains("outbound sidecar"),
        "{}",
        err.message()
    );
    ex.stop().await;
}

/// A result file comes back in the final status once the process has ended, also when a
/// timeout ended it; a file too large, never written or not regular gives the reason instead;
/// a relative result path is refused at the start.
#[tokio::test]
async fn the_result_file_comes_back_in_the_final_status() {
    let ex = executor(limits()).await;
    let mut c = ex.client();
    let dir = tempfile::tempdir().unwrap();
    let at = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let run = |uid: &'static str, text: String, result: String| {
        let mut req = script(uid, &text);
        req.result_path = result;
        req
    };
    let mut go = async |req: pb::StartRequest| {
        let uid = req.attempt_uid.clone();
        c.start(req).await.unwrap();
        let (_, fin) = log(&mut c, &uid).await;
        c.release(pb::ReleaseRequest { attempt_uid: uid })
            .await
            .unwrap();
        fin
    };

    let ok = at("r.json");
    let fin = go(run(
        "res-1.1",
        format!("printf '{{\"passed\":3}}' > {ok}; exit 1"),
        ok.clone(),
    ))
    .await;
    assert_eq!(fin.exit_code, Some(1), "a failed job has its result too");
    assert_eq!(fin.result.as_deref(), Some(&b"{\"passed\":3}"[..]));
    assert_eq!(fin.result_error, "");

    let slow = at("slow.txt");
    let mut req = run(
        "res-2.1",
        format!("echo partial > {slow}; sleep 30"),
        slow.clone(),
    );
    req.timeout_ms = 500;
    let fin = go(req).await;
    assert!(fin.timed_out);
    assert_eq!(fin.result.as_deref(), Some(&b"partial\n"[..]));

    let big = at("big");
    let fin = go(run(
        "res-3.1",
        format!("head -c 5000 /dev/zero > {big}"),
        big.clone(),
    ))
    .await;
    assert_eq!(fin.result, None);
    assert!(
        fin.result_error.contains("5000 bytes, more than the 4096"),
        "{}",
        fin.result_error
    );

    let fin = go(run("res-4.1", "true".into(), at("never"))).await;
    assert_eq!(fin.result_error, "the job did not write it");

    let fifo = at("fifo");
    let fin = go(run("res-5.1", format!("mkfifo {fifo}"), fifo.clone())).await;
    assert_eq!(fin.result_error, "is not a regular file");

    // Without a result path, nothing is read or said.
    let fin = go(script("res-6.1", "true")).await;
    assert!(fin.result.is_none() && fin.result_error.is_empty());

    let refused = c
        .start(run("res-7.1", "true".into(), "out.json".into()))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(refused.message().contains("result path"), "{refused:?}");
    ex.stop().await;
}
