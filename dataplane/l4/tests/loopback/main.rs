//! Loopback tests of the L4 listeners: real sockets on 127.0.0.1, echo workers that say who
//! they are, every wait bounded.

#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod common;
mod tcp;
mod udp;
mod update;
