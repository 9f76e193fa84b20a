//! The server roles' old commands (`spur routeserver`, `spur hub serve`, ...): each is now a
//! binary of its own (`bin/`), so the user's `spur` links none of the servers. The commands stay,
//! hidden, to tell a person upgrading which binary to run instead, with the same arguments.

use std::ffi::OsString;
use std::process::ExitCode;

use clap::{Args, Subcommand};

/// Whatever followed the old command, passed through untouched to the message.
#[derive(Args)]
#[command(disable_help_flag = true, disable_version_flag = true)]
pub(crate) struct Rest {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
    args: Vec<OsString>,
}

#[derive(Subcommand)]
pub(crate) enum Moved {
    #[command(hide = true)]
    Routeserver(Rest),
    #[command(hide = true)]
    Gateway(Rest),
    #[command(hide = true)]
    Operator(Rest),
    #[command(hide = true)]
    TunnelProxy(Rest),
    #[command(hide = true)]
    Hub(Rest),
    #[command(hide = true)]
    Agent(Rest),
    #[command(hide = true)]
    Jobs(Rest),
    #[command(hide = true)]
    Ics(Rest),
    #[command(hide = true)]
    TrafficStore(Rest),
}

impl Moved {
    /// The old command and the binary that replaces it.
    fn names(&self) -> (&'static str, &'static str, &Rest) {
        match self {
            Moved::Routeserver(r) => ("routeserver", "spur-routeserver", r),
            Moved::Gateway(r) => ("gateway", "spur-gateway", r),
            Moved::Operator(r) => ("operator", "spur-operator", r),
            Moved::TunnelProxy(r) => ("tunnel-proxy", "spur-tunnel-proxy", r),
            Moved::Hub(r) => ("hub", "spur-hub", r),
            Moved::Agent(r) => ("agent", "spur-agent", r),
            Moved::Jobs(r) => ("jobs", "spur-jobs", r),
            Moved::Ics(r) => ("ics", "spur-ics", r),
            Moved::TrafficStore(r) => ("traffic-store", "spur-traffic-store", r),
        }
    }

    /// Says which binary to run instead and fails (exit code 2, as for a usage error).
    pub(crate) fn refuse(&self) -> ExitCode {
        let (old, new, rest) = self.names();
        Self::refuse_as(old, new, rest)
    }

    /// Says that `spur <old>` is now `<new>` (with the same arguments) and fails.
    pub(crate) fn refuse_as(old: &str, new: &str, rest: &Rest) -> ExitCode {
        let mut same = String::from(new);
        for a in &rest.args {
            same.push(' ');
            same.push_str(&a.to_string_lossy());
        }
        eprintln!(
            "spur: `spur {old}` moved to its server's own binary: run `{same}` (the image ships \
             it; the chart runs it)"
        );
        ExitCode::from(2)
    }
}
