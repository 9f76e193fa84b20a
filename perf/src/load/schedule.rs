//! Open-loop pacing: a fixed schedule of intended start times, released by a pacer thread.
//!
//! tokio's timer has millisecond granularity, which would add up to a millisecond of generator
//! delay to every open-loop latency (they are measured from the intended start). So each worker
//! has a plain OS thread that sleeps until each intended start with nanosecond timer slack and
//! then releases the ticket; the worker's idle slots queue for tickets in FIFO order.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::{Mutex, Notify};

/// Longest single sleep of the pacer, so that it notices `stop` promptly at low rates.
const MAX_SLEEP: Duration = Duration::from_millis(50);

/// One worker's share of the global schedule: global request `i` is intended at
/// `start + i / rate`, and worker `offset` of `stride` takes every `stride`-th request, so the
/// workers together keep the global rate evenly spaced.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Schedule {
    pub(crate) start: Instant,
    pub(crate) end: Instant,
    pub(crate) interval_ns: f64,
    pub(crate) stride: u64,
    pub(crate) offset: u64,
}

impl Schedule {
    /// Intended start of this worker's `k`-th request.
    pub(crate) fn intended(&self, k: u64) -> Instant {
        let i = k * self.stride + self.offset;
        self.start + Duration::from_nanos((i as f64 * self.interval_ns) as u64)
    }

    /// Number of this worker's requests intended in `[from, end)`.
    pub(crate) fn due_from(&self, from: Instant) -> u64 {
        // Counted with `intended` itself so the count matches the tickets exactly.
        let mut due = 0;
        for k in 0.. {
            let t = self.intended(k);
            if t >= self.end {
                break;
            }
            if t >= from {
                due += 1;
            }
        }
        due
    }
}

/// State shared by the pacer thread and the worker.
struct Pace {
    /// Number of tickets whose intended start has passed.
    released: AtomicU64,
    notify: Notify,
    stop: AtomicBool,
}

/// The worker side: slots take tickets here.
pub(crate) struct Tickets {
    schedule: Schedule,
    pace: Arc<Pace>,
    /// Next ticket to hand out. Idle slots queue on this (tokio's mutex is FIFO), so only the
    /// slot at the head waits for the pacer and each release wakes exactly one task.
    next: Mutex<u64>,
    pacer: Option<JoinHandle<()>>,
}

impl Tickets {
    /// Starts the pacer thread for `schedule`.
    pub(crate) fn start(schedule: Schedule, name: String) -> std::io::Result<Self> {
        let pace = Arc::new(Pace {
            released: AtomicU64::new(0),
            notify: Notify::new(),
            stop: AtomicBool::new(false),
        });
        let pacer_pace = Arc::clone(&pace);
        let pacer = std::thread::Builder::new()
            .name(name)
            .spawn(move || pace_thread(schedule, &pacer_pace))?;
        Ok(Self {
            schedule,
            pace,
            next: Mutex::new(0),
            pacer: Some(pacer),
        })
    }

    /// Waits for the next ticket and returns its intended start, or `None` once the schedule is
    /// exhausted. A ticket whose time has already passed (all slots were busy) is returned at
    /// once: the request is late, not dropped.
    pub(crate) async fn next(&self) -> Option<Instant> {
        let mut next = self.next.lock().await;
        let k = *next;
        let intended = self.schedule.intended(k);
        if intended >= self.schedule.end {
            return None;
        }
        *next = k + 1;
        // `notify_one` stores a permit when nobody waits, so a release between the check and the
        // wait is not lost; a stale permit only costs one more check.
        while self.pace.released.load(Ordering::Acquire) <= k {
            self.pace.notify.notified().await;
        }
        Some(intended)
    }

    /// Stops the pacer thread and waits for it (at most about `MAX_SLEEP`).
    pub(crate) fn stop(&mut self) {
        self.pace.stop.store(true, Ordering::Relaxed);
        if let Some(pacer) = self.pacer.take() {
            let _ = pacer.join();
        }
    }
}

impl Drop for Tickets {
    fn drop(&mut self) {
        self.stop();
    }
}

fn pace_thread(schedule: Schedule, pace: &Pace) {
    let intended = |k| Some(schedule.intended(k)).filter(|&t| t < schedule.end);
    pacer(intended, &pace.stop, |due| {
        pace.released.store(due.end, Ordering::Release);
        pace.notify.notify_one();
    });
}

/// An open-loop pacer, run on a dedicated OS thread: item `k` falls due at `intended(k)` (`None`
/// past the last one), and `release(range)` is called with each batch of items that fell due,
/// in order, until every item is released or `stop` is set.
///
/// The thread runs with 1 ns timer slack: the default 50 µs would show up as up to 50 µs of
/// extra latency in every sample measured from the intended time (best effort: without it the
/// schedule is merely coarser). A late wake-up releases everything due by then in one batch.
pub fn pacer(
    intended: impl Fn(u64) -> Option<Instant>,
    stop: &AtomicBool,
    mut release: impl FnMut(std::ops::Range<u64>),
) {
    let _ = nix::sys::prctl::set_timerslack(1);
    let mut k = 0;
    while let Some(t) = intended(k) {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let now = Instant::now();
        if t > now {
            std::thread::sleep((t - now).min(MAX_SLEEP));
            continue;
        }
        let from = k;
        while intended(k).is_some_and(|t| t <= now) {
            k += 1;
        }
        release(from..k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_interleave_and_cover_the_window() {
        let start = Instant::now();
        let end = start + Duration::from_secs(1);
        let worker = |offset| Schedule {
            start,
            end,
            interval_ns: 1e9 / 1000.0,
            stride: 3,
            offset,
        };
        let (a, b, c) = (worker(0), worker(1), worker(2));
        assert_eq!(a.intended(0), start);
        assert_eq!(b.intended(0), start + Duration::from_millis(1));
        assert_eq!(c.intended(0), start + Duration::from_millis(2));
        assert_eq!(a.intended(1), start + Duration::from_millis(3));
        let total = a.due_from(start) + b.due_from(start) + c.due_from(start);
        assert_eq!(total, 1000);
        let half = start + Duration::from_millis(500);
        assert_eq!(a.due_from(half) + b.due_from(half) + c.due_from(half), 500);
    }

    #[test]
    fn tickets_follow_the_schedule() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let start = Instant::now();
            let schedule = Schedule {
                start,
                end: start + Duration::from_millis(100),
                interval_ns: 1e9 / 200.0,
                stride: 1,
                offset: 0,
            };
            let mut tickets = Tickets::start(schedule, "test-pacer".to_owned()).unwrap();
            let mut n = 0;
            while let Some(intended) = tickets.next().await {
                assert!(Instant::now() >= intended);
                n += 1;
            }
            assert_eq!(n, 20);
            tickets.stop();
        });
    }
}
