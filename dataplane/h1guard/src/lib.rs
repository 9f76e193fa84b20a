//! The HTTP/1 front door every Spur HTTP/1 server applies, the sidecar's proxy and the control
//! plane's REST and web ports alike: [`Guard`] around each connection (a bare LF, or framing
//! hyper would read differently from the next hop, gets a 400 and a closed connection) and
//! [`check_host`] on each request (a refusal is a 400 that closes the connection).
//!
//! Its own crate so that servers share the rules without linking the proxy core.

mod guard;
mod host;

pub use guard::Guard;
pub use host::{check_host, valid_authority};
