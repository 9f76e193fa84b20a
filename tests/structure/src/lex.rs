//! Just enough Rust lexing to read paths: comments and the contents of string and character
//! literals are blanked (so `// use crate::x` or `"crate::x"` produce nothing), and what is left
//! is cut into identifiers, `::` and single punctuation characters, each with its line number.
//!
//! Limits: numbers come out as identifier-like tokens (harmless: nothing looks them up), raw
//! identifiers (`r#mod`) come out as `r`, `#`, `mod`, and a character literal is recognised as
//! `'x'` or `'\...'` (anything else after a quote is taken for a lifetime or label).

/// One token of the blanked source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tok {
    /// An identifier or keyword (also numbers, see the module's limits).
    Ident(String),
    /// `::`.
    PathSep,
    /// Any other single character that is not whitespace.
    Punct(char),
}

/// A token and the 1-based line it starts on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token {
    pub tok: Tok,
    pub line: usize,
}

fn is_ident(c: char) -> bool {
    c == '_' || c.is_alphanumeric()
}

/// The source with every comment and the inside of every string, byte string, raw string and
/// character literal replaced by spaces; newlines are kept, so line numbers still match.
pub fn blank(src: &str) -> String {
    let chars: Vec<char> = src.chars().collect();
    let mut out: Vec<char> = Vec::with_capacity(chars.len());
    let mut i = 0;
    // Blanks chars[from..to], keeping newlines.
    let blank_range = |out: &mut Vec<char>, from: usize, to: usize| {
        out.extend(
            chars[from..to]
                .iter()
                .map(|&c| if c == '\n' { '\n' } else { ' ' }),
        );
    };
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        // A quote right after an identifier character is a lifetime's or a label's, except
        // after the `b` of a byte literal (`b'"'`).
        let byte_prefix = i > 0 && chars[i - 1] == 'b' && (i == 1 || !is_ident(chars[i - 2]));
        let prev_ident = i > 0 && is_ident(chars[i - 1]) && !byte_prefix;
        if c == '/' && next == Some('/') {
            let end = chars[i..]
                .iter()
                .position(|&c| c == '\n')
                .map_or(chars.len(), |p| i + p);
            blank_range(&mut out, i, end);
            i = end;
        } else if c == '/' && next == Some('*') {
            // Block comments nest in Rust.
            let mut depth = 0;
            let mut j = i;
            while j < chars.len() {
                if chars[j] == '/' && chars.get(j + 1) == Some(&'*') {
                    depth += 1;
                    j += 2;
                } else if chars[j] == '*' && chars.get(j + 1) == Some(&'/') {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            blank_range(&mut out, i, j.min(chars.len()));
            i = j;
        } else if let Some(end) = raw_string_end(&chars, i) {
            blank_range(&mut out, i, end);
            i = end;
        } else if c == '"' {
            let mut j = i + 1;
            while j < chars.len() && chars[j] != '"' {
                j += if chars[j] == '\\' { 2 } else { 1 };
            }
            let end = (j + 1).min(chars.len());
            blank_range(&mut out, i, end);
            i = end;
        } else if c == '\'' && !prev_ident {
            // 'x' and '\n' are characters; 'a (no closing quote right after) is a lifetime.
            let end = if next == Some('\\') {
                let mut j = i + 1;
                while j < chars.len() && chars[j] != '\'' {
                    j += if chars[j] == '\\' { 2 } else { 1 };
                }
                Some(j + 1)
            } else if chars.get(i + 2) == Some(&'\'') {
                Some(i + 3)
            } else {
                None
            };
            match end {
                Some(end) => {
                    let end = end.min(chars.len());
                    blank_range(&mut out, i, end);
                    i = end;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out.into_iter().collect()
}

/// If a raw string (`r"…"`, `r#"…"#`, `br#…`, `cr#…`) starts at `i`, the index just past it.
fn raw_string_end(chars: &[char], i: usize) -> Option<usize> {
    let starts_token = |k: usize| k == 0 || !is_ident(chars[k - 1]);
    let r = match chars[i] {
        'r' if starts_token(i) => i,
        'b' | 'c' if starts_token(i) && chars.get(i + 1) == Some(&'r') => i + 1,
        _ => return None,
    };
    let hashes = chars[r + 1..].iter().take_while(|&&c| c == '#').count();
    if chars.get(r + 1 + hashes) != Some(&'"') {
        return None;
    }
    let mut j = r + 2 + hashes;
    while j < chars.len() {
        if chars[j] == '"'
            && chars[j + 1..]
                .iter()
                .take(hashes)
                .filter(|&&c| c == '#')
                .count()
                == hashes
        {
            return Some(j + 1 + hashes);
        }
        j += 1;
    }
    Some(chars.len())
}

/// The tokens of already blanked source (see [`blank`]).
pub fn tokens(code: &str) -> Vec<Token> {
    let chars: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if is_ident(c) {
            let len = chars[i..].iter().take_while(|&&c| is_ident(c)).count();
            out.push(Token {
                tok: Tok::Ident(chars[i..i + len].iter().collect()),
                line,
            });
            i += len;
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            out.push(Token {
                tok: Tok::PathSep,
                line,
            });
            i += 2;
        } else {
            out.push(Token {
                tok: Tok::Punct(c),
                line,
            });
            i += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comments_and_literals_are_blanked_lines_kept() {
        let src = "a // crate::x\n/* crate::y /* nested */ still */ b\n\"crate::z\\\" q\" c\nr#\"crate::\"w\"# d '\"' 'e' '\\'' <'f> g b'\"' h";
        let out = blank(src);
        assert_eq!(out.lines().count(), src.lines().count());
        let words: Vec<&str> = out.split_whitespace().collect();
        assert_eq!(words, ["a", "b", "c", "d", "<'f>", "g", "b", "h"]);
    }

    #[test]
    fn tokens_carry_lines() {
        let toks = tokens("use crate::a;\n  super::b");
        let lines: Vec<usize> = toks.iter().map(|t| t.line).collect();
        assert_eq!(lines, [1, 1, 1, 1, 1, 2, 2, 2]);
        assert_eq!(toks[2].tok, Tok::PathSep);
    }
}
