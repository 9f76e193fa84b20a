//! The process's effective capabilities, read from `/proc/self/status`, so a missing grant is
//! reported by name before any tool runs (the tools' own errors, "Permission denied (you must be
//! root)", send people looking in the wrong place).

use crate::Error;

/// A Linux capability: its name and bit number in the capability sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capability {
    pub name: &'static str,
    pub bit: u32,
}

/// Needed for every change to netfilter rules.
pub const CAP_NET_ADMIN: Capability = Capability {
    name: "CAP_NET_ADMIN",
    bit: 12,
};

/// Needed by iptables-legacy, which talks to the kernel over a raw socket.
pub const CAP_NET_RAW: Capability = Capability {
    name: "CAP_NET_RAW",
    bit: 13,
};

/// An effective capability set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    effective: u64,
}

impl Capabilities {
    /// The calling process's effective set.
    pub fn current() -> Result<Self, Error> {
        let status = std::fs::read_to_string("/proc/self/status")
            .map_err(|e| Error::Capabilities(format!("/proc/self/status: {e}")))?;
        Self::from_status(&status)
    }

    /// Parses the `CapEff:` line of a `/proc/<pid>/status` text.
    pub fn from_status(status: &str) -> Result<Self, Error> {
        let hex = status
            .lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .ok_or_else(|| Error::Capabilities("no CapEff line in /proc/self/status".into()))?
            .trim();
        let effective = u64::from_str_radix(hex, 16)
            .map_err(|_| Error::Capabilities(format!("unreadable CapEff value {hex:?}")))?;
        Ok(Capabilities { effective })
    }

    pub fn has(self, cap: Capability) -> bool {
        self.effective & (1 << cap.bit) != 0
    }

    /// `Ok` if `cap` is effective; otherwise the error that names it, says what it is `purpose`
    /// (for), and how to grant it.
    pub fn require(self, cap: Capability, purpose: &'static str) -> Result<(), Error> {
        if self.has(cap) {
            Ok(())
        } else {
            Err(Error::MissingCapability {
                cap,
                purpose,
                effective: self.effective,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn reads_the_effective_set() {
        let root = "Name:\tx\nCapPrm:\t000001ffffffffff\nCapEff:\t000001ffffffffff\n";
        let caps = Capabilities::from_status(root).unwrap();
        assert!(caps.has(CAP_NET_ADMIN) && caps.has(CAP_NET_RAW));

        // NET_ADMIN alone, as a pod that granted only that gets.
        let caps = Capabilities::from_status("CapEff:\t0000000000001000\n").unwrap();
        assert!(caps.has(CAP_NET_ADMIN) && !caps.has(CAP_NET_RAW));
        let e = caps.require(CAP_NET_RAW, "by iptables-legacy").unwrap_err();
        assert!(e.to_string().contains("CAP_NET_RAW"), "{e}");

        let nobody = Capabilities::from_status("CapEff:\t0000000000000000\n").unwrap();
        assert!(nobody.require(CAP_NET_ADMIN, "x").is_err());

        assert!(Capabilities::from_status("Name:\tx\n").is_err());
        assert!(Capabilities::from_status("CapEff:\tzz\n").is_err());
    }
}
