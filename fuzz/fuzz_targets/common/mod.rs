//! Helpers several targets share (included with `#[path = "common/mod.rs"] mod common;`; a
//! target uses what it needs).
#![allow(dead_code)]

use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};

/// A reader that hands out `data` in chunks of the given sizes (cycled).
pub struct Chunks<'a> {
    data: &'a [u8],
    sizes: &'a [usize],
    i: usize,
}

impl<'a> Chunks<'a> {
    pub fn new(data: &'a [u8], sizes: &'a [usize]) -> Self {
        Chunks { data, sizes, i: 0 }
    }
}

impl AsyncRead for Chunks<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let size = self.sizes[self.i % self.sizes.len()];
        self.i += 1;
        let n = size.min(self.data.len()).min(buf.remaining());
        let (head, rest) = self.data.split_at(n);
        buf.put_slice(head);
        self.data = rest;
        Poll::Ready(Ok(()))
    }
}

/// One current-thread runtime and a loopback listener for the whole run, for targets that need
/// a real `TcpStream`.
pub fn net() -> &'static (tokio::runtime::Runtime, tokio::net::TcpListener) {
    static NET: OnceLock<(tokio::runtime::Runtime, tokio::net::TcpListener)> = OnceLock::new();
    NET.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind");
        (rt, listener)
    })
}
