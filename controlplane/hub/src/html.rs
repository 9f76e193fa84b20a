//! Text in the hub's HTML pages: escaping and how long ago something happened.

use std::time::{Duration, SystemTime};

/// Escapes text for HTML content and attribute values.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

pub(crate) fn human(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..120 => format!("{s}s"),
        120..7200 => format!("{}m", s / 60),
        7200..172_800 => format!("{}h {}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {}h", s / 86_400, s % 86_400 / 3600),
    }
}

pub(crate) fn ago(now: SystemTime, t: SystemTime) -> String {
    now.duration_since(t)
        .map_or_else(|_| "just now".into(), |d| format!("{} ago", human(d)))
}
