//! Text that others wrote (a job's result, the findings of a smart test, paths a job named), made
//! safe for a terminal.

/// `text` with its control characters other than `keep` shown escaped (`\u{1b}`), never sent,
/// so whoever wrote it cannot move the cursor, retitle the window or hide a line of what the
/// command prints.
pub(crate) fn escaped(text: &str, keep: &[char]) -> String {
    text.chars()
        .flat_map(|c| match c {
            c if c.is_control() && !keep.contains(&c) => c.escape_default().collect(),
            c => vec![c],
        })
        .collect()
}

/// [`escaped`] on one line: a newline is escaped too.
pub(crate) fn one_line(text: &str) -> String {
    escaped(text, &[])
}

/// Lines of `text`, each escaped, joined by a newline and `indent`.
pub(crate) fn lines(text: &str, indent: &str) -> String {
    text.trim_end_matches('\n')
        .split('\n')
        .map(|line| escaped(line, &['\t']))
        .collect::<Vec<_>>()
        .join(&format!("\n{indent}"))
}
