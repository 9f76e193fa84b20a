//! A run as a person reads it: a line per step and check, then the findings by endpoint.

use std::fmt::Write as _;

use spur_proto::traffic::Exchange;

use crate::run::{RunReport, grpc_status};

impl RunReport {
    /// The run for a person: a line per step and check, then the findings by endpoint.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let brief = |x: &Exchange| {
            if !x.error.is_empty() {
                return format!("error ({})", x.error);
            }
            let ms = x.duration_micros / 1000;
            match grpc_status(x) {
                Some(code) => format!("grpc-status {code} in {ms} ms"),
                None if x.method == crate::exec::SCRIPT_METHOD => {
                    format!("exit {} in {ms} ms", x.status)
                }
                None => format!("{} in {ms} ms", x.status),
            }
        };
        for s in &self.steps {
            let _ = writeln!(
                out,
                "step {} ({}): sandbox {}; baseline {}, {}",
                s.name,
                s.endpoint,
                brief(&s.sandbox),
                brief(&s.baseline[0]),
                brief(&s.baseline[1])
            );
            for c in &s.checks {
                let side = |r: &Result<(), String>| match r {
                    Ok(()) => "passed".to_owned(),
                    Err(e) => format!("FAILED ({e})"),
                };
                let _ = writeln!(
                    out,
                    "  check {}: sandbox {}, baseline {}",
                    c.check,
                    side(&c.sandbox),
                    side(&c.baseline)
                );
            }
            if let Some([b1, b2, cs]) = &s.calls {
                let _ = writeln!(
                    out,
                    "  calls downstream: sandbox {}; baseline {}, {}",
                    cs.len(),
                    b1.len(),
                    b2.len()
                );
            }
        }
        if let Some(c) = &self.calls {
            let _ = writeln!(
                out,
                "calls captured in {} ({} baselines watching): {}, of which {} not marked by this run{}",
                c.namespaces.join(", "),
                c.watching,
                c.captured,
                c.unmarked,
                if c.skipped > 0 {
                    format!(", {} past the limit not looked at", c.skipped)
                } else {
                    String::new()
                }
            );
        }
        let count = self.findings.count();
        if count == 0 {
            out.push_str("no findings: the sandbox answered as the baseline did, noise aside\n");
        } else {
            let _ = writeln!(out, "findings ({count}), most important first:");
            for (endpoint, e) in &self.findings.endpoints {
                if e.findings.is_empty() {
                    continue;
                }
                let _ = writeln!(out, "  {endpoint}");
                for f in &e.findings {
                    let times = if f.occurrences > 1 {
                        format!(" (x{})", f.occurrences)
                    } else {
                        String::new()
                    };
                    let _ = writeln!(
                        out,
                        "    {:<6} {}{times}",
                        f.rank.as_str(),
                        f.difference.render()
                    );
                }
                if e.more > 0 {
                    let _ = writeln!(out, "    ... {} more", e.more);
                }
            }
        }
        out
    }
}
