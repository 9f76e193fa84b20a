//! `spur sandbox` and `spur routegroup` (apply, list, get, delete, with `--wait` progress) and
//! `spur preview open`: a developer's sandboxes from the terminal or a CI job, with the user's
//! own kubeconfig (docs/cli.md).

mod apply;
mod describe;
mod local;
mod progress;
mod wait;

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use clap::{Args, Subcommand, ValueEnum};
use kube::api::{DeleteParams, ListParams};
use kube::{Api, Client};
use spur_api::{RouteGroup, RoutingConfig, Sandbox, names};

use apply::Owned;
pub(crate) use describe::{describe, describe_records};
pub(crate) use local::local_flags_alone;
use wait::{Printer, Waited};

/// Exit codes of the `--wait` outcomes (0 is ready or gone, 1 an error, 2 a usage error).
pub(crate) const EXIT_FAILED: u8 = 3;
pub(crate) const EXIT_TIMED_OUT: u8 = 4;
pub(crate) const EXIT_INTERRUPTED: u8 = 130;

const EXIT_CODES: &str = "Exit codes: 0 done (with --wait: ready, or gone); 1 an error (a bad file, a refusal by the API server or Spur's admission, which names the field, or no connection); 2 a usage error; 3 --wait saw a failure (its reason, message and the object to look at are printed); 4 --wait timed out (what it still waited for is printed); 130 interrupted (Ctrl-C: the object stays as it is; with --local it is deleted unless --keep).";

#[derive(Args)]
#[command(after_help = EXIT_CODES)]
pub(crate) struct SandboxArgs {
    #[command(subcommand)]
    command: SandboxVerb,
}

impl SandboxArgs {
    /// `apply --local`: the command carries a workstation's tunnel.
    pub(crate) fn joins_locally(&self) -> bool {
        matches!(&self.command, SandboxVerb::Apply(a) if a.local.local)
    }
}

#[derive(Args)]
#[command(after_help = EXIT_CODES)]
pub(crate) struct RouteGroupArgs {
    #[command(subcommand)]
    command: Verb,
}

/// The sandbox verbs: those of every kind, `apply` with `--local`.
#[derive(Subcommand)]
enum SandboxVerb {
    /// Create or update from a file (server-side apply as you); with --wait, show each part
    /// coming up until it is ready, then the routing key, preview URLs and a curl to try; with
    /// --local, also join this machine to its local workloads until Ctrl-C.
    Apply(Box<SandboxApplyArgs>),
    /// List them: name, routing key, readiness, age.
    List(ListArgs),
    /// Show one: routing key, readiness, forks, expiry, preview URLs.
    Get(GetArgs),
    /// Delete; with --wait, until it and its forks are gone.
    Delete(DeleteArgs),
}

#[derive(Args)]
struct SandboxApplyArgs {
    #[command(flatten)]
    apply: ApplyArgs,
    #[command(flatten)]
    local: local::LocalArgs,
}

#[derive(Subcommand)]
enum Verb {
    /// Create or update from a file (server-side apply as you); with --wait, show each part
    /// coming up until it is ready, then the routing key, preview URLs and a curl to try.
    Apply(ApplyArgs),
    /// List them: name, routing key, readiness, age.
    List(ListArgs),
    /// Show one: routing key, readiness, forks, expiry, preview URLs.
    Get(GetArgs),
    /// Delete; with --wait, until it and its forks are gone.
    Delete(DeleteArgs),
}

#[derive(Args)]
struct Conn {
    /// Kubeconfig file (default: $KUBECONFIG, then ~/.kube/config, then the in-cluster config).
    #[arg(long, env = "SPUR_KUBECONFIG", global = true)]
    kubeconfig: Option<PathBuf>,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Output {
    /// For people.
    Text,
    /// The objects as the API server returned them (progress goes to stderr).
    Json,
    /// The same as YAML.
    Yaml,
}

#[derive(Args)]
struct ApplyArgs {
    /// The file (`-` for standard input); every document must be of this kind.
    #[arg(short = 'f', long)]
    file: PathBuf,
    /// Wait until ready (or failed), showing progress.
    #[arg(long)]
    wait: bool,
    /// How long --wait waits (e.g. 90s, 5m).
    #[arg(long, default_value = "5m", value_parser = parse_wait)]
    timeout: Duration,
    /// Take over fields another field manager (e.g. kubectl) set.
    #[arg(long)]
    force_conflicts: bool,
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Text)]
    output: Output,
    #[command(flatten)]
    conn: Conn,
}

#[derive(Args)]
struct ListArgs {
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Text)]
    output: Output,
    #[command(flatten)]
    conn: Conn,
}

#[derive(Args)]
struct GetArgs {
    name: String,
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Text)]
    output: Output,
    #[command(flatten)]
    conn: Conn,
}

#[derive(Args)]
struct DeleteArgs {
    #[arg(required = true)]
    names: Vec<String>,
    /// Wait until each is gone (a sandbox: with its forks).
    #[arg(long)]
    wait: bool,
    /// How long --wait waits.
    #[arg(long, default_value = "5m", value_parser = parse_wait)]
    timeout: Duration,
    /// Not an error if it does not exist.
    #[arg(long)]
    ignore_not_found: bool,
    #[command(flatten)]
    conn: Conn,
}

#[derive(Args)]
pub(crate) struct PreviewArgs {
    #[command(subcommand)]
    command: PreviewCommand,
}

#[derive(Subcommand)]
enum PreviewCommand {
    /// Print a sandbox's (or route group's) preview URL and open it in the browser.
    Open {
        /// The sandbox or route group.
        name: String,
        /// The endpoint (default: the only one).
        endpoint: Option<String>,
        /// Print the URL only.
        #[arg(long)]
        print: bool,
        #[command(flatten)]
        conn: Conn,
    },
}

/// The longest wait a command takes (beyond it a deadline is no longer a time on the clock).
const MAX_WAIT: Duration = Duration::from_secs(30 * 24 * 3600);

/// A wait's length (`90s`, `5m`, `2h`), at most [`MAX_WAIT`].
pub(crate) fn parse_wait(s: &str) -> Result<Duration, String> {
    let d = spur_runtime::parse_duration(s)?;
    if d > MAX_WAIT {
        return Err(format!("{s:?} is longer than 30 days"));
    }
    Ok(d)
}

/// A line on stderr that never panics: after a hangup, stderr is gone (EIO), and what the
/// command still has to do (delete, disconnect) matters more than saying it.
pub(crate) fn note(line: std::fmt::Arguments<'_>) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// An API error with what was being done, and for a refusal the API server's own words (an
/// admission webhook's message names the field).
pub(crate) fn api_error(e: kube::Error, doing: &str) -> anyhow::Error {
    match e {
        kube::Error::Api(s) if s.code == 403 => {
            anyhow::anyhow!("{doing}: forbidden: {}", s.message)
        }
        kube::Error::Api(s) if s.reason.is_empty() => {
            anyhow::anyhow!("{doing}: {} ({})", s.message, s.code)
        }
        kube::Error::Api(s) => anyhow::anyhow!("{doing}: {} ({}, {})", s.message, s.reason, s.code),
        e => anyhow::Error::new(e).context(doing.to_string()),
    }
}

pub(crate) async fn sandbox(args: SandboxArgs) -> Result<ExitCode> {
    match args.command {
        SandboxVerb::Apply(a) if a.local.local => local::apply_local(a.apply, a.local).await,
        SandboxVerb::Apply(a) => apply_verb::<Sandbox>(a.apply).await,
        SandboxVerb::List(a) => list::<Sandbox>(a).await,
        SandboxVerb::Get(a) => get_sandbox(a).await,
        SandboxVerb::Delete(a) => delete::<Sandbox>(a).await,
    }
}

pub(crate) async fn route_group(args: RouteGroupArgs) -> Result<ExitCode> {
    match args.command {
        Verb::Apply(a) => apply_verb::<RouteGroup>(a).await,
        Verb::List(a) => list::<RouteGroup>(a).await,
        Verb::Get(a) => get_route_group(a).await,
        Verb::Delete(a) => delete::<RouteGroup>(a).await,
    }
}

fn print_objects<K: serde::Serialize>(output: Output, objs: &[K]) -> Result<()> {
    // One object alone, several as a List, as kubectl prints them.
    let value = match objs {
        [one] => serde_json::to_value(one)?,
        many => serde_json::json!({"apiVersion": "v1", "kind": "List", "items": many}),
    };
    match output {
        Output::Json => outln!("{}", serde_json::to_string_pretty(&value)?),
        Output::Yaml => out!("{}", serde_yaml_ng::to_string(&value)?),
        Output::Text => {}
    }
    Ok(())
}

/// Per kind: how `--wait` follows it and what it prints once ready.
trait Follow: Owned {
    async fn ready(
        client: &Client,
        name: &str,
        deadline: Instant,
        printer: &mut Printer<Box<dyn std::io::Write + Send>>,
    ) -> Waited<Self>;
    fn summary(&self, took: Duration) -> String;
    /// ForkedWorkloads (namespace, name) a deletion waits for.
    fn children(&self) -> Vec<(String, String)>;
}

impl Follow for Sandbox {
    async fn ready(
        client: &Client,
        name: &str,
        deadline: Instant,
        printer: &mut Printer<Box<dyn std::io::Write + Send>>,
    ) -> Waited<Self> {
        wait::sandbox_ready(client, name, deadline, printer).await
    }
    fn summary(&self, took: Duration) -> String {
        describe::ready_summary(self, took)
    }
    fn children(&self) -> Vec<(String, String)> {
        let name = self.metadata.name.clone().unwrap_or_default();
        self.spec
            .forks
            .iter()
            .map(|f| {
                (
                    f.fork_of.namespace.clone(),
                    names::fork_name(&name, &f.fork_of),
                )
            })
            .collect()
    }
}

impl Follow for RouteGroup {
    async fn ready(
        client: &Client,
        name: &str,
        deadline: Instant,
        printer: &mut Printer<Box<dyn std::io::Write + Send>>,
    ) -> Waited<Self> {
        wait::route_group_ready(client, name, deadline, printer).await
    }
    fn summary(&self, took: Duration) -> String {
        describe::route_group_summary(self, took)
    }
    fn children(&self) -> Vec<(String, String)> {
        Vec::new()
    }
}

/// Progress goes where the person is: stdout for text, stderr when stdout carries objects.
fn progress_out(output: Output) -> Box<dyn std::io::Write + Send> {
    match output {
        Output::Text => Box::new(std::io::stdout()),
        _ => Box::new(std::io::stderr()),
    }
}

/// The end of a wait as an exit code, saying why on stderr.
fn waited_code<K>(what: &str, waited: &Waited<K>, timeout: Duration) -> Option<ExitCode> {
    match waited {
        Waited::Ready(_) => None,
        Waited::Failed(f) => {
            note(format_args!(
                "{what} failed: {}: {}\n  look at: {}",
                f.reason, f.message, f.object
            ));
            Some(ExitCode::from(EXIT_FAILED))
        }
        Waited::TimedOut(why) => {
            note(format_args!(
                "{what} is not ready after {}: {why}",
                human(timeout)
            ));
            Some(ExitCode::from(EXIT_TIMED_OUT))
        }
        Waited::Interrupted => {
            note(format_args!("stopped waiting; {what} stays as it is"));
            Some(ExitCode::from(EXIT_INTERRUPTED))
        }
    }
}

async fn apply_verb<K: Follow>(a: ApplyArgs) -> Result<ExitCode> {
    let start = Instant::now();
    let file = a.file.display().to_string();
    let text = apply::read_file(&a.file)?;
    let docs: Vec<apply::Doc<K>> = apply::documents(&file, &text)?;
    let client = crate::kube_client(a.conn.kubeconfig.as_deref()).await?;
    let api = Api::<K>::all(client.clone());
    // Every document through the API server's checks first (a server-side dry run: RBAC,
    // schema, Spur's admission), so a refused one leaves the others unapplied too.
    for doc in &docs {
        apply::apply(&api, doc, a.force_conflicts, true).await?;
    }
    let mut applied = Vec::with_capacity(docs.len());
    let mut log = progress_out(a.output);
    for doc in &docs {
        let (obj, outcome) = apply::apply(&api, doc, a.force_conflicts, false).await?;
        let name = obj.meta().name.clone().unwrap_or_default();
        let _ = writeln!(log, "{} {name} {}", K::NOUN, outcome.as_str());
        applied.push(obj);
    }
    if !a.wait {
        print_objects(a.output, &applied)?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut printer = Printer::new(start, log);
    // One time limit for the whole command, however many objects it waits for.
    let deadline = start + a.timeout;
    let several = applied.len() > 1;
    let mut ready = Vec::with_capacity(applied.len());
    for obj in &applied {
        let name = obj.meta().name.clone().unwrap_or_default();
        if several {
            printer.prefix(format!("{name} "));
        }
        let what = format!("{} {name}", K::NOUN);
        let waited = K::ready(&client, &name, deadline, &mut printer).await;
        if let Some(code) = waited_code(&what, &waited, a.timeout) {
            return Ok(code);
        }
        if let Waited::Ready(obj) = waited {
            if a.output == Output::Text {
                out!("{}", obj.summary(printer.elapsed()));
            }
            ready.push(obj);
        }
    }
    print_objects(a.output, &ready)?;
    Ok(ExitCode::SUCCESS)
}

async fn list<K: Owned + describe::Row>(a: ListArgs) -> Result<ExitCode> {
    let client = crate::kube_client(a.conn.kubeconfig.as_deref()).await?;
    let mut items = Api::<K>::all(client)
        .list(&ListParams::default())
        .await
        .map_err(|e| api_error(e, &format!("listing {}", K::plural(&()))))?
        .items;
    items.sort_by_key(|o| o.meta().name.clone());
    match a.output {
        Output::Text if items.is_empty() => eprintln!("no {}", K::PLURAL),
        Output::Text => out!("{}", describe::table(&items)),
        _ => {
            let value = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items});
            match a.output {
                Output::Json => outln!("{}", serde_json::to_string_pretty(&value)?),
                _ => out!("{}", serde_yaml_ng::to_string(&value)?),
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn read<K: Owned>(client: &Client, name: &str) -> Result<K> {
    let kind = K::kind(&());
    Api::<K>::all(client.clone())
        .get_opt(name)
        .await
        .map_err(|e| api_error(e, &format!("reading {kind} {name}")))?
        .with_context(|| format!("no {kind} named {name}"))
}

async fn get_sandbox(a: GetArgs) -> Result<ExitCode> {
    let client = crate::kube_client(a.conn.kubeconfig.as_deref()).await?;
    let sb: Sandbox = read(&client, &a.name).await?;
    if a.output != Output::Text {
        print_objects(a.output, &[sb])?;
        return Ok(ExitCode::SUCCESS);
    }
    // What its forks receive from Kafka: the route history's spans in its RoutingConfig, read
    // with the user's own rights (a cluster-scoped object: a user may not be allowed to).
    let rc_name = names::sandbox_routing_config_name(&a.name);
    let spans = match Api::<RoutingConfig>::all(client).get_opt(&rc_name).await {
        Ok(rc) => Ok(rc.map(|rc| rc.spans().to_vec()).unwrap_or_default()),
        Err(kube::Error::Api(e)) if e.code == 403 => Err(format!(
            "RoutingConfig {rc_name} is not readable with your credentials"
        )),
        Err(e) => Err(format!("cannot read RoutingConfig {rc_name}: {e}")),
    };
    out!("{}", describe(&sb));
    out!("{}", describe_records(&sb, &spans));
    Ok(ExitCode::SUCCESS)
}

async fn get_route_group(a: GetArgs) -> Result<ExitCode> {
    let client = crate::kube_client(a.conn.kubeconfig.as_deref()).await?;
    let rg: RouteGroup = read(&client, &a.name).await?;
    match a.output {
        Output::Text => out!("{}", describe::route_group(&rg)),
        _ => print_objects(a.output, &[rg])?,
    }
    Ok(ExitCode::SUCCESS)
}

async fn delete<K: Follow>(a: DeleteArgs) -> Result<ExitCode> {
    let start = Instant::now();
    let client = crate::kube_client(a.conn.kubeconfig.as_deref()).await?;
    let api = Api::<K>::all(client.clone());
    let kind = K::kind(&());
    let mut deleting = Vec::new();
    for name in &a.names {
        let obj = match api.get_opt(name).await {
            Ok(Some(obj)) => obj,
            Ok(None) if a.ignore_not_found => continue,
            Ok(None) => bail!("no {kind} named {name}"),
            Err(e) => return Err(api_error(e, &format!("reading {kind} {name}"))),
        };
        match api.delete(name, &DeleteParams::default()).await {
            Ok(_) => outln!("{} {name} deleted", K::NOUN),
            Err(kube::Error::Api(e)) if e.code == 404 && a.ignore_not_found => continue,
            Err(e) => return Err(api_error(e, &format!("deleting {kind} {name}"))),
        }
        // The forks it has now (or that the user cannot see): what the deletion waits for.
        let mut children = Vec::new();
        for (ns, fw) in obj.children() {
            let exists = Api::<spur_api::ForkedWorkload>::namespaced(client.clone(), &ns)
                .get_opt(&fw)
                .await;
            if !matches!(exists, Ok(None)) {
                children.push((ns, fw));
            }
        }
        deleting.push((name.clone(), children));
    }
    if !a.wait {
        return Ok(ExitCode::SUCCESS);
    }
    let mut printer = Printer::new(start, progress_out(Output::Text));
    let deadline = start + a.timeout;
    for (name, children) in &deleting {
        if deleting.len() > 1 {
            printer.prefix(format!("{name} "));
        }
        let waited = wait::gone::<K, _>(&client, name, children, deadline, &mut printer).await;
        if let Some(code) = waited_code(&format!("deleting {} {name}", K::NOUN), &waited, a.timeout)
        {
            return Ok(code);
        }
    }
    outln!("gone in {}", human(printer.elapsed()));
    Ok(ExitCode::SUCCESS)
}

/// `90.0s`, or `5m` for whole minutes.
fn human(d: Duration) -> String {
    let secs = d.as_secs_f64();
    if d.as_secs() >= 60 && d.subsec_nanos() == 0 && d.as_secs().is_multiple_of(60) {
        format!("{}m", d.as_secs() / 60)
    } else {
        format!("{secs:.1}s")
    }
}

const NO_URLS: &str = "no preview URLs in its status: the operator publishes them when it knows \
                       the hub's preview domain (chart value agent.previewDomain; docs/hub.md)";

pub(crate) async fn preview(args: PreviewArgs) -> Result<ExitCode> {
    let PreviewCommand::Open {
        name,
        endpoint,
        print,
        conn,
    } = args.command;
    let client = crate::kube_client(conn.kubeconfig.as_deref()).await?;
    let urls = match Api::<Sandbox>::all(client.clone()).get_opt(&name).await? {
        Some(sb) => sb.status.map(|s| s.endpoints).unwrap_or_default(),
        None => match Api::<RouteGroup>::all(client).get_opt(&name).await? {
            Some(rg) => rg.status.map(|s| s.endpoints).unwrap_or_default(),
            None => bail!("no Sandbox or RouteGroup named {name}"),
        },
    };
    if urls.is_empty() {
        bail!("{name} has {NO_URLS}");
    }
    let url = match &endpoint {
        Some(e) => urls.iter().find(|u| &u.name == e).with_context(|| {
            let known: Vec<&str> = urls.iter().map(|u| u.name.as_str()).collect();
            format!(
                "{name} has no endpoint {e:?} (it has: {})",
                known.join(", ")
            )
        })?,
        None if urls.len() == 1 => &urls[0],
        None => {
            let known: Vec<&str> = urls.iter().map(|u| u.name.as_str()).collect();
            bail!(
                "{name} has several endpoints; name one: {}",
                known.join(", ")
            )
        }
    };
    outln!("{}", url.url);
    if !print {
        // A desktop's opener; on a server there is none, and the printed URL is the answer.
        match std::process::Command::new("xdg-open")
            .arg(&url.url)
            .status()
        {
            Ok(s) if s.success() => {}
            _ => eprintln!("(no browser opener here; open the URL above yourself)"),
        }
    }
    Ok(ExitCode::SUCCESS)
}
