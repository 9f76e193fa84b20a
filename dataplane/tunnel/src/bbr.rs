//! BBR congestion control for the tunnel's QUIC connections, behind quinn's `Controller` trait.
//!
//! Why not quinn's own `Bbr` (marked experimental): its bandwidth sample is one packet's bytes
//! over the time since the previous ACK frame, so with ACKs that each cover k packets it reads
//! about 1/k of the real rate. The tunnel asks its peer to ACK every 4th packet (fewer ACKs,
//! less CPU), so quinn's model believed a quarter of the bandwidth, and when the window fell
//! to its floor the estimate could not climb back: a fresh tunnel on the benchmark link once
//! moved 0.6 MiB/s for a whole 6 s run (perf/results/tunnel_vs_ssh.md).
//!
//! This one follows BBR v1 (draft-cardwell-iccrg-bbr-congestion-control-00) with the
//! delivery-rate sampling of draft-cheng-iccrg-delivery-rate-estimation: every send records how
//! much had been delivered by then, so each ACK yields "bytes delivered over the interval they
//! took", whatever the ACK pattern. quinn paces from the window (about 1.25 windows per
//! smoothed RTT), so the model steers the window alone:
//! - Startup: the window grows by what is acknowledged (doubling per round trip) until the
//!   bottleneck bandwidth stops growing by 25 % for three rounds;
//! - Drain: no more than one bandwidth-delay product (BDP) in flight, to empty the queue
//!   Startup built;
//! - ProbeBw: window = 2 × BDP plus the recent ACK aggregation. Twice the BDP keeps a standing
//!   queue of one BDP at most, so a faster bottleneck shows up in the next samples by itself;
//! - ProbeRtt: when the minimum RTT is 10 s old, half a BDP for 200 ms and one round, to see
//!   the path's RTT without our own queue.
//!
//! Two additions for hosts that work in batches, which is what a path of a few hundred
//! microseconds mostly measures (the benchmark's veth; a laptop next to its cluster): the
//! bandwidth and ACK-aggregation maxima are kept for ten rounds but never less than 100 ms, so
//! one scheduler stall does not erase them; and the window adds Linux BBR's quantization budget
//! (three 1 ms quanta at the bottleneck rate, at most 64 KiB each) for GSO bursts, 4-packet
//! ACKs and a receiver that empties its socket buffer once per wake-up. Without them the
//! benchmark moved 55–100 MiB/s on 100 streams instead of 160–220.
//!
//! Random loss is not read as congestion (a workstation's Wi-Fi or hotel link loses packets
//! with no queue full). Persistent congestion (RFC 9002 §7.6: everything sent over several
//! PTOs lost) drops the window to the floor and restarts Startup with a fresh model.
//!
//! The window never goes below [`BbrConfig::min_window_packets`]: twice the peer's ACK
//! threshold, so a window's worth of packets always triggers immediate ACKs and a round trip
//! never waits out the peer's maximum ACK delay.

use std::any::Any;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use quinn::congestion::{Controller, ControllerFactory, ControllerMetrics};

/// Rounds over which the bottleneck bandwidth (a maximum) and the ACK aggregation are kept...
const BW_WINDOW_ROUNDS: u64 = 10;
/// ...and the least time (see [`WindowedMax`]).
const FILTER_MIN_TIME: Duration = Duration::from_millis(100);
/// How long a minimum RTT stands before ProbeRtt measures it again.
const MIN_RTT_WINDOW: Duration = Duration::from_secs(10);
/// How long ProbeRtt holds the window down (at least one round trip as well).
const PROBE_RTT_DURATION: Duration = Duration::from_millis(200);
/// Startup's window gain: 2/ln 2, the smallest that doubles the delivery rate each round.
const STARTUP_GAIN: f64 = 2.885;
/// The window as a multiple of the BDP in Drain and ProbeBw.
const CWND_GAIN: f64 = 2.0;
/// ProbeRtt's window as a multiple of the BDP (BBR v2's; v1's four packets stall a fast path).
const PROBE_RTT_GAIN: f64 = 0.5;
/// Startup ends when three rounds in a row grew the bandwidth by less than this factor.
const FULL_BW_GROWTH: f64 = 1.25;
const FULL_BW_ROUNDS: u8 = 3;
/// Upper bound on the ACK aggregation the window covers, in time at the bottleneck rate.
const MAX_EXTRA_ACKED: Duration = Duration::from_millis(100);
/// Sent-packet records kept for rate samples; beyond, the oldest go (they only lose a sample).
const MAX_SENT_RECORDS: usize = 8192;

/// Builds [`Bbr`] controllers (one per connection).
#[derive(Clone, Debug)]
pub(crate) struct BbrConfig {
    /// Smallest window, in packets.
    pub(crate) min_window_packets: u64,
    /// First window, in bytes (RFC 9002's 10 packets of 1472 bytes unless the floor is larger).
    pub(crate) initial_window: u64,
}

impl BbrConfig {
    /// A configuration for a peer that ACKs once more than `ack_threshold` ack-eliciting
    /// packets have arrived (the ACK frequency extension's `ack_eliciting_threshold`).
    pub(crate) fn for_ack_threshold(ack_threshold: u64) -> Self {
        BbrConfig {
            min_window_packets: (2 * (ack_threshold + 1)).max(4),
            initial_window: 14_720,
        }
    }
}

impl ControllerFactory for BbrConfig {
    fn build(self: Arc<Self>, now: Instant, current_mtu: u16) -> Box<dyn Controller> {
        Box::new(Bbr::new(&self, now, u64::from(current_mtu)))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Startup,
    Drain,
    ProbeBw,
    ProbeRtt,
}

/// What the connection's delivery state was when a batch of packets left (all packets of one
/// quinn `poll_transmit` share the send time, which identifies them on ACK).
#[derive(Clone, Copy, Debug)]
struct SentRecord {
    time: Instant,
    delivered: u64,
    delivered_time: Instant,
    first_sent_time: Instant,
    app_limited: bool,
}

/// The best rate sample of the ACK batch being processed: from the most recently sent packet
/// it acknowledges.
#[derive(Clone, Copy, Debug)]
struct PendingSample {
    prior_delivered: u64,
    prior_time: Instant,
    send_elapsed: Duration,
    rtt: Duration,
    app_limited: bool,
}

/// A running maximum over the last [`BW_WINDOW_ROUNDS`] rounds, and never less than
/// [`FILTER_MIN_TIME`]: on a path of a few hundred microseconds (a laptop to a cluster in the
/// same building, or the benchmark's veth) ten rounds last a few milliseconds, less than one
/// time slice of a busy scheduler, and a maximum that forgets within one stall shrinks the
/// window exactly when the peer catches up.
///
/// A monotonic queue: values decrease from front to back, so the front is the maximum.
#[derive(Clone, Debug, Default)]
struct WindowedMax {
    entries: VecDeque<(u64, Instant, u64)>,
}

impl WindowedMax {
    fn update(&mut self, round: u64, now: Instant, value: u64) {
        while self.entries.back().is_some_and(|&(_, _, v)| v <= value) {
            self.entries.pop_back();
        }
        self.entries.push_back((round, now, value));
    }

    fn expire(&mut self, round: u64, now: Instant) {
        while self.entries.front().is_some_and(|&(r, t, _)| {
            round.saturating_sub(r) >= BW_WINDOW_ROUNDS
                && now.saturating_duration_since(t) >= FILTER_MIN_TIME
        }) {
            self.entries.pop_front();
        }
    }

    fn get(&self) -> u64 {
        self.entries.front().map_or(0, |&(_, _, v)| v)
    }

    fn reset(&mut self) {
        self.entries.clear();
    }
}

/// The controller. See the module documentation.
#[derive(Clone, Debug)]
pub(crate) struct Bbr {
    mtu: u64,
    min_window_packets: u64,
    initial_window: u64,
    mode: Mode,
    cwnd: u64,

    // Delivery-rate estimation.
    delivered: u64,
    delivered_time: Instant,
    first_sent_time: Instant,
    in_flight: u64,
    /// `delivered + in_flight` when the sender last ran out of data; samples of packets sent
    /// before that much is delivered are app-limited. 0: not app-limited.
    app_limited_until: u64,
    sent: VecDeque<SentRecord>,
    pending: Option<PendingSample>,
    acked_in_batch: u64,

    // Round counting.
    round: u64,
    next_round_delivered: u64,

    // The model.
    bw: WindowedMax,
    min_rtt: Option<Duration>,
    min_rtt_stamp: Instant,
    extra_acked: WindowedMax,
    ack_epoch_start: Instant,
    ack_epoch_acked: u64,

    // Startup.
    filled_pipe: bool,
    full_bw: u64,
    full_bw_rounds: u8,

    // ProbeRtt.
    probe_rtt_done: Option<Instant>,
    probe_rtt_round_done: bool,
    prior_cwnd: u64,
}

impl Bbr {
    fn new(config: &BbrConfig, now: Instant, mtu: u64) -> Self {
        let mut bbr = Bbr {
            mtu,
            min_window_packets: config.min_window_packets,
            initial_window: config.initial_window,
            mode: Mode::Startup,
            cwnd: 0,
            delivered: 0,
            delivered_time: now,
            first_sent_time: now,
            in_flight: 0,
            app_limited_until: 0,
            sent: VecDeque::new(),
            pending: None,
            acked_in_batch: 0,
            round: 0,
            next_round_delivered: 0,
            bw: WindowedMax::default(),
            min_rtt: None,
            min_rtt_stamp: now,
            extra_acked: WindowedMax::default(),
            ack_epoch_start: now,
            ack_epoch_acked: 0,
            filled_pipe: false,
            full_bw: 0,
            full_bw_rounds: 0,
            probe_rtt_done: None,
            probe_rtt_round_done: false,
            prior_cwnd: 0,
        };
        bbr.cwnd = bbr.init_window();
        bbr
    }

    /// Mode changes are rare (ProbeRtt every 10 s at most), so each is logged at debug level
    /// with the model behind it.
    fn set_mode(&mut self, mode: Mode) {
        tracing::debug!(
            from = ?self.mode,
            to = ?mode,
            bandwidth = self.bandwidth(),
            min_rtt_us = self.min_rtt.map(|r| r.as_micros() as u64),
            cwnd = self.cwnd,
            in_flight = self.in_flight,
            "bbr mode"
        );
        self.mode = mode;
    }

    fn min_window(&self) -> u64 {
        self.min_window_packets * self.mtu
    }

    fn init_window(&self) -> u64 {
        self.initial_window.max(self.min_window())
    }

    /// Bottleneck bandwidth, bytes per second.
    fn bandwidth(&self) -> u64 {
        self.bw.get()
    }

    /// `gain` × bandwidth × min RTT; the initial window until both are measured.
    fn bdp(&self, gain: f64) -> u64 {
        let bw = self.bandwidth();
        match self.min_rtt {
            Some(rtt) if bw > 0 => {
                let bdp = bw as f64 * rtt.as_secs_f64() * gain;
                (bdp as u64).max(self.min_window())
            }
            _ => self.init_window(),
        }
    }

    /// The rate sample of the ACK batch just processed, with whether it was app-limited; the
    /// sample's RTT goes to the minimum-RTT filter either way.
    fn take_sample(&mut self, now: Instant) -> Option<(u64, bool)> {
        let s = self.pending.take()?;
        let ack_elapsed = now.saturating_duration_since(s.prior_time);
        let interval = s.send_elapsed.max(ack_elapsed);
        // A sample over less than the minimum RTT comes from ACK compression, not the path.
        let valid = !interval.is_zero() && self.min_rtt.is_none_or(|m| interval >= m);
        self.update_min_rtt(now, s.rtt);
        valid.then(|| {
            let rate = (self.delivered - s.prior_delivered) as f64 / interval.as_secs_f64();
            (rate as u64, s.app_limited)
        })
    }

    fn update_min_rtt(&mut self, now: Instant, rtt: Duration) {
        let expired = now.saturating_duration_since(self.min_rtt_stamp) > MIN_RTT_WINDOW;
        if self.min_rtt.is_none_or(|m| rtt < m) || expired {
            self.min_rtt = Some(rtt);
            self.min_rtt_stamp = now;
        }
        if expired && self.mode != Mode::ProbeRtt && self.app_limited_until == 0 {
            self.set_mode(Mode::ProbeRtt);
            self.prior_cwnd = self.cwnd;
            self.probe_rtt_done = None;
        }
    }

    fn check_full_pipe(&mut self, app_limited: bool) {
        if self.filled_pipe || app_limited {
            return;
        }
        let bw = self.bandwidth();
        if bw as f64 >= self.full_bw as f64 * FULL_BW_GROWTH {
            self.full_bw = bw;
            self.full_bw_rounds = 0;
            return;
        }
        self.full_bw_rounds += 1;
        if self.full_bw_rounds >= FULL_BW_ROUNDS {
            self.filled_pipe = true;
        }
    }

    /// How many more bytes than the bandwidth explains arrived in the current ACK epoch (ACKs
    /// that bunch up, like the peer's every-4th-packet ACKs): the window must cover them.
    fn update_ack_aggregation(&mut self, now: Instant, acked: u64) {
        let bw = self.bandwidth();
        let expected = (bw as f64
            * now
                .saturating_duration_since(self.ack_epoch_start)
                .as_secs_f64()) as u64;
        if self.ack_epoch_acked <= expected {
            self.ack_epoch_start = now;
            self.ack_epoch_acked = acked;
            return;
        }
        self.ack_epoch_acked += acked;
        // Bounded by the window and by 100 ms of bandwidth (Linux's bounds), so a bandwidth
        // underestimate cannot grow the window through this term alone.
        let cap = (bw as f64 * MAX_EXTRA_ACKED.as_secs_f64()) as u64;
        let extra = (self.ack_epoch_acked - expected).min(self.cwnd).min(cap);
        self.extra_acked.update(self.round, now, extra);
    }

    fn probe_rtt(&mut self, now: Instant, round_start: bool) {
        match self.probe_rtt_done {
            None => {
                if self.in_flight <= self.probe_rtt_window() {
                    self.probe_rtt_done = Some(now + PROBE_RTT_DURATION);
                    self.probe_rtt_round_done = false;
                    self.next_round_delivered = self.delivered;
                }
            }
            Some(done) => {
                if round_start {
                    self.probe_rtt_round_done = true;
                }
                if self.probe_rtt_round_done && now >= done {
                    self.min_rtt_stamp = now;
                    self.cwnd = self.cwnd.max(self.prior_cwnd);
                    self.set_mode(if self.filled_pipe {
                        Mode::ProbeBw
                    } else {
                        Mode::Startup
                    });
                }
            }
        }
    }

    fn probe_rtt_window(&self) -> u64 {
        self.bdp(PROBE_RTT_GAIN)
    }

    fn set_cwnd(&mut self, acked: u64) {
        let gain = if self.mode == Mode::Startup {
            STARTUP_GAIN
        } else {
            CWND_GAIN
        };
        // Room for the batches the hosts work in (GSO sends, ACKs of 4 packets, a receiver
        // that reads a socket buffer per wake-up): Linux BBR's "quantization budget" of three
        // send quanta, a quantum being 1 ms at the bottleneck rate, at most 64 KiB.
        let quantum = ((self.bandwidth() as f64 * 0.001) as u64).min(64 * 1024);
        let mut target = self.bdp(gain) + 3 * quantum;
        if self.filled_pipe {
            target += self.extra_acked.get();
            self.cwnd = (self.cwnd + acked).min(target);
        } else if self.cwnd < target || self.delivered < self.init_window() {
            self.cwnd += acked;
        }
        self.cwnd = self.cwnd.max(self.min_window());
    }

    /// Forgets the model: after persistent congestion the path may be a different one.
    fn restart(&mut self) {
        self.set_mode(Mode::Startup);
        self.cwnd = self.min_window();
        self.bw.reset();
        self.extra_acked.reset();
        self.filled_pipe = false;
        self.full_bw = 0;
        self.full_bw_rounds = 0;
        self.probe_rtt_done = None;
    }
}

/// The controller's inputs, as plain methods (quinn's trait adds an RTT estimator this
/// controller does not use, and which only quinn can build).
impl Bbr {
    fn sent(&mut self, now: Instant, bytes: u64) {
        if self.in_flight == 0 {
            // Restarting from idle: the interval of the next sample starts now.
            self.first_sent_time = now;
            self.delivered_time = now;
        }
        let record = SentRecord {
            time: now,
            delivered: self.delivered,
            delivered_time: self.delivered_time,
            first_sent_time: self.first_sent_time,
            app_limited: self.app_limited_until != 0,
        };
        match self.sent.back() {
            Some(last) if last.time == now => {}
            _ => {
                if self.sent.len() == MAX_SENT_RECORDS {
                    self.sent.pop_front();
                }
                self.sent.push_back(record);
            }
        }
        self.in_flight += bytes;
    }

    fn acked(&mut self, now: Instant, sent: Instant, bytes: u64, app_limited: bool) {
        self.delivered += bytes;
        self.delivered_time = now;
        self.acked_in_batch += bytes;
        self.in_flight = self.in_flight.saturating_sub(bytes);
        let i = self.sent.partition_point(|r| r.time < sent);
        let Some(record) = self.sent.get(i).copied().filter(|r| r.time == sent) else {
            return;
        };
        // Older records belong to packets acknowledged, lost or reordered: done with.
        self.sent.drain(..i);
        if self
            .pending
            .is_some_and(|p| record.delivered < p.prior_delivered)
        {
            return;
        }
        self.first_sent_time = record.time;
        self.pending = Some(PendingSample {
            prior_delivered: record.delivered,
            prior_time: record.delivered_time,
            send_elapsed: record
                .time
                .saturating_duration_since(record.first_sent_time),
            rtt: now.saturating_duration_since(record.time),
            app_limited: record.app_limited || app_limited,
        });
    }

    fn end_acks(&mut self, now: Instant, in_flight: u64, app_limited: bool) {
        self.in_flight = in_flight;
        let acked = std::mem::take(&mut self.acked_in_batch);
        if self.app_limited_until != 0 && self.delivered > self.app_limited_until {
            self.app_limited_until = 0;
        }
        if app_limited && self.app_limited_until == 0 {
            self.app_limited_until = (self.delivered + self.in_flight).max(1);
        }
        if acked == 0 {
            return;
        }

        let prior_delivered = self.pending.map(|p| p.prior_delivered);
        let mut sample_app_limited = app_limited;
        self.bw.expire(self.round, now);
        self.extra_acked.expire(self.round, now);
        if let Some((rate, limited)) = self.take_sample(now) {
            sample_app_limited = limited;
            if !limited || rate >= self.bandwidth() {
                self.bw.update(self.round, now, rate);
            }
        }
        let round_start = prior_delivered.is_some_and(|d| d >= self.next_round_delivered);
        if round_start {
            self.round += 1;
            self.next_round_delivered = self.delivered;
            self.check_full_pipe(sample_app_limited);
        }
        self.update_ack_aggregation(now, acked);

        if self.mode == Mode::Startup && self.filled_pipe {
            self.set_mode(Mode::Drain);
        }
        if self.mode == Mode::Drain && self.in_flight <= self.bdp(1.0) {
            self.set_mode(Mode::ProbeBw);
        }
        if self.mode == Mode::ProbeRtt {
            self.probe_rtt(now, round_start);
        }
        self.set_cwnd(acked);
    }

    fn lost(&mut self, bytes: u64, persistent: bool) {
        self.in_flight = self.in_flight.saturating_sub(bytes);
        if persistent {
            self.restart();
        }
    }
}

impl Controller for Bbr {
    fn on_sent(&mut self, now: Instant, bytes: u64, _last_packet_number: u64) {
        self.sent(now, bytes);
    }

    fn on_ack(
        &mut self,
        now: Instant,
        sent: Instant,
        bytes: u64,
        app_limited: bool,
        _rtt: &quinn_proto::RttEstimator,
    ) {
        self.acked(now, sent, bytes, app_limited);
    }

    fn on_end_acks(
        &mut self,
        now: Instant,
        in_flight: u64,
        app_limited: bool,
        _largest_packet_num_acked: Option<u64>,
    ) {
        self.end_acks(now, in_flight, app_limited);
    }

    fn on_congestion_event(
        &mut self,
        _now: Instant,
        _sent: Instant,
        is_persistent_congestion: bool,
        lost_bytes: u64,
    ) {
        self.lost(lost_bytes, is_persistent_congestion);
    }

    fn on_mtu_update(&mut self, new_mtu: u16) {
        self.mtu = u64::from(new_mtu);
        self.cwnd = self.cwnd.max(self.min_window());
    }

    fn window(&self) -> u64 {
        match self.mode {
            Mode::ProbeRtt => self.cwnd.min(self.probe_rtt_window()),
            Mode::Drain => self.cwnd.min(self.bdp(1.0)),
            Mode::Startup | Mode::ProbeBw => self.cwnd,
        }
    }

    fn metrics(&self) -> ControllerMetrics {
        let mut m = ControllerMetrics::default();
        m.congestion_window = self.window();
        // quinn paces from the window; what qlog gets here is the bottleneck estimate.
        m.pacing_rate = Some(self.bandwidth().saturating_mul(8));
        m
    }

    fn clone_box(&self) -> Box<dyn Controller> {
        Box::new(self.clone())
    }

    fn initial_window(&self) -> u64 {
        self.init_window()
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

#[cfg(test)]
mod tests {
    //! A discrete-event model of one bottleneck link: a sender driven by the controller (bulk
    //! data, batches of up to 10 packets like quinn's GSO batches), a FIFO bottleneck with a
    //! tail-drop queue and random loss, and a receiver that ACKs like quinn with the ACK
    //! frequency the tunnel asks for (every 4th packet, at once on a gap, else within 5 ms).

    use std::cmp::Reverse;
    use std::collections::{BTreeMap, BinaryHeap};

    use super::*;

    const MTU: u64 = 1452;
    const ACK_THRESHOLD: u64 = 3;
    const MAX_ACK_DELAY: Duration = Duration::from_millis(5);

    #[derive(Clone, Copy)]
    struct Link {
        /// Bottleneck rate, bytes per second.
        rate: f64,
        one_way: Duration,
        loss: f64,
        /// Queue in front of the bottleneck, in multiples of the BDP.
        queue_bdps: f64,
    }

    #[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
    enum Event {
        Arrive(u64),
        Ack(Vec<u64>),
        AckTimer(u64),
        Pto(u64),
    }

    struct Sim {
        base: Instant,
        now: Instant,
        link: Link,
        cc: Bbr,
        events: BinaryHeap<Reverse<(Instant, u64, Event)>>,
        seq: u64,
        next_pn: u64,
        in_flight: BTreeMap<u64, Instant>,
        link_free: Instant,
        rng: u64,
        // Receiver.
        unacked: Vec<u64>,
        largest_received: Option<u64>,
        ack_timer: u64,
        received_bytes: u64,
        // Sender's loss timer (a crude PTO).
        acks_seen: u64,
    }

    impl Sim {
        fn new(link: Link) -> Self {
            let base = Instant::now();
            let config = BbrConfig::for_ack_threshold(ACK_THRESHOLD);
            Sim {
                base,
                now: base,
                link,
                cc: Bbr::new(&config, base, MTU),
                events: BinaryHeap::new(),
                seq: 0,
                next_pn: 0,
                in_flight: BTreeMap::new(),
                link_free: base,
                rng: 0x9e37_79b9_7f4a_7c15,
                unacked: Vec::new(),
                largest_received: None,
                ack_timer: 0,
                received_bytes: 0,
                acks_seen: 0,
            }
        }

        fn at(&mut self, time: Instant, event: Event) {
            self.seq += 1;
            self.events.push(Reverse((time, self.seq, event)));
        }

        fn chance(&mut self, p: f64) -> bool {
            // xorshift64*: deterministic runs.
            self.rng ^= self.rng >> 12;
            self.rng ^= self.rng << 25;
            self.rng ^= self.rng >> 27;
            let x = self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11;
            (x as f64 / (1u64 << 53) as f64) < p
        }

        fn bytes_in_flight(&self) -> u64 {
            self.in_flight.len() as u64 * MTU
        }

        fn send(&mut self) {
            while self.bytes_in_flight() + MTU <= self.cc.window() {
                let mut batch = 0;
                while batch < 10 && self.bytes_in_flight() + MTU <= self.cc.window() {
                    let pn = self.next_pn;
                    self.next_pn += 1;
                    self.in_flight.insert(pn, self.now);
                    batch += 1;
                    let start = self.link_free.max(self.now);
                    let queued = start.saturating_duration_since(self.now).as_secs_f64();
                    let bdp = self.link.rate * 2.0 * self.link.one_way.as_secs_f64();
                    let tail_drop =
                        queued * self.link.rate > self.link.queue_bdps * bdp + 2.0 * MTU as f64;
                    if tail_drop || self.chance(self.link.loss) {
                        continue;
                    }
                    self.link_free = start + Duration::from_secs_f64(MTU as f64 / self.link.rate);
                    let arrive = self.link_free + self.link.one_way;
                    self.at(arrive, Event::Arrive(pn));
                }
                self.cc.sent(self.now, batch * MTU);
            }
            let pto = self.now + 3 * (2 * self.link.one_way + MAX_ACK_DELAY);
            let acks = self.acks_seen;
            self.at(pto, Event::Pto(acks));
        }

        fn send_ack(&mut self) {
            if self.unacked.is_empty() {
                return;
            }
            self.ack_timer += 1;
            let pns = std::mem::take(&mut self.unacked);
            let at = self.now + self.link.one_way;
            self.at(at, Event::Ack(pns));
        }

        fn on_arrive(&mut self, pn: u64) {
            self.received_bytes += MTU;
            let in_order = self.largest_received.is_none_or(|l| pn == l + 1);
            self.largest_received = Some(self.largest_received.map_or(pn, |l| l.max(pn)));
            self.unacked.push(pn);
            if !in_order || self.unacked.len() as u64 > ACK_THRESHOLD {
                self.send_ack();
            } else if self.unacked.len() == 1 {
                let at = self.now + MAX_ACK_DELAY;
                let timer = self.ack_timer;
                self.at(at, Event::AckTimer(timer));
            }
        }

        fn on_ack(&mut self, pns: Vec<u64>) {
            self.acks_seen += 1;
            let mut largest = 0;
            for pn in pns {
                largest = largest.max(pn);
                if let Some(sent) = self.in_flight.remove(&pn) {
                    self.cc.acked(self.now, sent, MTU, false);
                }
            }
            // Packet threshold loss detection (RFC 9002: 3 packets).
            let lost: Vec<u64> = self
                .in_flight
                .range(..largest.saturating_sub(2))
                .map(|(pn, _)| *pn)
                .collect();
            for pn in &lost {
                self.in_flight.remove(pn);
            }
            let in_flight = self.bytes_in_flight();
            self.cc.end_acks(self.now, in_flight, false);
            if !lost.is_empty() {
                self.cc.lost(lost.len() as u64 * MTU, false);
            }
            self.send();
        }

        /// Runs until `until` (from the start); returns the bytes the receiver got meanwhile.
        fn run_until(&mut self, until: Duration) -> u64 {
            let end = self.base + until;
            let before = self.received_bytes;
            if self.now == self.base {
                self.send();
            }
            while let Some(Reverse((time, _, _))) = self.events.peek() {
                if *time > end {
                    break;
                }
                let Some(Reverse((time, _, event))) = self.events.pop() else {
                    break;
                };
                self.now = time;
                match event {
                    Event::Arrive(pn) => self.on_arrive(pn),
                    Event::Ack(pns) => self.on_ack(pns),
                    Event::AckTimer(t) if t == self.ack_timer => self.send_ack(),
                    Event::AckTimer(_) => {}
                    Event::Pto(acks) if acks == self.acks_seen && !self.in_flight.is_empty() => {
                        let lost = self.bytes_in_flight();
                        self.in_flight.clear();
                        self.cc.lost(lost, false);
                        self.send();
                    }
                    Event::Pto(_) => {}
                }
            }
            self.now = end;
            self.received_bytes - before
        }

        /// Throughput over `[from, to)` as a fraction of the link rate.
        fn utilisation(&mut self, from: Duration, to: Duration) -> f64 {
            self.run_until(from);
            let bytes = self.run_until(to);
            bytes as f64 / (self.link.rate * (to - from).as_secs_f64())
        }
    }

    fn link(rate_mb: f64, rtt_ms: u64, loss: f64) -> Link {
        Link {
            rate: rate_mb * 1e6,
            one_way: Duration::from_millis(rtt_ms) / 2,
            loss,
            queue_bdps: 1.0,
        }
    }

    #[test]
    fn the_floor_is_twice_the_ack_threshold() {
        let bbr = Bbr::new(&BbrConfig::for_ack_threshold(3), Instant::now(), MTU);
        assert_eq!(bbr.min_window(), 8 * MTU);
        let bbr = Bbr::new(&BbrConfig::for_ack_threshold(0), Instant::now(), MTU);
        assert_eq!(bbr.min_window(), 4 * MTU);
    }

    #[test]
    fn fills_the_bottleneck_when_acks_cover_four_packets() {
        let mut sim = Sim::new(link(20.0, 20, 0.0));
        let u = sim.utilisation(Duration::from_secs(1), Duration::from_secs(3));
        assert!(u > 0.9, "utilisation {u:.2}");
        assert_eq!(sim.cc.mode, Mode::ProbeBw);
    }

    #[test]
    fn random_loss_is_not_read_as_congestion() {
        let mut sim = Sim::new(link(20.0, 20, 0.01));
        let u = sim.utilisation(Duration::from_secs(1), Duration::from_secs(3));
        assert!(u > 0.85, "utilisation {u:.2} at 1 % loss");
    }

    #[test]
    fn climbs_back_from_a_slow_period() {
        // 0.5 MB/s for 2 s (the window at its floor), then 40× faster: the model must follow
        // within a few round trips, where quinn's stayed near its old estimate.
        let mut sim = Sim::new(link(0.5, 10, 0.0));
        sim.run_until(Duration::from_secs(2));
        assert!(
            sim.cc.window() <= 2 * sim.cc.min_window(),
            "window {}",
            sim.cc.window()
        );
        sim.link.rate = 20e6;
        let u = sim.utilisation(Duration::from_millis(2500), Duration::from_secs(4));
        assert!(u > 0.85, "utilisation {u:.2} after the link got faster");
    }

    #[test]
    fn a_longer_path_is_seen_after_probe_rtt() {
        // The RTT grows from 10 to 40 ms after 1 s. With the old minimum RTT the window would
        // be 2 × bw × 10 ms, half the new BDP; ProbeRtt (after 10 s) must see the new RTT.
        let mut sim = Sim::new(link(5.0, 10, 0.0));
        sim.run_until(Duration::from_secs(1));
        sim.link.one_way = Duration::from_millis(20);
        sim.run_until(Duration::from_secs(12));
        let min_rtt = sim.cc.min_rtt.unwrap_or_default();
        assert!(min_rtt >= Duration::from_millis(39), "min RTT {min_rtt:?}");
        let u = sim.utilisation(Duration::from_secs(12), Duration::from_secs(14));
        assert!(u > 0.85, "utilisation {u:.2} on the longer path");
    }

    #[test]
    fn persistent_congestion_restarts_from_the_floor() {
        let mut sim = Sim::new(link(20.0, 20, 0.0));
        sim.run_until(Duration::from_secs(1));
        assert!(sim.cc.window() > 4 * sim.cc.min_window());
        sim.cc.lost(MTU, true);
        assert_eq!(sim.cc.window(), sim.cc.min_window());
        assert_eq!(sim.cc.mode, Mode::Startup);
        assert_eq!(sim.cc.bandwidth(), 0);
        let u = sim.utilisation(Duration::from_secs(2), Duration::from_secs(3));
        assert!(u > 0.9, "utilisation {u:.2} after the restart");
    }

    #[test]
    fn the_queue_stays_near_one_bdp() {
        // A deep buffer (10 BDPs): loss-based control would fill it; BBR keeps about one BDP
        // queued (window 2 × BDP). Across two minimum-RTT expiries (25 s), ProbeRtt must drain
        // that queue to measure the path: a minimum RTT read through our own queue would grow
        // the window, the queue and the next reading, without end.
        let mut l = link(5.0, 20, 0.0);
        l.queue_bdps = 10.0;
        let mut sim = Sim::new(l);
        sim.run_until(Duration::from_secs(25));
        let min_rtt = sim.cc.min_rtt.unwrap_or_default();
        assert!(min_rtt < Duration::from_millis(23), "min RTT {min_rtt:?}");
        let bdp = 5e6 * 0.020;
        let window = sim.cc.window() as f64;
        assert!(window < 2.6 * bdp, "window {window} vs BDP {bdp}");
        let u = sim.utilisation(Duration::from_secs(25), Duration::from_secs(27));
        assert!(u > 0.9, "utilisation {u:.2}");
    }
}
