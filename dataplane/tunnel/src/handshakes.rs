//! Bounds on unauthenticated connections: every connection is accepted at once and its
//! handshake (TLS, then `hello` and authentication) runs under the handshake timeout, holding
//! one slot of this table until it ends.
//!
//! - One peer (an IPv4 address, an IPv6 /64) holds at most `per_peer` slots: beyond that its new
//!   connections are closed at once, so one host cannot starve the others.
//! - All peers together hold at most `max` slots: a new connection then takes the slot of the
//!   oldest handshake, which is cancelled. A real client finishes its handshake in a few round
//!   trips, so idle connections (slowloris) are always the oldest and go first; to lock a
//!   client out, an attacker would have to open `max` connections within that client's
//!   handshake.
//!
//! The old design took one of `max` permits before accepting: 64 idle connections stopped the
//! accept loop, and every agent and workstation waited behind them.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

use spur_runtime::peer::PeerKey;

use crate::session::lock;

pub(crate) struct Handshakes {
    max: usize,
    per_peer: usize,
    table: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    next: u64,
    /// In-flight handshakes by start order (ids only grow): the first is the oldest.
    by_age: BTreeMap<u64, (PeerKey, CancellationToken)>,
    per_peer: HashMap<PeerKey, usize>,
}

impl Table {
    fn release(&mut self, peer: PeerKey) {
        if let Some(n) = self.per_peer.get_mut(&peer) {
            *n -= 1;
            if *n == 0 {
                self.per_peer.remove(&peer);
            }
        }
    }
}

/// Why a connection was turned away or cut short.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shed {
    /// Its peer already has `per_peer` handshakes in flight.
    PeerCap,
}

/// A handshake's slot; dropping it frees the slot.
pub(crate) struct Ticket {
    table: Arc<Handshakes>,
    id: u64,
    peer: PeerKey,
    cancel: CancellationToken,
}

impl Ticket {
    /// Resolves when a newer connection took this slot (the table was full and this was the
    /// oldest handshake).
    pub(crate) async fn evicted(&self) {
        self.cancel.cancelled().await;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut t = lock(&self.table.table);
        // An evicted ticket was already taken out (and its peer's count lowered) by `admit`.
        if t.by_age.remove(&self.id).is_some() {
            t.release(self.peer);
        }
    }
}

impl Handshakes {
    pub(crate) fn new(max: usize, per_peer: usize) -> Arc<Handshakes> {
        Arc::new(Handshakes {
            max,
            per_peer,
            table: Mutex::new(Table::default()),
        })
    }

    /// A slot for a handshake from `ip`. Returns how many older handshakes were evicted for it
    /// (0 or 1) with the ticket.
    pub(crate) fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<(Ticket, usize), Shed> {
        let peer = PeerKey::of(ip);
        let mut t = lock(&self.table);
        if t.per_peer.get(&peer).copied().unwrap_or(0) >= self.per_peer {
            return Err(Shed::PeerCap);
        }
        let mut evicted = 0;
        while t.by_age.len() >= self.max {
            let Some((_, (old_peer, cancel))) = t.by_age.pop_first() else {
                break;
            };
            t.release(old_peer);
            cancel.cancel();
            evicted += 1;
        }
        let id = t.next;
        t.next += 1;
        let cancel = CancellationToken::new();
        t.by_age.insert(id, (peer, cancel.clone()));
        *t.per_peer.entry(peer).or_insert(0) += 1;
        drop(t);
        Ok((
            Ticket {
                table: self.clone(),
                id,
                peer,
                cancel,
            },
            evicted,
        ))
    }

    /// At least half the slots are taken: time to make QUIC peers prove their address (a
    /// Retry costs the server no state) before they count against anyone's share.
    pub(crate) fn busy(&self) -> bool {
        lock(&self.table).by_age.len() * 2 >= self.max
    }

    #[cfg(test)]
    fn in_flight(&self) -> usize {
        lock(&self.table).by_age.len()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_peer_gets_its_share_and_no_more() {
        let h = Handshakes::new(10, 2);
        let a1 = h.admit(ip("192.0.2.1")).unwrap();
        let _a2 = h.admit(ip("::ffff:192.0.2.1")).unwrap();
        assert_eq!(h.admit(ip("192.0.2.1")).err(), Some(Shed::PeerCap));
        // Another peer is unaffected.
        let _b = h.admit(ip("192.0.2.2")).unwrap();
        // A finished handshake frees its peer's slot.
        drop(a1);
        let _a3 = h.admit(ip("192.0.2.1")).unwrap();
        // An IPv6 host counts by its /64.
        let _v1 = h.admit(ip("2001:db8:1:2::1")).unwrap();
        let _v2 = h.admit(ip("2001:db8:1:2::ffff")).unwrap();
        assert_eq!(h.admit(ip("2001:db8:1:2:3::9")).err(), Some(Shed::PeerCap));
        assert!(h.admit(ip("2001:db8:1:3::1")).is_ok());
    }

    #[tokio::test]
    async fn a_full_table_evicts_the_oldest_handshake() {
        let h = Handshakes::new(3, 3);
        let (oldest, _) = h.admit(ip("192.0.2.1")).unwrap();
        let (second, _) = h.admit(ip("192.0.2.1")).unwrap();
        let (_third, _) = h.admit(ip("192.0.2.2")).unwrap();
        let (newest, evicted) = h.admit(ip("192.0.2.3")).unwrap();
        assert_eq!(evicted, 1);
        tokio::time::timeout(std::time::Duration::from_secs(1), oldest.evicted())
            .await
            .unwrap();
        assert!(!second.cancel.is_cancelled());
        assert_eq!(h.in_flight(), 3);
        // The evicted ticket's drop does not free anyone else's slot.
        drop(oldest);
        assert_eq!(h.in_flight(), 3);
        drop(newest);
        assert_eq!(h.in_flight(), 2);
        // Its peer's count went down at eviction: 192.0.2.1 has one handshake (second) now.
        let _again = h.admit(ip("192.0.2.1")).unwrap();
        let _again2 = h.admit(ip("192.0.2.1")).unwrap();
        assert!(h.busy());
    }
}
