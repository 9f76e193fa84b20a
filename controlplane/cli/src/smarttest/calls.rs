//! `spur test run --calls`: the run's downstream calls captured by the traffic store
//! (docs/smart-tests.md, "Downstream calls"). The store is asked, with the user's token, to
//! capture the sandbox's key and a reference key at every baseline of the sandbox's namespaces
//! for the run's duration; the run sends its baseline requests with the reference key and marks
//! every request; then the captured calls are read back (with the same token: `get` on
//! `sandboxes/traffic`) and compared per step.

use std::collections::HashSet;
use std::time::Duration;

use anyhow::{Result, bail};
use spur_proto::traffic::{
    EndRunCaptureRequest, Exchange, Filter, QueryRequest, ReadRunRequest, RunCapture,
    StartRunCaptureRequest,
};
use spur_smarttest::Prepared;
use spur_smarttest::calls::{CallPlan, MAX_CAPTURED, attribute};
use spur_smarttest::run::CallsSeen;

use crate::traffic::{Client, Conn, STORE_LIMIT, connect, query_request, status_error};

/// How long the sidecars get to receive the run's settings before the first request: the
/// store has handed them to every open settings stream when it answers; this covers the
/// stream's own latency.
const SETTLE: Duration = Duration::from_secs(1);
/// After the last request, the store is read until what it holds of the run stops growing for
/// this long (sidecars ship every 100 ms)...
const QUIET: Duration = Duration::from_millis(1000);
/// ...and at most this long.
const MAX_WAIT: Duration = Duration::from_secs(15);
const POLL: Duration = Duration::from_millis(250);
/// ReadRun asked again at most this many times ([`POLL`] apart) while the store is busy
/// (another read of the run under way, or its turn not come).
const BUSY_RETRIES: u32 = 20;
/// The longest capture the store grants (proto/traffic.proto).
const MAX_SECONDS: u32 = 1800;
/// Start times are the sidecars' clocks, the run's start the store's: read from a little
/// before it.
const CLOCK_SLACK: Duration = Duration::from_secs(5);

/// What ending a run capture told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ended {
    /// It was capturing until the end: every call of the run was recorded.
    Live,
    /// The store no longer had it: it ended before the run did.
    Lost,
    /// The store could not be asked.
    Unknown,
}

/// Refuses to compare the calls of a run whose capture ended before the run did: the calls
/// made after it ended were not recorded, on one side or on both, and comparing what is left
/// would report calls the fork never stopped making.
fn complete(ended: Ended) -> Result<()> {
    if ended == Ended::Lost {
        bail!(
            "the run's capture had ended before the run did (the traffic store restarted, or the run outlived the time it asked for): its downstream calls are incomplete, so they were not compared; run the test again"
        );
    }
    Ok(())
}

/// A run capture the store started.
pub(super) struct Capture {
    client: Client,
    /// How it is read back.
    reader: Reader,
    run: RunCapture,
    /// When the capture started, by the store's clock (the sidecars' clocks in its cluster).
    since_unix_micros: i64,
}

enum Reader {
    /// Query, with the user's token: `get` on the sandbox's `sandboxes/traffic`.
    Query { sandbox: String },
    /// ReadRun, with the run's own token: an operator started it for the test's creator
    /// (`--run-capture-env`, automatic runs). `ended`: the store said it had ended;
    /// `truncated`: it returned only the newest.
    Run { ended: bool, truncated: bool },
}

/// Takes on the run capture an operator started for this run (automatic runs), from `json`
/// ([`spur_api::smarttest::RunCaptureEnv`]); the connection's token is the run's own. The run
/// sends `key`, which must be the key the capture records.
pub(super) async fn adopt(conn: &Conn, json: &str, key: &str) -> Result<Capture> {
    let given: spur_api::smarttest::RunCaptureEnv = serde_json::from_str(json)
        .map_err(|e| anyhow::anyhow!("the run capture given to this run is not readable: {e}"))?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    if given.until_unix_micros <= micros(now) {
        bail!(
            "the run capture given to this run had ended before it started (its Job waited too long for a runner): its downstream calls cannot be compared; run the test again"
        );
    }
    if given.routing_key != key {
        bail!(
            "the run capture given to this run records another routing key than the one this run sends"
        );
    }
    let client = connect(conn).await?;
    let run = RunCapture {
        id: given.id,
        routing_key: given.routing_key,
        reference_key: given.reference_key,
        namespaces: given.namespaces,
        until_unix_micros: given.until_unix_micros,
        watching_baselines: given.watching_baselines,
        run_token: String::new(),
        marker_tag: given.marker_tag,
    };
    // The store sent the settings when it started the capture, maybe only just now.
    tokio::time::sleep(SETTLE).await;
    Ok(Capture {
        client,
        reader: Reader::Run {
            ended: false,
            truncated: false,
        },
        run,
        // ReadRun knows when the run started; nothing here reads by time.
        since_unix_micros: 0,
    })
}

/// Asks the store to capture the run of `steps` against `sandbox`, whose key was read as `key`.
/// The right to read the sandbox's traffic is checked first: a user who could not read the
/// calls back sends nothing.
pub(super) async fn start(
    conn: &Conn,
    sandbox: &str,
    key: &str,
    steps: &[Prepared],
) -> Result<Capture> {
    let mut client = connect(conn).await?;
    let probe = QueryRequest {
        filter: Some(Filter {
            sandbox: sandbox.to_owned(),
            ..Filter::default()
        }),
        limit: 1,
        without_bodies: true,
    };
    query_request(&mut client, conn, probe)
        .await
        .map_err(|e| e.context("--calls reads the run's calls back, with your token"))?;
    // Each step is sent three or four times, each within its timeout; a minute of slack.
    let worst: u64 = steps.iter().map(|s| 4 * s.timeout.as_secs()).sum();
    let wanted = worst.saturating_add(60);
    let seconds = u32::try_from(wanted).unwrap_or(u32::MAX).min(MAX_SECONDS);
    if u64::from(seconds) < wanted {
        crate::sandbox::note(format_args!(
            "spur: the run may take up to {wanted} s, longer than a capture lasts ({MAX_SECONDS} s): calls of steps after that are not seen"
        ));
    }
    let run = client
        .start_run_capture(StartRunCaptureRequest {
            sandbox: sandbox.to_owned(),
            seconds,
            run_for: None,
        })
        .await
        .map_err(|s| status_error(conn, &s).context("starting the run's capture (--calls)"))?
        .into_inner();
    let since_unix_micros = run
        .until_unix_micros
        .saturating_sub(i64::from(seconds) * 1_000_000);
    let capture = Capture {
        client,
        reader: Reader::Query {
            sandbox: sandbox.to_owned(),
        },
        run,
        since_unix_micros,
    };
    if capture.run.routing_key != key {
        capture.end(conn).await;
        bail!(
            "the traffic store knows sandbox {sandbox} by another routing key than the one this run sends (it is being re-created, or --key is not its key)"
        );
    }
    if capture.run.watching_baselines == 0 {
        crate::sandbox::note(format_args!(
            "spur: no sidecar in {} watches the traffic store's settings: no downstream call will be seen (is traffic capture enabled in the chart?)",
            capture.run.namespaces.join(", ")
        ));
    }
    tokio::time::sleep(SETTLE).await;
    Ok(capture)
}

impl Capture {
    /// The plan the run follows: its baseline requests carry the store's reference key, and
    /// its markers the tag the store gave a run started for a user (else a new one).
    pub(super) fn plan(&self) -> Result<CallPlan> {
        Ok(match &self.reader {
            Reader::Query { .. } => CallPlan::new(self.run.reference_key.clone())?,
            Reader::Run { .. } => {
                CallPlan::with_tag(self.run.reference_key.clone(), self.run.marker_tag.clone())?
            }
        })
    }

    /// Waits for the sidecars' last pushes of the run's `steps` steps, reads what the capture
    /// recorded, ends it and returns what it recorded. The capture is ended whatever happens.
    pub(super) async fn finish(
        mut self,
        conn: &Conn,
        plan: &CallPlan,
        steps: usize,
    ) -> Result<(Vec<Exchange>, CallsSeen)> {
        let read = self.read_until_quiet(conn, plan, steps).await;
        let seen = CallsSeen {
            namespaces: self.run.namespaces.clone(),
            watching: self.run.watching_baselines,
            ..CallsSeen::default()
        };
        let truncated = matches!(
            self.reader,
            Reader::Run {
                truncated: true,
                ..
            }
        );
        let lost = matches!(self.reader, Reader::Run { ended: true, .. });
        let ended = match self.end(conn).await {
            _ if lost => Ended::Lost,
            ended => ended,
        };
        let captured = read.map_err(|e| e.context("reading the run's captured calls back"))?;
        complete(ended)?;
        // Comparing part of them would report the calls of the oldest steps as gone.
        if truncated {
            bail!(
                "more exchanges were captured during the run than the store returns at once: its downstream calls are incomplete, so they were not compared"
            );
        }
        Ok((captured, seen))
    }

    /// What the store holds of the run once this run's marked exchanges stop arriving (other
    /// requests with the sandbox's key may keep coming: they are not waited for).
    async fn read_until_quiet(
        &mut self,
        conn: &Conn,
        plan: &CallPlan,
        steps: usize,
    ) -> Result<Vec<Exchange>> {
        let waited = tokio::time::Instant::now();
        let mut last = usize::MAX;
        let mut quiet_since = waited;
        loop {
            let captured = self.read(conn).await?;
            let marked = captured.len() - attribute(plan, steps, &captured).unmarked;
            let now = tokio::time::Instant::now();
            if marked != last {
                last = marked;
                quiet_since = now;
            } else if now - quiet_since >= QUIET {
                if marked == 0 && self.run.watching_baselines > 0 {
                    crate::sandbox::note(format_args!(
                        "spur: no call of this run came back: do the services propagate `baggage`, and are their sidecars capturing?"
                    ));
                }
                return Ok(captured);
            }
            if now - waited >= MAX_WAIT {
                crate::sandbox::note(format_args!(
                    "spur: the run's captured calls were still arriving after {} s; comparing what arrived",
                    MAX_WAIT.as_secs()
                ));
                return Ok(captured);
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Ends the capture, and says whether it was still capturing; a failure to end it is only
    /// said (the store ends it at its time anyway).
    pub(super) async fn end(mut self, conn: &Conn) -> Ended {
        let ended = self
            .client
            .end_run_capture(EndRunCaptureRequest {
                id: self.run.id.clone(),
                // Ended with the run's own token (or the user's rights): no job to name.
                job: String::new(),
            })
            .await;
        match ended {
            Ok(_) => Ended::Live,
            Err(s) if s.code() == tonic::Code::NotFound => Ended::Lost,
            Err(s) => {
                crate::sandbox::note(format_args!(
                    "spur: ending the run's capture: {:#} (it ends by itself at the time it asked for)",
                    status_error(conn, &s)
                ));
                Ended::Unknown
            }
        }
    }

    /// Every exchange stored with the run's keys since it started, newest first.
    async fn read(&mut self, conn: &Conn) -> Result<Vec<Exchange>> {
        match &self.reader {
            Reader::Query { sandbox } => {
                let sandbox = sandbox.clone();
                self.query(conn, &sandbox).await
            }
            Reader::Run { .. } => self.read_run(conn).await,
        }
    }

    /// ReadRun: the run's own marked exchanges, heads cut down by the store.
    async fn read_run(&mut self, conn: &Conn) -> Result<Vec<Exchange>> {
        let mut busy = 0;
        let reply = loop {
            let read = self
                .client
                .read_run(ReadRunRequest {
                    id: self.run.id.clone(),
                })
                .await;
            match read {
                Ok(reply) => break reply.into_inner(),
                Err(s)
                    if busy < BUSY_RETRIES
                        && matches!(
                            s.code(),
                            tonic::Code::ResourceExhausted | tonic::Code::Unavailable
                        ) =>
                {
                    busy += 1;
                    tokio::time::sleep(POLL).await;
                }
                Err(s) => return Err(status_error(conn, &s)),
            }
        };
        self.reader = Reader::Run {
            ended: !reply.live,
            truncated: reply.truncated,
        };
        Ok(reply.exchanges)
    }

    /// Query, page by page (heads only), until a page brings nothing new; at most
    /// [`MAX_CAPTURED`] and a page.
    async fn query(&mut self, conn: &Conn, sandbox: &str) -> Result<Vec<Exchange>> {
        let keys = [&self.run.routing_key, &self.run.reference_key];
        let since = self.since_unix_micros - micros(CLOCK_SLACK);
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        let mut until = 0i64;
        loop {
            let request = QueryRequest {
                filter: Some(Filter {
                    sandbox: sandbox.to_owned(),
                    since_unix_micros: since.max(1),
                    until_unix_micros: until,
                    ..Filter::default()
                }),
                limit: STORE_LIMIT,
                without_bodies: true,
            };
            let page = query_request(&mut self.client, conn, request).await?;
            let mut oldest = i64::MAX;
            let mut new = 0usize;
            for (x, _) in page {
                oldest = oldest.min(x.start_unix_micros);
                if seen.insert(x.id.clone()) {
                    new += 1;
                    if keys.contains(&&x.routing_key) {
                        out.push(x);
                    }
                }
            }
            // A page may be short for its reply's size as well as for the end of the data:
            // only a page with nothing new ends it. The next page ends after the oldest of
            // this one (its start time included, so that exchanges sharing it are not lost;
            // those seen already are skipped).
            if new == 0 || oldest == i64::MAX || oldest + 1 == until {
                return Ok(out);
            }
            if out.len() > MAX_CAPTURED {
                crate::sandbox::note(format_args!(
                    "spur: more than {MAX_CAPTURED} exchanges captured during the run; the oldest were not read"
                ));
                return Ok(out);
            }
            until = oldest + 1;
        }
    }
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_calls_of_a_run_whose_capture_was_lost_are_not_compared() {
        complete(Ended::Live).unwrap();
        // Not told: the capture may have run its course, and the read found what it found.
        complete(Ended::Unknown).unwrap();
        let e = complete(Ended::Lost).unwrap_err().to_string();
        assert!(e.contains("incomplete, so they were not compared"), "{e}");
    }
}
