//! One load worker: an OS thread with a single-threaded tokio runtime, its share of the
//! connections, and (open loop) its share of the schedule.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::mpsc::Sender as ReadySender;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::anyhow;
use tokio::sync::oneshot;
use tokio::task::LocalSet;

use super::conn::{Env, Failure, Slot};
use super::schedule::{Schedule, Tickets};
use super::{LATE_AFTER, Mode, Plan, Stats};

/// Closed loop: pause after a request that found no connection, so a refused port does not turn
/// the slot into a busy loop. (The open loop is paced by its schedule already.)
const CONNECT_BACKOFF: Duration = Duration::from_millis(10);

#[derive(Clone, Copy)]
struct Timing {
    warm_end: Instant,
    end: Instant,
}

struct Ctx {
    env: Env,
    timing: Timing,
    tickets: Option<Tickets>,
    stats: RefCell<Stats>,
}

/// Starts worker `index` with `connections` connections. It connects, reports on `ready` (exactly
/// once), waits for the start time on `start` (`None`: abort), runs, and returns its counters.
pub(crate) fn spawn(
    plan: Arc<Plan>,
    index: usize,
    connections: usize,
    ready: ReadySender<anyhow::Result<()>>,
    start: oneshot::Receiver<Option<Instant>>,
) -> anyhow::Result<JoinHandle<anyhow::Result<Stats>>> {
    Ok(std::thread::Builder::new()
        .name(format!("spur-load-{index}"))
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(err) => {
                    let _ = ready.send(Err(anyhow!("worker {index}: runtime: {err}")));
                    return Err(anyhow!("worker {index}: no runtime"));
                }
            };
            LocalSet::new().block_on(&rt, work(plan, index, connections, ready, start))
        })?)
}

async fn work(
    plan: Arc<Plan>,
    index: usize,
    connections: usize,
    ready: ReadySender<anyhow::Result<()>>,
    start: oneshot::Receiver<Option<Instant>>,
) -> anyhow::Result<Stats> {
    let env = Env {
        tls: plan.tls.clone(),
        addr: plan.addr,
        proto: plan.proto,
        template: plan.template.clone(),
        reconnects: Cell::new(0),
    };
    let mut slots = Vec::with_capacity(connections * plan.streams);
    let mut connect_error = None;
    for _ in 0..connections {
        match Slot::open(&env, plan.streams).await {
            Ok(more) => slots.extend(more),
            Err(err) => {
                connect_error = Some(err);
                break;
            }
        }
    }
    // Consumed here, so the sender is gone once this worker has reported.
    let _ = ready.send(connect_error.map_or(Ok(()), Err));
    let Ok(Some(start)) = start.await else {
        return Err(anyhow!("worker {index}: aborted before the start"));
    };

    let warm_end = start + plan.warmup;
    let end = warm_end + plan.duration;
    let hard_end = end + plan.drain;
    let schedule = match plan.mode {
        Mode::Open { rate } => Some(Schedule {
            start,
            end,
            interval_ns: 1e9 / rate,
            stride: plan.threads as u64,
            offset: index as u64,
        }),
        Mode::Closed => None,
    };
    let tickets = match schedule {
        Some(schedule) => Some(Tickets::start(schedule, format!("spur-pacer-{index}"))?),
        None => None,
    };
    let ctx = Rc::new(Ctx {
        env,
        timing: Timing { warm_end, end },
        tickets,
        stats: RefCell::new(Stats::new()?),
    });
    let handles: Vec<_> = slots
        .into_iter()
        .map(|slot| {
            let ctx = Rc::clone(&ctx);
            if ctx.tickets.is_some() {
                tokio::task::spawn_local(open_slot(ctx, slot))
            } else {
                tokio::task::spawn_local(closed_slot(ctx, slot))
            }
        })
        .collect();
    let all_done = async {
        for handle in handles {
            let _ = handle.await;
        }
    };
    // Whatever is still queued or in flight at `hard_end` is abandoned (and counted below); the
    // tasks are dropped with the `LocalSet`.
    let _ = tokio::time::timeout_at(hard_end.into(), all_done).await;

    let mut stats = ctx.stats.replace(Stats::new()?);
    stats.reconnects = ctx.env.reconnects.get();
    stats.errors.timeout = stats.claimed - stats.finished;
    if let Some(schedule) = schedule {
        stats.errors.unsent = schedule.due_from(warm_end) - stats.claimed;
    }
    Ok(stats)
}

async fn closed_slot(ctx: Rc<Ctx>, mut slot: Slot) {
    let Timing { warm_end, end } = ctx.timing;
    loop {
        let started = Instant::now();
        if started >= end {
            break;
        }
        let counted = started >= warm_end;
        if counted {
            ctx.stats.borrow_mut().claimed += 1;
        }
        let outcome = slot.request(&ctx.env).await;
        if counted {
            ctx.stats.borrow_mut().finish(outcome, started.elapsed());
        }
        if outcome == Err(Failure::Connect) {
            tokio::time::sleep(CONNECT_BACKOFF).await;
        }
    }
}

async fn open_slot(ctx: Rc<Ctx>, mut slot: Slot) {
    let Some(tickets) = &ctx.tickets else {
        return;
    };
    let warm_end = ctx.timing.warm_end;
    while let Some(intended) = tickets.next().await {
        let counted = intended >= warm_end;
        if counted {
            let mut stats = ctx.stats.borrow_mut();
            stats.claimed += 1;
            if intended.elapsed() > LATE_AFTER {
                stats.late += 1;
            }
        }
        let outcome = slot.request(&ctx.env).await;
        if counted {
            // From the intended start: time spent queued behind busy connections counts.
            ctx.stats.borrow_mut().finish(outcome, intended.elapsed());
        }
    }
}
