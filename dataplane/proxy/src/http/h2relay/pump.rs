//! Moves one HTTP/2 body from a received stream to a sending one: DATA as it comes, trailers,
//! the end, and resets. The sender's flow-control window is the limit: a chunk is sent only as
//! far as the receiving peer's window allows, and its bytes are released to the peer it came
//! from only then, so neither side's data is buffered beyond the windows the peers granted.

use std::task::{Context, Poll, ready};

use bytes::Bytes;
use h2::{Reason, RecvStream, SendStream};

use crate::capture::{Direction, Pending};

/// Why a pump stopped before its body ended.
#[derive(Debug)]
pub(super) enum Stop {
    /// The peer the body goes to reset its stream (with this reason), or its connection ended.
    ToReset(Reason),
    /// A request body's upstream stream was reset (with this reason) or its connection ended
    /// before any frame of the body was handed to it: the body's stream is as it was (a chunk
    /// read from it and not yet sent is still held), so the pump can go on with another
    /// upstream stream if the request is sent again, and the tap has not been told. The caller
    /// decides; not sending it again makes it `ToReset` with the same reason
    /// ([`Pump::settle_unsent`]).
    /// A response body's pump never stops so (its client stream is never replaced).
    Unsent(Reason),
    /// The body's own stream failed (reset by its peer, a protocol error, a lost
    /// connection); the stream it went to has been reset.
    FromFailed,
}

/// The state of one body on its way.
pub(super) struct Pump {
    dir: Direction,
    /// A chunk received and not yet fully sent, and whether it ends the body.
    held: Option<(Bytes, bool)>,
    /// Reset sent to the receiving side when the body's stream fails for a reason of its own
    /// (not a reset its peer sent, which is passed on as it came).
    fallback: Reason,
    /// Whether a frame of the body was handed to a sending stream (or may have been: set before
    /// each `send_data` or `send_trailers`, since a failed one has taken its bytes all the
    /// same). Until then the body can be replayed on another stream.
    sent: bool,
}

impl Pump {
    /// A pump for the request body (client to upstream) or the response body.
    pub(super) fn new(dir: Direction) -> Self {
        Pump {
            dir,
            held: None,
            sent: false,
            fallback: match dir {
                Direction::Request => Reason::CANCEL,
                Direction::Response => Reason::INTERNAL_ERROR,
            },
        }
    }

    /// Moves what can be moved now; `Ready(Ok)` once the body has ended at `to`. Not polled
    /// again once ready (the exchange drops the body's stream then), except after
    /// [`Stop::Unsent`], with the stream the request is sent on again.
    pub(super) fn poll(
        &mut self,
        cx: &mut Context<'_>,
        from: &mut RecvStream,
        to: &mut SendStream<Bytes>,
        tap: Option<&Pending>,
    ) -> Poll<Result<(), Stop>> {
        let res = match self.poll_inner(cx, from, to, tap) {
            Poll::Ready(Err(Stop::ToReset(reason)))
                if !self.sent && self.dir == Direction::Request =>
            {
                return Poll::Ready(Err(Stop::Unsent(reason)));
            }
            res => res,
        };
        if let Poll::Ready(r) = &res {
            self.report(tap, r);
        }
        res
    }

    /// Whether no frame of the body has gone to a sending stream yet: the body can still be
    /// sent on another one.
    pub(super) fn nothing_sent(&self) -> bool {
        !self.sent
    }

    /// A [`Stop::Unsent`] whose request is not sent again: from now on it is the upstream's
    /// reset of the request's side, `Stop::ToReset`, told to the tap as any other.
    pub(super) fn settle_unsent(&self, reason: Reason, tap: Option<&Pending>) {
        self.report(tap, &Err(Stop::ToReset(reason)));
    }

    fn report(&self, tap: Option<&Pending>, r: &Result<(), Stop>) {
        let Some(p) = tap else { return };
        match r {
            Ok(()) => p.end(self.dir, None),
            Err(Stop::FromFailed) => p.end(self.dir, Some(format!("{} failed", self.what()))),
            Err(Stop::ToReset(reason) | Stop::Unsent(reason)) => p.end(
                self.dir,
                Some(format!(
                    "{} not delivered: stream reset ({reason})",
                    self.what()
                )),
            ),
        }
    }

    fn what(&self) -> &'static str {
        match self.dir {
            Direction::Request => "request body",
            Direction::Response => "response body",
        }
    }

    fn poll_inner(
        &mut self,
        cx: &mut Context<'_>,
        from: &mut RecvStream,
        to: &mut SendStream<Bytes>,
        tap: Option<&Pending>,
    ) -> Poll<Result<(), Stop>> {
        loop {
            if let Some((chunk, end)) = self.held.as_mut() {
                let end = *end;
                let sent = ready!(send(cx, to, chunk, end, &mut self.sent))?;
                // Released as the receiving window takes it: the sender's window reopens at
                // the pace of the receiver's.
                let _ = from.flow_control().release_capacity(sent);
                if !chunk.is_empty() {
                    continue;
                }
                self.held = None;
                if end {
                    return Poll::Ready(Ok(()));
                }
            }
            // Waiting for data is also waiting for the receiving side to go away, so a reset
            // there is passed on without waiting for the body's next chunk.
            if let Poll::Ready(r) = to.poll_reset(cx) {
                return Poll::Ready(Err(Stop::ToReset(r.unwrap_or(Reason::CANCEL))));
            }
            match ready!(from.poll_data(cx)) {
                Some(Ok(chunk)) => {
                    if let Some(p) = tap {
                        p.data(self.dir, &chunk);
                    }
                    let end = from.is_end_stream();
                    self.held = Some((chunk, end));
                }
                Some(Err(e)) => return Poll::Ready(Err(self.fail(to, &e))),
                None => {
                    let trailers = match ready!(from.poll_trailers(cx)) {
                        Ok(t) => t,
                        Err(e) => return Poll::Ready(Err(self.fail(to, &e))),
                    };
                    self.sent = true;
                    let sent = match trailers {
                        Some(t) => {
                            if let Some(p) = tap {
                                p.trailers(self.dir, &t);
                            }
                            to.send_trailers(t)
                        }
                        None => to.send_data(Bytes::new(), true),
                    };
                    return Poll::Ready(sent.map_err(|e| Stop::ToReset(reason_of(&e))));
                }
            }
        }
    }

    /// The body's stream failed with `e`: a reset its peer sent goes on with the same reason,
    /// anything else with the direction's fallback.
    fn fail(&self, to: &mut SendStream<Bytes>, e: &h2::Error) -> Stop {
        let reason = if e.is_reset() && e.is_remote() {
            e.reason().unwrap_or(self.fallback)
        } else {
            self.fallback
        };
        tracing::debug!(error = %e, %reason, "{} failed; resetting the other side", self.what());
        to.send_reset(reason);
        Stop::FromFailed
    }
}

/// Sends as much of `chunk` as the window allows now (all of it, with `end`, if it fits);
/// returns how many bytes went. `sent` is set before anything is handed to `to`.
fn send(
    cx: &mut Context<'_>,
    to: &mut SendStream<Bytes>,
    chunk: &mut Bytes,
    end: bool,
    sent: &mut bool,
) -> Poll<Result<usize, Stop>> {
    if chunk.is_empty() {
        *sent = true;
        return Poll::Ready(
            to.send_data(Bytes::new(), end)
                .map(|()| 0)
                .map_err(|e| Stop::ToReset(reason_of(&e))),
        );
    }
    to.reserve_capacity(chunk.len());
    loop {
        let cap = to.capacity();
        if cap > 0 {
            let n = cap.min(chunk.len());
            let last = n == chunk.len();
            let part = chunk.split_to(n);
            *sent = true;
            to.send_data(part, end && last)
                .map_err(|e| Stop::ToReset(reason_of(&e)))?;
            return Poll::Ready(Ok(n));
        }
        // No capacity: wait for the window; `None` means the stream can no longer send.
        match ready!(to.poll_capacity(cx)) {
            Some(Ok(_)) => continue,
            Some(Err(e)) => return Poll::Ready(Err(Stop::ToReset(reason_of(&e)))),
            None => {
                let reason = match to.poll_reset(cx) {
                    Poll::Ready(Ok(r)) => r,
                    _ => Reason::CANCEL,
                };
                return Poll::Ready(Err(Stop::ToReset(reason)));
            }
        }
    }
}

/// The reset reason an error of a sending stream carries; CANCEL when it has none (a connection
/// that went away).
pub(super) fn reason_of(e: &h2::Error) -> Reason {
    e.reason()
        .filter(|_| e.is_reset())
        .unwrap_or(Reason::CANCEL)
}
