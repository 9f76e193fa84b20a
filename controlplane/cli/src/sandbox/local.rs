//! `spur sandbox apply --local`: a sandbox with local workloads brought up and this machine
//! joined to it in one command, and taken down on Ctrl-C. It finds the tunnel proxy, uses the
//! workstation's credential or asks the cluster for one (a certificate request an administrator
//! approves), applies the Sandbox as the user, runs `spur local connect`'s session in process,
//! shows the sandbox coming up with the workstation's events in the same timeline, and on
//! Ctrl-C or SIGTERM deletes the sandbox (unless `--keep`) and disconnects. Every read and
//! write is the user's own: RBAC and Spur's admission (a workstation's owner is its
//! credential's user) judge them, never a component.

use std::io::Write as _;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Result, bail};
use clap::Args;
use kube::api::DeleteParams;
use kube::{Api, Client};
use spur_api::Sandbox;
use spur_workstation::{Event, EventSink, Workstation};

use super::apply::{self, Doc};
use super::wait::{self, Printer, Waited};
use super::{
    ApplyArgs, EXIT_INTERRUPTED, Follow as _, Output, describe, note, progress_out, waited_code,
};
use crate::local::connect::{self, SideArgs, TunnelArgs};
use crate::local::endpoint::Endpoint;
use crate::local::{StateDir, cert};

/// How long taking the sandbox down waits for it to go before disconnecting anyway.
const TAKE_DOWN: Duration = Duration::from_secs(60);

/// A certificate with less left than this is replaced before connecting.
const CERT_MARGIN: Duration = Duration::from_secs(5 * 60);

#[derive(Args)]
#[command(next_help_heading = "With --local")]
pub(crate) struct LocalArgs {
    /// Also join this machine to the sandbox's local workloads (its `spec.workstation`), in
    /// the foreground as `spur local connect` does, finding the tunnel proxy in the cluster and
    /// asking for a workstation certificate when there is none. Waits until ready; Ctrl-C or
    /// SIGTERM deletes the sandbox and disconnects.
    #[arg(long)]
    pub(crate) local: bool,
    /// Leave the sandbox in place when disconnecting.
    #[arg(long, requires = "local")]
    keep: bool,
    /// How long to wait for an administrator to approve a new workstation certificate.
    #[arg(long, default_value = "15m", value_parser = super::parse_wait)]
    approval_timeout: Duration,
    /// How long a new workstation certificate is valid (the operator caps it).
    #[arg(long, default_value = "24h", value_parser = spur_runtime::parse_duration)]
    cert_lifetime: Duration,
    #[command(flatten)]
    tunnel: TunnelArgs,
    #[command(flatten)]
    side: SideArgs,
    #[command(flatten)]
    state: StateDir,
}

/// What is wrong when options of `--local` are on the command line without it (they would be
/// ignored; `-n` looks like kubectl's namespace flag); `None` when nothing is. Values from the
/// environment (`SPUR_TUNNEL_*`) are not the command line's and pass.
pub(crate) fn local_flags_alone(apply: &clap::ArgMatches) -> Option<String> {
    use clap::parser::ValueSource;
    if apply.get_flag("local") {
        return None;
    }
    let cmd = <LocalArgs as clap::Args>::augment_args(clap::Command::new("local"));
    let given: Vec<String> = cmd
        .get_arguments()
        .filter(|a| a.get_id() != "local")
        .filter(|a| apply.value_source(a.get_id().as_str()) == Some(ValueSource::CommandLine))
        .map(|a| match a.get_long() {
            Some(long) => format!("--{long}"),
            None => a.get_id().to_string(),
        })
        .collect();
    (!given.is_empty()).then(|| {
        format!(
            "{} only act(s) with --local (a sandbox is cluster-scoped: there is no namespace to give)",
            given.join(", ")
        )
    })
}

/// The workstation a sandbox's local workloads run on, if `--local` can join it.
fn workstation_of(sb: &Sandbox) -> Result<&str, String> {
    let name = sb.metadata.name.as_deref().unwrap_or_default();
    if sb.spec.local.is_empty() {
        return Err(format!(
            "Sandbox {name} has no local workloads (spec.local): apply it without --local"
        ));
    }
    match sb.spec.workstation.as_deref() {
        Some(w) if !w.is_empty() => Ok(w),
        _ => Err(format!(
            "Sandbox {name} names no workstation (spec.workstation): --local joins the workstation its local workloads run on"
        )),
    }
}

/// What to do about the workstation's credential.
#[derive(Debug, PartialEq, Eq)]
enum Credential {
    /// A token was given, or the state directory's certificate names this workstation and is
    /// good for a while.
    Use,
    /// Ask for a certificate (why, for the progress line).
    Ask(String),
}

/// Decides from the certificate held in the state directory, or given with `--cert-file`
/// (`given`; never replaced).
fn credential(
    workstation: &str,
    token: bool,
    given: bool,
    held: Option<Result<cert::Held, String>>,
    now: SystemTime,
) -> Result<Credential, String> {
    if token {
        return Ok(Credential::Use);
    }
    let whose = if given {
        "--cert-file"
    } else {
        "the certificate here"
    };
    match held {
        None => Ok(Credential::Ask(format!(
            "no certificate for workstation {workstation} here"
        ))),
        Some(Err(e)) if given => Err(e),
        Some(Err(e)) => Err(format!(
            "{e}: remove it, or pass --state-dir for another directory"
        )),
        Some(Ok(h)) if h.workstation != workstation => Err(format!(
            "{whose} is workstation {}'s, and the sandbox names {workstation}: pass --state-dir for a directory of {workstation}'s (spur local cert --state-dir D --workstation {workstation}), or name {} in spec.workstation",
            h.workstation, h.workstation
        )),
        Some(Ok(_)) if given => Ok(Credential::Use),
        Some(Ok(h)) => match h.expires_at {
            Some(t) if t <= now + CERT_MARGIN => Ok(Credential::Ask(format!(
                "the certificate of workstation {workstation} here has {} left",
                if t <= now {
                    "no time".to_string()
                } else {
                    format!("{}s", t.duration_since(now).unwrap_or_default().as_secs())
                }
            ))),
            _ => Ok(Credential::Use),
        },
    }
}

/// Progress lines written by the workstation's tasks: a printer of their own on the same clock.
fn event_sink(start: Instant, output: Output) -> EventSink {
    let printer = Mutex::new(Printer::new(start, progress_out(output)));
    Arc::new(move |e: &Event| {
        if let Ok(mut printer) = printer.lock() {
            printer.line("workstation", &e.to_string());
        }
    })
}

/// SIGINT, SIGTERM or SIGHUP (the terminal closed, an ssh session lost), listened for from the
/// call on (not only once polled).
fn stop_signal() -> Result<impl Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut int = signal(SignalKind::interrupt())?;
    let mut term = signal(SignalKind::terminate())?;
    let mut hup = signal(SignalKind::hangup())?;
    Ok(async move {
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
            _ = hup.recv() => {}
        }
    })
}

/// How the session ended.
enum End {
    Waited(Box<Waited<Sandbox>>),
    Closed(String),
    Signal,
}

pub(crate) async fn apply_local(a: ApplyArgs, l: LocalArgs) -> Result<ExitCode> {
    let start = Instant::now();
    // Listening from the start, so no signal falls between two steps or kills the command
    // while the sandbox is being applied.
    let mut stop = std::pin::pin!(stop_signal()?);
    let file = a.file.display().to_string();
    let text = apply::read_file(&a.file)?;
    let docs: Vec<Doc<Sandbox>> = apply::documents(&file, &text)?;
    let doc = match docs.as_slice() {
        [doc] => doc,
        many => bail!(
            "{file}: --local takes one Sandbox, and it has {}",
            many.len()
        ),
    };
    let name = doc.obj.metadata.name.clone().unwrap_or_default();
    let workstation = workstation_of(&doc.obj).map_err(anyhow::Error::msg)?;
    if l.cert_lifetime < Duration::from_secs(600) {
        bail!("--cert-lifetime must be at least 10m");
    }
    let state_dir = l.state.resolve()?;
    let client = crate::kube_client(a.conn.kubeconfig.as_deref()).await?;
    let mut printer = Printer::new(start, progress_out(a.output));

    // Before the apply, nothing is written but the workstation's credential, and every step
    // can be interrupted.
    let filed = Mutex::new(String::new());
    let prepared = tokio::select! {
        r = prepare(&l, &client, workstation, &state_dir, &filed, &mut printer) => r?,
        () = &mut stop => {
            let csr = filed.lock().map(|f| f.clone()).unwrap_or_default();
            if csr.is_empty() {
                note(format_args!("stopped; nothing was applied"));
            } else {
                note(format_args!("stopped; nothing was applied (certificate request {csr} is not used: kubectl delete csr {csr})"));
            }
            return Ok(ExitCode::from(EXIT_INTERRUPTED));
        }
    };
    // The session before the Sandbox: one that cannot start (another `connect` on this state
    // directory, a port in use) stops the command with nothing applied.
    let sink = event_sink(start, a.output);
    let ws = connect::start(connect::config(
        &prepared, &l.tunnel, &l.side, &state_dir, sink,
    )?)
    .await?;

    // The sandbox, as the user (a dry run through every check first). A signal that comes
    // during the apply itself is acted on right after it.
    let api = Api::<Sandbox>::all(client.clone());
    let checked = apply::apply(&api, doc, a.force_conflicts, true).await;
    // A signal that came while the session started or the dry run ran: still nothing applied.
    let stopped = tokio::select! {
        biased;
        () = &mut stop => true,
        () = std::future::ready(()) => false,
    };
    if stopped {
        ws.shutdown(Duration::from_secs(5)).await;
        note(format_args!("stopped; nothing was applied"));
        return Ok(ExitCode::from(EXIT_INTERRUPTED));
    }
    let applied = match checked {
        Ok(_) => apply::apply(&api, doc, a.force_conflicts, false).await,
        Err(e) => Err(e),
    };
    let (obj, outcome) = match applied {
        Ok(applied) => applied,
        Err(e) => {
            ws.shutdown(Duration::from_secs(5)).await;
            return Err(e);
        }
    };
    printer.line("sandbox", &format!("{name} {}", outcome.as_str()));
    let children = obj.children();
    warn_unreachable(&doc.obj, &mut printer).await;

    // From here on every way out disconnects, and all but a failure take the sandbox down
    // (unless --keep).
    let deadline = Instant::now() + a.timeout;
    let end = tokio::select! {
        w = wait::sandbox_ready(&client, &name, deadline, &mut printer) => End::Waited(Box::new(w)),
        reason = ws.closed() => End::Closed(reason),
        () = &mut stop => End::Signal,
    };
    let code = match end {
        End::Waited(w) => match *w {
            Waited::Ready(sb) => {
                let shown = match a.output {
                    Output::Text => crate::write_out(format_args!(
                        "{}{}\n",
                        describe::ready_summary(&sb, printer.elapsed()),
                        joined(&sb, l.keep)
                    )),
                    _ => super::print_objects(a.output, &[sb]),
                };
                let _ = std::io::stdout().flush();
                match shown {
                    Err(e) => {
                        note(format_args!("{e:#}"));
                        ExitCode::FAILURE
                    }
                    Ok(()) => tokio::select! {
                        () = &mut stop => ExitCode::SUCCESS,
                        reason = ws.closed() => {
                            note(format_args!("the tunnel closed: {reason}"));
                            ExitCode::FAILURE
                        }
                    },
                }
            }
            w @ (Waited::Failed(_) | Waited::TimedOut(_)) => {
                // Left for the person to look at (the message names the object).
                let code = waited_code(&format!("sandbox {name}"), &w, a.timeout)
                    .unwrap_or(ExitCode::FAILURE);
                note(format_args!(
                    "sandbox {name} is left for you to look at: spur sandbox delete {name} removes it"
                ));
                ws.shutdown(Duration::from_secs(5)).await;
                printer.line("workstation", "disconnected");
                return Ok(code);
            }
            Waited::Interrupted => ExitCode::from(EXIT_INTERRUPTED),
        },
        End::Signal => ExitCode::from(EXIT_INTERRUPTED),
        End::Closed(reason) => {
            note(format_args!("the tunnel closed: {reason}"));
            ExitCode::FAILURE
        }
    };
    take_down(&client, &name, &children, l.keep, &mut printer, ws).await;
    Ok(code)
}

/// Where the tunnel proxy is, the CA that signed its certificate, and the workstation's
/// credential (asked for if there is none; `filed` gets the request's name).
async fn prepare<W: std::io::Write>(
    l: &LocalArgs,
    client: &Client,
    workstation: &str,
    state_dir: &std::path::Path,
    filed: &Mutex<String>,
    printer: &mut Printer<W>,
) -> Result<Endpoint> {
    let endpoint = l.tunnel.endpoint_in(client).await?;
    printer.line(
        "workstation",
        &format!(
            "tunnel proxy at {} ({}), certificate name {}",
            connect::host_port(&endpoint.host, endpoint.quic_port),
            endpoint.how,
            endpoint.server_name
        ),
    );
    if l.tunnel.ca_file.is_none()
        && let Err(why) = cert::save_ca_bundle(client, &l.tunnel.spur_namespace, state_dir).await
    {
        printer.line(
            "workstation",
            &format!("{why}; using what is saved, else the system's trust store"),
        );
    }
    // The credential before the Sandbox: a Sandbox may name only a workstation whose
    // credential its creator obtained, so the owner must be on record first.
    let held = match &l.tunnel.cert_file {
        Some(file) => Some(cert::identity(file)),
        None => cert::held(state_dir),
    };
    let held = held.map(|h| h.map_err(|e| format!("{e:#}")));
    let decision = credential(
        workstation,
        l.tunnel.has_token(),
        l.tunnel.cert_file.is_some(),
        held,
        SystemTime::now(),
    )
    .map_err(anyhow::Error::msg)?;
    if let Credential::Ask(why) = decision {
        printer.line(
            "workstation",
            &format!("{why}; asking the cluster for one (a CertificateSigningRequest)"),
        );
        let req = cert::Request {
            workstation,
            lifetime: l.cert_lifetime,
            wait: l.approval_timeout,
            namespace: &l.tunnel.spur_namespace,
        };
        let obtained = cert::obtain(client, &req, state_dir, |csr| {
            if let Ok(mut f) = filed.lock() {
                *f = csr.to_string();
            }
            printer.line(
                "workstation",
                &format!(
                    "certificate request {csr} filed; waiting up to {} for an administrator to run: kubectl certificate approve {csr}",
                    super::human(l.approval_timeout)
                ),
            );
        })
        .await?;
        printer.line(
            "workstation",
            &format!(
                "certificate for workstation {} saved in {}",
                obtained.workstation,
                state_dir.display()
            ),
        );
    }
    Ok(endpoint)
}

/// What a joined workstation means, and how it ends.
fn joined(sb: &Sandbox, keep: bool) -> String {
    let name = sb.metadata.name.as_deref().unwrap_or_default();
    let mut out = String::from("This machine serves the sandbox's local workloads:\n");
    for l in &sb.spec.local {
        for m in &l.mappings {
            out.push_str(&format!(
                "  {}/{} port {} → {} here\n",
                l.from.namespace, l.from.name, m.port, m.to_local
            ));
        }
    }
    if keep {
        out.push_str(&format!(
            "Ctrl-C disconnects; sandbox {name} stays (--keep)."
        ));
    } else {
        out.push_str(&format!(
            "Ctrl-C disconnects and deletes sandbox {name} (--keep leaves it)."
        ));
    }
    out
}

/// Says which local targets accept no connection yet (keyed requests fail until they do).
async fn warn_unreachable<W: std::io::Write>(sb: &Sandbox, printer: &mut Printer<W>) {
    for l in &sb.spec.local {
        for m in &l.mappings {
            let dial = tokio::time::timeout(
                Duration::from_millis(500),
                tokio::net::TcpStream::connect(m.to_local.as_str()),
            )
            .await;
            if !matches!(dial, Ok(Ok(_))) {
                printer.line(
                    &format!("local {}", l.name),
                    &format!(
                        "nothing accepts connections at {} yet: start your process there (its keyed requests fail until then)",
                        m.to_local
                    ),
                );
            }
        }
    }
}

/// Deletes the sandbox (unless `keep`) and waits a while for it and its forks to go, then
/// disconnects `ws`.
async fn take_down<W: std::io::Write>(
    client: &Client,
    name: &str,
    children: &[(String, String)],
    keep: bool,
    printer: &mut Printer<W>,
    ws: Workstation,
) {
    if !keep {
        let api = Api::<Sandbox>::all(client.clone());
        let deleted = match api.delete(name, &DeleteParams::default()).await {
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            r => r.map(drop),
        };
        match deleted {
            Ok(()) => {
                let deadline = Instant::now() + TAKE_DOWN;
                let gone =
                    wait::gone::<Sandbox, _>(client, name, children, deadline, printer).await;
                if let Some(_code) =
                    waited_code(&format!("deleting sandbox {name}"), &gone, TAKE_DOWN)
                {
                    note(format_args!(
                        "disconnecting anyway; `spur sandbox delete {name} --wait` follows it"
                    ));
                }
            }
            Err(e) => note(format_args!(
                "{:#}; disconnecting anyway (delete it with spur sandbox delete {name})",
                super::api_error(e, &format!("deleting sandbox {name}"))
            )),
        }
    }
    ws.shutdown(Duration::from_secs(5)).await;
    printer.line("workstation", "disconnected");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox(workstation: Option<&str>, local: bool) -> Sandbox {
        let local = if local {
            serde_json::json!([{"name": "api", "from": {"kind": "Deployment", "namespace": "shop", "name": "api"},
                "mappings": [{"port": 8080, "toLocal": "127.0.0.1:3000"}]}])
        } else {
            serde_json::json!([])
        };
        serde_json::from_value(serde_json::json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": "dev"},
            "spec": {"workstation": workstation, "local": local},
        }))
        .unwrap()
    }

    #[test]
    fn local_options_without_local_are_refused() {
        use clap::CommandFactory as _;
        let alone = |args: &[&str]| {
            let m = crate::Cli::command()
                .try_get_matches_from(args)
                .unwrap_or_else(|e| panic!("{args:?}: {e}"));
            let (_, m) = m.subcommand().unwrap();
            let (_, m) = m.subcommand().unwrap();
            local_flags_alone(m)
        };
        assert_eq!(
            alone(&["spur", "sandbox", "apply", "-f", "x.yaml", "--wait"]),
            None
        );
        assert_eq!(
            alone(&[
                "spur", "sandbox", "apply", "-f", "x", "--local", "-n", "shop", "--no-dns"
            ]),
            None
        );
        assert_eq!(
            alone(&["spur", "sandbox", "apply", "-f", "x", "-n", "shop", "--server", "h"]),
            Some(
                "--server, --namespace only act(s) with --local (a sandbox is cluster-scoped: there is no namespace to give)"
                    .into()
            )
        );
    }

    #[test]
    fn local_needs_local_workloads_and_their_workstation() {
        assert_eq!(workstation_of(&sandbox(Some("alice"), true)), Ok("alice"));
        assert!(
            workstation_of(&sandbox(Some("alice"), false))
                .unwrap_err()
                .contains("has no local workloads (spec.local): apply it without --local")
        );
        assert!(
            workstation_of(&sandbox(None, true))
                .unwrap_err()
                .contains("names no workstation (spec.workstation)")
        );
        let text = joined(&sandbox(Some("alice"), true), false);
        assert!(
            text.contains("  shop/api port 8080 → 127.0.0.1:3000 here\n"),
            "{text}"
        );
        assert!(text.ends_with("Ctrl-C disconnects and deletes sandbox dev (--keep leaves it)."));
    }

    #[test]
    fn a_certificate_is_used_only_for_its_own_workstation_and_while_it_lasts() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let held = |w: &str, left: u64| {
            Some(Ok(cert::Held {
                workstation: w.into(),
                expires_at: Some(now + Duration::from_secs(left)),
            }))
        };
        assert_eq!(
            credential("alice", true, false, None, now),
            Ok(Credential::Use)
        );
        assert_eq!(
            credential("alice", false, false, held("alice", 3600), now),
            Ok(Credential::Use)
        );
        assert_eq!(
            credential("alice", false, false, None, now),
            Ok(Credential::Ask(
                "no certificate for workstation alice here".into()
            ))
        );
        assert_eq!(
            credential("alice", false, false, held("alice", 60), now),
            Ok(Credential::Ask(
                "the certificate of workstation alice here has 60s left".into()
            ))
        );
        let other = credential("alice", false, false, held("bob", 3600), now).unwrap_err();
        assert!(
            other.starts_with(
                "the certificate here is workstation bob's, and the sandbox names alice"
            ),
            "{other}"
        );
        let broken =
            credential("alice", false, false, Some(Err("cannot read".into())), now).unwrap_err();
        assert!(broken.contains("pass --state-dir"), "{broken}");
        // A given --cert-file is used while it lasts (the connection refuses it once expired)
        // and never replaced; another workstation's is refused.
        assert_eq!(
            credential("alice", false, true, held("alice", 60), now),
            Ok(Credential::Use)
        );
        let given = credential("alice", false, true, held("bob", 3600), now).unwrap_err();
        assert!(
            given.starts_with("--cert-file is workstation bob's"),
            "{given}"
        );
    }
}
