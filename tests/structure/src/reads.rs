//! Where a source file reads the Kubernetes API directly, by function: what `tests/reads.rs`
//! holds to the reasons ARCHITECTURE.md gives ("Controllers read through stores").
//!
//! A direct read is a call of kube's `Api` that reads: `get_opt`, `get_metadata_opt`,
//! `get_metadata`, `list_metadata` anywhere, and `get` or `list` when the call is awaited
//! (`.get(..).await`, or as the last argument of a wrapper that is: `timeout(t, api.list(..))
//! .await`). A store's `get` is not awaited, so it does not count, nor does a map's. Only the
//! code before the file's top-level `#[cfg(test)]` is read (see `crate::sizes`).
//!
//! Limits: the enclosing function is the last `fn` before the call in the file (a closure
//! counts as its function; a nested `fn` as itself), and a `get`/`list` of another type that
//! is awaited would count too (none is today).

use crate::lex::{self, Tok, Token};

/// One direct read: the function it is in, the method, and its line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    pub function: String,
    pub method: String,
    pub line: usize,
}

/// Methods that only kube's `Api` has.
const ALWAYS: &[&str] = &[
    "get_opt",
    "get_metadata_opt",
    "get_metadata",
    "list_metadata",
];
/// Methods that are an API read only when awaited.
const AWAITED: &[&str] = &["get", "list"];

/// The direct reads of `src` (see the module's doc).
pub fn direct_reads(src: &str) -> Vec<Read> {
    let blanked = lex::blank(src);
    let code: String = match blanked.find("\n#[cfg(test)]") {
        Some(at) => blanked[..at].to_owned(),
        None => blanked,
    };
    let toks = lex::tokens(&code);
    let mut out = Vec::new();
    let mut function = String::new();
    for i in 0..toks.len() {
        if ident(&toks, i) == Some("fn")
            && let Some(name) = ident(&toks, i + 1)
        {
            function = name.to_owned();
        }
        if punct(&toks, i) != Some('.') || punct(&toks, i + 2) != Some('(') {
            continue;
        }
        let Some(method) = ident(&toks, i + 1) else {
            continue;
        };
        let counts = ALWAYS.contains(&method)
            || (AWAITED.contains(&method) && awaited_after_call(&toks, i + 2));
        if counts {
            out.push(Read {
                function: function.clone(),
                method: method.to_owned(),
                line: toks[i + 1].line,
            });
        }
    }
    out
}

fn ident(toks: &[Token], i: usize) -> Option<&str> {
    match toks.get(i).map(|t| &t.tok) {
        Some(Tok::Ident(s)) => Some(s),
        _ => None,
    }
}

fn punct(toks: &[Token], i: usize) -> Option<char> {
    match toks.get(i).map(|t| &t.tok) {
        Some(Tok::Punct(c)) => Some(*c),
        _ => None,
    }
}

/// Whether the call whose `(` is at `open` is followed by `.await`, directly or after the one
/// closing parenthesis of a wrapper call.
fn awaited_after_call(toks: &[Token], open: usize) -> bool {
    let mut depth = 0usize;
    let mut close = None;
    for (j, t) in toks.iter().enumerate().skip(open) {
        match t.tok {
            Tok::Punct('(') => depth += 1,
            Tok::Punct(')') => {
                depth -= 1;
                if depth == 0 {
                    close = Some(j);
                    break;
                }
            }
            _ => {}
        }
    }
    let Some(close) = close else {
        return false;
    };
    let await_at = |k: usize| punct(toks, k) == Some('.') && ident(toks, k + 1) == Some("await");
    await_at(close + 1) || (punct(toks, close + 1) == Some(')') && await_at(close + 2))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(src: &str) -> Vec<(String, String)> {
        direct_reads(src)
            .into_iter()
            .map(|r| (r.function, r.method))
            .collect()
    }

    #[test]
    fn awaited_api_reads_count_store_and_map_reads_do_not() {
        let src = "async fn a(api: Api<P>) {\n    api.get_opt(\"x\").await?;\n    \
                   let p = store.get(&key);\n    map.get(&k);\n}\n\
                   async fn b() {\n    let l = api\n        .list(&ListParams::default())\n        \
                   .await?;\n    timeout(T, api.list(&lp)).await;\n    \
                   api.list_metadata(&lp)\n}\n";
        assert_eq!(
            found(src),
            [
                ("a".into(), "get_opt".into()),
                ("b".into(), "list".into()),
                ("b".into(), "list".into()),
                ("b".into(), "list_metadata".into()),
            ]
        );
    }

    #[test]
    fn comments_literals_and_the_test_module_are_not_read() {
        let src = "fn a() {\n    // api.get_opt(x)\n    let s = \"api.get_opt(x)\";\n}\n\
                   #[cfg(test)]\nmod tests {\n    async fn t() { api.get_opt(\"x\").await; }\n}\n";
        assert!(found(src).is_empty());
    }
}
